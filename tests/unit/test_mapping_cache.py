"""The worker's mapping cache (``maasd.client.entries.MappingCache``) on fake mappings:
which slots it keeps and lets go of, and that a hit costs the same whatever it holds."""

from __future__ import annotations

from maasd.client.entries import CachedMapping, MappingCache


class Mapping:
    """What the cache reads of a mapping: its id and size (each read of the size counted)."""

    reads = 0

    def __init__(self, buffer_id: str, size: int = 100) -> None:
        self.buffer_id = buffer_id
        self._size = size
        self.unmapped = False

    @property
    def size(self) -> int:
        Mapping.reads += 1
        return self._size

    def unmap(self) -> None:
        self.unmapped = True


def slot(i: int, key: str | None = None, size: int = 100) -> CachedMapping:
    return CachedMapping(Mapping(f"b{i}", size), key or f"k{i}")  # type: ignore[arg-type]


def ids(slots: list[CachedMapping]) -> list[str]:
    return [s.buffer_id for s in slots]


def test_a_hit_costs_the_same_with_ten_thousand_slots_cached() -> None:
    cache = MappingCache(max_bytes=1 << 40, max_age_s=3600)
    slots = [slot(i) for i in range(10_000)]
    for s in slots:
        assert cache.add(s) == []
        assert cache.checkin(s) == []
    Mapping.reads = 0
    for i in range(0, 10_000, 97):
        got = cache.checkout(f"b{i}")
        assert got is slots[i]
        assert cache.checkin(got) == []
    # two reads of a size per hit (idle bytes out, then in): none per slot cached
    assert Mapping.reads == 2 * len(range(0, 10_000, 97))
    assert cache.idle_bytes == 100 * 10_000


def test_the_budget_evicts_the_least_recently_used_idle_slots_first() -> None:
    cache = MappingCache(max_bytes=300, max_age_s=3600)
    a, b, c, d = (slot(i) for i in range(4))
    for s in (a, b, c):
        cache.add(s)
        cache.checkin(s)
    cache.checkin(cache.checkout("b0") or a)  # a used last now: b is the oldest idle
    cache.add(d)  # in use: not idle, nothing over the budget yet
    assert cache.idle_bytes == 300
    assert ids(cache.checkin(d)) == ["b1"]  # 400 idle: the oldest goes
    assert cache.idle_bytes == 300
    assert "b1" not in cache
    assert len(cache) == 3


def test_slots_in_use_are_never_evicted_and_the_walk_passes_them() -> None:
    cache = MappingCache(max_bytes=0, max_age_s=3600)
    held = slot(0)
    cache.add(held)  # in use, oldest
    other = slot(1)
    cache.add(other)
    assert ids(cache.checkin(other)) == ["b1"]  # nothing idle is kept
    assert "b0" in cache
    assert ids(cache.checkin(held)) == ["b0"]


def test_expire_lets_go_of_the_slots_idle_too_long_and_stops_at_the_first_fresh_one() -> None:
    cache = MappingCache(max_bytes=1 << 20, max_age_s=10)
    slots = [slot(i) for i in range(5)]
    for s in slots:
        cache.add(s)
        cache.checkin(s)
    for i, s in enumerate(slots):
        s.last_used = 100.0 + i  # as if given back a second apart
    assert ids(cache.expire(now=112.5)) == ["b0", "b1", "b2"]
    assert ids(cache.expire(now=112.5)) == []
    assert len(cache) == 2
    assert cache.idle_bytes == 200


def test_forgotten_keys_go_now_when_idle_and_when_given_back_when_in_use() -> None:
    cache = MappingCache(max_bytes=1 << 20, max_age_s=3600)
    old, used, other = slot(0, "k"), slot(1, "k"), slot(2, "x")
    for s in (old, used, other):
        cache.add(s)
    cache.checkin(old)
    cache.checkin(other)
    assert ids(cache.forget_keys(["k"], keep="b9")) == ["b0"]
    assert cache.checkout("b1") is None  # forgotten: not handed out again
    assert ids(cache.checkin(used)) == ["b1"]
    assert ids(cache.forget_keys(["k"])) == []
    assert len(cache) == 1
    assert cache.idle_bytes == 100


def test_an_id_cached_again_while_its_forgotten_slot_is_in_use_drops_that_slot_when_given_back() -> (
    None
):
    cache = MappingCache(max_bytes=1 << 20, max_age_s=3600)
    first = slot(0)
    cache.add(first)
    assert cache.forget("b0") == []  # in use
    second = slot(0)
    assert cache.add(second) == []
    assert cache.checkout("b0") is second
    assert ids(cache.checkin(first)) == ["b0"]  # the first slot, unmapped by the caller
    assert cache.checkin(second) == []
    assert cache.checkin(second) == []  # a second give-back counts nothing
    assert len(cache) == 1
    assert cache.idle_bytes == 100
    assert [s is first for s in cache.clear()] == [False]


def test_a_released_slot_is_unmapped_now_or_when_given_back() -> None:
    cache = MappingCache(max_bytes=1 << 20, max_age_s=3600)
    idle, used = slot(0), slot(1)
    cache.add(idle)
    cache.checkin(idle)
    cache.add(used)
    cache.released("b0")
    assert idle.mapping.unmapped  # type: ignore[attr-defined]
    assert idle.released
    assert "b0" not in cache
    cache.released("b1")
    assert not used.mapping.unmapped  # type: ignore[attr-defined]
    assert ids(cache.checkin(used)) == ["b1"]
    assert cache.idle_bytes == 0
    assert len(cache) == 0
    cache.released("b2")  # not cached yet: an answer racing the frame is dropped when given back
    late = slot(2)
    cache.add(late)
    assert ids(cache.checkin(late)) == ["b2"]
    assert late.released
