"""Work deferred past an answer (:mod:`maasd.core.answered`): later inside ``answering``,
at once anywhere else, every call run even when one fails."""

from __future__ import annotations

import logging
import threading

import pytest

from maasd.core.answered import after_answer, answering


def test_outside_an_answer_the_work_runs_at_once() -> None:
    ran: list[str] = []
    after_answer(lambda: ran.append("now"))
    assert ran == ["now"]


def test_inside_an_answer_the_work_waits_for_run_in_order() -> None:
    ran: list[str] = []
    with answering() as later:
        after_answer(lambda: ran.append("a"))
        after_answer(lambda: ran.append("b"))
        assert ran == []
        assert later
        later.run()
    assert ran == ["a", "b"]
    assert not later
    after_answer(lambda: ran.append("after"))  # the block is over: at once again
    assert ran == ["a", "b", "after"]


def test_work_deferred_by_deferred_work_runs_too() -> None:
    ran: list[str] = []
    with answering() as later:
        after_answer(lambda: after_answer(lambda: ran.append("inner")))
        later.run()
    assert ran == ["inner"]


def test_a_failing_call_is_logged_and_the_rest_still_run(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("boom")

    with answering() as later:
        after_answer(boom)
        after_answer(lambda: ran.append("still"))
        with caplog.at_level(logging.ERROR, logger="maasd.core.answered"):
            later.run()
    assert ran == ["still"]
    assert "deferred past an answer failed" in caplog.text


def test_the_deferral_is_per_thread_and_nests() -> None:
    ran: list[str] = []
    with answering() as outer:
        t = threading.Thread(target=lambda: after_answer(lambda: ran.append("other thread")))
        t.start()
        t.join()
        assert ran == ["other thread"]  # another thread answers nothing of ours: at once
        with answering() as inner:
            after_answer(lambda: ran.append("inner"))
        after_answer(lambda: ran.append("outer"))
        assert ran == ["other thread"]
        inner.run()
        outer.run()
    assert ran == ["other thread", "inner", "outer"]
