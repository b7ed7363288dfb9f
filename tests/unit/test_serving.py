"""The signals that stop a maasd process, named once (:mod:`maasd.serving`): each of
``HANDLED_SIGNALS`` ends a process cleanly, before a server takes them over
(``exit_on_signals``) and while one runs (``handling``, restored after)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from maasd.serving import HANDLED_SIGNALS, handling

_CHILD = """
import os, signal, sys, time
from maasd.serving import exit_on_signals
exit_on_signals(0)
try:
    print("ready", flush=True)
    time.sleep(30)
finally:
    print("finally ran", flush=True)
"""


@pytest.mark.parametrize("sig", HANDLED_SIGNALS)
def test_a_stop_before_the_server_runs_exits_0_and_runs_finally(sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "finally ran" in out


def test_handling_answers_both_signals_and_puts_the_handlers_back():
    assert set(HANDLED_SIGNALS) == {signal.SIGINT, signal.SIGTERM}
    before = {s: signal.getsignal(s) for s in HANDLED_SIGNALS}
    seen: list[int] = []
    with handling(lambda sig, _frame: seen.append(sig)):
        for s in HANDLED_SIGNALS:
            signal.raise_signal(s)
    assert seen == [int(s) for s in HANDLED_SIGNALS]
    assert {s: signal.getsignal(s) for s in HANDLED_SIGNALS} == before
