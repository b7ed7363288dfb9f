"""Victim choice for a reserve's shortfall (maasd.store.eviction), case by case.

The laws it obeys for every input are checked in tests/property/test_eviction_laws.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from maasd.store.eviction import Candidate, Victims, choose_victims


def choose(cands: list[Candidate], quota_short: int, capacity_short: int) -> Victims:
    return choose_victims(
        cands, tenant_id="t", pool_id="p", quota_short=quota_short, capacity_short=capacity_short
    )


def c(id: str, tenant: str, pool: str, size: int) -> Candidate:
    return Candidate(id, tenant, pool, size)


def test_nothing_short_takes_nothing_even_with_candidates() -> None:
    cands = [c("a", "t", "p", 10)]
    assert choose(cands, 0, 0) == Victims((), 0, 0, None)
    assert choose(cands, -5, -1) == Victims((), 0, 0, None)


def test_the_candidates_are_not_even_read_when_nothing_is_short() -> None:
    def unread() -> Iterator[Candidate]:
        raise AssertionError("the candidates were read")
        yield  # a generator: the body runs only when iterated

    assert choose_victims(
        unread(), tenant_id="t", pool_id="p", quota_short=0, capacity_short=-1
    ) == Victims((), 0, 0, None)


def test_quota_shortfall_takes_the_tenants_own_in_lru_order_and_stops() -> None:
    cands = [c("a", "t", "q", 3), c("b", "u", "p", 50), c("c", "t", "p", 4), c("d", "t", "p", 9)]
    got = choose(cands, 6, 0)
    assert got == Victims(("a", "c"), 7, 4, None)  # "b" is another tenant's; "d" is not needed


def test_capacity_shortfall_takes_any_tenants_in_the_pool() -> None:
    cands = [c("a", "t", "q", 30), c("b", "u", "p", 5), c("c", "t", "p", 5), c("d", "u", "p", 5)]
    got = choose(cands, 0, 10)
    assert got == Victims(("b", "c"), 5, 10, None)  # "a" is in another pool: it frees no room


def test_both_shortfalls_each_candidate_taken_for_whichever_it_helps() -> None:
    cands = [c("a", "t", "q", 5), c("b", "u", "p", 5), c("c", "t", "p", 5), c("d", "u", "q", 99)]
    assert choose(cands, 5, 5) == Victims(("a", "b"), 5, 5, None)
    # A candidate of both (the tenant's, in this pool) closes both at once.
    assert choose([c("x", "t", "p", 8), *cands], 5, 5) == Victims(("x",), 8, 8, None)


def test_a_candidate_for_a_closed_shortfall_is_skipped() -> None:
    # Quota closes after "a"; "b" (the tenant's, another pool) would only help quota: skipped.
    cands = [c("a", "t", "q", 10), c("b", "t", "q", 10), c("c", "u", "p", 10)]
    assert choose(cands, 5, 10) == Victims(("a", "c"), 10, 10, None)


def test_exactly_enough_is_enough() -> None:
    cands = [c("a", "t", "p", 4), c("b", "t", "p", 4)]
    assert choose(cands, 8, 8) == Victims(("a", "b"), 8, 8, None)
    assert choose(cands, 9, 0).unmet == "quota"
    assert choose(cands, 0, 9).unmet == "capacity"


@pytest.mark.parametrize(
    ("quota_short", "capacity_short", "unmet", "freed"),
    [
        (11, 0, "quota", (10, 3)),  # all of the tenant's own together free 10
        (0, 14, "capacity", (3, 13)),  # all of the pool's together free 13
        (11, 14, "quota", (10, 13)),  # both short: quota is named first
        (5, 14, "capacity", (10, 13)),
    ],
)
def test_unmet_shortfalls_name_themselves_and_what_could_be_freed(
    quota_short: int, capacity_short: int, unmet: str, freed: tuple[int, int]
) -> None:
    cands = [c("a", "t", "q", 7), c("b", "u", "p", 10), c("c", "t", "p", 3)]
    got = choose(cands, quota_short, capacity_short)
    assert got.unmet == unmet
    assert (got.freed_quota, got.freed_capacity) == freed


def test_no_candidates_and_a_shortfall_is_unmet() -> None:
    assert choose([], 1, 0) == Victims((), 0, 0, "quota")
    assert choose([], 0, 1) == Victims((), 0, 0, "capacity")


def test_a_count_shortfall_takes_the_tenants_own_one_each() -> None:
    cands = [c("a", "u", "p", 5), c("b", "t", "q", 1), c("c", "t", "p", 1), c("d", "t", "p", 1)]
    got = choose_victims(
        cands, tenant_id="t", pool_id="p", quota_short=0, capacity_short=0, count_short=2
    )
    assert got == Victims(("b", "c"), 2, 1, None)  # "a" is another tenant's: it frees no count


def test_a_count_shortfall_that_cannot_close_is_named() -> None:
    cands = [c("a", "t", "p", 5), c("b", "u", "p", 5)]
    got = choose_victims(
        cands, tenant_id="t", pool_id="p", quota_short=0, capacity_short=0, count_short=2
    )
    assert got.unmet == "count"
    # quota is named before the count
    got = choose_victims(
        cands, tenant_id="t", pool_id="p", quota_short=9, capacity_short=0, count_short=2
    )
    assert got.unmet == "quota"
