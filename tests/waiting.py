"""Polling for a condition that another thread or process makes true eventually.

Import as ``from waiting import wait_until`` (``tests/`` is on pytest's ``pythonpath``).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object],
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "",
) -> None:
    """Call ``predicate`` every ``interval`` seconds until it is true.

    Fails the test (``AssertionError``) when it is still false after ``timeout``
    seconds — checked one last time at the deadline — naming ``message`` if given.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    if not predicate():
        raise AssertionError(f"not true within {timeout:g} s: {message or repr(predicate)}")
