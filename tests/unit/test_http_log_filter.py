"""The REST server's filter of uvicorn's per-request warning (maasd.api.server.OnceAMinute)."""

from __future__ import annotations

import logging

from maasd.api.server import NOT_HTTP_WARNING, OnceAMinute


def record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, (), None)


def test_the_warning_passes_once_an_interval_and_counts_what_it_stood_for(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("maasd.api.server.time.monotonic", lambda: clock[0])
    f = OnceAMinute(NOT_HTTP_WARNING, interval_s=60)
    first = record(NOT_HTTP_WARNING)
    assert f.filter(first)
    assert "1 since the last such line" in first.getMessage()
    assert not any(f.filter(record(NOT_HTTP_WARNING)) for _ in range(500))
    assert f.filter(record("something else"))  # other records pass
    clock[0] += 61
    later = record(NOT_HTTP_WARNING)
    assert f.filter(later)
    assert "501 since the last such line" in later.getMessage()
