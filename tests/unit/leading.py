"""A fake of the scheduler's leadership for unit tests of its servicer: leads while is_leading() says so."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.scheduler.leadership import LeaderRole


def fake_leadership(monkeypatch: pytest.MonkeyPatch, is_leading: Callable[[], bool], revision: int = 7) -> None:
    """LeaderRole answers as a replica that leads (on a confirmed lease, under revision) exactly when
    is_leading() is true."""

    async def wait_confirmed(self: LeaderRole, timeout_s: float) -> bool:
        return is_leading()

    monkeypatch.setattr(LeaderRole, "is_leader", property(lambda self: is_leading()))
    monkeypatch.setattr(LeaderRole, "leading_revision", lambda self: revision if is_leading() else 0)
    monkeypatch.setattr(LeaderRole, "wait_confirmed", wait_confirmed)
    monkeypatch.setattr(LeaderRole, "has_taken_over", lambda self: is_leading())
