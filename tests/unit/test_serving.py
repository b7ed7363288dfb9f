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


_HANGUP = """
import atexit, os, signal, sys, time
# registered first, so it runs last: after keep_on_hangup's own exit handler
atexit.register(lambda: print("at exit", signal.getsignal(signal.SIGHUP) is signal.SIG_IGN))
from maasd.serving import keep_on_hangup
keep_on_hangup("maasd test")
print("ready", flush=True)
for _ in range(3):
    sys.stdin.readline()  # one line per SIGHUP the test sent: the process is still here
    print("alive", flush=True)
"""


def test_a_hangup_is_logged_and_changes_nothing_until_the_very_end():
    """SIGHUP's default action is to kill: under keep_on_hangup it logs one warning per
    signal and the process goes on; at exit it is ignored, not handed back to the default."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HANGUP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    assert proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    for _ in range(3):
        proc.send_signal(signal.SIGHUP)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "alive"
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.strip() == "at exit True"
    said = [line for line in err.splitlines() if "SIGHUP" in line]
    assert (
        said
        == [
            "SIGHUP ignored: maasd test reads its settings only at start; "
            "restart it to apply a change"
        ]
        * 3
    ), err
