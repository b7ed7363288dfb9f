"""The record of the spill directories' filesystems, and the start it stops
(``maasd.core.spillfs``). Another filesystem is played by a record naming another
``f_fsid``; the real unmounted filesystem is in ``tests/integration/test_spill_unmounted.py``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from maasd.core.spillfs import RECORD, SpillFilesystems, fs_id
from maasd.errors import ConfigError


def _spill(tmp_path: Path, *names: str) -> tuple[Path, list[str]]:
    spill = tmp_path / "spill"
    spill.mkdir(exist_ok=True)
    for name in names:
        (spill / name).write_bytes(b"x")
    return spill, [str(spill / n) for n in ("a.1.ckpt", "b.2.ckpt")]


def _recorded_elsewhere(data: Path, spill: Path) -> SpillFilesystems:
    """A record saying ``spill`` was on a filesystem it is not on now."""
    (data / RECORD).write_text(json.dumps({os.path.realpath(spill): (fs_id(str(spill)) or 0) + 1}))
    return SpillFilesystems(str(data))


def test_fs_id_is_the_filesystems_and_none_for_a_missing_path(tmp_path: Path) -> None:
    assert fs_id(str(tmp_path)) == os.statvfs(tmp_path).f_fsid
    assert fs_id(str(tmp_path / "nothing")) is None


def test_record_writes_each_directorys_filesystem_once(tmp_path: Path) -> None:
    spill, _ = _spill(tmp_path)
    fs = SpillFilesystems(str(tmp_path))
    fs.record([str(spill)])
    path = tmp_path / RECORD
    assert json.loads(path.read_text()) == {os.path.realpath(spill): fs_id(str(spill))}
    before = path.stat().st_mtime_ns, path.stat().st_ino
    fs.record([str(spill)])  # unchanged: not written again
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert not (tmp_path / (RECORD + ".tmp")).exists()
    assert SpillFilesystems(str(tmp_path)).recorded() == fs.recorded()


def test_another_filesystem_holding_none_of_the_checkpoints_stops_the_start(
    tmp_path: Path,
) -> None:
    spill, paths = _spill(tmp_path)
    fs = _recorded_elsewhere(tmp_path, spill)
    with pytest.raises(ConfigError) as e:
        fs.check({str(spill): paths})
    assert "is on another filesystem" in e.value.detail
    assert "none of the 2 checkpoints" in e.value.detail
    assert "--release-lost-checkpoints" in e.value.detail
    assert str(spill) in e.value.detail


def test_a_spill_directory_gone_stops_the_start(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    with pytest.raises(ConfigError, match="does not exist"):
        SpillFilesystems(str(tmp_path)).check({str(gone): [str(gone / "a.1.ckpt")]})


def test_release_lost_logs_instead(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spill, paths = _spill(tmp_path)
    fs = _recorded_elsewhere(tmp_path, spill)
    with caplog.at_level(logging.WARNING, logger="maasd.core.spillfs"):
        fs.check({str(spill): paths}, release_lost=True)
    assert "released (--release-lost-checkpoints)" in caplog.text


@pytest.mark.parametrize(
    "case",
    [
        "same filesystem, files removed by hand",
        "another filesystem holding one of them (moved there)",
        "nothing recorded (a data dir of an older maasd)",
        "no checkpoint named",
    ],
)
def test_what_does_not_stop_the_start(tmp_path: Path, case: str) -> None:
    if case.startswith("same"):
        spill, paths = _spill(tmp_path)
        fs = SpillFilesystems(str(tmp_path))
        fs.record([str(spill)])
    elif case.startswith("another"):
        spill, paths = _spill(tmp_path, "b.2.ckpt")
        fs = _recorded_elsewhere(tmp_path, spill)
    elif case.startswith("nothing"):
        spill, paths = _spill(tmp_path)
        fs = SpillFilesystems(str(tmp_path))
    else:
        spill, paths = _spill(tmp_path)
        fs = _recorded_elsewhere(tmp_path, spill)
        paths = []
    fs.check({str(spill): paths})


@pytest.mark.parametrize("content", ["", "[1, 2]", "{", '{"/x": "not an int", "/y": true}'])
def test_a_damaged_record_is_an_empty_one(tmp_path: Path, content: str) -> None:
    (tmp_path / RECORD).write_text(content)
    fs = SpillFilesystems(str(tmp_path))
    assert fs.recorded() == {}
    spill, _ = _spill(tmp_path)
    fs.record([str(spill)])  # and is replaced by a good one
    assert json.loads((tmp_path / RECORD).read_text()) == {
        os.path.realpath(spill): fs_id(str(spill))
    }


def test_a_record_that_cannot_be_written_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spill, _ = _spill(tmp_path)
    (tmp_path / (RECORD + ".tmp")).mkdir()  # the temporary file cannot be made
    with caplog.at_level(logging.WARNING, logger="maasd.core.spillfs"):
        SpillFilesystems(str(tmp_path)).record([str(spill)])
    assert "cannot record the spill filesystems" in caplog.text
