"""Tenancy: API keys (random tokens, stored hashed) and lease arithmetic.

Pure functions only — no I/O, no database. The ledger lives in :mod:`maasd.store`;
the rules that combine them live in :mod:`maasd.core`.

>>> from maasd.tenancy import keys, leases
>>> token = keys.new_token()
>>> keys.matches(token, keys.digest(token))
True
>>> leases.expires_at(100.0, 600, 86400)
700.0
"""

from __future__ import annotations

from maasd.tenancy import keys, leases

__all__ = ["keys", "leases"]
