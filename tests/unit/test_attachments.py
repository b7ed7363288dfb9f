"""The attachment counts' view of the held buffers (what a reserve's eviction defers):
it answers from the counts as they are when asked, and copies nothing."""

from __future__ import annotations

from maasd.core.attachments import Attachments


def test_the_attached_view_follows_attaches_and_detaches() -> None:
    a = Attachments()
    view = a.attached_ids()  # taken once, as a reserve does before its rounds
    assert not view
    assert "b1" not in view
    a.attach("t1", "b1")
    a.attach("t1", "b1")
    a.attach("t2", "b2")
    assert {b for b in ("b1", "b2", "b3") if b in view} == {"b1", "b2"}
    assert len(view) == 2
    assert sorted(view) == ["b1", "b2"]
    a.detach("t1", "b1")
    assert "b1" in view  # one handle of it is still attached
    a.detach("t1", "b1")
    a.detach("t2", "b3")  # never attached: changes nothing
    assert "b1" not in view
    assert list(view) == ["b2"]
    a.detach("t2", "b2")
    assert not view


def test_asking_the_view_counts_nothing() -> None:
    a = Attachments()
    view = a.attached_ids()
    assert "b1" not in view
    a.detach("t1", "b1")  # a detach of what no question attached
    assert (a.attached("b1"), a.tenant_attached("t1"), len(view)) == (0, 0, 0)
