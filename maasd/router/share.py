"""The router's side of maasd: find a prefix and stage it for a restore; publish a saved slot.

Blocking (the worker socket is), so the router calls these from a thread, one at a
time per connection: lookups (on a request's path) and publishes (after an answer, in
the background) each have a connection and a lock of their own, so a restore never
queues behind a publish's copy and commit. While maasd is unreachable every call is a miss
and the router is a plain balancer (:class:`~maasd.llama.link.Link` says so, once, in
the log; ``maasd_router_sharing`` in ``/metrics``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from maasd.bounds import MAX_LOOKUP_KEYS
from maasd.client import EntryMapping, Scratch, Worker
from maasd.client import errors as ce
from maasd.llama.format import HeaderError, check_chunk, chunk_keys
from maasd.llama.link import Link
from maasd.router import PUBLISH_TTL_S
from maasd.router.files import LinkedFile
from maasd.router.state import (
    Settings,
    StateError,
    check_file_form,
    file_checksum,
    file_size,
    validate_entry,
    write_entry_form,
    write_file_form,
)

__all__ = ["Sharing", "Staged"]

logger = logging.getLogger(__name__)


@dataclass
class Staged:
    """A prefix from maasd, as a sealed slot file linked into one backend's slot dir."""

    file: LinkedFile
    n_tokens: int  # the tokens the file holds (what n_restored must say)
    matched: int  # the prompt tokens its key covers
    key: str
    buffer_id: str


class Sharing:
    """Lookups and publishes of one router, for one tenant key and one fingerprint."""

    def __init__(
        self,
        link: Link,
        fingerprint: str,
        *,
        chunk: int,
        pool: str | None = None,
        ttl_s: int = PUBLISH_TTL_S,
        drop: Callable[[str], None] | None = None,
        count: Callable[[str, str], None] | None = None,
        copy_files: bool = False,
        publish_link: Link | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.link = link
        self.publish_link = publish_link or link
        self.fingerprint = fingerprint
        self.chunk = check_chunk(chunk)
        self.pool = pool
        self.ttl_s = ttl_s
        self._drop = drop  # releases an entry that failed validation (REST), best effort
        self._count = count or (lambda _what, _kind: None)
        self._lock = threading.Lock()
        self._publish_lock = self._lock if self.publish_link is link else threading.Lock()
        self.copy_files = copy_files  # real files in the slot dir, not /proc links
        self.settings = settings  # what every state restored or published must show
        #: the memfd each publish writes the entry into (kept, mapped: the largest entry)
        self._scratch: Scratch | None = None

    @property
    def up(self) -> bool:
        return self.link.up

    def available(self) -> bool:
        """Whether maasd is reachable now (connecting again once a back-off is over)."""
        return self.link.get() is not None

    def keys(self, tokens: Any) -> list[tuple[int, str]]:
        return chunk_keys(self.fingerprint, tokens, self.chunk)

    # -- restore

    def stage(self, tokens: Any, slot_dir: str | Path, longer_than: int) -> Staged | None:
        """The longest prefix of ``tokens`` maasd holds, longer than ``longer_than``
        tokens, checked and copied into a sealed slot file in ``slot_dir``; None: a miss.

        A lookup names at most ``MAX_LOOKUP_KEYS`` keys (the daemon refuses more): the
        longest ones, which are those worth a restore (a prompt of more than 1024 chunks
        finds no prefix shorter than its last 1024 boundaries)."""
        keys = [(n, k) for n, k in self.keys(tokens) if n > longer_than][-MAX_LOOKUP_KEYS:]
        if not keys:
            return None
        with self._lock:
            worker = self.link.get()
            if worker is None:
                return None
            try:
                hit = worker.lookup([k for _, k in keys])
            except (ce.MaasdClientError, OSError) as exc:
                self.link.failed(exc)
                return None
            if hit is None:
                self._count("lookup", "miss")
                return None
            try:
                return self._stage_hit(worker, hit, dict((k, n) for n, k in keys), tokens, slot_dir)
            finally:
                hit.close()

    def _stage_hit(
        self,
        worker: Worker,
        hit: EntryMapping,
        by_key: dict[str, int],
        tokens: Any,
        slot_dir: str | Path,
    ) -> Staged | None:
        matched = by_key.get(hit.key, 0)
        view = hit.array
        try:
            hdr = validate_entry(view, hit.size, self.fingerprint, tokens, matched, self.settings)
        except StateError as exc:
            logger.warning("entry %s refused, dropped: %s", hit.buffer_id, exc)
            self._count("lookup", "refused")
            worker.forget(hit.buffer_id)
            if self._drop is not None:
                self._drop(hit.buffer_id)
            return None
        size = file_size(hdr.n_tokens, hdr.state_len - 8)
        f = LinkedFile(slot_dir, "restore", size, copy=self.copy_files)
        try:
            _copy_checked(f, view, hdr)
        except HeaderError as exc:
            f.close()
            logger.info("entry %s went away while it was copied: %s", hit.buffer_id, exc)
            worker.forget(hit.buffer_id)
            self._count("lookup", "released")
            return None
        except BaseException:
            f.close()
            raise
        self._count("lookup", "hit")
        return Staged(f, hdr.n_tokens, matched, hit.key, hit.buffer_id)

    # -- publish

    def publish(self, saved: LinkedFile, n_written: int, tokens: Any, key_len: int) -> bool:
        """Copy a slot file the server saved (holding ``tokens[:key_len]`` and perhaps
        more: an answer) into a new entry under the key of that prefix, all of the saved
        tokens in its header, and commit it → whether it was published."""
        key = next(k for n, k in self.keys(np.asarray(tokens)[:key_len]) if n == key_len)
        mm, src = saved.map(n_written, write=False)
        try:
            form = check_file_form(src, n_written, self.settings)
            if len(form.tokens) < key_len or not np.array_equal(
                form.tokens[:key_len], np.asarray(tokens, dtype=np.int32)[:key_len]
            ):
                raise StateError(f"the slot saved {len(form.tokens)} other tokens")
            return self._put(key, form, src)
        finally:
            del src
            mm.close()

    def _put(self, key: str, form: Any, src: Any) -> bool:
        """The entry form of ``form`` written into the router's scratch memfd and published
        under ``key``: one round trip, in which maasd copies it into a sealed entry."""
        from maasd.router.state import entry_size

        size = entry_size(len(form.tokens), form.state_len)
        link = self.publish_link
        with self._publish_lock:
            worker = link.get()
            if worker is None:
                return False
            if self._scratch is None or self._scratch.closed:
                self._scratch = Scratch(name="maasd-router-publish")
            view = self._scratch.ensure(size)
            write_entry_form(view, self.fingerprint, self.chunk, form, src)
            # Neither may stay referenced from this frame: a refusal's traceback keeps the
            # frame (a cycle only the gc breaks), and a live view of the slot file's
            # mapping makes the caller's close fail (BufferError).
            del view, src
            try:
                worker.publish(key, self._scratch, size, pool=self.pool, ttl_s=self.ttl_s)
            except ce.DuplicateKey:
                self._count("publish", "duplicate")
                return False
            except (ce.MaasdClientError, OSError) as exc:
                link.failed(exc)
                self._count("publish", "refused")
                logger.info("publish of %s refused: %s", key, exc)
                return False
        self._count("publish", "ok")
        return True

    def close(self) -> None:
        """Let go of the scratch memfd publishes are written in (it is made again if needed)."""
        with self._publish_lock:
            if self._scratch is not None:
                self._scratch.close()
                self._scratch = None


def _copy_checked(f: LinkedFile, view: Any, hdr: Any) -> None:
    """Write the file form of the entry ``view`` into ``f``, seal it, and check the state
    checksum of the sealed copy — exactly the bytes the server will read, which nobody
    can change any more; raises HeaderError if they are not the entry's (released and
    scrubbed while copied)."""
    mm, dst = f.map(f.size, write=True)
    try:
        write_file_form(dst, view, hdr)
    finally:
        del dst
        mm.close()
    f.seal()
    prefix = view[hdr.header_len : hdr.header_len + 8]
    mm, sealed = f.map(f.size, write=False)
    try:
        ok = file_checksum(sealed, hdr.n_tokens, bytes(prefix)) == hdr.state_crc
    finally:
        del sealed
        mm.close()
    if not ok:
        raise HeaderError("the sealed copy is not the entry's state (changed while copied)")
