"""The supervisor of ``maasd worker``: N server processes on one listening socket.

It checks that the port is free and holds it (bound with ``SO_REUSEPORT``, not
listening: a port in use fails at once, with one message), starts ``--processes``
children (``python -m maasd.llama.worker_process``) — each loads its own model, talks to
maasd over its own connection and, once loaded, listens on the port with a socket of its
own, among which the kernel spreads new connections — and waits until each says it
serves. One socket per process rather than one shared: from a shared socket, the
process whose event loop wakes first accepts every connection waiting (a burst of
clients all lands on one process), and a keep-alive connection stays where it landed.
Then:

* a child that dies is started again (after a back-off: 1 s, doubling, at most 30 s);
* ``--pool`` naming none of maasd's pools (maasd answered so) exits 2 before any child;
* SIGTERM or SIGINT: every child gets SIGTERM, finishes what it serves (``--graceful-timeout``)
  and exits 0; the supervisor exits 0 when they all did (a child still there 10 s after
  the grace is killed, and the exit is 1).

The children's metrics meet in a private ``PROMETHEUS_MULTIPROC_DIR`` made at start and
removed at exit. Children die with the supervisor (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

import msgspec

from maasd.llama.worker_config import WorkerConfig
from maasd.llama.worker_process import ProcessSpec, reuse_port_socket
from maasd.serving import handling

__all__ = ["Supervisor", "UnknownPool", "sharing_check"]

logger = logging.getLogger("maasd.worker")

FIRST_RESPAWN_S = 1.0
MAX_RESPAWN_S = 30.0
KILL_AFTER_S = 10.0


@dataclass
class Child:
    """One server process and its readiness pipe."""

    slot: int
    proc: subprocess.Popen[bytes]
    ready_r: int
    ready: bool = False
    started: float = field(default_factory=time.monotonic)

    def close_pipe(self) -> None:
        fd, self.ready_r = self.ready_r, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class UnknownPool(Exception):
    """``--pool`` names a pool maasd says it does not have: every save would be refused."""


def sharing_check(cfg: WorkerConfig) -> tuple[bool, str]:
    """Whether this key can reach maasd's worker socket → (ok, why); raises
    :class:`UnknownPool` when maasd answers that ``--pool`` is none of its pools."""
    if not cfg.key:
        return False, "no tenant key (--key or MAASD_KEY)"
    from maasd.client import Client, Worker
    from maasd.client.errors import MaasdClientError

    try:
        with Worker(cfg.socket, cfg.key, renew_interval_s=0) as w:
            tenant = w.tenant_id
    except (MaasdClientError, OSError) as exc:
        return False, f"cannot use maasd's socket {cfg.socket}: {exc}"
    if cfg.pool and cfg.maasd_url:
        try:
            with Client(cfg.maasd_url, cfg.key) as c:
                pools = c.pools()
        except (MaasdClientError, OSError) as exc:
            return True, f"tenant {tenant}; pool {cfg.pool} not checked ({exc})"
        names = sorted(p.name for p in pools)
        if cfg.pool not in set(names) | {p.id for p in pools}:
            raise UnknownPool(
                f"no pool {cfg.pool!r} in maasd (pools: {', '.join(names) or 'none'})"
            )
    return True, f"tenant {tenant}, socket {cfg.socket}" + (
        f", pool {cfg.pool}" if cfg.pool else ""
    )


class Supervisor:
    """Runs the worker's processes until a signal; ``run()`` → the exit code."""

    def __init__(
        self, cfg: WorkerConfig, *, python: str = sys.executable, out: TextIO | None = None
    ) -> None:
        self.cfg = cfg
        self.python = python
        self.out = out or sys.stderr
        self.children: list[Child] = []
        self.metrics_dir = ""
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self.port = cfg.port
        self._respawn_at: dict[int, float] = {}
        self._backoff: dict[int, float] = {}

    def say(self, text: str) -> None:
        print(f"maasd worker: {text}", file=self.out, flush=True)

    def run(self) -> int:
        """Startup (hold the port, start the processes, wait until they serve), watch them
        until a signal of :data:`~maasd.serving.HANDLED_SIGNALS`, shutdown → the exit code."""
        with handling(lambda *_: self._stop.set()):
            return self._run()

    def _run(self) -> int:
        self.metrics_dir = tempfile.mkdtemp(prefix="maasd-worker-metrics-")
        try:
            try:
                self._listener = self._bind()
            except OSError as exc:
                self.say(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc}")
                return 1
            try:
                ok, why = sharing_check(self.cfg)
            except UnknownPool as exc:  # a typo would share nothing, silently, for ever
                self.say(f"--pool: {exc}")
                return 2
            self.say(f"prefix sharing through maasd: {why}" if ok else f"PREFIX SHARING OFF: {why}")
            self.children = [self._spawn(slot) for slot in range(self.cfg.processes)]
            started = self._await_ready()
            if started == "failed":
                return self._shutdown(1)
            if started == "ready":
                pids = ", ".join(str(c.proc.pid) for c in self.children)
                self.say(
                    f"serving http://{self.cfg.host}:{self.port} with "
                    f"{self.cfg.processes} process(es) (pids {pids})"
                    + ("" if ok else ", WITHOUT prefix sharing")
                )
                self._watch()
            return self._shutdown(0)
        finally:
            if self._listener is not None:
                self._listener.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    # -- processes

    def _bind(self) -> socket.socket:
        """Hold the port for the children (bound, ``SO_REUSEPORT``, never listening), once a
        plain bind showed that no one else has it — not even another worker's processes,
        which a ``SO_REUSEPORT`` bind would join."""
        host, port = self.cfg.host, self.cfg.port
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            port = probe.getsockname()[1]  # --port 0: the one the kernel chose
        self.port = port
        return reuse_port_socket(host, port)

    def _spawn(self, slot: int) -> Child:
        ready_r, ready_w = os.pipe()
        spec = ProcessSpec(
            server=self.cfg.server,
            model=self.cfg.model,
            socket=self.cfg.socket,
            key=self.cfg.key,
            pool=self.cfg.pool,
            maasd_url=self.cfg.maasd_url,
            host=self.cfg.host,
            port=self.port,
            ready_fd=ready_w,
            parent_pid=os.getpid(),
            log_level=self.cfg.log_level,
            graceful_s=self.cfg.graceful_s,
        )
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        try:
            proc = subprocess.Popen(
                [self.python, "-m", "maasd.llama.worker_process"],
                stdin=subprocess.PIPE,
                pass_fds=(ready_w,),
                env=env,
            )
        finally:
            os.close(ready_w)
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(msgspec.json.encode(spec))
            proc.stdin.close()
        return Child(slot, proc, ready_r)

    def _await_ready(self) -> str:
        """Wait until every child serves → ``ready``; ``failed`` if one exits first;
        ``stopped`` on a signal."""
        while not all(c.ready for c in self.children):
            if self._stop.is_set():
                return "stopped"
            self._poll_ready(0.2)
            for c in self.children:
                if not c.ready and c.proc.poll() is not None:
                    self.say(f"process {c.proc.pid} exited ({c.proc.returncode}) before serving")
                    return "failed"
        return "ready"

    def _poll_ready(self, timeout: float) -> None:
        waiting = {c.ready_r: c for c in self.children if not c.ready and c.ready_r >= 0}
        if not waiting:
            self._stop.wait(timeout)
            return
        with contextlib.suppress(InterruptedError):
            readable, _, _ = select.select(list(waiting), [], [], timeout)
            for fd in readable:
                child = waiting[fd]
                child.ready = os.read(fd, 64).startswith(b"ready")
                child.close_pipe()  # "ready", or the end of the pipe: the child is gone
                if child.ready:
                    self._backoff.pop(child.slot, None)

    def _watch(self) -> None:
        """Until a signal: start again a child that died (after its back-off)."""
        while not self._stop.is_set():
            self._poll_ready(0.5)
            now = time.monotonic()
            for i, c in enumerate(self.children):
                if c.proc.poll() is None:
                    continue
                due = self._respawn_at.get(c.slot)
                if due is None:
                    wait = self._backoff.get(c.slot, FIRST_RESPAWN_S)
                    self._backoff[c.slot] = min(wait * 2, MAX_RESPAWN_S)
                    self._respawn_at[c.slot] = now + wait
                    self._forget(c)
                    self.say(
                        f"process {c.proc.pid} died ({c.proc.returncode}); "
                        f"starting another in {wait:.0f} s"
                    )
                elif now >= due and not self._stop.is_set():
                    del self._respawn_at[c.slot]
                    self.children[i] = self._spawn(c.slot)

    def _forget(self, c: Child) -> None:
        from prometheus_client import multiprocess

        c.close_pipe()
        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(c.proc.pid, self.metrics_dir)

    def _shutdown(self, code: int) -> int:
        """SIGTERM every child, wait for them (then kill) → ``code``, or 1 if one failed."""
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.graceful_s + KILL_AFTER_S
        for c in alive:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"process {c.proc.pid} did not stop: killed")
                c.proc.kill()
                c.proc.wait()
            if c.proc.returncode != 0:
                code = code or 1
        for c in self.children:
            self._forget(c)
        self.say("stopped" if code == 0 else f"stopped (exit {code})")
        return code
