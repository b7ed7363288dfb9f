"""Who is calling: the admin key, tenant keys (with a cache), and the two role checks.

The admin key comes, first found wins, from the settings (``MAASD_ADMIN_KEY``),
from the file ``admin_key_file`` (``--admin-key-file``, ``MAASD_ADMIN_KEY_FILE``),
from the systemd credential ``admin-key`` (``$CREDENTIALS_DIRECTORY/admin-key``,
from the unit's ``LoadCredential=``), or from ``DATA_DIR/admin.key``; when none
exists it is generated once and written there. A key file must be private to
its owner, with no group or other permission bits (systemd makes the credential
so), and no key may be empty, else :class:`ConfigError`.

Tenant keys are looked up by digest and remembered, so that a request's
authentication costs one hash, not a database round trip. A remembered key must
never outlive its revocation, wherever that was made:

* SQLite: this daemon is the ledger's only writer (the data-dir lock), so its
  own revocations are all there are; each empties the cache.
* PostgreSQL: several daemons share the ledger. Every revocation — by any
  daemon, or an operator's SQL — fires migration 0003's trigger, which
  notifies ``maasd_keys`` when the revoking transaction commits. A listener
  thread on a connection of its own (:class:`maasd.store.notify.Listener`)
  empties the cache on each notification. The cache answers only while that
  listener is in place: until it is (at start) and from the moment it loses
  its connection, every check asks the database, as if there were no cache.

While the ledger cannot be read (an outage: the key's check raises
:class:`~maasd.errors.LedgerUnavailable`), a key this daemon checked against the
ledger since it last heard of a revocation is still taken (``_known``): the
worker data plane outlives the ledger (docs/scale-out.md, "Failure modes"). What
holds: a key revoked before the outage stays revoked (its revocation emptied
``_known``, and an unknown key is never taken without the ledger); a key revoked
during the outage cannot reach this host's ledger, nor its notification this
daemon, until the ledger is back — and then the listener's ``on_up`` moves the
generation, so every connection checks its key against the ledger again (401 and a
close for the revoked one). ``_known`` is not emptied then: the listener's connection
can be back before the pool's (the circuit still open, or a pooled connection the
outage killed), and a key taken through the outage must not be refused for that. Each
check reads the ledger first; only a check that cannot read it takes ``_known``, and a
key the ledger no longer has leaves ``_known`` at that check. So the ledger's circuit
closing (the pool back) moves the generation too: a connection whose key was checked
again from ``_known`` after the listener's return, while the circuit was still open,
would otherwise keep a key revoked during the outage for good.

Why notifications and not a revocation counter polled with the reaper: a
notification reaches every daemon within milliseconds of the commit, and
costs nothing while nothing is revoked; a counter bounds the delay only by its
polling interval, and N hosts poll it forever. The cost is one more
connection per daemon, and a connection that must not go through a
transaction-pooling proxy (docs/scale-out.md).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import stat
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from maasd.errors import ConfigError, Forbidden, LedgerUnavailable, Unauthorized
from maasd.models import Principal
from maasd.settings import Settings
from maasd.store import KEYS_CHANNEL, TenantRepo
from maasd.store.notify import Listener
from maasd.tenancy import keys

logger = logging.getLogger(__name__)

__all__ = ["Auth", "require_admin", "require_tenant"]

#: Keys remembered at most; the cache is emptied when it is full.
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


def _remember(cache: dict[bytes, Principal], digest: bytes, who: Principal) -> None:
    if len(cache) >= KEY_CACHE_SIZE:
        cache.clear()
    cache[digest] = who


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


def write_key_file(path: Path, token: str) -> str:
    """Write a generated key to ``path`` (mode 0600) so that it is there whole or not at
    all: a temporary file, fsync'd, linked to ``path``, the directory fsync'd. Written in
    place, a crash between the file's creation and its write left an empty ``admin.key``,
    and every start after it refused that file. Returns the key ``path`` holds (another's,
    should one have appeared meanwhile)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a crash's leftover
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, path)  # never over a key file that exists
    except FileExistsError:
        return _read_key_file(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return token


def _missing_key() -> Unauthorized:
    return Unauthorized("missing API key (Authorization: Bearer <key>)")


class Auth:
    """Maps bearer tokens to principals. Thread-safe.

    A checked key is remembered until any key is revoked (see the module
    docstring for how a revocation through another daemon reaches this one).
    :meth:`start` / :meth:`stop` run the PostgreSQL listener.
    """

    def __init__(self, settings: Settings, keys: TenantRepo) -> None:
        self._settings = settings
        self._keys = keys
        self._lock = threading.Lock()  # a leaf lock (maasd.core.regions)
        self._cache: dict[bytes, Principal] = {}
        # Keys checked against the ledger since the last revocation this daemon heard of:
        # taken while the ledger cannot be read (see the module docstring).
        self._known: dict[bytes, Principal] = {}
        # Whether the cache may answer: always with SQLite; with PostgreSQL only
        # while the listener is in place (set and cleared under the lock).
        self._trusted = not keys.is_postgres
        self._listener: Listener | None = None
        self._generation = 0
        #: called (outside the lock, on the revoking thread) after the generation moves
        self._watchers: list[Callable[[], None]] = []
        self._admin_digest = b""
        keys.circuit.on_up(self._ledger_back)
        #: The admin key when this process generated it (print it once), else ``None``.
        self.admin_key_generated: str | None = None

    def start(self) -> None:
        """With PostgreSQL, start listening for revocations (the cache answers once it does)."""
        if self._keys.is_postgres and self._listener is None:
            # on a connection of its own to the keys' database (maasd.store.notify)
            self._listener = self._keys.db.listener(
                KEYS_CHANNEL,
                on_up=partial(self._set_trusted, True),
                on_event=self.forget_keys,
                on_down=partial(self._set_trusted, False),
            )
            self._listener.start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None

    @property
    def caching(self) -> bool:
        """Whether remembered keys answer now (with PostgreSQL: the listener is in place)."""
        return self._trusted

    def _set_trusted(self, trusted: bool) -> None:
        # Either way the cache starts empty: while nobody listened, a revocation may
        # have been missed; from now on, none can be. The generation moves, so every
        # connection checks its key against the ledger again. ``_known`` stays: it
        # answers only a check that cannot read the ledger (see the module docstring).
        with self._lock:
            self._trusted = trusted
            self._generation += 1
            self._cache.clear()

    def _ledger_back(self) -> None:
        # On the circuit's probe thread, once the pool reads the ledger again: a key taken
        # from ``_known`` meanwhile (the listener may have been back first, and moved the
        # generation while only memory could answer) is checked against the ledger again.
        with self._lock:
            self._generation += 1
            watchers = list(self._watchers)
        self._tell(watchers)

    def load_admin_key(self) -> None:
        """Read (or generate once) the admin key. :class:`ConfigError` for an unsafe key file,
        or for a metrics key that is the admin key (the API would take it for the metrics
        key, good for ``GET /metrics`` only: the admin would be refused everywhere else)."""
        digest = keys.digest(self._admin_key())
        metrics_key = self._settings.metrics_key
        if metrics_key and hmac.compare_digest(keys.digest(metrics_key), digest):
            raise ConfigError(
                "metrics_key (MAASD_METRICS_KEY) is the admin key: give /metrics a key of its "
                "own (e.g. `openssl rand -hex 24`), or leave it unset for the admin key alone"
            )
        self._admin_digest = digest

    def _admin_key(self) -> str:
        if self._settings.admin_key:
            return self._settings.admin_key
        if self._settings.admin_key_file:
            return _read_key_file(Path(self._settings.admin_key_file))
        credentials = os.environ.get("CREDENTIALS_DIRECTORY")
        if credentials and (cred := Path(credentials, "admin-key")).exists():
            # systemd made it (mode 0400, this service's alone): no mode check to do.
            key = cred.read_text().strip()
            if not key:
                raise ConfigError(f"the admin-key credential ({cred}) is empty")
            return key
        path = Path(self._settings.admin_key_path)
        if path.exists():
            return _read_key_file(path)
        token = write_key_file(path, keys.new_token())
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
        return self._cache.get(d) if self._trusted else None

    def authenticate(self, token: str | None) -> Principal:
        """Map a bearer token to a principal; :class:`Unauthorized` if unknown or revoked."""
        if not token:
            raise _missing_key()
        d = keys.digest(token)
        if hmac.compare_digest(d, self._admin_digest):
            return Principal(is_admin=True)
        if self._trusted:
            who = self._cache.get(d)
            if who is not None:
                return who
        generation = self._generation
        try:
            row = self._keys.key_by_digest(d)
        except LedgerUnavailable:
            known = self._known.get(d)
            if known is None:
                raise
            return known  # checked before the outage, and no revocation heard of since
        if row is None or not hmac.compare_digest(d, row.digest):
            with self._lock:
                self._known.pop(d, None)
            raise Unauthorized("unknown or revoked API key")
        who = Principal(is_admin=False, tenant_id=row.tenant_id, key_id=row.id)
        with self._lock:
            # A revocation (or a lost listener) since the read above moved the
            # generation: the row read may be stale, so it is not remembered.
            if generation == self._generation:
                if self._trusted:
                    _remember(self._cache, d, who)
                _remember(self._known, d, who)
        return who

    @property
    def generation(self) -> int:
        """Bumped by every revocation this process learns of (its own, or — with several
        daemons on one ledger — another's), and when the ledger is back after an outage (a
        key taken from memory meanwhile is checked against it again). A holder of an
        authenticated principal (a socket connection) re-checks its key only when this
        moved: an int compare per operation."""
        return self._generation

    def watch_revocations(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every revocation (on the revoking thread: keep it short
        and never blocking — the broker wakes its event loop with it)."""
        with self._lock:
            self._watchers.append(callback)

    def forget_keys(self) -> None:
        """Call after any key is revoked (its commit done), here or by another daemon: no
        cached key outlives it, :attr:`generation` moves, and the watchers are told."""
        with self._lock:
            self._generation += 1
            self._cache.clear()
            self._known.clear()
            watchers = list(self._watchers)
        self._tell(watchers)

    @staticmethod
    def _tell(watchers: list[Callable[[], None]]) -> None:
        for callback in watchers:
            try:
                callback()
            except Exception:  # a watcher's bug must not undo a revocation's effect here
                logger.exception("a revocation watcher failed")
