"""``maasd router``'s judgment of attached backends that hang and that go, with real
llama-server processes on the real Gemma 3 270M behind TCP proxies the test controls,
and the module's real ``maasd serve``.

A proxy passes everything until the test makes its backend hang — connections taken,
nothing passed either way, as the router sees a SIGSTOPped server — or go: every
connection dropped and new ones refused, as the router sees a killed one. The proxies
see each ``/health`` probe, so the test tells whether the router probes two hung
backends at once (one probe's wait overlaps another's) or one after the other.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.llama

from llama_model import CAPITALS  # noqa: E402
from maasd.router.fleet import HUNG_PROBES  # noqa: E402
from router_fleet import RouterProc, attached_process, long_stream, serve_on_each  # noqa: E402
from tcpproxy import Proxy  # noqa: E402
from waiting import wait_until  # noqa: E402

#: one lock for every group of proxies: a probe's overlap is judged in one step
GROUP_LOCK = threading.Lock()


class Fault(Proxy):
    """A proxy before one attached backend, which :meth:`hang` and :meth:`go` break and
    :meth:`come_back` mends; ``group``: the proxies whose held probes count as overlaps."""

    def __init__(self, upstream: tuple[str, int], group: list[Fault]) -> None:
        super().__init__(upstream)
        self.held = threading.Event()
        self.group = group
        group.append(self)
        self.waiting: list[socket.socket] = []  # connections a held probe came on
        self.probes = 0  # probes held
        self.overlaps = 0  # held probes that came while another's held probe was open
        self.clients: set[socket.socket] = set()

    def _connect(self, client: socket.socket) -> socket.socket | None:
        self.clients.add(client)
        return super()._connect(client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.held.is_set():  # hung: nothing passes, either way
                    if b"GET /health " in data:
                        self._held_probe(src)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # A hung server closes nothing: while held, the server's end (llama-server
            # drops a connection idle for 5 s, and it sees no request) is not passed on.
            ends = (src,) if self.held.is_set() and src not in self.clients else (src, dst)
            for s in ends:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _held_probe(self, conn: socket.socket) -> None:
        with GROUP_LOCK:
            others = [c for f in self.group if f is not self for c in f.waiting]
            # The router closes a probe's connection when it gives up on it, before its
            # next probe: a connection still open is a probe it still waits for.
            self.overlaps += any(_open(c) for c in others)
            self.probes += 1
            self.waiting.append(conn)

    def hang(self) -> None:
        self.held.set()

    def go(self, *, linger: bool = False) -> None:
        """Gone: new connections refused (nothing listens), open ones dropped — or, with
        ``linger``, left open and silent (a server gone but for the requests it had)."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # ends the accept thread too
        self.listener.close()
        if linger:
            self.held.set()
        else:
            self.cut()

    def come_back(self) -> None:
        self.cut()  # connections that passed nothing while held are no use
        if self.listener.fileno() == -1:  # gone: listen again, on the same port
            self.listener = socket.create_server(("127.0.0.1", self.port))
            threading.Thread(target=self._accept, daemon=True).start()
        self.held.clear()
        self.resume()


def _open(conn: socket.socket) -> bool:
    """Whether the peer has not closed ``conn`` (read without taking anything)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True  # nothing to read, not closed
    except OSError:
        return False


@contextlib.contextmanager
def _proxied_fleet(
    routers: Any, binary: str, model: Path, tmp_path: Path, n: int
) -> Iterator[tuple[RouterProc, list[Fault]]]:
    """``n`` attached backends of one slot each, each behind a :class:`Fault`, and a
    router in front of the proxies → the router and the proxies, in the router's order."""
    group: list[Fault] = []
    with contextlib.ExitStack() as stack:
        args: list[str] = []
        for i in range(n):
            slot_dir = tmp_path / f"slots-{i}"
            slot_dir.mkdir()
            log = tmp_path / f"server-{i}.log"
            url, _proc = stack.enter_context(
                attached_process(binary, model, slot_dir, log, slots=1)
            )
            host, port = url.removeprefix("http://").split(":")
            f = Fault((host, int(port)), group)
            stack.callback(f.close)
            args += ["--backend", f"http://127.0.0.1:{f.port}", "--slot-dir", str(slot_dir)]
        yield routers(backends=0, router_args=tuple(args)), group


def _wait(cond: Any, r: RouterProc, what: str, timeout: float = 120.0) -> None:
    try:
        wait_until(cond, timeout, 0.1, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {r.health()}\n{r.log()}") from None


def _stream(url: str, body: dict[str, Any], out: dict[str, Any], begun: threading.Event) -> None:
    """A streamed completion read to its end into ``out``; ``begun`` at its first bytes."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(240.0)) as c:
        try:
            with c.stream("POST", "/v1/completions", json=body) as s:
                out["status"] = s.status_code
                chunks = []
                for chunk in s.iter_raw():
                    chunks.append(chunk)
                    begun.set()
                out["body"] = b"".join(chunks)
        except httpx.HTTPError as exc:
            out["client_error"] = repr(exc)
        finally:
            begun.set()


def test_hung_and_gone_attached_backends_are_judged_at_once_each_by_its_kind(
    routers: Any, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """Of three attached backends, one goes (killed: refused) while it streams and two
    hang at the same moment. The stream ends at once with an error event of code 502
    (no ``[DONE]``). The two hung ones are probed at once, not one after the other (a
    probe of one comes while the router still waits for the other's), so both are
    judged in one judging period; each is counted as ``backend_hung``, the gone one as
    ``backend_gone`` — never the other way. Mended, all three serve again."""
    with _proxied_fleet(routers, llama_server, gemma_gguf, tmp_path, 3) as (r, faults):
        out: dict[str, Any] = {}
        body = long_stream("Story.\n" + CAPITALS, max_tokens=1000)
        begun = threading.Event()
        t = threading.Thread(target=_stream, args=(r.url, body, out, begun), daemon=True)
        t.start()
        _wait(begun.is_set, r, "streaming")
        (gone,) = [i for i, b in enumerate(r.health()["backends"]) if b["busy"]]
        hung = [i for i in range(3) if i != gone]
        try:
            for i in hung:
                faults[i].hang()
            faults[gone].go()
            t.join(120)
            assert not t.is_alive(), "a stream from a gone backend hangs"
            assert "client_error" not in out, out
            assert out["status"] == 200  # it had begun: its end is an error event
            assert b"[DONE]" not in out["body"]
            last = out["body"].strip().split(b"\n")[-1]
            assert last.startswith(b"data: "), out["body"][-500:]
            err = json.loads(last[6:])["error"]
            assert err["code"] == 502, err
            assert "went away" in err["message"], err
            r.wait_metric("maasd_router_errors", 2, 120, kind="backend_hung")
            r.wait_metric("maasd_router_errors", 1, 120, kind="backend_gone")
            for i in range(3):
                label = str(i)
                hung_n = r.metric("maasd_router_errors", backend=label, kind="backend_hung")
                gone_n = r.metric("maasd_router_errors", backend=label, kind="backend_gone")
                assert (hung_n, gone_n) == ((0, 1) if i == gone else (1, 0)), (i, r.log())
                assert r.metric("maasd_router_errors", backend=label, kind="backend_down") == 1
                assert not r.health()["backends"][i]["alive"]
            held = [faults[i].probes for i in hung]
            assert min(held) >= HUNG_PROBES, held
            overlaps = sum(faults[i].overlaps for i in hung)
            assert overlaps >= 1, f"the hung backends were probed one after the other: {held}"
        finally:
            for f in faults:
                f.come_back()
        _wait(lambda: all(b["alive"] for b in r.health()["backends"]), r, "back", 180)
        serve_on_each(r, [0, 1, 2])
        r.wait_idle()
        assert "Traceback" not in r.log()


def test_a_request_still_waiting_on_a_gone_backend_ends_as_a_bad_gateway(
    routers: Any, llama_server: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    """An attached backend that refuses new connections while the one of a stream under
    way stays open and silent: at its third refused probe it is ``backend_gone`` (not
    ``backend_hung``) and the stream ends with an error event of code 502 that says the
    backend went away (a hung one's is a 504). Mended, it serves again."""
    with _proxied_fleet(routers, llama_server, gemma_gguf, tmp_path, 1) as (r, (fault,)):
        out: dict[str, Any] = {}
        body = long_stream("Story.\n" + CAPITALS, max_tokens=1000)
        begun = threading.Event()
        t = threading.Thread(target=_stream, args=(r.url, body, out, begun), daemon=True)
        t.start()
        _wait(begun.is_set, r, "streaming")
        try:
            fault.go(linger=True)
            t.join(120)
            assert not t.is_alive(), "a stream from a gone backend hangs"
            assert "client_error" not in out, out
            assert out["status"] == 200, out
            assert b"[DONE]" not in out["body"]
            last = out["body"].strip().split(b"\n")[-1]
            err = json.loads(last[6:])["error"]
            assert err["code"] == 502, err
            assert "went away" in err["message"], err
            assert r.metric("maasd_router_errors", kind="backend_gone") == 1
            assert r.metric("maasd_router_errors", kind="backend_hung") == 0
            assert r.metric("maasd_router_errors", kind="stream") == 0  # no transport error
            assert r.metric("maasd_router_requests", outcome="error") == 1
        finally:
            fault.come_back()
        _wait(lambda: r.health()["backends"][0]["alive"], r, "back", 180)
        serve_on_each(r, [0])
        r.wait_idle()
        assert "Traceback" not in r.log()
