"""The router's side of maasd: find a prefix and stage it for a restore; publish a saved slot.

Blocking (the worker socket is), so the router calls these from a thread, one at a
time per connection: lookups (on a request's path) and publishes (after an answer, in
the background) each have a connection and a lock of their own, so a restore never
queues behind a publish's copy and commit. While maasd is unreachable every call is a miss
and the router is a plain balancer (:class:`~maasd.llama.link.Link` says so, once, in
the log; ``maasd_router_sharing`` in ``/metrics``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from maasd.client import EntryMapping, Worker
from maasd.client import errors as ce
from maasd.llama.format import HeaderError, check_chunk, chunk_keys, parse_header
from maasd.llama.link import Link
from maasd.router import PUBLISH_TTL_S
from maasd.router.files import LinkedFile
from maasd.router.state import (
    StateError,
    check_file_form,
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
        tokens, checked and copied into a sealed slot file in ``slot_dir``; None: a miss."""
        keys = [(n, k) for n, k in self.keys(tokens) if n > longer_than]
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
            hdr = validate_entry(view, hit.size, self.fingerprint, tokens, matched)
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
            _copy_checked(f, view, hit.size, hdr)
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
            form = check_file_form(src, n_written)
            if len(form.tokens) < key_len or not np.array_equal(
                form.tokens[:key_len], np.asarray(tokens, dtype=np.int32)[:key_len]
            ):
                raise StateError(f"the slot saved {len(form.tokens)} other tokens")
            return self._put(key, form, src)
        finally:
            del src
            mm.close()

    def _put(self, key: str, form: Any, src: Any) -> bool:
        from maasd.router.state import entry_size

        size = entry_size(len(form.tokens), form.state_len)
        link = self.publish_link
        with self._publish_lock:
            worker = link.get()
            if worker is None:
                return False
            try:
                m = worker.put(key, size, pool=self.pool, ttl_s=self.ttl_s)
            except ce.DuplicateKey:
                self._count("publish", "duplicate")
                return False
            except (ce.MaasdClientError, OSError) as exc:
                link.failed(exc)
                self._count("publish", "refused")
                logger.info("publish of %s refused: %s", key, exc)
                return False
            try:
                write_entry_form(m.array, self.fingerprint, self.chunk, form, src)
            except BaseException:
                with contextlib.suppress(ce.MaasdClientError, OSError):
                    worker.abort(m)
                raise
            try:
                worker.commit(m)
            except (ce.MaasdClientError, OSError) as exc:
                link.failed(exc)
                self._count("publish", "refused")
                return False
        self._count("publish", "ok")
        return True


def _copy_checked(f: LinkedFile, view: Any, size: int, hdr: Any) -> None:
    """Write the file form of the entry ``view`` into ``f`` and seal it; raises HeaderError
    if the entry was released meanwhile."""
    mm, dst = f.map(f.size, write=True)
    try:
        write_file_form(dst, view, hdr)
    finally:
        del dst
        mm.close()
    # A scrub (an entry released while it was copied) zeroes the header page first: a
    # header that still parses, with the same checksum, saw no scrub.
    again = parse_header(view, size)
    if again.state_crc != hdr.state_crc:
        raise HeaderError("changed while copied")
    f.seal()
