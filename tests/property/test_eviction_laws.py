"""The laws of victim choice (maasd.store.eviction.choose_victims), for every input.

Checked on every input of a small universe (exhaustively) and on random larger ones
(Hypothesis). Together the laws pin the choice down completely: which candidates go,
in which order, when it stops, and when it refuses.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from maasd.store.eviction import Candidate, Victims, choose_victims
from strategies import eviction_candidates, shortfalls


def check(
    cands: list[Candidate], quota_short: int, capacity_short: int, count_short: int = 0
) -> Victims:
    got = choose_victims(
        cands,
        tenant_id="t",
        pool_id="p",
        quota_short=quota_short,
        capacity_short=capacity_short,
        count_short=count_short,
    )
    mine = [x.tenant_id == "t" for x in cands]
    here = [x.pool_id == "p" for x in cands]
    # Feasibility: it refuses exactly when all helpful candidates together are not enough
    # (quota is named first, then the buffer count, then capacity).
    quota_possible = sum(x.size_bytes for x, m in zip(cands, mine, strict=True) if m)
    count_possible = sum(mine)
    pool_possible = sum(x.size_bytes for x, h in zip(cands, here, strict=True) if h)
    expect_unmet = None
    if quota_short > 0 and quota_possible < quota_short:
        expect_unmet = "quota"
    elif count_short > 0 and count_possible < count_short:
        expect_unmet = "count"
    elif capacity_short > 0 and pool_possible < capacity_short:
        expect_unmet = "capacity"
    assert got.unmet == expect_unmet
    # Victims are candidates, once each, in LRU (list) order.
    position = {x.id: i for i, x in enumerate(cands)}
    assert all(v in position for v in got.ids)
    idx = [position[v] for v in got.ids]
    assert idx == sorted(set(idx))
    # What they free is what they are.
    assert got.freed_quota == sum(cands[i].size_bytes for i in idx if mine[i])
    assert got.freed_capacity == sum(cands[i].size_bytes for i in idx if here[i])
    # Walk the list: each victim helped a shortfall still open when it was taken, each
    # candidate passed over before the last victim would have helped none, and the walk
    # stopped at the first point where both shortfalls were closed.
    need_t, need_p, need_c = quota_short, capacity_short, count_short
    last = idx[-1] if idx else -1
    for i, x in enumerate(cands[: last + 1]):
        assert need_t > 0 or need_p > 0 or need_c > 0, "took a victim after all were closed"
        helps = ((need_t > 0 or need_c > 0) and mine[i]) or (need_p > 0 and here[i])
        assert helps == (i in idx), (i, x)
        if i in idx:
            need_t -= x.size_bytes if mine[i] else 0
            need_c -= 1 if mine[i] else 0
            need_p -= x.size_bytes if here[i] else 0
    if got.unmet is None:
        assert need_t <= 0
        assert need_p <= 0
        assert need_c <= 0
    else:  # it went through every candidate that could help
        rest = cands[last + 1 :]
        assert not any(
            ((need_t > 0 or need_c > 0) and x.tenant_id == "t") or (need_p > 0 and x.pool_id == "p")
            for x in rest
        )
    return got


@given(
    cands=eviction_candidates(),
    quota_short=shortfalls,
    capacity_short=shortfalls,
    count_short=st.integers(min_value=-3, max_value=8),
)
def test_the_laws_hold_for_random_inputs(
    cands: list[Candidate], quota_short: int, capacity_short: int, count_short: int
) -> None:
    check(cands, quota_short, capacity_short, count_short)


def test_the_laws_hold_for_every_small_input() -> None:
    """Every list of up to 3 candidates (4 owners × sizes 1..3) × shortfalls -1..7 (count 0..2)."""
    kinds = [
        (t, p, size) for t in ("t", "u") for p in ("p", "q") for size in (1, 2, 3)
    ]  # 12 kinds of candidate
    outcomes: set[object] = set()
    for n in range(4):
        for combo in itertools.product(kinds, repeat=n):
            cands = [Candidate(f"b{i}", t, p, size) for i, (t, p, size) in enumerate(combo)]
            for quota_short in range(-1, 8):
                for capacity_short in range(-1, 8):
                    for count_short in range(3):
                        got = check(cands, quota_short, capacity_short, count_short)
                        outcomes.add(got.unmet)
    assert outcomes == {None, "quota", "count", "capacity"}
