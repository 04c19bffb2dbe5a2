"""A leader acts only while its lease surely lives: until the last refresh's send time plus the TTL, less a margin."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from services.common.election import Election, NotLeader
from services.common.lease_deadline import LeaseDeadline


def test_a_refresh_makes_the_lease_valid_until_its_send_time_plus_the_ttl_less_the_margin() -> None:
    deadline = LeaseDeadline(margin_s=0.5)
    assert not deadline.is_valid(0.0)  # never granted
    deadline.renewed(sent_at=10.0, ttl_s=3)
    assert deadline.is_valid(12.49)
    assert not deadline.is_valid(12.5)


def test_a_late_answer_to_an_older_refresh_never_shortens_the_deadline() -> None:
    deadline = LeaseDeadline(margin_s=0.5)
    deadline.renewed(sent_at=20.0, ttl_s=3)
    deadline.renewed(sent_at=19.0, ttl_s=3)
    assert deadline.valid_until == 22.5


def test_an_expired_lease_is_valid_again_only_after_a_new_grant() -> None:
    deadline = LeaseDeadline(margin_s=0.5)
    deadline.renewed(sent_at=10.0, ttl_s=3)
    deadline.expire()
    assert not deadline.is_valid(10.1)
    deadline.renewed(sent_at=11.0, ttl_s=0)  # etcd refused: the lease was gone
    assert not deadline.is_valid(11.1)


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeEtcd:
    """Just enough of aetcd.Client for one candidate: its key is the only one, or deleted."""

    ttl_s: int = 3
    refresh_ttl: int = 3
    key_deleted: bool = False
    keys: dict[bytes, int] = field(default_factory=dict)
    transactions: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(
        create=lambda key: 0, put=lambda *args, **kwargs: None))

    async def lease(self, ttl: int) -> SimpleNamespace:
        return SimpleNamespace(id=0xA, ttl=self.ttl_s)

    async def transaction(self, compare: list, success: list, failure: list) -> tuple[bool, None]:
        self.keys[b"/e/000000000000000a"] = 5
        return True, None

    async def get(self, key: bytes) -> SimpleNamespace:
        return SimpleNamespace(create_revision=self.keys[key])

    async def get_prefix(self, prefix: bytes) -> list[SimpleNamespace]:
        return [] if self.key_deleted else [SimpleNamespace(key=k, create_revision=r) for k, r in self.keys.items()]

    async def refresh_lease(self, lease_id: int, ttl_s: float | None = None) -> SimpleNamespace:
        return SimpleNamespace(TTL=self.refresh_ttl)

    async def revoke_lease(self, lease_id: int) -> None:
        self.keys.clear()


async def test_a_leader_stops_leading_a_margin_before_its_lease_could_end_and_leads_again_once_refreshed() -> None:
    clock, etcd = FakeClock(100.0), FakeEtcd()
    election = Election(etcd, "/e/", ttl_s=3, margin_s=0.5, clock=clock)  # type: ignore[arg-type]
    leadership = await election.campaign(b"me")  # the lease was asked for at 100.0: it lives until 103.0 at least
    clock.now = 102.49
    assert election.is_leading()
    clock.now = 102.5  # no refresh got through (frozen, or cut off from etcd)
    assert not election.is_leading()
    assert election.leadership == leadership and not election.lost.is_set()  # unconfirmed, not lost

    confirmed = asyncio.create_task(election.wait_confirmed(10))
    await asyncio.sleep(0)
    assert not confirmed.done(), "an unconfirmed leader waits for its lease"
    clock.now = 102.6
    await election.refresh()  # sent at 102.6 with TTL 3: valid until 105.1
    assert await asyncio.wait_for(confirmed, 1)
    clock.now = 105.09
    assert election.is_leading()
    clock.now = 105.1
    assert not election.is_leading()


async def test_a_leader_whose_refresh_is_refused_has_lost_and_a_waiting_placement_learns_it() -> None:
    clock, etcd = FakeClock(100.0), FakeEtcd()
    election = Election(etcd, "/e/", ttl_s=3, margin_s=0.5, clock=clock)  # type: ignore[arg-type]
    await election.campaign(b"me")
    clock.now = 104.0
    confirmed = asyncio.create_task(election.wait_confirmed(10))
    await asyncio.sleep(0)
    etcd.refresh_ttl = 0  # etcd let the lease go while this leader was frozen
    await election.refresh()
    assert await asyncio.wait_for(confirmed, 1) is False
    assert election.lost.is_set() and election.leadership is None and not election.is_leading()


async def test_a_candidate_whose_key_was_deleted_is_never_elected() -> None:
    etcd = FakeEtcd(key_deleted=True)  # its lease expired (an etcd freeze) before it listed the prefix
    election = Election(etcd, "/e/", ttl_s=3, clock=FakeClock())  # type: ignore[arg-type]
    with pytest.raises(NotLeader):
        await election.campaign(b"me")
    assert election.leadership is None and not election.is_leading()


async def test_a_leader_cut_off_from_etcd_says_it_stopped_acting_once_its_lease_deadline_passed(
        caplog: pytest.LogCaptureFixture) -> None:
    # It said "leading until the lease deadline" on every failed keep-alive, long after that deadline (helper-120).
    clock, etcd = FakeClock(100.0), FakeEtcd()
    election = Election(etcd, "/e/", ttl_s=3, margin_s=0.5, clock=clock)  # type: ignore[arg-type]
    await election.campaign(b"me")

    async def unreachable(lease_id: int, ttl_s: float | None = None) -> SimpleNamespace:
        raise ConnectionError("etcd unreachable")

    etcd.refresh_lease = unreachable  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="services.common.election"):
        clock.now = 101.0
        await election.refresh()
        clock.now = 103.0
        await election.refresh()
    assert [r.getMessage().rpartition("; ")[2] for r in caplog.records] == [
        "leading until the lease deadline", "not acting as leader: the lease deadline has passed"]
