"""The laws of the disk tier's policy (maasd.disk.policy), for any sequence of operations.

Both caches keep their books (bytes used = the sizes held, never above the capacity),
give up only what they hold, and an eviction kept to some entries takes only those.
S3-FIFO resists a scan (an entry used once outlives any run of one-off entries), and the
admission filter writes nothing seen once, but remembers what it dropped (the ghost).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from maasd.disk.policy import Admission, Lru, S3Fifo
from strategies import tier_ops

CAPACITY = 100


def replay(cache: Lru | S3Fifo, ops: list[tuple[str, int | None, int]]) -> None:
    """Apply ``ops``, checking the books after each against a model of what is held."""
    held: dict[object, int] = {}
    for op, key, arg in ops:
        if op == "insert" and key is not None and key not in cache:
            victims = cache.insert(key, arg)
            for v in victims:
                if v.key == key:  # it could never fit: refused, nothing else moved
                    assert arg > CAPACITY
                    assert victims == [v]
                    continue
                assert held.pop(v.key) == v.size  # only what it held, at its size
            if arg <= CAPACITY:
                held[key] = arg
        elif op == "hit" and key is not None:
            assert cache.hit(key) == (key in held)
        elif op == "remove" and key is not None:
            assert cache.remove(key) == held.pop(key, None)
        elif op == "evict" and isinstance(cache, S3Fifo):

            def kept(k: object, parity: int = arg) -> bool:
                return isinstance(k, int) and k % 2 == parity

            victim = cache.evict_one(kept)
            if victim is None:
                assert not any(kept(k) for k in held)
            else:
                assert kept(victim.key)
                assert isinstance(victim.key, int)
                assert held.pop(victim.key) == victim.size
        assert cache.used == sum(held.values()) <= CAPACITY
        assert len(cache) == len(held)
        assert all(k in cache for k in held)


@given(tier_ops)
def test_lru_keeps_its_books(ops: list[tuple[str, int | None, int]]) -> None:
    replay(Lru(CAPACITY), ops)


@given(tier_ops)
def test_s3fifo_keeps_its_books(ops: list[tuple[str, int | None, int]]) -> None:
    replay(S3Fifo(CAPACITY), ops)


@given(tier_ops)
def test_s3fifo_unrestricted_eviction_empties_it(ops: list[tuple[str, int | None, int]]) -> None:
    cache = S3Fifo(CAPACITY)
    replay(cache, ops)
    while cache.evict_one() is not None:
        pass
    assert cache.used == 0
    assert len(cache) == 0


@given(
    hot=st.integers(1, 45),
    scan=st.lists(st.integers(1, 45), min_size=1, max_size=200),
)
def test_s3fifo_an_entry_used_once_outlives_any_scan(hot: int, scan: list[int]) -> None:
    # The hot entry and the largest scan entry together fit in the 90 % beside the small
    # queue's share: the scan then only ever evicts from the small queue.
    cache = S3Fifo(CAPACITY)
    cache.insert("hot", hot)
    assert cache.hit("hot")
    for i, size in enumerate(scan):
        evicted = cache.insert(("scan", i), size)
        assert all(v.key != "hot" for v in evicted)
    assert "hot" in cache


def test_lru_loses_that_entry_to_a_scan() -> None:
    cache = Lru(CAPACITY)
    cache.insert("hot", 10)
    cache.hit("hot")
    for i in range(20):
        cache.insert(("scan", i), 10)
    assert "hot" not in cache


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3)), max_size=100))
def test_admission_writes_only_what_was_used_again_or_came_back(
    events: list[tuple[int, int]],
) -> None:
    adm = Admission(ghost_keys=1000)
    dropped: set[int] = set()
    for key, hits in events:
        for _ in range(hits):
            adm.hit(key)
        demote = adm.evicted(key)
        # Demoted exactly when it was hit, or dropped before (the ghost remembers it).
        assert demote == (hits > 0 or key in dropped)
        if demote:
            dropped.discard(key)
        else:
            dropped.add(key)


def test_admission_forgets_released_entries_without_a_ghost() -> None:
    adm = Admission()
    adm.hit("k")
    adm.forget("k")
    assert adm.evicted("k") is False  # a release is no sign it will come back
    assert len(adm) == 0


def test_admission_ghost_is_bounded() -> None:
    adm = Admission(ghost_keys=2)
    for k in ("a", "b", "c"):
        adm.evicted(k)
    assert adm.evicted("a") is False  # pushed out of the ghost by "c"
    assert adm.evicted("c") is True
