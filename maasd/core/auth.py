"""Who is calling: the admin key, tenant keys (with a cache), and the two role checks.

The admin key comes, first found wins, from the settings (``MAASD_ADMIN_KEY``),
from the file ``admin_key_file`` (``MAASD_ADMIN_KEY_FILE``), from
``$CREDENTIALS_DIRECTORY/admin-key`` (systemd's ``LoadCredential=admin-key:…``),
or from ``DATA_DIR/admin.key``; when none exists it is generated once and
written there. A key file must be private to its owner (no group or other
permission bits) and not empty, else :class:`ConfigError`.
"""

from __future__ import annotations

import hmac
import os
import stat
import threading
from pathlib import Path

from maasd.errors import ConfigError, Forbidden, Unauthorized
from maasd.models import Principal
from maasd.settings import Settings
from maasd.store import Store
from maasd.tenancy import keys

__all__ = ["Auth", "require_admin", "require_tenant"]

#: Keys remembered at most (SQLite); the cache is emptied when it is full.
KEY_CACHE_SIZE = 4096


def require_admin(who: Principal) -> None:
    """:class:`Forbidden` unless ``who`` is the admin."""
    if not who.is_admin:
        raise Forbidden("this operation needs the admin key")


def require_tenant(who: Principal) -> str:
    """``who``'s tenant id; :class:`Forbidden` for the admin (who owns no buffers)."""
    if who.tenant_id is None:
        raise Forbidden("this operation needs a tenant key (the admin owns no buffers)")
    return who.tenant_id


def _read_key_file(path: Path) -> str:
    """The key a file holds; :class:`ConfigError` if it is missing, empty or not private."""
    try:
        st = path.stat()
        text = path.read_text()
    except (OSError, ValueError) as e:
        raise ConfigError(f"admin key file {path}: {getattr(e, 'strerror', None) or e}") from e
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    key = text.strip()
    if not key:
        raise ConfigError(f"admin key file {path} is empty")
    return key


def _missing_key() -> Unauthorized:
    return Unauthorized("missing API key (Authorization: Bearer <key>)")


class Auth:
    """Maps bearer tokens to principals. Thread-safe.

    With SQLite the ledger has exactly one writer — this daemon (the data-dir
    lock) — so a key, once checked, is remembered until this process revokes
    any key; the check then costs one hash. With PostgreSQL another daemon may
    revoke, so every call asks the database: a revocation bites at once anywhere.
    """

    def __init__(self, settings: Settings, store: Store) -> None:
        self._settings = settings
        self._store = store
        self._lock = threading.Lock()  # a leaf lock (maasd.core.runtime)
        self._cache: dict[bytes, Principal] | None = None if store.is_postgres else {}
        self._generation = 0
        self._admin_digest = b""
        #: The admin key when this process generated it (print it once), else ``None``.
        self.admin_key_generated: str | None = None

    def load_admin_key(self) -> None:
        """Read (or generate once) the admin key. :class:`ConfigError` for an unsafe key file."""
        self._admin_digest = keys.digest(self._admin_key())

    def _admin_key(self) -> str:
        if self._settings.admin_key:
            return self._settings.admin_key
        if self._settings.admin_key_file:
            return _read_key_file(Path(self._settings.admin_key_file))
        credentials = os.environ.get("CREDENTIALS_DIRECTORY")
        if credentials and os.path.exists(os.path.join(credentials, "admin-key")):
            return _read_key_file(Path(credentials, "admin-key"))
        path = Path(self._settings.admin_key_path)
        if path.exists():
            return _read_key_file(path)
        token = keys.new_token()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        self.admin_key_generated = token
        return token

    def known_principal(self, token: str | None) -> Principal | None:
        """The principal of ``token`` if it can be told without I/O (admin, remembered key).

        ``None`` means "ask :meth:`authenticate`". Lets the API answer most requests'
        authentication on the event loop without a thread hop.
        """
        if not token:
            raise _missing_key()
        d = keys.digest(token)
        if hmac.compare_digest(d, self._admin_digest):
            return Principal(is_admin=True)
        return self._cache.get(d) if self._cache is not None else None

    def authenticate(self, token: str | None) -> Principal:
        """Map a bearer token to a principal; :class:`Unauthorized` if unknown or revoked."""
        if not token:
            raise _missing_key()
        d = keys.digest(token)
        if hmac.compare_digest(d, self._admin_digest):
            return Principal(is_admin=True)
        cache = self._cache
        if cache is not None:
            who = cache.get(d)
            if who is not None:
                return who
            generation = self._generation
        row = self._store.key_by_digest(d)
        if row is None or not hmac.compare_digest(d, row.digest):
            raise Unauthorized("unknown or revoked API key")
        who = Principal(is_admin=False, tenant_id=row.tenant_id, key_id=row.id)
        if cache is not None:
            with self._lock:
                # A revocation since the read above bumps the generation: don't cache.
                if generation == self._generation:
                    if len(cache) >= KEY_CACHE_SIZE:
                        cache.clear()
                    cache[d] = who
        return who

    def forget_keys(self) -> None:
        """Call after revoking any key (its commit done): no cached key outlives it."""
        with self._lock:
            self._generation += 1
            if self._cache is not None:
                self._cache.clear()
