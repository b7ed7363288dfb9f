"""The shared prefix tier: what the core asks of L2, and the thread that writes behind.

The core (:mod:`maasd.core.shared`) makes one :class:`L2Tier` when ``l2_url`` is set and
calls it at three places:

* a committed entry → :meth:`L2Tier.write_behind` (never waits: a bounded queue, a job
  that does not fit is dropped and counted); the writer thread reads the entry's bytes
  when its turn comes (``source``), prefixes the header of :mod:`maasd.l2.codec` and
  stores it in one round trip;
* a local lookup miss → :meth:`L2Tier.fetch` (one round trip for all of the lookup's
  keys, the longest that L2 holds wins), which returns the entry's bytes only once the
  codec's checks pass.
* an entry released → :meth:`L2Tier.ended`: unless it was evicted, the value it wrote
  (or was restored from) is deleted from L2 — by the writer thread, never the caller —
  and a write of it still queued is dropped (:mod:`maasd.l2.ends`).

Neither ever raises for L2's sake: a failure, a timeout (``l2_timeout_s``) or a refused
value is counted and answered as "nothing". After ``l2_breaker_failures`` failures in a
row the circuit breaker opens: for ``l2_breaker_backoff_s`` nothing asks L2 (lookups miss
at once, writes are dropped), then the writer thread probes it with a PING (or the next
request does), and the first success closes it again.

Judged fairly (docs/scale-out.md, "Failure modes"): the breaker judges the service, not
one tenant's traffic.

* A store's timeout grows with its value: ``l2_timeout_s`` plus the value's bytes at
  ``l2_min_bytes_per_s`` (64 MiB at 100 MiB/s: 0.74 s in all).
* A failed call counts first against its tenant (:class:`~maasd.l2.breaker.TenantBreakers`:
  after ``l2_breaker_failures`` in a row, that tenant's calls stop for a backoff), and
  against the host only if a PING — small, on the base timeout — fails too.
* The write-behind queue gives each tenant a bounded share, taken round-robin
  (:mod:`maasd.l2.queue`).
* Values over ``l2_max_value_bytes`` are not sent at all, and counted
  (``maasd_l2_skipped_writes_total{reason="over_value_limit"}``; the limit is the gauge
  ``maasd_l2_max_value_bytes``). Not chunked: docs/scale-out.md says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from maasd.errors import ConfigError
from maasd.l2 import codec
from maasd.l2.breaker import Breaker, TenantBreakers
from maasd.l2.ends import Ends, Written
from maasd.l2.metrics import L2Metrics
from maasd.l2.queue import Job, WriteQueue

if TYPE_CHECKING:
    from maasd.l2.client import RedisL2
    from maasd.settings import Settings

__all__ = ["Fetched", "L2Tier", "Source"]

logger = logging.getLogger("maasd.l2")

#: Calls of a delete that may fail before it is given up (the value then ages out).
DELETE_TRIES = 5

#: ``source(buffer_id, tenant_id, key, head)``: a bytearray of ``head`` free bytes and then
#: the committed entry's bytes, or None if that entry is gone (released, not that key).
Source = Callable[[str, str, str, int], "bytearray | None"]


@dataclass(frozen=True, slots=True)
class Fetched:
    """An entry read back from L2 and checked: ``data`` is a view of the value's bytes,
    ``digest`` the value's identity (:func:`maasd.l2.codec.digest`)."""

    key: str
    data: memoryview
    digest: bytes = b""


class _Judged:
    """How the tier's calls to L2 are judged: the host's circuit breaker and each tenant's
    (the module docstring, "Judged fairly")."""

    breaker: Breaker
    tenants: TenantBreakers
    metrics: L2Metrics
    client: RedisL2
    _errors: tuple[type[Exception], ...]

    def _allow(self, tenant_id: str) -> bool:
        """The rights to call L2 for this tenant now: the host's breaker's, then its own."""
        if not self.breaker.allow():
            return False
        if not self.tenants.allow(tenant_id):
            self.breaker.release()
            return False
        return True

    def _failed_for(
        self, tenant_id: str, op: str, exc: BaseException, timeout_s: float | None = None
    ) -> None:
        """A call of ``tenant_id``'s failed: its own breaker counts it; the host's only if
        a PING fails too — else the service is fine and the failure was this tenant's
        traffic (a value too large for its timeout, say). The PING may take as long as
        the failed call could (``timeout_s``): queued behind a large value in Redis, it
        says "busy", not "dead", and the next job waits for that value to be done."""
        if self.tenants.failure(tenant_id):
            self.metrics.tenant_breaker_trips.inc()
            logger.warning(
                "L2 failing for one tenant: its L2 calls pause, the others' go on",
                extra={"op": op, "tenant": tenant_id, "error": type(exc).__name__},
            )
        try:
            self.client.ping(timeout_s)
        except self._errors:
            self._failed(op, exc)
        else:
            self._host_ok()

    def _failed(self, op: str, exc: BaseException) -> None:
        was_closed = self.breaker.closed
        self.breaker.failure()
        if was_closed and not self.breaker.closed:
            self.metrics.breaker_trips.inc()
            self.metrics.breaker_open.set(1)
            logger.warning(
                "L2 failing: circuit breaker open, local operations go on without it",
                extra={"op": op, "error": type(exc).__name__, "backoff_s": self.breaker.backoff_s},
            )
        logger.debug("L2 %s failed: %s", op, exc)

    def _succeeded(self, tenant_id: str | None = None) -> None:
        if tenant_id is not None:
            self.tenants.success(tenant_id)
        self._host_ok()

    def _host_ok(self) -> None:
        if not self.breaker.closed:  # an outage ended: no tenant is judged by its failures
            logger.info("L2 reachable again: circuit breaker closed")
            self.tenants.clear()
        self.breaker.success()
        self.metrics.breaker_open.set(0)


class _Deletes(_Judged):
    """The deletes of the values that released entries wrote (:mod:`maasd.l2.ends`): queued
    in the write-behind queue's lane of their own, done by the writer thread while the
    host's breaker is closed (a failed one is tried again, up to :data:`DELETE_TRIES`
    calls). A release never waits for one, and never fails for one."""

    ends: Ends
    queue: WriteQueue

    def ended(self, tenant_id: str, buffer_id: str, reason: str) -> None:
        """The entry ``buffer_id`` is being released for ``reason`` (the core's release
        hook, before its region goes): a write of it still queued is dropped, and unless
        it was evicted, the value it wrote (or was restored from) is deleted later."""
        value = self.ends.ended(buffer_id, reason)
        if self.queue.drop_buffer(tenant_id, buffer_id):
            self.ends.withdrawn(buffer_id)
            self.metrics.dropped.labels(reason="gone").inc()
            self._queue_gauges()
        if value is not None:
            self._delete_later(value)

    def restored(self, buffer_id: str, tenant_id: str, fetched: Fetched) -> None:
        """The entry ``buffer_id`` was restored here from the value ``fetched``."""
        self.ends.restored(buffer_id, Written(tenant_id, fetched.key, fetched.digest, True))

    def _delete_later(self, value: Written, tries: int = 0) -> None:
        job = Job(value.tenant_id, value.key, digest=value.digest, tries=tries)
        if not self.queue.offer_delete(job, first=tries > 0):
            self.metrics.deletes.labels(outcome="queue_full").inc()
        self._queue_gauges()

    def _delete(self, job: Job) -> None:
        m = self.metrics
        if not self.breaker.allow():  # opened since it was taken: it waits for L2
            if not self.queue.offer_delete(job, first=True):
                m.deletes.labels(outcome="queue_full").inc()
            return
        started = time.perf_counter()
        try:
            deleted = self.client.delete(job.tenant_id, job.key, job.digest)
        except self._errors as exc:
            m.seconds.labels(op="delete").observe(time.perf_counter() - started)
            self._failed("delete", exc)
            m.deletes.labels(outcome="error").inc()
            if job.tries + 1 < DELETE_TRIES:
                self._delete_later(Written(job.tenant_id, job.key, job.digest), job.tries + 1)
            else:
                m.deletes.labels(outcome="given_up").inc()
            return
        m.seconds.labels(op="delete").observe(time.perf_counter() - started)
        self._succeeded()
        self.ends.settled(job.digest)
        m.deletes.labels(outcome="deleted" if deleted else "absent").inc()

    def _queue_gauges(self) -> None:
        self.metrics.queued.set(self.queue.entries)
        self.metrics.queued_bytes.set(self.queue.bytes)
        self.metrics.queued_deletes.set(self.queue.deletes)


class L2Tier(_Deletes):
    """One daemon's L2: the client, the breaker, the write-behind queue and its thread."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry,
        source: Source,
        *,
        client: RedisL2 | None = None,
    ) -> None:
        assert settings.l2_url is not None
        self._cap = settings.l2_tenant_bytes
        #: what this daemon sends or reads back, at most (a value: header and entry)
        self._max_value = min(settings.l2_max_value_bytes, settings.l2_tenant_bytes)
        self._ttl_ms = settings.l2_ttl_s * 1000
        self._timeout = settings.l2_timeout_s
        self._rate = settings.l2_min_bytes_per_s
        self._source = source
        self.metrics = L2Metrics(registry)
        self.metrics.max_value.set(settings.l2_max_value_bytes)
        self._skipped = self.metrics.lookups.labels(outcome="skipped")  # bound once: hot path
        self.breaker = Breaker(settings.l2_breaker_failures, settings.l2_breaker_backoff_s)
        self.tenants = TenantBreakers(settings.l2_breaker_failures, settings.l2_breaker_backoff_s)
        self.queue = WriteQueue(settings.l2_queue_entries, settings.l2_queue_bytes)
        self.ends = Ends()
        self.client = client or _connect(settings)
        #: errors of a call to L2 that count against it (redis-py's, the socket's)
        self._errors = self.client.errors
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the core's two calls ----------------------------------------------------------------

    def ready(self) -> bool:
        """Whether a lookup miss should ask L2 now (the breaker would let it through)."""
        return self.breaker.ready()

    def fetch(self, tenant_id: str, keys: list[str]) -> Fetched | None:
        """The tenant's longest of ``keys`` that L2 holds, checked; None for anything else."""
        m = self.metrics
        if not self._allow(tenant_id):
            self._skipped.inc()
            return None
        started = time.perf_counter()
        try:
            found = self.client.fetch(tenant_id, keys, max_bytes=self._max_value)
        except self._errors as exc:
            m.seconds.labels(op="fetch").observe(time.perf_counter() - started)
            self._failed_for(tenant_id, "fetch", exc)
            m.lookups.labels(outcome="error").inc()
            return None
        m.seconds.labels(op="fetch").observe(time.perf_counter() - started)
        self._succeeded(tenant_id)
        if found is None:
            m.lookups.labels(outcome="miss").inc()
            return None
        key, value = found
        m.bytes_in.inc(len(value) if isinstance(value, bytes) else 0)
        try:
            data = codec.checked(value, tenant_id, key, self._max_value)
        except codec.Refused as refused:
            m.refused.labels(reason=refused.reason).inc()
            m.lookups.labels(outcome="refused").inc()
            logger.warning(
                "refused a value read from L2",
                extra={"tenant": tenant_id, "reason": refused.reason, "detail": str(refused)},
            )
            if not refused.keep:
                self.queue.offer(Job(tenant_id, key, forget=True))
            return None
        digest = codec.digest(value) if isinstance(value, bytes) else b""
        if self.ends.deleting(digest):  # its entry here was deleted, its delete not done
            m.lookups.labels(outcome="miss").inc()
            return None
        return Fetched(key, data, digest)

    def drop_tenant(self, tenant_id: str) -> None:
        """A deleted tenant's values dropped, in one call (skipped if L2 fails: they age out),
        and its writes queued or being stored (:meth:`_write`) with them."""
        self.metrics.dropped.labels(reason="gone").inc(self.queue.drop_tenant(tenant_id))
        self.ends.drop_tenant(tenant_id)
        try:
            if self.breaker.allow():
                self.client.drop_tenant(tenant_id, ttl_ms=self._ttl_ms)
                return self._succeeded(tenant_id)
        except self._errors as exc:
            self._failed("drop_tenant", exc)
        logger.warning("a deleted tenant's values in L2 age out (l2_ttl_s) instead")

    def skipped(self) -> None:
        """A local miss not asked of L2: the breaker is open (the broker's hot path)."""
        self._skipped.inc()

    def counted(self, outcome: str) -> None:
        """Count how a fetched entry ended here (``hit`` once restored, or ``unplaced``)."""
        self.metrics.lookups.labels(outcome=outcome).inc()

    def write_behind(self, tenant_id: str, key: str, buffer_id: str, size: int) -> None:
        """Queue a committed entry for L2; dropped (and counted) when that cannot be done."""
        dropped = self.metrics.dropped
        value_size = codec.value_size(tenant_id, key, size)
        if value_size > self._cap:
            dropped.labels(reason="too_large").inc()
        elif value_size > self._max_value:
            self.metrics.skipped_writes.labels(reason="over_value_limit").inc()
        elif not self.breaker.ready() or not self.tenants.ready(tenant_id):
            dropped.labels(reason="breaker_open").inc()
        elif not self.ends.offered(tenant_id, buffer_id):
            dropped.labels(reason="gone").inc()  # released before its commit hook ran
        elif not self.queue.offer(Job(tenant_id, key, buffer_id, size)):
            self.ends.withdrawn(buffer_id)
            dropped.labels(reason="queue_full").inc()
        self._queue_gauges()

    # -- the writer thread ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="maasd-l2-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the writer (the jobs still queued are dropped), close the connections."""
        self._stop.set()
        left = self.queue.close()
        deletes = sum(1 for job in left if job.digest)
        self.metrics.dropped.labels(reason="shutdown").inc(len(left) - deletes)
        self.metrics.deletes.labels(outcome="shutdown").inc(deletes)
        if self._thread is not None:
            self._thread.join(timeout=5 * self._timeout + 1)
        self.client.close()

    def _run(self) -> None:
        idle = min(1.0, max(0.05, self.breaker.backoff_s / 2))
        while not self._stop.is_set():
            job = self.queue.take(idle, deletes=self.breaker.closed)
            self._queue_gauges()
            try:
                if job is None:
                    self._probe()
                elif job.digest:
                    self._delete(job)
                elif job.forget:
                    self._forget(job)
                else:
                    self._write(job)
            except Exception:  # a bug: never let the writer die with it
                logger.exception("L2 writer failed on a job")

    def _write(self, job: Job) -> None:
        """Store ``job``'s entry, then (its store done) delete the value again if the entry
        was released meanwhile (:mod:`maasd.l2.ends`)."""
        left = None
        try:
            left = self._store(job)
        finally:
            value = self.ends.stored(job.buffer_id, left)
            if value is not None:
                self._delete_later(value)

    def _store(self, job: Job) -> Written | None:
        """Store ``job``'s entry; the value it may have left in L2 (None: none)."""
        dropped = self.metrics.dropped
        t = job.tenant_id
        if not self.ends.wanted(job.buffer_id):  # released since it was queued
            dropped.labels(reason="gone").inc()
            return None
        if not self._allow(t):
            dropped.labels(reason="breaker_open").inc()
            return None
        head = codec.value_size(t, job.key, 0)
        buf = self._source(job.buffer_id, t, job.key, head)
        if buf is None:
            self.breaker.release()
            self.tenants.release(t)
            dropped.labels(reason="gone").inc()
            return None
        value = codec.encode_into(buf, t, job.key)
        written = Written(t, job.key, codec.digest(value))
        timeout = self._timeout + len(value) / self._rate
        started = time.perf_counter()
        try:
            evicted = self.client.store(
                t, job.key, value, cap=self._cap, ttl_ms=self._ttl_ms, timeout_s=timeout
            )
        except self._errors as exc:
            self.metrics.seconds.labels(op="store").observe(time.perf_counter() - started)
            self._failed_for(t, "store", exc, timeout)
            self.metrics.writes.labels(outcome="error").inc()
            dropped.labels(reason="error").inc()
            return written  # a timed-out store may still land
        self.metrics.seconds.labels(op="store").observe(time.perf_counter() - started)
        self._succeeded(t)
        if evicted == codec.GONE:  # deleted (by any host) before the store landed: undone
            dropped.labels(reason="gone").inc()
            return None
        if self.queue.deleted(t):  # its tenant deleted as it was stored: the drop missed it
            self.drop_tenant(t)
            dropped.labels(reason="gone").inc()
            return None
        if evicted < 0:
            dropped.labels(reason="too_large").inc()
            return None
        self.metrics.writes.labels(outcome="ok").inc()
        self.metrics.bytes_out.inc(len(value))
        self.metrics.evicted.inc(evicted)
        return written

    def _forget(self, job: Job) -> None:
        if not self.breaker.allow():
            return
        try:
            self.client.forget(job.tenant_id, job.key)
        except self._errors as exc:
            self._failed("forget", exc)
        else:
            self._succeeded()

    def _probe(self) -> None:
        """Idle with the breaker open and its backoff over: a PING decides."""
        if self.breaker.closed or not self.breaker.ready() or not self.breaker.allow():
            return
        try:
            self.client.ping()
        except self._errors as exc:
            self._failed("ping", exc)
        else:
            self._succeeded()


def _connect(settings: Settings) -> RedisL2:
    """The redis-py client of ``settings.l2_url``; a ConfigError without the ``l2`` extra."""
    try:
        from maasd.l2.client import RedisL2
    except ImportError as exc:
        raise ConfigError(
            f"--l2-url needs the l2 extra (pip install 'maasd[l2]'): {exc.name} is missing"
        ) from None
    assert settings.l2_url is not None
    return RedisL2(
        settings.l2_url,
        timeout_s=settings.l2_timeout_s,
        # the slow pool's threads (the fetches), the writer, and one to spare
        connections=settings.socket_slow_workers + 2,
        prefix=settings.l2_prefix,
    )
