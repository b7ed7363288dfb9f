"""Which filesystem each spill directory was on, so that a start without it loses nothing.

A persistent buffer comes back from its checkpoint file (invariant 6). If the spill
directory's filesystem is not mounted when the daemon starts (a slow disk, a typo in
fstab, a network mount not yet up), the mount point is an empty directory of the root
filesystem: every checkpoint looks missing, and recovery would release every buffer —
and remove their files as orphans at the next start, once the disk is back.

So the data dir keeps ``spill-filesystems.json``: for each spill directory (the path the
pool names, not where a symlink on it leads: a link repointed to another filesystem is
that directory moved), the ``f_fsid`` of the filesystem it was on when this daemon last
started or made it. At the next start, a spill directory that is on *another* filesystem now (or no
longer exists) *and* holds none of the checkpoints the ledger names there stops the
start, releasing nothing, with one line that names it. ``maasd serve
--release-lost-checkpoints`` is the way out for a disk that is really lost: those
buffers are released, as a missing checkpoint is.

A checkpoint missing on the filesystem it was written to (a file removed by hand) is
released as before; so is a directory on a new filesystem that holds some of its files
(the files were moved: the new filesystem is recorded). A filesystem without an
``f_fsid`` (0) is not compared. Nothing is written into the spill directory itself: it
holds checkpoint files and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping

from maasd.errors import ConfigError

__all__ = ["RECORD", "SpillFilesystems", "fs_id"]

logger = logging.getLogger(__name__)

#: The record, in the data dir.
RECORD = "spill-filesystems.json"


def fs_id(path: str) -> int | None:
    """The ``f_fsid`` of the filesystem ``path`` is on; ``None`` when it does not exist or
    its filesystem gives none."""
    try:
        return os.statvfs(path).f_fsid or None
    except OSError:
        return None


def _cannot_list(path: str) -> str | None:
    """Why the daemon cannot list the directory ``path`` (``strerror``), or ``None``."""
    try:
        with os.scandir(path):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _denied(path: str) -> bool:
    """Whether the file ``path`` exists and the daemon may not open it for reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except PermissionError:
        return True
    except OSError:
        return False  # gone, a symlink, …: restore's own outcome, as before
    os.close(fd)
    return False


def _key(spill_dir: str) -> str:
    """A spill directory as the record names it: the pool's own path (a checkpoint's
    directory is that path, joined), normalised."""
    return os.path.normpath(os.path.abspath(spill_dir))


class SpillFilesystems:
    """The record of the filesystems the spill directories were on (see the module)."""

    def __init__(self, data_dir: str) -> None:
        self._path = os.path.join(data_dir, RECORD)
        self._lock = threading.Lock()  # checkpoints are written from several threads
        self._known: dict[str, int] | None = None  # what the file holds, once read

    def recorded(self) -> dict[str, int]:
        """Spill directory → the ``f_fsid`` recorded for it; empty if none."""
        if self._known is None:
            self._known = self._read()
        return dict(self._known)

    def _read(self) -> dict[str, int]:
        """The record; empty when there is none yet (a first start), or — said in the log,
        since such a start cannot tell an unmounted disk from removed files — when it
        cannot be read."""
        try:
            with open(self._path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            data = e
        known = (
            {k: v for k, v in data.items() if isinstance(k, str) and type(v) is int}
            if isinstance(data, dict)
            else {}
        )
        if not isinstance(data, dict) or len(known) < len(data):
            logger.warning(
                "%s cannot be read (%s): a spill filesystem not mounted is not told from "
                "checkpoints removed until it is written again",
                self._path,
                data if isinstance(data, Exception) else "not an object of f_fsid numbers",
            )
        return known

    def check(self, named: Mapping[str, Iterable[str]], *, release_lost: bool = False) -> None:
        """Stop the start (:class:`ConfigError`) when a spill directory holding checkpoints
        the ledger names (``named``: directory → their paths) is not on the filesystem
        recorded for it, or is gone, and holds none of them. With ``release_lost``, log it
        instead: those buffers are then released as missing checkpoints are."""
        recorded = self.recorded()
        for spill_dir, paths in sorted(named.items()):
            paths = list(paths)
            if not paths:
                continue
            if any(os.path.exists(p) for p in paths):
                self._check_readable(spill_dir, paths, release_lost)
                continue
            real = os.path.realpath(spill_dir)
            now = fs_id(real)
            # By the pool's path; a record of an earlier version holds real paths.
            was = recorded.get(_key(spill_dir), recorded.get(real))
            hint = "is its filesystem mounted?"
            if not os.path.isdir(real):
                why = "does not exist"
            elif (denied := _cannot_list(real)) is not None:
                # A disk mounted with a root the daemon's user cannot search: its files
                # look missing (``exists`` is False on EACCES), on the same filesystem.
                why = f"cannot be read by the daemon ({denied})"
                hint = "can the daemon's user read it (owner, mode)?"
            elif was is not None and now is not None and was != now:
                why = (
                    f"is on another filesystem than when its checkpoints were written "
                    f"(f_fsid {now:#x}, was {was:#x})"
                )
            else:
                continue  # the same filesystem: the files were removed, not hidden
            if release_lost:
                logger.warning(
                    "spill directory %s %s and holds none of the %d checkpoints the ledger "
                    "names there: their buffers are released (--release-lost-checkpoints)",
                    spill_dir,
                    why,
                    len(paths),
                )
                continue
            raise ConfigError(
                f"spill directory {spill_dir} {why} and holds none of the {len(paths)} "
                f"checkpoints the ledger names there: {hint} Nothing was "
                "released. If that disk is really lost, start once with "
                "`maasd serve --release-lost-checkpoints` to release those buffers"
            )

    @staticmethod
    def _check_readable(spill_dir: str, paths: list[str], release_lost: bool) -> None:
        """Stop the start when checkpoint files are there but the daemon may not read them
        (another owner, a mode): restoring would release their buffers, and remove the
        files, as if they were corrupt."""
        denied = [p for p in paths if _denied(p)]
        if not denied:
            return
        if release_lost:
            logger.warning(
                "%d checkpoints in spill directory %s cannot be read by the daemon (permission "
                "denied, e.g. %s): their buffers are released (--release-lost-checkpoints)",
                len(denied),
                spill_dir,
                denied[0],
            )
            return
        raise ConfigError(
            f"{len(denied)} checkpoints in spill directory {spill_dir} cannot be read by the "
            f"daemon (permission denied, e.g. {denied[0]}): can the daemon's user read them "
            "(owner, mode)? Nothing was released. If they are really lost, start once with "
            "`maasd serve --release-lost-checkpoints` to release those buffers"
        )

    def record(self, spill_dirs: Iterable[str]) -> None:
        """Record the filesystem each directory is on now: at start and at each checkpoint
        (a ``statvfs``; the file is replaced atomically, and only when something changed).
        A failure to write is logged: the next start compares less, and loses nothing it
        did not before.

        A directory found on another filesystem than recorded is logged as a warning: a
        disk unmounted (or mounted) under the running daemon splits a pool's checkpoints
        between two filesystems, and a start sees only the ones mounted then."""
        with self._lock:
            recorded = self.recorded()
            now = dict(recorded)
            for spill_dir in spill_dirs:
                fsid = fs_id(spill_dir)
                if fsid is None:
                    continue
                key = _key(spill_dir)
                was = recorded.get(key)
                if was is not None and was != fsid:
                    logger.warning(
                        "spill directory %s is on another filesystem than recorded "
                        "(f_fsid %#x, was %#x): checkpoints go there from now on; those "
                        "written before are where they were (was a disk unmounted or "
                        "mounted while the daemon runs?)",
                        spill_dir,
                        fsid,
                        was,
                    )
                now[key] = fsid
            if now != recorded:
                self._write(now)
                self._known = now

    def _write(self, now: dict[str, int]) -> None:
        tmp = self._path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(now, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except OSError as e:
            logger.warning("cannot record the spill filesystems in %s: %s", self._path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
