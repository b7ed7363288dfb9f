"""Shared Hypothesis strategies for maasd's tests (one place, as in *attrs*).

Import as ``from strategies import ...`` (``tests/`` is on pytest's ``pythonpath``):
py-libnuma installs a top-level ``tests`` package of its own, which shadows this
directory as a namespace package, so ``tests.strategies`` does not resolve.
"""

from __future__ import annotations

from hypothesis import strategies as st

from maasd.store.eviction import Candidate

#: Page sizes the allocator rounds to: base pages and the usual huge pages.
page_sizes = st.sampled_from([4096, 16384, 65536, 2 << 20, 1 << 30])

#: Valid sizes: positive ints below 2^63, biased towards the interesting edges.
valid_sizes = st.one_of(
    st.integers(min_value=1, max_value=1 << 24),
    st.integers(min_value=1, max_value=(1 << 63) - 1),
    st.sampled_from([1, 4095, 4096, 4097, (2 << 20) - 1, 2 << 20, (1 << 63) - 1]),
)

#: Anything a caller may wrongly pass as a size; each must be refused with InvalidRequest.
bad_sizes = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=1 << 63, max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.builds(list),
)

#: Non-power-of-two (or non-positive) page sizes.
bad_page_sizes = st.integers(min_value=-4096, max_value=1 << 22).filter(
    lambda p: p <= 0 or p & (p - 1) != 0
)


#: Request sizes for a tiny pool of ``pages`` base pages: from one byte to a bit beyond it.
def request_sizes(page: int, pages: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(min_value=1, max_value=page * 4),
        st.integers(min_value=1, max_value=page * (pages + 4)),
        st.sampled_from([1, page, page + 1, page * pages, page * pages + 1]),
    )


#: Ledger operations, for the pure arithmetic model test.
ledger_ops = st.lists(
    st.tuples(st.sampled_from(["take", "give"]), st.integers(min_value=0, max_value=1 << 20)),
    max_size=50,
)


#: Eviction candidates in LRU order: the reserving tenant is "t" and its pool "p"; others
#: ("u", "q") never help a shortfall. Ids are unique (their position).
def eviction_candidates() -> st.SearchStrategy[list[Candidate]]:
    owner = st.tuples(st.sampled_from(["t", "u"]), st.sampled_from(["p", "q"]))
    sizes = st.integers(min_value=1, max_value=100)
    return st.lists(st.tuples(owner, sizes), max_size=12).map(
        lambda cs: [Candidate(f"b{i}", t, p, size) for i, ((t, p), size) in enumerate(cs)]
    )


#: A shortfall in bytes: ≤ 0 means none.
shortfalls = st.integers(min_value=-50, max_value=400)


#: Operations on a tier cache (maasd.disk.policy): ("insert", key, size), ("hit", key),
#: ("remove", key), ("evict", None, parity) — keys from a small universe, so that they repeat.
tier_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 15), st.integers(1, 40)),
        st.tuples(st.just("hit"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("evict"), st.none(), st.integers(0, 1)),
    ),
    max_size=120,
)
