"""The router's pure parts: the two state forms, their checks, and the slot choice."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest

pytest.importorskip("xxhash")

from kvstate import Cache, memory
from maasd.llama.fleet import fleet_fingerprint, ggml_type_name
from maasd.router.slots import Slot, choose, common_prefix, restore_target
from maasd.router.state import (
    FILE_MAGIC,
    FILE_VERSION,
    StateError,
    check_file_form,
    entry_size,
    parse_file_form,
    validate_entry,
    write_entry_form,
    write_file_form,
)

FP = "ab" * 16
MEMORY = np.frombuffer(memory(Cache(n_cells=4)), np.uint8)  # 2 layers, 4 cells


def ggsq(tokens: list[int], memory: np.ndarray, *, packed: bool = True) -> np.ndarray:
    """A slot file as llama-server writes it (packed token record) or a plain one."""
    words = [-1, 1, len(tokens), *tokens, 0] if packed else list(tokens)
    head = struct.pack("<III", FILE_MAGIC, FILE_VERSION, len(words))
    body = np.asarray(words, dtype="<i4").tobytes()
    return np.frombuffer(head + body + memory.tobytes(), dtype=np.uint8).copy()


def entry_of(tokens: list[int], memory: np.ndarray = MEMORY) -> np.ndarray:
    src = ggsq(tokens, memory)
    form = parse_file_form(src, src.size)
    dst = np.zeros(entry_size(len(form.tokens), form.state_len) + 100, np.uint8)
    write_entry_form(dst, FP, 64, form, src)
    return dst


def test_packed_and_plain_token_records_parse_alike() -> None:
    for packed in (True, False):
        src = ggsq([5, 6, 7], MEMORY, packed=packed)
        form = parse_file_form(src, src.size)
        assert form.tokens.tolist() == [5, 6, 7]
        assert bytes(src[form.state_offset :]) == MEMORY.tobytes()


@pytest.mark.parametrize(
    "words",
    [[-1, 2, 1, 5, 0], [-1, 1, 9, 5, 0], [-1, 1, 1, 5, 1], [-1, 1, 1, 5, 0, 3]],
    ids=["record-version", "count-past-end", "media", "trailing"],
)
def test_odd_token_records_are_refused(words: list[int]) -> None:
    head = struct.pack("<III", FILE_MAGIC, FILE_VERSION, len(words))
    src = np.frombuffer(head + np.asarray(words, "<i4").tobytes() + b"x" * 64, np.uint8)
    with pytest.raises(StateError):
        parse_file_form(src, src.size)


def test_file_magic_version_and_size_are_checked() -> None:
    src = ggsq([1, 2], MEMORY)
    for bad in (struct.pack("<I", 0x1234), struct.pack("<II", FILE_MAGIC, 4)):
        b = src.copy()
        b[: len(bad)] = np.frombuffer(bad, np.uint8)
        with pytest.raises(StateError):
            parse_file_form(b, b.size)
    with pytest.raises(StateError):
        parse_file_form(src, 12 + 4 * 6)  # the tokens but no state


def test_entry_and_file_forms_round_trip() -> None:
    entry = entry_of([10, 11, 12, 13])
    hdr = validate_entry(entry, entry.size, FP, [10, 11, 12, 13, 99], 4)
    assert hdr.tokens.tolist() == [10, 11, 12, 13]
    out = np.zeros(entry.size, np.uint8)
    n = write_file_form(out, entry, hdr)
    again = parse_file_form(out, n)
    assert again.tokens.tolist() == [10, 11, 12, 13]
    assert bytes(out[again.state_offset : n]) == MEMORY.tobytes()


def test_every_corruption_is_refused_before_a_server_sees_it() -> None:
    good = entry_of([10, 11, 12, 13])
    hdr = validate_entry(good, good.size, FP, [10, 11, 12, 13], 4)
    cases = {
        "state byte": (hdr.header_len + 100, 0x5A),
        "io magic": (hdr.header_len, 0x00),
        "token": (64, 0x77),
        "magic": (0, 0x00),
    }
    for what, (off, val) in cases.items():
        bad = good.copy()
        bad[off] = val if bad[off] != val else val ^ 1
        with pytest.raises(StateError):
            validate_entry(bad, bad.size, FP, [10, 11, 12, 13], 4)
        assert what
    with pytest.raises(StateError, match="fingerprint"):
        validate_entry(good, good.size, "cd" * 16, [10, 11, 12, 13], 4)
    with pytest.raises(StateError, match="do not match"):
        validate_entry(good, good.size, FP, [10, 11, 99, 13], 4)
    with pytest.raises(StateError):
        validate_entry(good, hdr.header_len + 10, FP, [10, 11, 12, 13], 4)  # truncated
    zeros = np.zeros_like(good)  # what a scrubbed entry reads as
    with pytest.raises(StateError):
        validate_entry(zeros, zeros.size, FP, [10], 1)


@pytest.mark.parametrize(
    ("mem", "why"),
    [
        (memory(Cache(n_cells=3)), "3 cells for 4 tokens"),
        (memory(Cache(n_cells=4))[:-1], "truncated"),
        (memory(Cache(n_cells=4)) + b"\0\0\0\0", "0 streams"),
        (struct.pack("<II", 1, 4) + b"\0" * 200, "n_seq_id"),
    ],
    ids=["fewer-cells", "truncated", "trailing", "no-sequence"],
)
def test_a_state_with_a_good_checksum_but_a_broken_layout_is_refused(mem: bytes, why: str) -> None:
    # The checksum is the writer's: these entries were written so, not corrupted since.
    bad = entry_of([10, 11, 12, 13], np.frombuffer(mem, np.uint8))
    with pytest.raises(StateError, match=why):
        validate_entry(bad, bad.size, FP, [10, 11, 12, 13], 4)
    src = ggsq([10, 11, 12, 13], np.frombuffer(mem, np.uint8))
    with pytest.raises(StateError, match=why):
        check_file_form(src, src.size)


def test_fingerprint_names_every_setting(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"x" * 1000)
    base = fleet_fingerprint(str(model), "llama-cpp-python-0.3.36")
    assert base == fleet_fingerprint(str(model), "llama-cpp-python-0.3.36", type_k=1, type_v=1)
    others = {
        fleet_fingerprint(str(model), "b11669"),
        fleet_fingerprint(str(model), "llama-cpp-python-0.3.36", type_k="q8_0"),
        fleet_fingerprint(str(model), "llama-cpp-python-0.3.36", flash_attn=True),
        fleet_fingerprint(str(model), "llama-cpp-python-0.3.36", swa_full=False),
        fleet_fingerprint(str(model), "llama-cpp-python-0.3.36", n_stream=2),
    }
    model.write_bytes(b"GGUF" + b"y" * 1000)
    others.add(fleet_fingerprint(str(model), "llama-cpp-python-0.3.36"))
    assert base not in others
    assert len(others) == 6
    assert ggml_type_name(8) == "q8_0"
    assert ggml_type_name("F16") == "f16"


# --------------------------------------------------------------------------- slots


def held(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_common_prefix() -> None:
    assert common_prefix(held(1, 2, 3), held(1, 2, 4)) == 2
    assert common_prefix(held(1, 2), held(1, 2, 4)) == 2
    assert common_prefix(held(), held(1)) == 0


def test_busy_slots_are_never_chosen() -> None:
    prompt = held(1, 2, 3, 4)
    a = Slot(0, 0, busy=True, held=held(1, 2, 3, 4))
    b = Slot(1, 0)
    for sharing in (True, False):
        c = choose([a, b], prompt, {0: 1, 1: 0}, sharing=sharing)
        assert c is not None
        assert c.slot is b
    a2 = Slot(1, 1, busy=True)
    assert choose([a, a2], prompt, {0: 1, 1: 1}, sharing=True) is None


def test_longest_held_prefix_first_else_least_loaded() -> None:
    prompt = held(1, 2, 3, 4, 5)
    s = [Slot(0, 0, held=held(1, 2)), Slot(0, 1, busy=True), Slot(1, 0, held=held(1, 2, 3, 4))]
    c = choose(s, prompt, {0: 1, 1: 0}, sharing=False)
    assert c is not None
    assert c.slot is s[2]
    assert c.held == 4
    assert not c.restore
    c = choose(s, prompt, {0: 1, 1: 0}, sharing=True)
    assert c is not None
    assert c.slot is s[2]
    assert c.held == 4
    assert not c.restore
    cold = [Slot(0, 0, held=held(9)), Slot(1, 0), Slot(1, 1, busy=True)]
    c = choose(cold, prompt, {0: 0, 1: 1}, sharing=False)
    assert c is not None
    assert c.slot is cold[0]
    c = choose(cold, prompt, {0: 0, 1: 1}, sharing=True)
    assert c is not None
    assert c.restore
    assert c.held == 0
    assert restore_target(cold, c, {0: 0, 1: 1}) is cold[0]


def test_a_few_common_tokens_keep_no_slot_from_an_empty_one() -> None:
    prompt = held(*range(1, 41))
    bos_only = Slot(0, 0, held=held(1, 99, 98))  # shares the BOS, nothing more
    empty = Slot(0, 1)
    c = choose([bos_only, empty], prompt, {0: 0}, sharing=True)
    assert c is not None
    assert c.slot is empty  # the other slot's content stays for the prompts that share it
    assert restore_target([bos_only, empty], c, {0: 0}) is empty
    useful = Slot(0, 0, held=held(*range(1, 21)))
    c = choose([useful, empty], prompt, {0: 0}, sharing=True)
    assert c is not None
    assert c.slot is useful
    assert c.held == 20


# --------------------------------------------------------------------------- publish plan


if TYPE_CHECKING:
    from maasd.client import Worker


class _Open:
    """An open connection as far as ``Link`` asks (its ``closed``); these tests make no
    request through it."""

    closed = False


def _open(_socket: str, _key: str) -> Worker:
    return cast("Worker", _Open())


def publisher(chunk: int = 4, min_tokens: int = 8) -> Any:
    from maasd.llama.link import Link
    from maasd.router.metrics import RouterMetrics
    from maasd.router.publish import Publisher
    from maasd.router.share import Sharing

    link = Link("/nowhere", "key", open_worker=_open)
    assert link.get() is not None  # up
    return Publisher(Sharing(link, FP, chunk=chunk), RouterMetrics(), min_tokens=min_tokens)


def test_the_prompts_own_prefix_and_the_one_it_shares_are_worth_publishing() -> None:
    p = publisher()
    system = list(range(100, 113))  # 13 tokens shared by every user
    a = held(*system, 1, 2, 3, 4, 5)  # 18 tokens
    assert p.plan(a, restored=0) == [16]  # its own boundary; nothing seen before
    b = held(*system, 9, 9, 9, 9, 9, 9, 9)  # 20 tokens, shares 13 with a
    assert p.plan(b, restored=0) == [20, 12]  # its own, and the shared system prompt
    p._remember(p._key(b, 12))  # published once: not again
    c = held(*system, 7, 7, 7)
    assert p.plan(c, restored=12) == [16]  # its own; the shared part is known already
    assert p.plan(held(1, 2, 3), restored=0) == []  # shorter than min_tokens
    d = held(*range(200, 224))
    assert p.plan(d, restored=24) == []  # maasd gave it all


def test_nothing_is_published_while_maasd_is_down() -> None:
    from maasd.llama.link import Link
    from maasd.router.metrics import RouterMetrics
    from maasd.router.publish import Publisher
    from maasd.router.share import Sharing

    def refuse(_s: str, _k: str) -> Any:
        raise OSError("no socket")

    link = Link("/nowhere", "key", open_worker=refuse)
    assert link.get() is None
    p = Publisher(Sharing(link, FP, chunk=4), RouterMetrics(), min_tokens=8)
    assert p.plan(held(*range(40)), restored=0) == []


@pytest.mark.parametrize("chunk", [0, -4])
def test_sharing_refuses_a_chunk_that_is_not_positive_at_once(chunk: int) -> None:
    """The router's key granularity is held to the rule every worker's is
    (``maasd.llama.format.check_chunk``), when it is made — not at its first save."""
    from maasd.llama.link import Link
    from maasd.router.share import Sharing

    link = Link("/nowhere", "key", open_worker=_open)
    with pytest.raises(ValueError, match="chunk must be > 0"):
        Sharing(link, FP, chunk=chunk)


def test_a_shared_prefix_is_published_by_one_request_and_waited_for_by_the_others() -> None:
    import asyncio

    async def main() -> None:
        p = publisher()
        system = list(range(100, 113))  # 13 tokens
        a = held(*system, 1, 2, 3)
        assert await p.before(a) == 0  # nothing seen before: nothing shared
        b = held(*system, 4, 5, 6)
        assert await p.before(b) == 12  # shares 13 with a: b publishes its 12 first
        c = held(*system, 7, 8, 9)
        waiter = asyncio.create_task(p.before(c))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # c waits for b's publish …
        p.settle(b, 12)
        assert await waiter == 0  # … then goes on, to restore it
        assert await p.before(held(*system, 5, 5, 5)) == 12  # b failed: the next one leads
        p._remember(p._key(b, 12))
        p.settle(b, 12)
        assert await p.before(held(*system, 6, 6, 6)) == 0  # published: nobody leads again
        # a prefix being published after an answer is waited for the same way
        d = held(*range(300, 320))
        assert await p.before(d) == 0  # every request arrives first
        assert p.plan(d, restored=0) == [20]
        again = asyncio.create_task(p.before(held(*range(300, 320), 1)))
        await asyncio.sleep(0.05)
        assert not again.done()
        p.settle(d, 20)
        assert await again == 0

    asyncio.run(main())


def test_a_waiter_gives_up_after_wait_s() -> None:
    import asyncio

    async def main() -> None:
        p = publisher()
        p.wait_s = 0.05
        system = list(range(100, 113))
        await p.before(held(*system, 1))
        assert await p.before(held(*system, 2)) == 12  # leads, and never settles
        assert await asyncio.wait_for(p.before(held(*system, 3)), 5) == 0  # not stuck

    asyncio.run(main())
