"""Fds a peer sends: which frame each batch belongs to, and that none stays behind.

Only a ``publish`` takes fds (the writer's memfd, sent with its frame in one
``sendmsg``). A Unix stream socket hands ancillary fds over with the read that reaches
the bytes they were sent with — glued after any bytes the peer sent before them without
fds, and the read stops right after them. So the fds of one read belong to the *last*
frame that begins within that read: :meth:`InboundFds.take` gives them to that frame
when it is taken off the stream, or closes them if no frame begins within that read.

At most one batch waits per connection (the broker reads nothing more from a connection
while a whole frame of it waits, so a batch waits only for its own frame's tail); a
second batch, fds that came with no bytes, a batch of more than one fd (no frame takes
more: a publish takes one) and one the kernel had to truncate (the daemon at its
open-files limit) are discarded at once. Whatever waits is discarded with the
connection. So a peer can make the daemon hold at most one fd of its own, and only
until its frame is served. "Discarded": closed without the daemon ever waiting on
the close (:mod:`.sink`).
"""

from __future__ import annotations

import os

from .sink import discard

__all__ = ["MAX_INBOUND_FDS", "InboundFds", "close_fds"]

#: The most fds a frame takes (a publish: its source); a batch of more is discarded.
MAX_INBOUND_FDS = 1


class InboundFds:
    """The one batch of fds a connection's peer sent that waits for its frame."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        #: ``(first, end, fds)``: the stream offsets of the read the fds came with (read it
        #: for ``None`` before calling :meth:`take`: the one check on every frame's path)
        self.batch: tuple[int, int, tuple[int, ...]] | None = None

    @property
    def waiting(self) -> tuple[int, ...]:
        """The fds that wait for their frame (``()`` if none)."""
        return () if self.batch is None else self.batch[2]

    def __bool__(self) -> bool:
        return self.batch is not None

    def arrived(self, fds: tuple[int, ...], first: int, nbytes: int, truncated: bool) -> None:
        """``fds`` came with the ``nbytes`` read at stream offset ``first``: kept for their
        frame, or discarded at once (module docstring)."""
        if truncated or not nbytes or self.batch is not None or len(fds) > MAX_INBOUND_FDS:
            discard(fds)
        elif fds:
            self.batch = (first, first + nbytes, fds)

    def take(self, start: int, end: int) -> tuple[int, ...]:
        """The fds of the frame that spans stream offsets ``[start, end)`` (the caller owns
        them now); ``()`` if none, or if they may be a later frame's. Fds within whose
        read no frame begins are closed here, once the frame spanning it is taken."""
        batch = self.batch
        if batch is None:
            return ()
        first, stop, fds = batch
        if end < stop:
            return ()  # a later frame begins within that read: theirs, if anyone's
        self.batch = None
        if first <= start < stop:
            return fds
        discard(fds)  # no frame begins within the read they came with
        return ()

    def close(self) -> None:
        """Close what waits (the connection is closing)."""
        batch, self.batch = self.batch, None
        if batch is not None:
            discard(batch[2])


def close_fds(fds: tuple[int, ...]) -> None:
    """Close each of the daemon's own ``fds`` (a reply's), ignoring errors; a peer's
    go to :func:`~maasd.broker.sink.discard`."""
    for fd in fds:
        try:  # noqa: SIM105 - on every attach: suppress() would cost a context manager per fd
            os.close(fd)
        except OSError:
            pass
