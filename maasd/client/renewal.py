"""``LeaseRenewer``: the thread that keeps a worker's attached buffers leased.

A buffer's lease runs out unless it is renewed; a worker that attached it means to
keep it while it maps it. The renewer owns its thread and its stop event: every
``interval_s`` seconds it runs the owner's ``each_round`` (the worker ages idle entry
mappings out there too, so a worker that makes no lookups still lets them go) and
renews each buffer the owner says is attached, one request each.

A buffer the daemon no longer knows (released, expired) is logged once and not
asked about again: its stale mapping reads zeros. A broken connection or a revoked
key ends the thread (logged, unless the owner is closing); any other refusal is
logged and tried again the next round.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from maasd.client.errors import ConnectionFailed, MaasdClientError, NotFound, Unauthorized

__all__ = ["LeaseRenewer"]

logger = logging.getLogger("maasd.client.worker")


class LeaseRenewer:
    """Renews ``attached()`` buffers with ``renew(buffer_id)`` every ``interval_s``
    seconds, in a daemon thread started by :meth:`start` and ended by :meth:`stop`."""

    def __init__(
        self,
        interval_s: float,
        attached: Callable[[], list[str]],
        renew: Callable[[str], object],
        each_round: Callable[[], object],
    ) -> None:
        self.interval_s = interval_s
        self._attached = attached
        self._renew = renew
        self._each_round = each_round
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="maasd-worker-renew", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end: it leaves at its next wait or check, or when the request
        it is in fails (the owner shuts the connection down to wake it)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end, unless it is the caller (a close from the thread)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        gone: set[str] = set()
        while not self._stop.wait(self.interval_s):
            self._each_round()
            for buffer_id in self._attached():
                if buffer_id in gone or self._stop.is_set():
                    continue
                try:
                    self._renew(buffer_id)
                except NotFound:
                    # Released or expired: a stale mapping now reads zeros.
                    logger.warning("lease renewal: buffer %s is gone", buffer_id)
                    gone.add(buffer_id)
                except (ConnectionFailed, Unauthorized) as exc:
                    if not self._stop.is_set():
                        logger.warning("lease renewal stopped: %s", exc)
                    return
                except MaasdClientError as exc:
                    logger.warning("lease renewal of %s failed: %s", buffer_id, exc)
