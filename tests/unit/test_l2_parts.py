"""The L2 tier's pure parts: the value codec, the circuit breaker, the write-behind
queue, URL redaction and the settings' checks. (With a real Redis: test_l2.py.)"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maasd.errors import ConfigError
from maasd.l2.breaker import Breaker
from maasd.l2.queue import Job, WriteQueue
from maasd.settings import load
from waiting import wait_until

pytest.importorskip("xxhash", reason="needs the l2 extra (xxhash)")

from maasd.l2 import codec


def encode(tenant: str, key: str, data: bytes) -> bytes:
    buf = bytearray(codec.value_size(tenant, key, len(data)))
    buf[len(buf) - len(data) :] = data
    return bytes(codec.encode_into(buf, tenant, key))


# ---------------------------------------------------------------------------- codec
@given(
    tenant=st.text(min_size=1, max_size=40),
    key=st.text(max_size=200),
    data=st.binary(min_size=1, max_size=2048),
)
def test_a_value_decodes_to_its_bytes_under_its_own_namespace(
    tenant: str, key: str, data: bytes
) -> None:
    value = encode(tenant, key, data)
    assert len(value) == codec.value_size(tenant, key, len(data))
    assert bytes(codec.decode(value, tenant, key, max_bytes=len(data))) == data


def test_every_check_refuses_with_its_reason() -> None:
    value = encode("t1", "k", secrets.token_bytes(5000))

    def reason(v: bytes, tenant: str = "t1", key: str = "k", most: int = 1 << 20) -> str:
        with pytest.raises(codec.Refused) as e:
            codec.decode(v, tenant, key, most)
        return e.value.reason

    assert reason(b"") == "format"
    assert reason(encode("t1", "k", b"")) == "size"  # no entry is empty
    assert reason(value[: codec.HEADER - 1]) == "format"
    assert reason(b"x" * len(value)) == "format"
    assert reason(value[:-1]) == "size"  # truncated
    assert reason(value + b"\0") == "size"  # longer than it says
    assert reason(value, most=4999) == "size"  # more than the caller reads
    assert reason(value, tenant="t2") == "namespace"
    assert reason(value, key="k2") == "namespace"
    assert reason(value, tenant="t", key="1k") == "namespace"  # the split matters too
    for at in (8, 20, codec.HEADER + 1, len(value) - 1):  # version, length, tenant, data
        bad = bytearray(value)
        bad[at] ^= 0x01
        assert reason(bytes(bad)) in ("format", "size", "namespace", "checksum"), at
    flipped = bytearray(value)
    flipped[-1] ^= 0x80
    assert reason(bytes(flipped)) == "checksum"
    forged = bytearray(value)
    forged[codec.HEADER + 3] ^= 0xFF  # the data moved into the namespace's bytes
    assert reason(bytes(forged)) in ("namespace", "checksum")


def test_keys_of_a_tenant_share_its_hash_tag() -> None:
    k = codec.Keys("maasd", "tenant-1")
    names = [k.entry("fp:abc"), k.lru, k.sizes, k.bytes, k.gone]
    assert all("{tenant-1}" in n for n in names)
    assert k.entry("fp:abc") != codec.Keys("maasd", "tenant-2").entry("fp:abc")
    assert k.entry("x") != codec.Keys("other", "tenant-1").entry("x")


# ---------------------------------------------------------------------------- breaker
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_k_failures_and_probes_once_per_backoff() -> None:
    clock = Clock()
    b = Breaker(3, 2.0, clock)
    assert b.allow() and b.ready()  # noqa: PT018
    b.failure()
    b.failure()
    b.success()  # a success in between starts the count again
    b.failure()
    b.failure()
    assert b.closed
    b.failure()
    assert not b.closed
    assert b.opened == 1
    assert not b.ready()
    assert not b.allow()
    clock.now += 1.9
    assert not b.allow()
    clock.now += 0.2
    assert b.ready()
    assert b.allow()  # the one probe
    assert not b.allow()  # … and only one
    assert not b.ready()
    b.failure()  # the probe failed: another backoff
    assert not b.allow()
    clock.now += 2.1
    assert b.allow()
    b.release()  # the probe did not reach L2 after all: someone else may
    assert b.allow()
    b.success()
    assert b.closed and b.allow() and b.opened == 1  # noqa: PT018


def test_the_breaker_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="failures"):
        Breaker(0, 1.0)
    with pytest.raises(ValueError, match="backoff"):
        Breaker(1, 0)


# ---------------------------------------------------------------------------- queue
def test_the_queue_is_bounded_in_entries_and_bytes_and_never_waits() -> None:
    q = WriteQueue(max_entries=3, max_bytes=100)
    assert q.offer(Job("t", "a", "b1", 40))
    assert q.offer(Job("u", "b", "b2", 40))
    assert not q.offer(Job("v", "c", "b3", 40))  # 120 bytes > 100
    assert q.offer(Job("v", "c", "b3", 20))
    assert not q.offer(Job("w", "d", "b4", 0))  # 4 entries > 3
    assert (q.entries, q.bytes) == (3, 100)
    first = q.take(0)
    assert first is not None
    assert first.key == "a"
    assert (q.entries, q.bytes) == (2, 60)
    assert q.take(0) is not None
    assert q.take(0) is not None
    assert q.take(0.01) is None
    q.offer(Job("t", "e", "b5", 1))
    assert [j.key for j in q.close()] == ["e"]
    assert not q.offer(Job("t", "f", "b6", 1))  # closed
    assert q.take(0) is None


def test_a_deleted_tenants_jobs_are_taken_out_and_its_offers_refused() -> None:
    q = WriteQueue(max_entries=8, max_bytes=1000)
    for job in (Job("gone", "a", "b1", 10), Job("kept", "b", "b2", 20), Job("gone", "c", "b3", 30)):
        assert q.offer(job)
    assert q.drop_tenant("gone") == 2
    assert (q.entries, q.bytes) == (1, 20)
    assert q.deleted("gone")
    assert not q.deleted("kept")
    assert not q.offer(Job("gone", "d", "b4", 1))
    assert [j.key for j in iter(lambda: q.take(0), None)] == ["b"]
    assert q.drop_tenant("never-queued") == 0


def test_a_tenant_holds_at_most_its_share_and_the_others_are_served_in_turn() -> None:
    q = WriteQueue(max_entries=8, max_bytes=1000)
    assert q.offer(Job("flood", "f0", "x", 400))  # a first job fits whatever its size
    assert q.offer(Job("flood", "f1", "x", 100))  # 500: half of the bytes
    assert not q.offer(Job("flood", "f2", "x", 1))  # past its share of the bytes
    assert q.offer(Job("small", "s0", "x", 10))  # another's still fits
    assert q.offer(Job("small", "s1", "x", 10))
    order = [job.key for job in iter(lambda: q.take(0), None)]
    assert order == ["f0", "s0", "f1", "s1"]  # round-robin, FIFO within a tenant
    for i in range(4):
        assert q.offer(Job("many", f"m{i}", "x", 1))
    assert not q.offer(Job("many", "m4", "x", 1))  # half of the entries
    assert q.offer(Job("other", "o", "x", 1))


def test_a_tenant_failing_alone_pauses_only_itself() -> None:
    t, fake, reg = tier(l2_breaker_failures=2, l2_breaker_backoff_s=60)
    fake.values[("b", "k")] = encode("b", "k", b"y" * 100)
    failing = {"a"}
    real_fetch = fake.fetch

    def fetch(tenant_id: str, keys: list[str], *, max_bytes: int):
        if tenant_id in failing:  # this tenant's calls time out; PING answers
            raise ConnectionError("its value did not move in time")
        return real_fetch(tenant_id, keys, max_bytes=max_bytes)

    fake.fetch = fetch
    assert t.fetch("a", ["k"]) is None
    assert t.fetch("a", ["k"]) is None  # a's breaker opens; the host's does not
    assert sample(reg, "maasd_l2_breaker_open") == 0
    assert sample(reg, "maasd_l2_tenant_breaker_trips_total") == 1
    assert t.ready()
    calls = fake.calls
    assert t.fetch("a", ["k"]) is None  # not asked: a is paused
    assert fake.calls == calls
    assert sample(reg, "maasd_l2_lookups_total", outcome="skipped") == 1
    hit = t.fetch("b", ["k"])  # b is served
    assert hit is not None
    assert bytes(hit.data) == b"y" * 100
    t.write_behind("a", "k2", "b1", 4096)  # a's writes are dropped, b's queued
    t.write_behind("b", "k2", "b2", 4096)
    assert sample(reg, "maasd_l2_dropped_writes_total", reason="breaker_open") == 1
    assert t.queue.entries == 1


def test_an_outage_pauses_no_tenant_once_the_service_is_back() -> None:
    """Redis frozen, then thawed between a tenant's call and its PING: the call failed
    (the outage's doing), the PING answers and the host's breaker closes — the tenant is
    not paused for another backoff (its lookups asked, its writes queued at once). Before,
    its breaker stayed open past the service's return and its writes were dropped."""
    from maasd.l2.breaker import TenantBreakers

    t, fake, reg = tier(l2_breaker_failures=2)
    clock = Clock()
    t.breaker = Breaker(2, 60.0, clock)
    t.tenants = TenantBreakers(2, 60.0, clock)
    fake.values[("a", "k")] = encode("a", "k", b"z" * 100)
    fake.down = True
    assert t.fetch("a", ["k"]) is None
    assert t.fetch("a", ["k"]) is None  # a's breaker and the host's open: PINGs fail too
    assert sample(reg, "maasd_l2_breaker_open") == 1
    clock.now += 61
    real_fetch = fake.fetch

    def fetch(*_args: object, **_kwargs: object):
        fake.fetch = real_fetch  # the service is back from the next call on
        fake.down = False
        raise ConnectionError("timed out while frozen")

    fake.fetch = fetch
    assert t.fetch("a", ["k"]) is None  # the probe: its call fails, its PING answers
    assert sample(reg, "maasd_l2_breaker_open") == 0
    assert t.tenants.ready("a")
    hit = t.fetch("a", ["k"])  # asked at once
    assert hit is not None
    assert bytes(hit.data) == b"z" * 100
    t.write_behind("a", "k2", "b1", 4096)
    assert sample(reg, "maasd_l2_dropped_writes_total", reason="breaker_open") == 0
    assert t.queue.entries == 1


def test_values_over_the_limit_are_skipped_and_counted() -> None:
    t, _fake, reg = tier(l2_max_value_bytes=1 << 20)
    assert sample(reg, "maasd_l2_max_value_bytes") == 1 << 20
    t.write_behind("t", "big", "b1", 1 << 20)  # with its header: over the limit
    t.write_behind("t", "small", "b2", 4096)
    assert sample(reg, "maasd_l2_skipped_writes_total", reason="over_value_limit") == 1
    assert t.queue.entries == 1


def test_a_store_gets_a_timeout_that_grows_with_its_value() -> None:
    data = secrets.token_bytes(1 << 20)
    t, fake, _reg = tier(
        lambda *a: bytearray(a[3]) + data,
        l2_timeout_s=0.1,
        l2_min_bytes_per_s=1 << 20,
    )
    t._write(Job("t", "k", "b1", len(data)))
    assert len(fake.timeouts) == 1  # the store's (no PING: it succeeded)
    timeout = fake.timeouts[0]
    assert timeout is not None
    assert 1.1 < timeout < 1.2  # 0.1 s, and 1 MiB (and its header) at 1 MiB/s


# ---------------------------------------------------------------------------- redaction
def test_redact_hides_the_password() -> None:
    pytest.importorskip("redis", reason="needs the l2 extra (redis-py)")
    from maasd.l2.client import redact

    assert redact("redis://:s3cret@h:6379/0") == "redis://***@h:6379/0"
    assert redact("rediss://user:s3cret@h/1") == "rediss://***@h/1"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    assert "s3cret" not in redact("unix://:s3cret@/run/redis.sock")


# ---------------------------------------------------------------------------- settings
def test_l2_settings_are_checked_at_load(tmp_path: Path) -> None:
    pg = {"db_url": "postgresql+psycopg://u@db/maasd", "data_dir": str(tmp_path)}
    s = load({**pg, "l2_url": "redis://:pw@127.0.0.1:6379/0"}, env={})
    assert s.l2_url == "redis://:pw@127.0.0.1:6379/0"
    s = load(pg, env={"MAASD_L2_URL": "redis://r:6379", "MAASD_L2_TENANT_BYTES": "2GiB"})
    assert s.l2_tenant_bytes == 2 << 30
    with pytest.raises(ConfigError, match="needs the shared PostgreSQL ledger") as e:
        load({"data_dir": str(tmp_path), "l2_url": "redis://:pw@r:6379"}, env={})
    assert "pw" not in e.value.detail
    with pytest.raises(ConfigError, match="redis://, rediss:// or unix://"):
        load({**pg, "l2_url": "http://r:6379"}, env={})
    with pytest.raises(ConfigError, match="l2_timeout_s must be > 0"):
        load({**pg, "l2_url": "redis://r"}, env={"MAASD_L2_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match="l2_prefix"):
        load({**pg, "l2_url": "redis://r"}, env={"MAASD_L2_PREFIX": "a{b"})


# ---------------------------------------------------------------------------- the tier
class FakeL2:
    """The client's interface over a dict, failing on demand (an unreachable Redis)."""

    errors = (ConnectionError,)

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], bytes] = {}
        self.down = False
        self.calls = 0
        self.forgotten: list[str] = []
        #: keys that hold another Redis type than a string (a hash, a list …)
        self.not_strings: set[tuple[str, str]] = set()
        self.timeouts: list[float | None] = []

    def _call(self) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("refused")

    def fetch(
        self, tenant_id: str, keys: list[str], *, max_bytes: int
    ) -> tuple[str, bytes | int | None] | None:
        self._call()
        for key in reversed(keys):
            if (tenant_id, key) in self.not_strings:
                return key, None
            value = self.values.get((tenant_id, key))
            if value is not None:
                return key, (value if len(value) <= max_bytes else len(value))
        return None

    def store(
        self,
        tenant_id: str,
        key: str,
        value: memoryview,
        *,
        cap: int,
        ttl_ms: int,
        timeout_s: float | None = None,
    ) -> int:
        self._call()
        self.timeouts.append(timeout_s)
        assert ttl_ms > 0
        if len(value) > cap:
            return -1
        self.values[(tenant_id, key)] = bytes(value)
        return 0

    def forget(self, tenant_id: str, key: str) -> None:
        self._call()
        self.values.pop((tenant_id, key), None)
        self.not_strings.discard((tenant_id, key))
        self.forgotten.append(key)

    def delete(self, tenant_id: str, key: str, digest: bytes) -> bool:
        self._call()
        value = self.values.get((tenant_id, key))
        if value is None or codec.digest(value) != digest:
            return False
        del self.values[(tenant_id, key)]
        return True

    def drop_tenant(self, tenant_id: str, *, ttl_ms: int = 0) -> int:
        self._call()
        assert ttl_ms > 0
        mine = [k for k in self.values if k[0] == tenant_id]
        for k in mine:
            del self.values[k]
        return len(mine)

    def ping(self, timeout_s: float | None = None) -> None:
        self._call()
        self.timeouts.append(timeout_s)

    def close(self) -> None:
        pass


def tier(source: object = None, **settings: object):  # -> (L2Tier, FakeL2, registry)
    from prometheus_client import CollectorRegistry

    from maasd.l2.tier import L2Tier
    from maasd.settings import Settings

    fake = FakeL2()
    registry = CollectorRegistry()
    s = Settings(l2_url="redis://unused", **settings)  # type: ignore[arg-type]
    t = L2Tier(s, registry, source or (lambda *_: None), client=fake)  # type: ignore[arg-type]
    return t, fake, registry


def sample(registry: object, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)  # type: ignore[attr-defined]
    return 0.0 if value is None else float(value)


def test_the_tier_counts_failures_then_stops_asking() -> None:
    t, fake, reg = tier(l2_breaker_failures=2, l2_breaker_backoff_s=60)
    fake.down = True
    assert t.fetch("t", ["a"]) is None
    assert t.fetch("t", ["a"]) is None  # the second failure opens the breaker
    assert sample(reg, "maasd_l2_lookups_total", outcome="error") == 2
    assert sample(reg, "maasd_l2_breaker_open") == 1
    assert not t.ready()
    calls = fake.calls
    assert t.fetch("t", ["a"]) is None
    assert fake.calls == calls  # not asked while open
    assert sample(reg, "maasd_l2_lookups_total", outcome="skipped") == 1
    t.write_behind("t", "k", "b1", 4096)  # dropped at once, nothing queued
    assert sample(reg, "maasd_l2_dropped_writes_total", reason="breaker_open") == 1
    assert t.queue.entries == 0


def test_a_full_queue_drops_and_counts() -> None:
    t, _fake, reg = tier(l2_queue_entries=4)
    for i in range(5):
        t.write_behind("t", f"k{i}", f"b{i}", 4096)
    assert t.queue.entries == 2  # one tenant: its share, half of the queue
    assert sample(reg, "maasd_l2_dropped_writes_total", reason="queue_full") == 3
    t.write_behind("t", "huge", "b9", 2 << 30)  # more than the tenant's L2 cap
    assert sample(reg, "maasd_l2_dropped_writes_total", reason="too_large") == 1


def test_the_writer_writes_what_the_source_reads_and_a_refused_value_is_forgotten() -> None:
    data = secrets.token_bytes(8192)

    def source(buffer_id: str, _tenant_id: str, _key: str, head: int) -> bytearray | None:
        if buffer_id != "b1":
            return None  # released meanwhile
        return bytearray(head) + data

    t, fake, reg = tier(source)
    t.start()
    try:
        t.write_behind("t", "k1", "b1", len(data))
        t.write_behind("t", "k2", "gone", len(data))
        wait_until(lambda: sample(reg, "maasd_l2_dropped_writes_total", reason="gone") == 1)
        assert sample(reg, "maasd_l2_writes_total", outcome="ok") == 1
        fetched = t.fetch("t", ["k0", "k1"])
        assert fetched is not None
        assert (fetched.key, bytes(fetched.data)) == ("k1", data)
        assert t.fetch("other-tenant", ["k1"]) is None  # another namespace holds nothing
        fake.values[("t", "k1")] = fake.values[("t", "k1")][:-1]  # truncated in L2
        assert t.fetch("t", ["k1"]) is None
        assert sample(reg, "maasd_l2_refused_total", reason="size") == 1
        wait_until(lambda: fake.forgotten == ["k1"], message="the refused value forgotten")
    finally:
        t.close()


def test_a_key_of_another_redis_type_is_refused_and_forgotten_not_failed() -> None:
    """Not a string under a tenant's key (something else wrote it): refused like any bad
    value and dropped — not an error, which would count against the tenant's breaker
    on every lookup naming it."""
    t, fake, reg = tier(l2_breaker_failures=2, l2_breaker_backoff_s=60)
    fake.values[("t", "good")] = encode("t", "good", b"g" * 100)
    fake.not_strings.add(("t", "bad"))
    t.start()
    try:
        for _ in range(3):
            fake.not_strings.add(("t", "bad"))
            assert t.fetch("t", ["good", "bad"]) is None
            wait_until(lambda: ("t", "bad") not in fake.not_strings, message="forgotten")
        assert sample(reg, "maasd_l2_refused_total", reason="format") == 3
        assert sample(reg, "maasd_l2_lookups_total", outcome="error") == 0
        assert t.tenants.ready("t")
        hit = t.fetch("t", ["good", "bad"])
        assert hit is not None
        assert bytes(hit.data) == b"g" * 100
    finally:
        t.close()


def test_a_deleted_tenants_values_are_dropped_and_an_outage_only_skips_it() -> None:
    t, fake, _reg = tier(l2_breaker_failures=1, l2_breaker_backoff_s=60)
    for tenant in ("gone", "kept"):
        fake.values[(tenant, "k")] = encode(tenant, "k", b"v" * 10)
    t.drop_tenant("gone")
    assert list(fake.values) == [("kept", "k")]
    fake.down = True
    t.drop_tenant("kept")  # fails: logged, the breaker opens, nothing raised
    assert not t.ready()
    calls = fake.calls
    t.drop_tenant("kept")  # the breaker is open: not even asked
    assert fake.calls == calls
    assert list(fake.values) == [("kept", "k")]


def test_a_write_queued_or_in_flight_when_its_tenant_is_deleted_is_not_left_in_l2() -> None:
    """The writer had the deleted tenant's entry queued (dropped: never sent), or was
    storing it as the drop ran (dropped again once stored): nothing of the tenant stays
    in L2 until its values' TTL, and another tenant's writes go on."""
    storing, proceed = threading.Event(), threading.Event()
    data = b"d" * 64

    def source(buffer_id: str, _tenant_id: str, _key: str, head: int) -> bytearray | None:
        if buffer_id == "slow":
            storing.set()
            proceed.wait(10)
        return bytearray(head) + data

    t, fake, reg = tier(source)
    t.start()
    try:
        t.write_behind("gone", "k1", "slow", len(data))  # read as the drop runs
        assert storing.wait(10)
        t.write_behind("gone", "k2", "b2", len(data))  # still queued at the drop
        t.drop_tenant("gone")
        proceed.set()
        t.write_behind("kept", "k", "b3", len(data))
        wait_until(lambda: ("kept", "k") in fake.values, message="another tenant's write")
        wait_until(lambda: sample(reg, "maasd_l2_dropped_writes_total", reason="gone") == 2)
        assert [k for k in fake.values if k[0] == "gone"] == []
    finally:
        t.close()
