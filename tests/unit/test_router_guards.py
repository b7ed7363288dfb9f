"""The router's guards, without a server: what backends may be told, what a state must
show, what a request body may be, how much it keeps and how many wait, and that a
restore that fails in any way is a miss that erases the slot."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("xxhash")

from kvstate import Cache, memory
from maasd.bounds import MAX_LOOKUP_KEYS
from maasd.llama.fleet import fleet_fingerprint
from maasd.llama.format import state_checksum
from maasd.llama.views import view_memory
from maasd.router.backend import Backend, BackendProcess, check_server_args
from maasd.router.slots import RecentPrompts
from maasd.router.state import (
    FILE_MAGIC,
    FILE_VERSION,
    Settings,
    StateError,
    file_checksum,
    parse_file_form,
    validate_entry,
)
from router_bad_bodies import BAD_BODIES

FP = "ab" * 16


# --------------------------------------------------------------------------- backend flags


@pytest.mark.parametrize(
    "args",
    [
        ["-fa", "on"],
        ["--flash-attn", "on"],
        ["-ctk", "q8_0"],
        ["--cache-type-v=q8_0"],
        ["--no-kv-unified"],
        ["-np", "8"],
        ["--cache-ram", "4096"],
        ["--lora", "x.gguf"],
        ["-m", "other.gguf"],
        ["--slot-save-path", "/tmp/x/"],
    ],
)
def test_extra_arguments_may_not_override_what_the_router_sets(args: list[str]) -> None:
    with pytest.raises(ValueError, match="the router's to set"):
        check_server_args(["-c", "4096", *args])


def test_arguments_that_change_a_state_are_named_in_the_fingerprint(tmp_path: Path) -> None:
    assert check_server_args(["-c", "4096", "-t", "2", "--temp", "0"]) == ()
    args = ["-c", "64", "--rope-freq-base", "5e5", "--control-vector-layer-range", "1", "9"]
    got = check_server_args([*args, "-t", "1"])
    assert got == ("--rope-freq-base", "5e5", "--control-vector-layer-range", "1", "9")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" * 10)
    plain = fleet_fingerprint(str(model), "b")
    assert fleet_fingerprint(str(model), "b", model_args=()) == plain  # a Python worker's
    assert fleet_fingerprint(str(model), "b", model_args=got) != plain


def test_a_started_backend_runs_the_required_flags_last_and_no_llama_arg_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = BackendProcess("llama-server", "m.gguf", n_slots=2, cache_types=("f16", "f16"))
    p.extra = ["-c", "64"]
    argv = p.argv()
    assert argv[1:3] == ["-c", "64"]  # extra first: whatever follows wins
    assert argv[-4:] == ["-ctk", "f16", "-ctv", "f16"]  # explicit: no default to drift
    assert "--kv-unified" in argv
    assert "--no-cache-idle-slots" in argv
    monkeypatch.setenv("LLAMA_ARG_FLASH_ATTN", "on")
    monkeypatch.setenv("LLAMA_ARG_CACHE_TYPE_K", "q8_0")
    assert not [k for k in p.env() if k.startswith("LLAMA_ARG_")]
    with pytest.raises(ValueError, match="the router's to set"):
        BackendProcess("llama-server", "m.gguf", n_slots=1, extra=["-fa", "on"])
    p.remove_dir()


# --------------------------------------------------------------------------- settings


def settings_of(*caches: Cache) -> Settings:
    from maasd.llama.views import StateView

    mem = memory(*caches)
    cs, ext = view_memory(mem)
    return Settings.of(StateView("get_data", cs, 0, len(mem), ext))


def test_the_settings_a_state_shows_are_read_and_checked() -> None:
    from maasd.llama.views import view_get_data

    f16 = settings_of(Cache(), Cache(n_layer=3))  # iSWA: two caches alike
    assert f16 == Settings("f16", "f16", False, 1)
    assert settings_of(Cache(v_trans=False)) == Settings("f16", "f16", True, 1)
    assert settings_of(Cache(n_stream=2)).n_stream == 2
    assert settings_of(Cache(ggml_type=0)).type_k == "f32"
    with pytest.raises(StateError, match="2 kinds of layers"):
        settings_of(Cache(), Cache(v_trans=False))
    # a state saved with flash attention, or by a non-unified server, is refused
    for other in (Cache(v_trans=False), Cache(n_stream=2), Cache(ggml_type=0)):
        state = struct.pack("<Ii", 0xAF143CD8, 0) + memory(other)
        with pytest.raises(StateError, match="a state of"):
            Settings().check(view_get_data(state))
    Settings().check(view_get_data(struct.pack("<Ii", 0xAF143CD8, 0) + memory(Cache())))


def test_validate_entry_refuses_a_state_of_other_settings_under_the_right_fingerprint() -> None:
    from test_router_state import entry_of

    flash = np.frombuffer(memory(Cache(v_trans=False)), np.uint8)
    e = entry_of([10, 11, 12, 13], flash)
    assert validate_entry(e, e.size, FP, [10, 11, 12, 13], 4)  # structure alone: fine
    with pytest.raises(StateError, match="flash attention"):
        validate_entry(e, e.size, FP, [10, 11, 12, 13], 4, Settings())


def test_the_sealed_copy_checksum_is_the_entry_state_checksum() -> None:
    from test_router_state import entry_of

    from maasd.llama.format import parse_header
    from maasd.router.state import write_file_form

    e = entry_of([10, 11, 12, 13])
    hdr = parse_header(e)
    state = e[hdr.header_len : hdr.header_len + hdr.state_len]
    assert state_checksum(state.data) == hdr.state_crc
    dst = np.zeros(12 + 4 * 4 + hdr.state_len - 8, np.uint8)
    write_file_form(dst, e, hdr)
    assert struct.unpack_from("<II", dst.tobytes()) == (FILE_MAGIC, FILE_VERSION)
    assert parse_file_form(dst, dst.size).tokens.tolist() == [10, 11, 12, 13]
    prefix = bytes(state[:8])
    assert file_checksum(dst, 4, prefix) == hdr.state_crc
    dst[-1] ^= 1  # one bit of the copy the server would read
    assert file_checksum(dst, 4, prefix) != hdr.state_crc


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize(
    ("path", "raw"), [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES]
)
def test_every_hostile_body_is_a_bad_request_before_any_backend_sees_it(
    path: str, raw: bytes
) -> None:
    from maasd.router.proxy import Unroutable, parse_body

    async def tokens() -> Any:
        from maasd.router.metrics import RouterMetrics
        from maasd.router.proxy import Proxy

        class NoFleet:
            def any_live(self) -> Any:
                raise AssertionError("a backend was asked")

        assert isinstance(parse_body(b'{"prompt": "a"}'), dict)
        proxy = Proxy(NoFleet(), None, RouterMetrics(), None)  # type: ignore[arg-type]
        return await proxy.complete(path, raw)

    with pytest.raises(Unroutable):
        asyncio.run(tokens())


# --------------------------------------------------------------------------- bounds


def test_recent_prompts_are_bounded_by_count_and_tokens() -> None:
    r = RecentPrompts(count=4, max_tokens=100)
    for i in range(10):
        r.add(np.full(30, i, np.int32))
    assert len(r) == 3  # 90 tokens: a fourth would be 120
    assert r.tokens == 90
    big = np.arange(1000, dtype=np.int32)
    r.add(big)
    assert len(r) == 1
    assert r.tokens == 100  # kept cut, and a copy: the 1000 tokens are not pinned
    assert r.longest_shared(np.arange(500, dtype=np.int32)) == 100
    assert r._prompts[0].base is None


class _LookupWorker:
    closed = False

    def __init__(self) -> None:
        self.asked: list[list[str]] = []

    def lookup(self, keys: list[str]) -> None:
        self.asked.append(keys)


def test_a_long_prompt_looks_up_its_longest_1024_keys_only(tmp_path: Path) -> None:
    from maasd.llama.format import chunk_keys
    from maasd.llama.link import Link
    from maasd.router.share import Sharing

    w = _LookupWorker()
    link = Link("/nowhere", "key", open_worker=lambda _s, _k: w)  # type: ignore[arg-type,return-value]
    s = Sharing(link, FP, chunk=4)
    tokens = np.arange(4 * 3000 + 2, dtype=np.int32)  # 3001 keys
    assert s.stage(tokens, tmp_path, 0) is None
    (asked,) = w.asked
    assert len(asked) == MAX_LOOKUP_KEYS
    assert asked == [k for _, k in chunk_keys(FP, tokens, 4)][-MAX_LOOKUP_KEYS:]
    s.stage(tokens[:40], tmp_path, 8)  # a short one: every key longer than held
    assert len(w.asked[-1]) == 8


def test_kvstore_looks_up_its_longest_1024_keys_only() -> None:
    from maasd.llama.store import KVStore

    class Seq:
        def check_seq(self, _s: int) -> None: ...
        def clear(self, _s: int) -> None: ...

    class Entries:
        asked: list[list[str]] = []

        def open_longest(self, keys: list[str]) -> None:
            self.asked.append(keys)

    kv = KVStore.__new__(KVStore)
    kv.seq, kv.entries, kv.chunk, kv.fingerprint = Seq(), Entries(), 2, FP  # type: ignore[assignment]
    assert kv.restore(0, list(range(2 * 1500))) == 0
    assert len(Entries.asked[0]) == MAX_LOOKUP_KEYS


def fleet_of(n_slots: int, **cfg: Any) -> Any:
    from maasd.router.fleet import Fleet, FleetConfig
    from maasd.router.metrics import RouterMetrics

    f = Fleet(FleetConfig(**cfg), RouterMetrics())
    b = Backend(0, "http://127.0.0.1:9", "/nonexistent", n_slots, alive=True)
    f.backends.append(b)
    return f


def test_requests_past_max_waiting_or_slot_timeout_get_no_slot() -> None:
    from maasd.router.fleet import NoSlot

    async def main() -> None:
        f = fleet_of(1, max_waiting=1, slot_timeout_s=0.2)
        toks = np.arange(8, dtype=np.int32)
        held = await f.acquire(toks, sharing=False)
        waiter = asyncio.create_task(f.acquire(toks, sharing=False))
        await asyncio.sleep(0.02)
        assert f.waiting == 1
        with pytest.raises(NoSlot, match="wait for a slot already"):
            await f.acquire(toks, sharing=False)  # the second waiter: refused at once
        with pytest.raises(NoSlot, match="no slot came free"):
            await waiter
        assert f.waiting == 0
        await f.release(held.slot, toks)
        again = await f.acquire(toks, sharing=False)  # nothing left busy by the timeouts
        assert again.slot is held.slot
        await f.backends[0].close()

    asyncio.run(main())


# --------------------------------------------------------------------------- restore


class _Staged:
    def __init__(self) -> None:
        self.closed = False
        self.file = self
        self.name = "maasd-router-1-1-restore"
        self.n_tokens, self.matched = 32, 32

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    "failure", ["stage-oserror", "bad-n_restored", "not-json", "restore-500", "unsettled"]
)
def test_a_restore_that_fails_in_any_way_is_a_miss_that_erases_the_slot(failure: str) -> None:
    from maasd.router.metrics import RouterMetrics
    from maasd.router.proxy import Proxy, Turn

    calls: list[str] = []
    staged = _Staged()

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(f"{req.method} {req.url.path} {req.url.params.get('action', '')}".strip())
        if req.url.path == "/slots":
            return httpx.Response(200, json=[{"id": 0, "is_processing": failure == "unsettled"}])
        action = req.url.params.get("action")
        if action == "restore":
            if failure == "not-json":
                return httpx.Response(200, content=b"<html>")
            if failure == "restore-500":
                return httpx.Response(500, text="boom")
            return httpx.Response(200, json={"n_restored": "lots"})
        return httpx.Response(200, json={})

    class Sharing:
        def stage(self, *_a: Any) -> Any:
            if failure == "stage-oserror":
                raise OSError(28, "No space left on device")
            return staged

    async def main() -> None:
        import maasd.router.proxy as proxy_mod

        f = fleet_of(1)
        b = f.backends[0]
        b.http = httpx.AsyncClient(base_url=b.url, transport=httpx.MockTransport(handler))
        choice = await f.acquire(np.arange(40, dtype=np.int32), sharing=True)
        slot = choice.slot
        slot.held = np.arange(20, dtype=np.int32)
        slot.unsettled = failure == "unsettled"
        p = Proxy(f, Sharing(), RouterMetrics(), None)  # type: ignore[arg-type]
        turn = Turn(slot, b, np.arange(40, dtype=np.int32))
        proxy_mod.SETTLE_S, saved = 0.1, proxy_mod.SETTLE_S
        try:
            await p._restore(turn, 0)
        finally:
            proxy_mod.SETTLE_S = saved
        assert turn.restored == 0  # a miss: the request runs cold
        if failure == "unsettled":  # still generating: no restore is even tried
            assert all(c == "GET /slots" for c in calls)
            assert slot.unsettled
            return
        assert calls[-1] == "POST /slots/0 erase"  # a failed restore may leave it corrupt
        assert len(slot.held) == 0
        assert staged.closed or failure == "stage-oserror"
        await b.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- a hung backend


def test_ending_a_hung_backends_waits_ends_those_under_way_and_nothing_else() -> None:
    """``Backend.end_waits`` (the watcher's, when an attached backend is judged hung) ends
    every wait for that server's answer under way, with BackendHung in the waiting task;
    another server's wait, a later wait and a timeout of a block's own are left alone."""
    from maasd.router.backend import BackendHung

    async def main() -> None:
        hung, other = Backend(0, "http://127.0.0.1:9", "/x"), Backend(1, "http://127.0.0.1:9", "/y")
        never = asyncio.Event()

        async def wait(b: Backend) -> None:
            async with b.until_hung():
                await never.wait()

        waits = [asyncio.create_task(wait(hung)) for _ in range(2)]
        spared = asyncio.create_task(wait(other))
        await asyncio.sleep(0.01)
        assert hung.end_waits() == 2
        for t in waits:
            with pytest.raises(BackendHung, match="stopped answering"):
                await t
        await asyncio.sleep(0.01)
        assert not spared.done()
        assert hung.end_waits() == 0  # the ended ones are gone
        async with hung.until_hung():  # a wait that begins later is not cut
            await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):  # the block's own timeout stays what it is
            async with hung.until_hung(), asyncio.timeout(0.01):
                await never.wait()
        spared.cancel()
        await asyncio.gather(spared, return_exceptions=True)
        await hung.close()
        await other.close()

    asyncio.run(main())


def test_an_attached_backend_is_hung_at_its_third_unanswered_probe_in_a_row() -> None:
    """The rule of a started backend's watcher (fleet.HUNG_PROBES), for an attached one:
    two misses end nothing, the third in a row ends its requests, once; an answer starts
    the count again. A request's wait inside a slot action's is ended once, from the
    outer block (BackendHung), the inner one seeing only the cancellation."""
    from maasd.router.backend import BackendHung, Health
    from maasd.router.fleet import HUNG_PROBES, count_probe
    from maasd.router.metrics import RouterMetrics

    async def main() -> None:
        m = RouterMetrics()
        b = Backend(0, "http://127.0.0.1:9", "/x")
        never = asyncio.Event()
        inner: list[BaseException] = []

        async def wait() -> None:
            async with b.until_hung():
                try:
                    async with b.until_hung():  # a slot action's, inside a request's
                        await never.wait()
                except BaseException as exc:
                    inner.append(exc)
                    raise

        def hung() -> float | None:
            labels = {"backend": "0", "kind": "backend_hung"}
            return m.registry.get_sample_value("maasd_router_errors_total", labels)

        for up in (False, False, True, False, False):  # answered in between: not hung
            count_probe(b, Health.UP if up else Health.HUNG, m)
        assert hung() is None  # never counted
        t = asyncio.create_task(wait())
        await asyncio.sleep(0.01)
        assert count_probe(b, Health.HUNG, m) is False  # the third in a row
        assert b.missed == HUNG_PROBES
        assert hung() == 1
        with pytest.raises(BackendHung):
            await t
        assert [type(e) for e in inner] == [asyncio.CancelledError]
        count_probe(b, Health.HUNG, m)  # still hung: counted once
        assert hung() == 1
        count_probe(b, Health.UP, m)
        assert b.missed == 0
        await b.close()

    asyncio.run(main())
