"""Running a daemon as uid ``nobody`` (root is exempt from the limits some tests attack).

Such a daemon imports maasd from this checkout and its ``.venv``, so ``nobody`` must be
able to reach them: a clone inside a private (0700) directory is not. ``.ci/run`` makes
its clone reachable; elsewhere :func:`require_reachable_checkout` skips, saying so.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

NOBODY = 65534


def as_nobody() -> list[str]:
    """The command prefix that runs what follows as uid/gid ``nobody``, no other groups."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


@functools.cache
def _unreachable() -> str | None:
    """Why ``nobody`` cannot import the daemon from this checkout, or ``None``."""
    try:
        run = subprocess.run(
            [*as_nobody(), sys.executable, "-c", "import maasd.cli.daemon"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run as nobody: {exc}"
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["?"])[-1]
        return f"uid nobody cannot import maasd from this checkout ({last})"
    return None


def require_reachable_checkout() -> None:
    """Skip the calling test unless a daemon running as ``nobody`` can start from here."""
    why = _unreachable()
    if why is not None:
        pytest.skip(f"{why}; run from a directory others may traverse (.ci/run does)")
