"""The disk tier's entry files (maasd.disk.store): a real directory, real AES-GCM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maasd.disk.store import NONCE, DiskDir, Unreadable


@pytest.fixture
def disk(tmp_path: Path) -> DiskDir:
    d = DiskDir(str(tmp_path / "tier"))
    d.open()
    return d


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 1 << 20, (3 << 20) + 123])
def test_round_trip_and_the_file_is_ciphertext(disk: DiskDir, size: int) -> None:
    data = os.urandom(size)
    sealed, blob = disk.seal("t", "k", memoryview(data))
    disk.write(sealed, blob)
    out = bytearray(size)
    disk.read_into(sealed, memoryview(out))
    assert out == data
    raw = Path(disk.path, sealed.name).read_bytes()
    assert len(raw) == NONCE + size + 16
    if size >= 32:  # a shorter plaintext may turn up in random ciphertext by chance
        assert data[:32] not in raw[NONCE:]
    assert disk.files() == [sealed.name]  # no temporary file left


def test_a_changed_byte_a_short_file_or_another_entry_key_is_unreadable(disk: DiskDir) -> None:
    data = os.urandom(10_000)
    sealed, blob = disk.seal("t", "k", memoryview(data))
    disk.write(sealed, blob)
    path = Path(disk.path, sealed.name)
    raw = bytearray(path.read_bytes())
    raw[NONCE + 5000] ^= 1
    path.write_bytes(raw)
    with pytest.raises(Unreadable, match="tag"):
        disk.read_into(sealed, memoryview(bytearray(10_000)))
    path.write_bytes(raw[:-1])
    with pytest.raises(Unreadable, match="bytes"):
        disk.read_into(sealed, memoryview(bytearray(10_000)))
    other, other_blob = disk.seal("t2", "k", memoryview(data))  # another tenant's file
    path.write_bytes(other_blob)
    with pytest.raises(Unreadable):
        disk.read_into(sealed, memoryview(bytearray(10_000)))


def test_erase_removes_the_file_and_missing_is_unreadable(disk: DiskDir) -> None:
    sealed, blob = disk.seal("t", "k", memoryview(b"x" * 100))
    disk.write(sealed, blob)
    disk.erase(sealed)
    assert disk.files() == []
    disk.erase(sealed)  # twice is fine
    with pytest.raises(Unreadable):
        disk.read_into(sealed, memoryview(bytearray(100)))


def test_open_empties_what_an_earlier_run_left(disk: DiskDir) -> None:
    sealed, blob = disk.seal("t", "k", memoryview(b"y" * 100))
    disk.write(sealed, blob)
    Path(disk.path, ".half.ent.tmp").write_bytes(b"torn")
    Path(disk.path, "keep.txt").write_bytes(b"not ours")
    assert DiskDir(disk.path).open() == 2
    assert disk.files() == ["keep.txt"]
