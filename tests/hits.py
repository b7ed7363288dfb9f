"""What a lookup answers, as tests want it: ``hit(svc.tiers.find(who, keys))`` is the
:class:`~maasd.core.EntryHandle` of a hit (a miss, or a miss to be asked of a slower tier, fails
the test). Import as ``from hits import hit`` (``tests/`` is on the path)."""

from __future__ import annotations

from maasd.core import EntryHandle
from maasd.core.tiers import Later


def hit(answer: EntryHandle | Later | None) -> EntryHandle:
    assert isinstance(answer, EntryHandle), f"expected a hit, got {answer!r}"
    return answer
