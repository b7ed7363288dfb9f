"""A spill "disk" a test can unmount and mount again: a tmpfs bind-mounted on a spill dir.

Unmounting the bind leaves the checkpoint files on the tmpfs, out of the daemon's sight,
as a disk that fstab failed to mount does (``maasd.core.spillfs``). Root only; a test
that cannot mount a tmpfs is skipped.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

MiB = 1 << 20


class Disk:
    """A tmpfs (the disk) bind-mounted on ``spill``, which can be unmounted and mounted again."""

    def __init__(self, base: Path, size: int = 32 * MiB) -> None:
        self.store = base / "disk"
        self.spill = base / "spill"
        self.store.mkdir(parents=True)
        self.spill.mkdir()
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.store)]
        ).returncode:
            pytest.skip("cannot mount a tmpfs here")
        self.mount()

    def mount(self) -> None:
        subprocess.run(["mount", "--bind", str(self.store), str(self.spill)], check=True)

    def umount(self) -> None:
        subprocess.run(["umount", str(self.spill)], check=True)

    def close(self) -> None:
        for path in (self.spill, self.spill, self.store):  # bound twice at most, then the disk
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
