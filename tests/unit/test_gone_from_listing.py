"""The models that left a listing lately: what tells a retryable outage from a name never served."""

from __future__ import annotations

from services.common.gone_from_listing import GoneFromListing


def test_a_name_that_left_the_listing_is_remembered_for_its_memory_from_when_it_left() -> None:
    gone: GoneFromListing[int] = GoneFromListing(memory_s=100.0)
    gone.update({"a": 1, "b": 2}, now=0.0)
    assert gone.get("a", 0.0) is None  # listed: not gone
    gone.update({"b": 2}, now=500.0)  # a was listed until now: its memory runs from here, not from its first listing
    assert gone.get("a", 550.0) == 1
    assert gone.get("a", 601.0) is None
    assert gone.get("never", 550.0) is None
    gone.update({"a": 3, "b": 2}, now=560.0)  # back
    assert gone.get("a", 560.0) is None
    gone.update({}, now=570.0)
    assert (gone.get("a", 600.0), gone.get("b", 600.0)) == (3, 2)
    gone.update({}, now=700.0)  # forgotten once past the memory, not kept
    assert gone.get("a", 650.0) is None
