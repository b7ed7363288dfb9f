"""Pure parts around the service: the error tree, its HTTP mapping, timestamps, request sizing."""

from __future__ import annotations

import errno
import logging

import msgspec
import pytest

from maasd import errors
from maasd.api.schemas import ReserveBody
from maasd.models import rfc3339
from maasd.problems import PROBLEM_BASE, STATUS, status_of

EXPECTED_STATUS = {
    errors.InvalidRequest: 400,
    errors.Unauthorized: 401,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.Conflict: 409,
    errors.QuotaExceeded: 409,
    errors.DuplicateKey: 409,
    errors.StateConflict: 409,
    errors.Unprocessable: 422,
    errors.QosUnmet: 422,
    errors.PlacementError: 422,
    errors.TooLarge: 422,
    errors.BufferCountExceeded: 409,
    errors.LimitExceeded: 429,
    errors.PoolExhausted: 507,
    errors.ResourceLimit: 507,
    errors.BackingError: 500,
    errors.ConfigError: 500,
}


@pytest.mark.parametrize(
    ("cls", "status"), EXPECTED_STATUS.items(), ids=lambda v: getattr(v, "__name__", v)
)
def test_every_error_maps_to_its_status(cls: type[errors.MaasdError], status: int) -> None:
    assert status_of(cls("x")) == status


def test_every_concrete_error_is_mapped() -> None:
    def subclasses(c: type[errors.MaasdError]) -> list[type[errors.MaasdError]]:
        return [c, *(s for sub in c.__subclasses__() for s in subclasses(sub))]

    for cls in subclasses(errors.MaasdError)[1:]:
        if cls in (errors.BackingError, errors.ConfigError):
            # The kernel refusing, or the operator's configuration: never a request's
            # fault, so no status of their own (the unlisted 500 if one ever leaks).
            assert status_of(cls("x")) == 500
        else:
            assert any(issubclass(cls, base) for base, _ in STATUS), cls
        assert cls.code != errors.MaasdError.code, f"{cls.__name__} needs its own code"


def test_broker_and_api_share_the_one_table() -> None:
    from maasd.api import problems as api_problems
    from maasd.broker.dispatch import Dispatcher
    from maasd.broker.pacing import LogLimiter
    from maasd.problems import problem_of
    from maasd.protocol import Error

    # Both faces use maasd.problems itself, not copies that could drift apart …
    assert api_problems.status_of is status_of
    assert api_problems.PROBLEM_BASE is PROBLEM_BASE
    dispatcher = Dispatcher(None, LogLimiter(logging.getLogger("test")))  # type: ignore[arg-type]
    # … so each error class gets its documented status on the socket and over REST,
    for cls, status in EXPECTED_STATUS.items():
        frame = dispatcher.error(cls("x"), {}).reply
        assert isinstance(frame, Error)
        p = problem_of(cls("x"))
        assert (frame.status, frame.type, frame.title, frame.detail) == (
            status,
            p.type,
            p.title,
            p.detail,
        ), cls
        assert api_problems.status_of(cls("x")) == status, cls
    # under the problem type base that docs/api.md shows.
    assert PROBLEM_BASE == "https://maasd.dev/problems/"


def test_problem_types_spec_names() -> None:
    assert (PROBLEM_BASE + errors.QuotaExceeded.code).endswith("quota-exceeded")
    assert (PROBLEM_BASE + errors.PoolExhausted.code).endswith("pool-exhausted")


def test_backing_error_carries_errno() -> None:
    e = errors.BackingError("mbind: [EINVAL] Invalid argument", errno=22)
    assert e.errno == 22
    assert "mbind" in e.detail


@pytest.mark.parametrize(
    ("epoch", "text"),
    [
        (0.0, "1970-01-01T00:00:00.000000Z"),
        (0.5, "1970-01-01T00:00:00.500000Z"),
        (1795956108.9999996, "2026-11-29T12:41:49.000000Z"),
    ],
)
def test_rfc3339_fixed_width(epoch: float, text: str) -> None:
    assert rfc3339(epoch) == text


def test_rfc3339_sorts_as_text() -> None:
    stamps = [0.1, 9.9, 10.0, 99.5, 1e9, 1.7e9 + 0.25]
    assert sorted(rfc3339(s) for s in stamps) == [rfc3339(s) for s in sorted(stamps)]


def test_reserve_body_sizes() -> None:
    assert ReserveBody(size_bytes=5).to_spec().size_bytes == 5
    assert ReserveBody(size_gb=1.0).to_spec().size_bytes == 1 << 30
    assert ReserveBody(size_gb=1e-12).to_spec().size_bytes == 1  # rounds up to a whole byte
    assert ReserveBody(size_bytes=5).to_spec("fast").pool == "fast"
    for bad in (ReserveBody(), ReserveBody(size_bytes=1, size_gb=1.0)):
        with pytest.raises(errors.InvalidRequest, match="exactly one of size_bytes and size_gb"):
            bad.to_spec()
    for body in (b'{"size_gb": -1.0}', b'{"size_gb": 17179869184.0}', b'{"size_gb": 0}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(body, type=ReserveBody)


@pytest.mark.parametrize(
    "body",
    [
        b'{"size_bytes": "5"}',
        b'{"size_bytes": 5.0}',
        b'{"size_bytes": true}',
        b'{"size_bytes": 0}',
        b'{"size_bytes": -1}',
        b'{"size_bytes": 9223372036854775808}',
        b'{"size_bytes": 1, "x": 1}',
        b'{"size_bytes": 1, "persistence": "forever"}',
        b'{"size_bytes": 1, "ttl_s": 0}',
        b'{"size_bytes": 1, "label": "' + b"a" * 129 + b'"}',
        b'{"size_bytes": 1, "key": ""}',
        b'{"size_bytes": 1, "evictable": 1}',
        b'{"size_bytes": 1, "numa_node": -1}',
    ],
)
def test_reserve_body_is_strict(body: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=ReserveBody)


def test_a_refused_syscall_is_named_in_the_error() -> None:
    """The allocator's syscall wrappers say which call the kernel refused (``op``)."""
    from maasd.allocator import _sys

    with pytest.raises(errors.BackingError) as info:
        _sys.mmap_shared(-1, 4096)  # not an fd: EBADF
    assert info.value.op == "mmap"
    assert info.value.errno == errno.EBADF
