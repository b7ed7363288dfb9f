"""Pure parts of maasd.llama: keys, header packing and checks, fingerprints.

Runs without the ``llama`` extra: neither llama-cpp-python nor xxhash is needed to import
``maasd.llama`` or to build keys and headers; only the state checksum test needs xxhash
(and skips without it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maasd import llama as L
from maasd.client import Client, Worker
from maasd.llama.entries import (
    Draft,
    EntryTransport,
    MappedEntry,
    RestBuffer,
    RestEntries,
    SocketEntries,
)

FP = "0123456789abcdef0123456789abcdef"
FP2 = "f" * 32


# ----------------------------------------------------------------------------- keys


def test_chunk_keys_boundaries_and_order() -> None:
    keys = L.chunk_keys(FP, list(range(200)), 64)
    assert [n for n, _ in keys] == [64, 128, 192, 200]
    assert all(k.startswith(FP + ":") for _, k in keys)
    assert all(len(k) == 32 + 1 + 32 for _, k in keys)
    assert len({k for _, k in keys}) == 4
    assert [n for n, _ in L.chunk_keys(FP, list(range(128)), 64)] == [64, 128]
    assert [n for n, _ in L.chunk_keys(FP, [5, 6, 7], 64)] == [3]
    assert L.chunk_keys(FP, [], 64) == []


def test_chunk_keys_are_a_function_of_the_prefix() -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 32000, 300)
    longer = np.concatenate([toks, rng.integers(0, 32000, 100)])
    a = dict(L.chunk_keys(FP, toks, 64))
    b = dict(L.chunk_keys(FP, longer, 64))
    for n in (64, 128, 192, 256):
        assert a[n] == b[n]
    assert a[300] != b[320]
    # list, numpy int64 and int32 give the same keys
    assert L.chunk_keys(FP, toks.tolist(), 64) == L.chunk_keys(FP, toks.astype(np.int32), 64)


def test_chunk_keys_differ_by_token_model_and_chunk() -> None:
    toks = list(range(100))
    changed = toks.copy()
    changed[10] = 99999
    base = dict(L.chunk_keys(FP, toks, 64))
    assert dict(L.chunk_keys(FP, changed, 64))[64] != base[64]
    assert dict(L.chunk_keys(FP2, toks, 64))[64].split(":")[1] != base[64].split(":")[1]
    assert dict(L.chunk_keys(FP, toks, 32))[64] != base[64]
    # a change after the first chunk leaves the first key alone
    late = toks.copy()
    late[80] = 7
    assert dict(L.chunk_keys(FP, late, 64))[64] == base[64]
    assert dict(L.chunk_keys(FP, late, 64))[100] != base[100]


def test_chunk_keys_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="chunk must be > 0"):
        L.chunk_keys(FP, [1, 2], 0)
    with pytest.raises(ValueError, match="flat sequence of token ids"):
        L.chunk_keys(FP, [[1, 2]], 64)  # type: ignore[list-item]


def test_save_prefix_len() -> None:
    assert L.save_prefix_len(600, 64) == 576
    assert L.save_prefix_len(640, 64) == 640
    assert L.save_prefix_len(30, 64) == 30
    assert L.save_prefix_len(64, 64) == 64
    # a save of n >= chunk tokens is found by the lookups of every prompt extending it
    for n in (64, 65, 200, 600):
        want = L.save_prefix_len(n, 64)
        for extra in (0, 1, 70):
            assert want in [m for m, _ in L.chunk_keys(FP, range(n + extra), 64)]


# ----------------------------------------------------------------------------- header


def _entry(tokens: list[int], state: bytes, fp: str = FP, crc: int = 0x1234ABCD) -> np.ndarray:
    # parse_header never checks the state checksum, so any value does here (no xxhash).
    hdr = L.pack_header(fp, tokens, len(state), crc)
    buf = np.zeros(len(hdr) + len(state) + 100, np.uint8)
    L.write_header(buf, hdr)
    buf[len(hdr) : len(hdr) + len(state)] = np.frombuffer(state, np.uint8)
    return buf


def test_header_roundtrip() -> None:
    toks = list(range(1, 71))
    state = bytes(range(256)) * 10
    buf = _entry(toks, state)
    h = L.parse_header(buf)
    assert h.fingerprint == FP
    assert h.n_tokens == 70
    assert h.tokens.tolist() == toks
    assert h.header_len == L.header_len_for(70)
    assert h.header_len % 64 == 0
    assert h.header_len >= 64 + 4 * 70
    assert h.state_len == len(state)
    assert h.chunk == L.DEFAULT_CHUNK
    assert h.state_crc == 0x1234ABCD
    # bytes and memoryview parse the same
    assert L.parse_header(bytes(buf)).tokens.tolist() == toks
    assert L.parse_header(memoryview(bytes(buf))).n_tokens == 70


@pytest.mark.parametrize("pos", [0, 3, 8, 12, 20, 40, 50, 55, 64, 100])
def test_any_flipped_header_byte_is_refused(pos: int) -> None:
    buf = _entry(list(range(20)), b"x" * 1000)
    buf[pos] ^= 0x40
    with pytest.raises(L.HeaderError):
        L.parse_header(buf)


def test_state_checksum_is_xxh3_low_bits_and_sees_a_flipped_state_byte() -> None:
    xxhash = pytest.importorskip(
        "xxhash", reason="the state checksum needs xxhash (the `llama` extra)"
    )
    state = bytes(range(256)) * 10
    assert L.state_checksum(state) == xxhash.xxh3_64_intdigest(state) & 0xFFFFFFFF
    buf = _entry(list(range(20)), state, crc=L.state_checksum(state))
    h = L.parse_header(buf)
    assert L.state_crc(buf, h) == h.state_crc  # computed in place over the mapping
    buf[h.header_len + 500] ^= 1
    h2 = L.parse_header(buf)  # the header itself is still fine …
    assert L.state_crc(buf, h2) != h2.state_crc  # … the checksum is not


def test_zeroed_truncated_and_other_versions_are_refused() -> None:
    with pytest.raises(L.HeaderError, match="magic"):
        L.parse_header(np.zeros(4096, np.uint8))  # a scrubbed buffer
    with pytest.raises(L.HeaderError):
        L.parse_header(np.zeros(10, np.uint8))
    buf = _entry(list(range(20)), b"x" * 1000)
    with pytest.raises(L.HeaderError, match="fit"):
        L.parse_header(buf, size=L.header_len_for(20) + 999)  # state past the end
    v2 = buf.copy()
    v2[8] = L.FORMAT_VERSION + 1  # another format version
    with pytest.raises(L.HeaderError, match="version"):
        L.parse_header(v2)


def test_magic_is_written_last() -> None:
    hdr = L.pack_header(FP, [1, 2, 3], 10, 0)
    dst = np.zeros(len(hdr), np.uint8)
    seen: list[bytes] = []

    class Spy(np.ndarray):
        def __setitem__(self, key: Any, value: Any) -> None:
            super().__setitem__(key, value)
            seen.append(bytes(np.asarray(self)[:8]))

    L.write_header(dst.view(Spy), hdr)
    assert seen[0] == b"\0" * 8  # everything else first …
    assert seen[-1] == L.MAGIC  # … then the magic
    assert bytes(dst) == hdr


# ----------------------------------------------------------------------------- fingerprints


def test_fingerprint_of_is_stable_and_sensitive() -> None:
    parts = {"arch": "llama", "n_layer": 2, "metadata": {"a": "1"}, "file": {"size": 3}}
    fp = L.fingerprint_of(parts)
    assert len(fp) == 32
    assert int(fp, 16) >= 0
    assert L.fingerprint_of(dict(reversed(list(parts.items())))) == fp
    for k, v in [
        ("n_layer", 3),
        ("arch", "gemma3"),
        ("metadata", {"a": "2"}),
        ("file", {"size": 4}),
    ]:
        assert L.fingerprint_of({**parts, k: v}) != fp


def test_file_identity_sees_every_byte_and_is_cached_by_inode_and_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    cache = tmp_path / "cache"
    monkeypatch.setenv("MAASD_CACHE_DIR", str(cache))
    p = tmp_path / "m.gguf"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    p.write_bytes(data)
    base = L.file_identity(p)
    assert base["size"] == 3 << 20
    assert len(list((cache / "file-hashes").iterdir())) == 1  # kept for the next start-up
    # a byte anywhere — the middle too: two fine-tunes can share head and tail
    for pos in (0, len(data) // 2, len(data) - 1):
        changed = bytearray(data)
        changed[pos] ^= 1
        p.write_bytes(changed)
        assert L.file_identity(p) != base
    p.write_bytes(data + b"\0")
    assert L.file_identity(p) != base
    p.write_bytes(data)
    assert L.file_identity(p) == base
    # the cache is keyed by (device, inode, size, mtime, ctime): a write keeping size and
    # mtime still changes ctime, so the file is hashed again
    st = p.stat()
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    p.write_bytes(changed)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert L.file_identity(p) != base
    small = tmp_path / "s.gguf"
    small.write_bytes(b"abc")
    assert L.file_identity(small)["size"] == 3


def test_file_identity_without_a_writable_cache_still_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    monkeypatch.setenv("MAASD_CACHE_DIR", str(blocker))
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" * 100)
    import hashlib

    assert L.file_identity(p) == {"size": 400, "sha256": hashlib.sha256(b"GGUF" * 100).hexdigest()}


# ----------------------------------------------------------------------------- the package


def test_import_needs_no_llama_cpp_no_xxhash_and_nothing_of_the_server() -> None:
    # A fresh interpreter: what `import maasd.llama` pulls in by itself.
    code = (
        "import sys\n"
        "from maasd.llama import KVStore, chunk_keys, parse_header\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "llama_cpp" not in out  # imported by a KVStore, not by the package
    assert "xxhash" not in out  # imported by the first state checksum
    # maasd.llama builds on the client only: nothing of the daemon's side
    server_side = [
        m
        for m in out
        if m.startswith("maasd.")
        and m.split(".")[1] not in ("llama", "client", "protocol", "bounds")
    ]
    assert server_side == []
    assert "litestar" not in out


# ----------------------------------------------------------------------------- the seams


def _client_classes_fit_the_transports(
    c: Client, w: Worker
) -> tuple[EntryTransport[Draft, MappedEntry], EntryTransport[RestBuffer, RestBuffer]]:
    """Not run: a type check. mypy (``scripts/check``) fails if ``maasd.client``'s ``Client``
    and ``Worker`` stop being what the two transports' protocols ask of them, or if a
    transport stops being an ``EntryTransport`` of the records it hands out."""
    return SocketEntries(w), RestEntries(c, w)


def test_the_transport_protocols_old_name_still_resolves_with_a_warning() -> None:
    import maasd.llama

    with pytest.warns(DeprecationWarning, match="EntryTransport"):
        old = maasd.llama.Entries
    assert old is EntryTransport


def test_value_settings_name_only_what_changes_a_states_values(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from maasd.llama.adapter import VALUE_DEFAULTS, value_settings
    from maasd.llama.format import file_identity

    cparams = SimpleNamespace(
        **{k: v for k, v in VALUE_DEFAULTS.items() if k.startswith(("rope", "yarn"))}
    )
    plain = SimpleNamespace(context_params=cparams, lora_base=None, lora_path=None, lora_scale=1.0)
    assert value_settings(plain) == {}  # a plain model keeps its fingerprint
    roped = SimpleNamespace(**{**vars(plain), "context_params": SimpleNamespace(**vars(cparams))})
    roped.context_params.rope_freq_base = 100.0
    assert value_settings(roped) == {"values": {"rope_freq_base": 100.0}}
    lora = tmp_path / "a.gguf"
    lora.write_bytes(b"GGUF-lora")
    adapted = SimpleNamespace(**{**vars(plain), "lora_path": str(lora), "lora_scale": 0.5})
    assert value_settings(adapted) == {
        "values": {"lora_path": file_identity(lora), "lora_scale": 0.5}
    }
