"""Leader election in etcd, after etcd's client/v3/concurrency recipe.

Each candidate puts a key under the election prefix, attached to its own lease. The candidate
whose key has the lowest create revision leads; the others wait for the key just below theirs
to be deleted. Leadership is the pair (key, create revision) held in etcd — never a local flag:

- a candidate is elected only when a listing shows its own key, at its own revision, with no
  earlier key (a key deleted while it waited — its lease expired — is no claim to lead);
- it leads only while its lease surely lives: until the last refresh's send time plus the
  TTL, less a margin (`LeaseDeadline`), so a leader that cannot refresh (frozen, cut off from
  etcd) stops acting before etcd can expire its key and elect another;
- every write the leader makes is a transaction that checks the pair, so a deposed leader's
  writes fail.

Resigning revokes the lease, which deletes the key and wakes the next candidate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aetcd

from services.common.change_signal import ChangeSignal, wait_or_timeout
from services.common.etcd_session import QUICK_RETRY_S
from services.common.lease_deadline import LeaseDeadline
from services.common.timeouts import within

log = logging.getLogger(__name__)


class NotLeader(Exception):
    """A fenced write was refused: this candidate's leadership key no longer stands."""


@dataclass(frozen=True)
class Leadership:
    """Proof of leadership: the candidate's key and its create revision."""

    key: str
    revision: int
    lease_id: int


class Election:
    """One candidate in the election under prefix.

    margin_s: how long before its lease could end at the earliest the leader stops acting
    (default a quarter of the TTL); clock: the monotonic clock the lease deadline is kept on.
    """

    def __init__(self, client: aetcd.Client, prefix: str, ttl_s: int, margin_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._prefix = prefix
        self._ttl_s = ttl_s
        self._clock = clock
        # The state the last failed keep-alive was logged with ("" since a refresh got an answer).
        self._failing = ""
        self._deadline = LeaseDeadline(ttl_s / 4 if margin_s is None else margin_s)
        self._leadership: Leadership | None = None
        # This candidate's key while it campaigns or leads.
        self._candidate: Leadership | None = None
        self._changed = ChangeSignal()  # the lease confirmed, or leadership lost
        self.lost = asyncio.Event()

    @property
    def leadership(self) -> Leadership | None:
        """The leadership won and not known lost (its lease may be unconfirmed: see is_leading)."""
        return self._leadership

    @property
    def candidate_key(self) -> str | None:
        """This candidate's election key while it campaigns or leads."""
        return None if self._candidate is None else self._candidate.key

    def is_leading(self) -> bool:
        """Elected, and the lease surely lives now: the only state in which to act as leader."""
        return self._leadership is not None and self._deadline.is_valid(self._clock())

    async def wait_confirmed(self, timeout_s: float) -> bool:
        """Whether this candidate leads on a live lease within timeout_s; False at once when it does not lead.

        An elected leader whose lease is unconfirmed (a refresh late, etcd unreachable) waits
        for the next refresh: confirmed, it leads on; refused, it has lost.
        """
        end = self._clock() + timeout_s
        while True:
            if self.is_leading():
                return True
            remaining = end - self._clock()
            if self._leadership is None or remaining <= 0:
                return False
            await wait_or_timeout(self._changed.since_now(), remaining)

    async def campaign(self, value: bytes) -> Leadership:
        """Join the election and return once this candidate leads (run keep_alive alongside)."""
        sent_at = self._clock()
        lease = await self._client.lease(self._ttl_s)
        key = f"{self._prefix}{lease.id:016x}"
        self._leadership = None
        self.lost.clear()
        self._deadline.expire()
        self._deadline.renewed(sent_at, lease.ttl)
        try:
            tx = self._client.transactions
            created, _ = await self._client.transaction(
                compare=[tx.create(key.encode()) == 0],
                success=[tx.put(key.encode(), value, lease=lease.id)],
                failure=[],
            )
            if not created:
                raise RuntimeError(f"election key {key} already exists")
            revision = (await self._client.get(key.encode())).create_revision
            self._candidate = Leadership(key, revision, lease.id)
            await self._wait_for_predecessors(key, revision)
        except BaseException:
            self._candidate = None
            self._deadline.expire()
            await self._revoke(lease.id)
            raise
        leadership = self._candidate
        if leadership is None:  # its key's deletion was seen (key_deleted) as the wait ended
            raise NotLeader(f"election key {key}@{revision} was deleted while campaigning")
        self._leadership = leadership
        log.info("elected: %s at revision %d", key, revision)
        return leadership

    async def _wait_for_predecessors(self, key: str, revision: int) -> None:
        """Until our key stands at our revision and no key under the prefix was created before it.

        NotLeader if our key is gone: its lease expired while we waited (an etcd freeze can
        expire every lease at once), and a later candidate may lead already.
        """
        while True:
            listing = await self._client.get_prefix(self._prefix.encode())
            # (Compared as bytes: a key not UTF-8 under the prefix, no candidate's, failed the decoding: helper-186.)
            if not any(kv.key == key.encode() and kv.create_revision == revision for kv in listing):
                raise NotLeader(f"election key {key}@{revision} was deleted while campaigning (lease expired)")
            earlier = [kv for kv in listing if kv.create_revision < revision]
            if not earlier:
                return
            predecessor = max(earlier, key=lambda kv: kv.create_revision).key
            # Watch the prefix, not only the predecessor: our own key's deletion ends the wait too.
            watch = await self._client.watch_prefix(self._prefix.encode(), start_revision=listing.header.revision + 1)
            try:
                async for event in watch:
                    if event.kind == "DELETE" and event.kv.key in (predecessor, key.encode()):
                        break
            except Exception as exc:  # noqa: BLE001 - the watch broke: list again (raises if etcd is down)
                # (A broken watch failed the campaign, which gave up its place in the election: when the etcd member
                # it watched on died, the client moved to another and could have watched on there: helper-178.)
                log.info("election watch on %s ended (%s); listing again", self._prefix, exc)
            finally:
                await watch.cancel()

    async def keep_alive(self) -> None:
        """Refresh the candidate's lease every third of its TTL (see refresh); after a failure, again within
        QUICK_RETRY_S: the next try a third of the TTL later came after a 3 s lease had run out, where the client
        had moved off a frozen etcd member within a second (helper-178)."""
        delay_s = self._ttl_s / 3
        while True:
            await asyncio.sleep(delay_s)
            delay_s = self._ttl_s / 3 if await self.refresh() else min(self._ttl_s / 3, QUICK_RETRY_S)

    async def refresh(self) -> bool:
        """Refresh the candidate's lease once: success extends the lease deadline, a refusal (TTL 0)
        means leadership is lost.

        etcd being unreachable is not a loss: the leader stays elected, but acts only until its
        lease deadline passes, and again once a refresh succeeds.

        Returns whether etcd answered (False: it did not, and the next refresh should come soon).
        """
        candidate = self._candidate
        if candidate is None:
            return True
        sent_at = self._clock()
        try:
            reply = await self._client.refresh_lease(candidate.lease_id, ttl_s=self._ttl_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - etcd down: the deadline decides
            if self._leadership is None:
                state = "campaigning"
            elif self.is_leading():
                state = "leading until the lease deadline"
            else:  # (it said 'leading until the lease deadline' every time, long past it: helper-120)
                state = "not acting as leader: the lease deadline has passed"
            # Said once per state: retried every QUICK_RETRY_S, it would fill the log through an outage.
            (log.warning if state != self._failing else log.debug)("election keep-alive failed (%s); %s", exc, state)
            self._failing = state
            return False
        self._failing = ""
        if self._candidate is not candidate:
            return True  # resigned or lost meanwhile
        if reply is None or reply.TTL <= 0:
            self._drop(f"election lease {candidate.lease_id:x} expired")
        else:
            self._deadline.renewed(sent_at, reply.TTL)
            self._changed.notify()
        return True

    def key_deleted(self, key: str) -> None:
        """etcd showed key deleted: if it is this candidate's, its claim is gone."""
        candidate = self._candidate
        if candidate is not None and candidate.key == key:
            self._drop(f"election key {key} was deleted")

    def _drop(self, reason: str) -> None:
        if self._leadership is not None:
            log.warning("%s: leadership lost", reason)
        self._give_up()

    def _give_up(self) -> None:
        """No longer leading nor a candidate (lost, or resigned): lost is set."""
        self._leadership = None
        self._candidate = None
        self._deadline.expire()
        self.lost.set()
        self._changed.notify()

    async def _put_under(self, leadership: Leadership, key: str, value: bytes) -> bool:
        """Write key=value if leadership's key still stands; whether it was written."""
        tx = self._client.transactions
        succeeded, _ = await self._client.transaction(
            compare=[tx.create(leadership.key.encode()) == leadership.revision],
            success=[tx.put(key.encode(), value)],
            failure=[],
        )
        return bool(succeeded)

    async def fenced_put(self, key: str, value: bytes) -> None:
        """Write key=value only while this candidate's leadership key stands; NotLeader otherwise."""
        leadership = self._leadership
        if leadership is None:
            raise NotLeader("not the leader")
        if not await self._put_under(leadership, key, value):
            self._drop(f"fenced write refused: {leadership.key}@{leadership.revision} no longer stands")
            raise NotLeader(f"leadership {leadership.key}@{leadership.revision} no longer stands")

    async def resign(self, last_put: Callable[[], tuple[str, bytes]] | None = None) -> None:
        """Give up leadership (or candidacy) at once; best effort. last_put: a leader's last fenced write, of what it
        returns once this no longer acts as leader (nothing done as leader after it is left out of it), before its
        key goes."""
        candidate, leadership, was_leading = self._candidate, self._leadership, self.is_leading()
        self._give_up()
        if leadership is not None and was_leading and last_put is not None:
            try:
                await within(self._put_under(leadership, *last_put()), 2.0)
            except Exception as exc:  # noqa: BLE001 - the successor starts from the last periodic write
                log.warning("last write before resigning failed: %s", exc)
        if candidate is not None:
            await self._revoke(candidate.lease_id)

    async def _revoke(self, lease_id: int) -> None:
        try:
            await within(self._client.revoke_lease(lease_id), 2.0)
        except Exception as exc:  # noqa: BLE001 - the lease expires anyway
            log.warning("election lease revoke failed: %s", exc)
