"""A scheduler replica's part in the election: campaign, lead, hand state over, step down."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd

from services.common import etcd_keys
from services.common.election import Election, NotLeader
from services.common.etcd_records import json_object, text_field
from services.common.etcd_session import PrefixView
from services.common.timeouts import within

log = logging.getLogger(__name__)

_RETRY_S = 0.5
# How often a leader looks whether its lease is still confirmed, to say so (on_leading).
_LEASE_LOOK_S = 0.25


class LeaderRole:
    """Campaigns until elected, leads until etcd says otherwise, then campaigns again.

    While leading it writes its hand-over state every persist_interval_s, fenced by its
    leadership; on election it first restores what its predecessor wrote.
    """

    def __init__(
        self,
        client: aetcd.Client,
        instance_id: str,
        address: str,
        ttl_s: int,
        save_state: Callable[[], dict[str, Any]],
        restore_state: Callable[[dict[str, Any]], None],
        persist_interval_s: float = 1.0,
        on_leading: Callable[[bool], None] = lambda leading: None,
    ) -> None:
        """on_leading(True) once this replica leads (its predecessor's state restored), on_leading(False) when it no
        longer does; and, while it leads, on_leading(False) when its lease goes unconfirmed (etcd unreachable past
        the lease's margin: it places nothing then) and on_leading(True) once confirmed again."""
        self._client = client
        self._on_leading = on_leading
        self._instance_id = instance_id
        self._value = json.dumps({"instance_id": instance_id, "address": address}).encode()
        self._election = Election(client, etcd_keys.SCHEDULER_ELECTION, ttl_s)
        self._view = PrefixView(client, etcd_keys.SCHEDULER_ELECTION, self._on_election_changed)
        # This replica's election key once the view has shown it: its absence later means deletion.
        self._key_seen: str | None = None
        # The malformed election record last warned of (leader() is asked often).
        self._malformed: str | None = None
        self._save_state = save_state
        self._restore_state = restore_state
        self._persist_interval_s = persist_interval_s
        self.elected = asyncio.Event()
        # Once it resigns it does not campaign again (alone, it led again within a second while it drained, and its
        # last updates were never written, helper-198). Its state writes one at a time: a periodic write under way as
        # it resigned could land after the last, with an older state.
        self._resigned = False
        self._writing = asyncio.Lock()

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        return [self._campaign_forever(), self._election.keep_alive(), self._view.run(), self._tell_confirmed()]

    async def _tell_confirmed(self) -> None:
        """While elected, on_leading follows the lease: a leader that cannot confirm its lease holds every placement
        until it can (docs/etcd.md), so it is not said to lead meanwhile (its gRPC health said SERVING through a 30 s
        etcd freeze, while GetClusterState's leading_revision said 0 from 2 s in, helper-207)."""
        while not self._resigned:
            if self.elected.is_set():
                self._on_leading(self.is_leader)
            await asyncio.sleep(_LEASE_LOOK_S)

    @property
    def is_leader(self) -> bool:
        """Elected, own key standing, and the lease surely alive now (see Election.is_leading)."""
        return self._election.is_leading()

    def leading_revision(self) -> int:
        """The create revision of the election key this replica leads under now; 0 when it does not lead."""
        leadership = self._election.leadership
        return leadership.revision if leadership is not None and self._election.is_leading() else 0

    async def wait_confirmed(self, timeout_s: float) -> bool:
        """Whether this replica leads on a confirmed lease within timeout_s (False at once on a standby)."""
        return await self._election.wait_confirmed(timeout_s)

    def _on_election_changed(self, items: dict[str, bytes]) -> None:
        """A deleted own key ends leadership at once, without waiting for the next keep-alive."""
        key = self._election.candidate_key
        if key is None:
            return
        if key in items:
            self._key_seen = key
        elif self._key_seen == key:
            self._election.key_deleted(key)

    def has_taken_over(self) -> bool:
        """Whether this replica leads and has restored its predecessor's hand-over state."""
        return self.elected.is_set()

    async def wait_if_taking_over(self, timeout_s: float) -> None:
        """If etcd already shows this replica as the leader but it has not finished taking over
        (its campaign has yet to see its predecessor's key go, or it is restoring the hand-over
        state), wait for that: routers see the new leader in etcd as soon as it does not."""
        if self.elected.is_set():  # the common case, on every Place: no parsing
            return
        leader = self.leader()
        if leader is None or leader[0] != self._instance_id:
            return
        try:
            await within(self.elected.wait(), timeout_s)
        except TimeoutError:
            pass

    async def wait_successor_shown(self, timeout_s: float) -> None:
        """Once leadership is lost, until etcd's view no longer shows this replica as the leader (so a
        refusal can name the successor); at most timeout_s."""
        def shows_other(_: dict[str, bytes]) -> bool:
            leader = self.leader()
            return leader is None or leader[0] != self._instance_id or self._election.is_leading()

        try:
            await within(self._view.wait_for(shows_other), timeout_s)
        except TimeoutError:
            pass

    def leader(self) -> tuple[str, str] | None:
        """(instance id, address) of the leader as etcd last showed it; None when there is none."""
        first = self._view.first()
        if first is None:
            return None
        try:
            record = json_object(first[1])
            instance_id, address = text_field(record, "instance_id"), text_field(record, "address")
        except ValueError as exc:  # no replica wrote it: none leads while it stands first (helper-181)
            if self._malformed != first[0]:
                self._malformed = first[0]
                log.warning("malformed election record at %s, first in line: %s", first[0], exc)
            return None
        return instance_id, address

    async def fenced_put(self, key: str, value: bytes) -> None:
        await self._election.fenced_put(key, value)

    async def resign(self) -> None:
        """Step down; a leader first writes its hand-over state once more: stopped between its periodic writes, it
        lost up to persist_interval_s of the ledger's updates, whose notices it had acknowledged, and a workflow
        whose every step succeeded then failed at the timeout (helper-194: 4 to 6 of 226 at each SIGTERM)."""
        async with self._writing:
            self._resigned = True
            # Only once it leads on its predecessor's state: resigned while it read it, it wrote its own empty state
            # over the hand-over, and its successor restored nothing (helper-199).
            await self._election.resign(
                (lambda: (etcd_keys.SCHEDULER_STATE, json.dumps(self._save_state()).encode()))
                if self.elected.is_set() else None)

    async def _campaign_forever(self) -> None:
        while not self._resigned:
            try:
                leadership = await self._election.campaign(self._value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd down: try again
                if self._resigned:
                    return
                log.warning("campaign failed (%s); retrying", exc)
                await asyncio.sleep(_RETRY_S)
                continue
            if not self._resigned:
                await self._take_over()
            if self._resigned:  # as it was elected (its lease granted after) or took over: its key goes (helper-199)
                await self._election.resign()
                return
            self.elected.set()
            self._on_leading(self.is_leader)  # (its lease may have gone unconfirmed while it took over, helper-209)
            log.info("leading as %s (revision %d)", leadership.key, leadership.revision)
            try:
                await self._lead()
            finally:
                self.elected.clear()
                self._on_leading(False)
            if not self._resigned:
                log.warning("no longer the leader; campaigning again")

    async def _take_over(self) -> None:
        try:
            stored = await self._client.get(etcd_keys.SCHEDULER_STATE.encode())
        except Exception as exc:  # noqa: BLE001 - start from nothing rather than not at all
            log.warning("could not read the predecessor's state (%s); starting fresh", exc)
            return
        if stored is not None:
            try:
                self._restore_state(json_object(stored.value))
            except Exception as exc:  # noqa: BLE001 - a record that is not a state (`5` crashed every replica in
                # turn as each took over, helper-181): lead on what was read before it rather than not at all
                log.warning("unreadable predecessor state (%s: %s): leading on what was read of it before that (the "
                            "retry budget, workflows and demand whole, or none of them), the rest from nothing",
                            type(exc).__name__, exc)

    async def _lead(self) -> None:
        """Persist state until leadership is lost."""
        while not self._election.lost.is_set():  # (set by a resignation too)
            try:
                await within(self._election.lost.wait(), self._persist_interval_s)
                return
            except TimeoutError:
                pass
            try:
                async with self._writing:  # (resigned meanwhile, NotLeader)
                    await self.fenced_put(etcd_keys.SCHEDULER_STATE, json.dumps(self._save_state()).encode())
            except NotLeader:
                return
            except Exception as exc:  # noqa: BLE001 - etcd down: keep leading on the last view
                log.warning("state write failed (%s)", exc)
