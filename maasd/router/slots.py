"""What each backend slot holds, and which slot a prompt goes to (pure; no I/O).

The rule (SPEC §11): the idle slot holding the longest prefix of the prompt; if maasd
may hold a longer one, an idle slot to restore it into (the one whose content is worth
least, on the least-loaded backend); otherwise cold on the least-loaded backend. A busy
slot is never chosen, for anything: the router is the only client of its backends, and
a request, a restore or a save owns its slot until it is given back.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["Choice", "RecentPrompts", "Slot", "choose", "common_prefix"]


def common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    """The length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class Slot:
    """One slot of one backend, as the router knows it."""

    backend: int
    index: int
    busy: bool = False
    held: npt.NDArray[np.int32] = field(default_factory=lambda: np.empty(0, np.int32))
    #: given back after a request that did not end well (a client that went away, a
    #: failure): the server may still be generating in it until it notices
    unsettled: bool = False

    def forget(self) -> None:
        self.held = np.empty(0, np.int32)


@dataclass(frozen=True)
class Choice:
    slot: Slot
    held: int  # prompt tokens the slot holds already
    restore: bool  # whether to try maasd for more than ``held`` first


#: a shorter common prefix (a BOS, a few template tokens) is worth nothing to keep or use
MIN_HELD = 16


def choose(
    slots: list[Slot],
    tokens: npt.NDArray[np.int32],
    load: dict[int, int],
    *,
    sharing: bool,
    min_held: int = MIN_HELD,
) -> Choice | None:
    """The slot for ``tokens`` (None: every live slot is busy).

    ``slots`` are those of live backends; ``load`` the busy slots per backend. With
    ``sharing`` the caller will look maasd up for a prefix longer than ``held`` and
    restore it into the chosen slot: so the slot chosen then is the idle one whose
    content is worth least to this prompt (it is overwritten), unless it already
    holds the whole prompt but its last token.
    """
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    scored = [(common_prefix(s.held, tokens), s) for s in idle]
    best_len, best = max(scored, key=lambda t: (t[0], -load.get(t[1].backend, 0), -t[1].index))
    if best_len < min(min_held, len(tokens)):  # nothing worth keeping: an empty slot
        best_len, best = 0, _least_loaded(idle, load)
        best_len = common_prefix(best.held, tokens)
    if best_len >= len(tokens) - 1 and best_len > 0:
        return Choice(best, best_len, False)
    if not sharing:
        return Choice(best, best_len, False)
    # Try maasd for more than the best slot holds: keep the best slot as it is if its
    # content is worth something, and restore into the slot that matters least.
    return Choice(best, best_len, True)


def _least_loaded(idle: list[Slot], load: dict[int, int]) -> Slot:
    """The idle slot of the least-loaded backend, preferring one that holds nothing."""
    return min(idle, key=lambda s: (load.get(s.backend, 0), len(s.held) > 0, s.backend, s.index))


def restore_target(slots: list[Slot], best: Choice, load: dict[int, int]) -> Slot:
    """The idle slot to restore into when maasd has more than ``best.held``.

    The best slot itself when it holds nothing useful; otherwise an empty or
    least-useful idle slot on the least-loaded backend, so a prefix this prompt does not
    share stays where it is for the prompts that do.
    """
    if best.held < MIN_HELD:
        return _least_loaded([s for s in slots if not s.busy], load)
    return best.slot


class RecentPrompts:
    """The last prompts seen, for the prefixes they share with the next: at most ``count``
    of them and ``max_tokens`` tokens in all, the oldest dropped first (a prompt longer
    than that is kept cut to it: only its prefixes matter). 4 MiB by default."""

    def __init__(self, count: int = 64, max_tokens: int = 1 << 20) -> None:
        self.count, self.max_tokens = count, max_tokens
        self._prompts: collections.deque[npt.NDArray[np.int32]] = collections.deque()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def longest_shared(self, tokens: npt.NDArray[np.int32]) -> int:
        """The longest common prefix of ``tokens`` with any prompt kept."""
        return max((common_prefix(p, tokens) for p in self._prompts), default=0)

    def add(self, tokens: npt.NDArray[np.int32]) -> None:
        if len(tokens) > self.max_tokens:
            tokens = tokens[: self.max_tokens].copy()  # a copy: a view would pin it all
        self._prompts.append(tokens)
        self.tokens += len(tokens)
        while len(self._prompts) > self.count or self.tokens > self.max_tokens:
            self.tokens -= len(self._prompts.popleft())
