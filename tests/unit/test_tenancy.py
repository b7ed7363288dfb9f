"""API tokens, digests, ids and lease arithmetic (maasd.tenancy): pure functions."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from maasd.errors import InvalidRequest
from maasd.tenancy import keys, leases

TOKEN_RE = re.compile(r"^maasd_[A-Za-z0-9_-]{43}$")


# ----------------------------------------------------------------- tokens
def test_token_format_and_length() -> None:
    token = keys.new_token()
    assert TOKEN_RE.match(token), token
    assert len(token) == 49


def test_token_carries_256_random_bits() -> None:
    raw = base64.urlsafe_b64decode(keys.new_token().removeprefix("maasd_") + "=")
    assert len(raw) == 32


def test_tokens_are_unique_and_bits_are_balanced() -> None:
    tokens = [keys.new_token() for _ in range(2000)]
    assert len(set(tokens)) == len(tokens)
    # Each of the 256 bit positions should be set in about half of the tokens;
    # a stuck bit (a broken generator) would sit at 0 or 2000.
    raws = [base64.urlsafe_b64decode(t.removeprefix("maasd_") + "=") for t in tokens]
    for bit in range(256):
        ones = sum((r[bit // 8] >> (bit % 8)) & 1 for r in raws)
        assert 800 < ones < 1200, (bit, ones)


def test_digest_is_sha256_and_stable() -> None:
    token = keys.new_token()
    d = keys.digest(token)
    assert d == keys.digest(token)
    assert d == hashlib.sha256(token.encode()).digest()
    assert len(d) == keys.DIGEST_BYTES == 32
    assert keys.digest(token + "x") != d


def test_matches() -> None:
    token = keys.new_token()
    stored = keys.digest(token)
    assert keys.matches(token, stored)
    assert not keys.matches(keys.new_token(), stored)
    assert not keys.matches(token[:-1], stored)
    assert not keys.matches(token, b"")
    assert not keys.matches(token, stored[:16])


@given(st.text(max_size=200))
def test_matches_only_its_own_digest(text: str) -> None:
    assert keys.matches(text, keys.digest(text))
    assert not keys.matches(text + "\0", keys.digest(text))


def test_new_id_is_128_bit_hex() -> None:
    ids = {keys.new_id() for _ in range(1000)}
    assert len(ids) == 1000
    for i in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", i)


# ----------------------------------------------------------------- leases
def test_expires_at_adds_ttl() -> None:
    assert leases.expires_at(1000.0, 1, 3600) == 1001.0
    assert leases.expires_at(1000.0, 3600, 3600) == 4600.0


@pytest.mark.parametrize("ttl", [0, -1, 3601, 10**20])
def test_expires_at_rejects_out_of_range(ttl: int) -> None:
    with pytest.raises(InvalidRequest, match="between 1 and 3600"):
        leases.expires_at(1000.0, ttl, 3600)


@given(
    now=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    ttl=st.integers(min_value=1, max_value=86400),
)
def test_a_lease_ends_ttl_seconds_after_it_starts(now: float, ttl: int) -> None:
    end = leases.expires_at(now, ttl, 86400)
    assert end == now + ttl
    assert end > now
