"""API tokens and ids: random, unguessable, stored only as SHA-256 digests.

A token is shown to its owner once and never stored; the ledger keeps
``digest(token)``. Authenticating is a lookup by digest (an indexed equality),
followed by a constant-time :func:`matches` so that no code path compares a
secret byte by byte.

>>> t = new_token()
>>> t.startswith("maasd_"), len(t)
(True, 49)
>>> matches(t, digest(t)), matches(t + "x", digest(t))
(True, False)
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["DIGEST_BYTES", "TOKEN_PREFIX", "digest", "matches", "new_id", "new_token"]

#: Every token starts with this, so secret scanners and humans recognise one.
TOKEN_PREFIX = "maasd_"
#: Random bytes in a token: 256 bits.
TOKEN_BYTES = 32
#: Length of :func:`digest` (SHA-256).
DIGEST_BYTES = 32


def new_token() -> str:
    """A fresh API token: ``"maasd_"`` + 256 random bits, URL-safe base64 (49 chars)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)


def digest(token: str) -> bytes:
    """SHA-256 of the UTF-8 token: what the ledger stores (32 bytes).

    A plain hash (no salt, no KDF) is right here: the token carries 256 bits of
    entropy, so there is nothing to brute-force, and a deterministic digest is
    what makes the lookup an index hit.
    """
    return hashlib.sha256(token.encode("utf-8")).digest()


def matches(token: str, stored_digest: bytes) -> bool:
    """Whether ``token`` hashes to ``stored_digest``, compared in constant time."""
    return hmac.compare_digest(digest(token), stored_digest)


def new_id() -> str:
    """A random, unguessable id: 128 bits as 32 lowercase hex characters."""
    return secrets.token_hex(16)
