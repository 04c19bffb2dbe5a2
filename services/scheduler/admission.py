"""Admission control: priority bands, weighted fair share between tenants, earliest deadline first. Pure.

A request offered to the leader is admitted at once, queued, or refused:

- refused at once when its tenant is over a limit (concurrency, tokens per minute), when its
  TTFT budget cannot be met given the predicted time to serve it, or when the fleet is saturated and
  it is sheddable (priority < 0);
- queued while the fleet is saturated or others of its band (or a higher one) wait; a full queue
  sheds its lowest-band, latest-deadline entry to make room for a more important one;
- dispatched from the queue, as capacity frees, by strict priority band; within a band to the
  tenant that has been served the fewest tokens for its weight over the last minute; within a
  tenant by earliest deadline, then the furthest workflow (a late step of a task goes before a
  fresh request), then arrival.

Requests already admitted are never shed. Each admitted request holds one of its tenant's concurrency
slots under a lease: the slot is freed when the request is reported finished, or when its lease runs
out without a renewal (whoever serves it renews it while it lives), so a lost finish notice cannot pin
a tenant at its limit. A tenant with nothing in flight and nothing served in the last minute leaves
no state behind. Time is passed in.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import json
import math
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60.0
# The fewest bytes a slot takes in the hand-over state (Admission.to_state): ["", 0.0, 0, []] and its comma.
_MIN_SLOT_BYTES = 18
# The age step of the tokens a leader hands over (Admission.to_state): a minute in 12 entries per tenant.
TOKEN_STATE_S = 5
# A tenant at its concurrency limit is told to retry when its oldest request should end: the mean time its requests
# have held a slot (an exponential average over those ended, SLOT_SMOOTHING per end) less that one's age, at least
# 1 s and at most SLOT_HINT_MAX_S (the openai client waits out a Retry-After of up to 60 s; longer, its own backoff).
SLOT_SMOOTHING = 0.2
SLOT_HINT_MAX_S = 60.0
# How often idle tenants' state is dropped (a sweep over every tenant).
_PRUNE_EVERY_S = 10.0
# How many processes of one router id each leader remembers (Admission.router_seen).
_INCARNATIONS_KEPT = 4
# How long at most the slots of a router process that a new one under its id replaced are kept for a resume or a
# live report to take back (Admission.router_seen).
ROUTER_GONE_GRACE_S = 5.0


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's share and limits (None: unlimited)."""

    weight: float = 1.0
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None

    @property
    def is_limited(self) -> bool:
        return self.max_concurrency is not None or self.tokens_per_minute is not None


@dataclass
class Ticket:
    request_id: str
    tenant: str
    priority: int
    # Prompt plus completion tokens: what the request will cost its tenant's share.
    num_tokens: int
    arrived_at: float
    # When it must have its first token by (inf: no budget).
    deadline_at: float = math.inf
    # When it must have ended by (deadline_ms; inf: none).
    ends_by: float = math.inf
    # How much of its workflow is done ((step - 1) / total steps; 0 for a lone request): among equal
    # deadlines, a late step of a task goes before a fresh one, whose failure would waste less.
    progress: float = 0.0
    # The completion tokens of num_tokens, named when the whole ask is more than its tenant may ever have.
    max_tokens: int = 0
    # The router that asked for it ("": not said): one holder of its slot.
    holder: str = ""
    # Sent again by its client with `resume`, or moved: it may share the slot its id holds. A fresh request may not.
    resumed: bool = False
    # Its prompt's and cache salt's digest (0: not said): a resend must have the held id's to share its slot.
    prompt_digest: int = 0
    # Which Place call asked for it (0: not said): a call that ends without placing it gives back only a slot no
    # later call of its id took over.
    attempt: int = 0

    @property
    def due_at(self) -> float:
        """What earliest-deadline-first orders by: the earlier of its two deadlines (a request with only deadline_ms
        queued behind those with none, helper-125)."""
        return min(self.deadline_at, self.ends_by)


def _dispatch_order(ticket: Ticket) -> tuple[float, float, float]:
    """Within its tenant's share of a band, earliest deadline first, then the furthest into its workflow, then the
    first to come."""
    return ticket.due_at, -ticket.progress, ticket.arrived_at


class Verdict(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    reason: str = ""
    retry_after_s: float = 0.0
    # The refusal's kind, a metric label: the reason without the names and numbers that would make a label per
    # tenant or limit.
    kind: str = ""
    # Refused for what it asks, not for the load: no retry would be admitted (bad input, not a wait).
    never: bool = False
    # Refused as a fresh request for an id that is queued or running already (ALREADY_EXISTS, not a wait).
    duplicate: bool = False
    # A queued ticket pushed out to make room (it is refused with `reason`).
    shed: Ticket | None = None
    # The queued ticket of the same id that this one, its resend, took the place of (it is refused).
    replaced: Ticket | None = None


@dataclass
class _Tenant:
    in_flight: int = 0
    served: deque[tuple[float, int]] = field(default_factory=deque)
    served_tokens: int = 0
    # When each request holding a slot was admitted, oldest first, and the mean time its ended ones held theirs
    # (None until one has ended).
    admitted: dict[str, float] = field(default_factory=dict)
    held_s: float | None = None

    def slot_free_in_s(self, now: float, num_waiting: int = 0) -> float:
        """About when a slot frees: the oldest holder's expected end by the mean hold, within [1, SLOT_HINT_MAX_S] s
        (1 s before any has ended). With none admitted and num_waiting of the tenant's requests queued, a whole mean
        hold: only an admitted request's end lowers the count, so the first queued one must be dispatched and run
        (the hint was 1 s, helper-127)."""
        if self.held_s is None or not (self.admitted or num_waiting):
            return 1.0
        first = max(0.0, self.held_s - (now - next(iter(self.admitted.values())))) if self.admitted else self.held_s
        return min(SLOT_HINT_MAX_S, max(1.0, first))

    def tokens_free_in_s(self, now: float, excess: int) -> float:
        """When charges of the window totalling at least excess tokens have expired. Told when the oldest charge
        expired, a client came back in vain while later ones still filled the window (helper-157). When even an empty
        window would not do, the whole window: the tenant's requests waiting for admission charge theirs once
        dispatched, now or later, for a window from then (told when the last charge expired, a client came back in
        vain, helper-159)."""
        freed = 0
        for at, tokens in self.served:
            freed += tokens
            if freed >= excess:
                return max(0.0, at + WINDOW_S - now)
        return WINDOW_S

    def expire(self, now: float) -> None:
        while self.served and self.served[0][0] <= now - WINDOW_S:
            self.served_tokens -= self.served.popleft()[1]

    def is_idle(self, now: float) -> bool:
        """Nothing in flight, nothing served within the window: its state says nothing."""
        self.expire(now)
        return not self.in_flight and not self.served


@dataclass
class _Hold:
    """An admitted request's concurrency slot, held until it is released or its lease runs out."""

    tenant: str
    expires_at: float
    # The digest of the prompt it was admitted with (0: not said).
    prompt_digest: int = 0
    # The routers that placed the id or reported it live, and when first and last: a stream of the id may run
    # through each (a client's resume through another router shares the slot).
    holders: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Routers that ended their stream of the id while another held it: a live report of theirs that was under way
    # (sent before the notice) does not make them holders again; their next placement of the id does.
    ended: set[str] = field(default_factory=set)
    # What admitting it charged its tenant's tokens per minute: (when, tokens).
    charged: tuple[float, int] = (0.0, 0)
    # The latest Place call admitted on it (Ticket.attempt: they are numbered in order).
    attempt: int = 0
    # Its charge stands whatever becomes of a call that never placed it: a call placed it (it may have run), or it
    # was admitted as a resume (the charge is its earlier stream's).
    spent: bool = False

    def claim(self, holder: str, now: float, placed: bool = False) -> None:
        """holder placed the id (a stream of it begins there: its claim starts now, a router restarted under the
        same id included) or reported it live."""
        if not holder:
            return
        if placed:
            self.ended.discard(holder)
            self.holders[holder] = (now, now)
        elif holder not in self.ended:
            self.holders[holder] = (self.holders.get(holder, (now, now))[0], now)

    def held_elsewhere(self, holder: str, now: float, lease_s: float, is_registered: Callable[[str], bool]) -> bool:
        """Whether a router other than holder placed the id or reported it live within the lease, has not ended its
        stream of it, and is registered in etcd or spoke of it within a third of the lease (holder's own claim is
        not asked about: the router knows its own streams). A router gone from etcd and silent has none: its node
        streams ended with its connections. One still speaking may run it unregistered: stopping, it leaves etcd
        first and lets its streams run on; its lease may lapse in an etcd hiccup while it serves."""
        return any(other != holder and other not in self.ended and now - last < lease_s
                   and (now - last < lease_s / 3 or is_registered(other))
                   for other, (_, last) in self.holders.items())


class Admission:
    def __init__(self, max_queued: int = 10_000, limits: dict[str, TenantLimits] | None = None,
                 default_limits: TenantLimits = TenantLimits(), fair_share: str = "tokens",
                 check_deadlines: bool = True, lease_s: float = math.inf,
                 is_registered: Callable[[str], bool] = lambda router_id: True) -> None:
        """fair_share "tokens" (Baton) or "round_robin" (GIE's flow control); check_deadlines refuses
        what cannot meet its deadline (GIE does not); lease_s: how long an admitted request keeps its
        slot without a renewal; is_registered: whether a router (by its id) is registered in etcd now."""
        if fair_share not in ("tokens", "round_robin"):
            raise ValueError(f"fair_share must be tokens or round_robin, got {fair_share!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s = lease_s
        self._is_registered = is_registered
        self.max_queued = max_queued
        self._fair_share = fair_share
        self._check_deadlines = check_deadlines
        self._last_served: dict[int, str] = {}
        self._limits = dict(limits or {})
        self._default = default_limits
        self._tenants: dict[str, _Tenant] = defaultdict(_Tenant)
        # When the ends of requests were reported (oldest first, a lease's worth): a live report under way as one
        # ended does not give it a slot again (adopt).
        self._ended_at: dict[str, float] = {}
        self._queued: dict[str, Ticket] = {}
        self._held: dict[str, _Hold] = {}
        self._pruned_at = -math.inf
        # The router processes seen under each router id: their incarnations, when last heard from (the latest last;
        # a few kept, and a router id silent for a lease dropped).
        self._incarnations: dict[str, dict[int, float]] = {}

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def queued_by_tenant(self) -> dict[str, int]:
        """How many requests each tenant has waiting in the queue (tenants with none left out)."""
        counts: dict[str, int] = {}
        for ticket in self._queued.values():
            counts[ticket.tenant] = counts.get(ticket.tenant, 0) + 1
        return counts

    @property
    def num_held(self) -> int:
        """Admitted requests holding a concurrency slot."""
        return len(self._held)

    @property
    def num_tenants(self) -> int:
        """Tenants with state kept (in flight, queued, or served within the window)."""
        return len(self._tenants)

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.in_flight if state is not None else 0

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        """Replace the per-tenant limits (tenant records changed); requests already admitted keep their slots. Those
        queued: refuse_over_limits."""
        self._limits = dict(limits)

    def refuse_over_limits(self, now: float) -> list[tuple[Ticket, Outcome]]:
        """The queued requests that their tenants' limits, lowered while they waited, no longer let in, taken out of
        the queue with their refusals: dispatched, they ran past the new limits (nothing checks them at dispatch).
        Each tenant's requests are let in the order they would be dispatched: by band, then _dispatch_order."""
        by_tenant: dict[str, list[Ticket]] = defaultdict(list)
        for queued in self._queued.values():
            by_tenant[queued.tenant].append(queued)
        refused = []
        for tickets in by_tenant.values():
            kept: list[Ticket] = []
            for queued in sorted(tickets, key=lambda t: (-t.priority, *_dispatch_order(t))):
                outcome = self._over_limits(queued, now, kept)
                if outcome is None:
                    kept.append(queued)
                else:
                    refused.append((queued, outcome))
        for queued, _ in refused:
            del self._queued[queued.request_id]
        return refused

    def limits(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self._default)

    def offer(self, ticket: Ticket, now: float, is_saturated: bool, predicted_ttft_s: float) -> Outcome:
        """Admit, queue or refuse a new request.

        One that already holds a slot (the same request sent again, e.g. resumed through another
        router after its first one died) is admitted on that slot: it has started and is never shed. A fresh
        request (not resumed) for an id that is queued, or that another live router runs, is refused as a duplicate:
        it would run a second time beside the first, on its slot, past its tenant's limits. A resumed one for an id
        that is queued takes its place (Outcome.replaced: its first ask is refused; its client resent it through
        another router, the first one frozen, say), as does one its own router sent again (a router refuses its own
        clients' duplicates itself).
        """
        queued = self._queued.get(ticket.request_id)
        if (queued is not None and ticket.holder and ticket.holder == queued.holder and not ticket.resumed
                and not _other_prompt(ticket, queued.prompt_digest)):
            # Sent again by the router that queued it: it abandoned its first call when etcd showed a new leader
            # (this replica, elected again after losing its lease), and its cancellation had not reached the queue
            # yet. Refused as a duplicate, a fresh request failed for good, and its first ask ran later with no
            # router behind it (helper-125). It keeps its place in the queue, and its deadlines.
            ticket = dataclasses.replace(ticket, arrived_at=queued.arrived_at,
                                         deadline_at=min(ticket.deadline_at, queued.deadline_at),
                                         ends_by=min(ticket.ends_by, queued.ends_by))
        elif queued is not None and (not ticket.resumed or _other_prompt(ticket, queued.prompt_digest)):
            return _duplicate(ticket, "is already waiting for admission; a new request needs another request_id")
        hold = self._held.get(ticket.request_id)
        if hold is not None:
            if ticket.resumed and _other_prompt(ticket, hold.prompt_digest):
                # Another prompt under a running id, sent as a "resume": placed away from the node running the id
                # (only that node could tell), it ran beside that stream on its slot, one stream per node past the
                # tenant's concurrency limit (helper-118).
                return _duplicate(ticket, "is already running as another request: this one's prompt (or cache "
                                          "salt) is not the running one's; a new request needs another request_id")
            if ticket.resumed or not hold.held_elsewhere(ticket.holder, now, self.lease_s, self._is_registered):
                return Outcome(Verdict.ADMIT)
            return _duplicate(ticket, "is already running, through another router; a new request needs another "
                                      "request_id (a gRPC client takes the stream over by sending it with `resume`)")
        if queued is not None:
            del self._queued[ticket.request_id]
            return dataclasses.replace(self._judge(ticket, now, is_saturated, predicted_ttft_s), replaced=queued)
        return self._judge(ticket, now, is_saturated, predicted_ttft_s)

    def limits_refusal(self, ticket: Ticket, now: float) -> Outcome | None:
        """offer's refusal of ticket by its tenant's limits now, if they refuse it (an id neither running nor
        queued): a question, which admits and queues nothing."""
        if (not self.limits(ticket.tenant).is_limited or ticket.request_id in self._held
                or ticket.request_id in self._queued):
            return None
        return self._over_limits(ticket, now, [t for t in self._queued.values() if t.tenant == ticket.tenant])

    def _over_limits(self, ticket: Ticket, now: float, waiting: list[Ticket]) -> Outcome | None:
        """The refusal of ticket by its tenant's limits, with waiting (its tenant's requests queued ahead of it)
        counted as admitted; None if they let it in."""
        limits = self.limits(ticket.tenant)
        tenant = self._tenants[ticket.tenant]
        tenant.expire(now)
        if not limits.is_limited:
            return None
        if limits.tokens_per_minute is not None and ticket.num_tokens > limits.tokens_per_minute:
            return Outcome(Verdict.REJECT, f"with its prompt, {ticket.num_tokens} tokens, more than the whole limit "
                                           f"of tenant {ticket.tenant!r}, {limits.tokens_per_minute} tokens per "
                                           "minute: no wait would let it in",
                           # Its own reason: refused INVALID_ARGUMENT, not the 429 of the limit (helper-185); and
                           # first, so that no busy moment answers it 429 with a hint it cannot use (helper-189).
                           kind="tenant tokens per minute less than the request", never=True)
        if limits.max_concurrency is not None and tenant.in_flight + len(waiting) >= limits.max_concurrency:
            return Outcome(Verdict.REJECT, f"tenant {ticket.tenant!r} is at its concurrency limit of "
                                           f"{limits.max_concurrency}"
                                           + (f" ({len(waiting)} of them waiting for admission)" if waiting else ""),
                           retry_after_s=tenant.slot_free_in_s(now, len(waiting)), kind="tenant concurrency limit")
        waiting_tokens = sum(t.num_tokens for t in waiting)
        if (limits.tokens_per_minute is not None
                and tenant.served_tokens + waiting_tokens + ticket.num_tokens > limits.tokens_per_minute):
            wait = tenant.tokens_free_in_s(
                now, tenant.served_tokens + waiting_tokens + ticket.num_tokens - limits.tokens_per_minute)
            return Outcome(Verdict.REJECT, f"tenant {ticket.tenant!r} is over its limit of "
                                           f"{limits.tokens_per_minute} tokens per minute"
                                           + (f" ({waiting_tokens} of them in requests waiting for admission)"
                                              if waiting_tokens else ""), retry_after_s=wait,
                           kind="tenant tokens per minute limit")
        return None

    def _judge(self, ticket: Ticket, now: float, is_saturated: bool, predicted_ttft_s: float) -> Outcome:
        """offer's verdict on a request that holds no slot: its tenant's limits, its deadline, the fleet's load."""
        # Its requests waiting for admission count against its limits as those admitted do: each takes a slot and
        # its tokens once dispatched, and nothing checks the limits again then (a tenant at max_concurrency 2 ran
        # six streams once the fleet was saturated, helper-125).
        refusal = self._over_limits(ticket, now, [t for t in self._queued.values() if t.tenant == ticket.tenant])
        if refusal is not None:
            return refusal
        ahead = self._wait_ahead_s(ticket, predicted_ttft_s)
        if self._check_deadlines and now + predicted_ttft_s + ahead > ticket.deadline_at:
            # In ms, as the budget is given: in seconds to two decimals a 7 ms budget read "needs about 0.01 s, has
            # 0.01 s".
            return Outcome(Verdict.REJECT, f"TTFT budget cannot be met: needs about "
                                           f"{(predicted_ttft_s + ahead) * 1000:.0f} ms to the first token (of which "
                                           f"{ahead * 1000:.0f} ms behind those queued ahead), has "
                                           f"{max(0.0, ticket.deadline_at - now) * 1000:.0f} ms",
                           # At least the excess (what a model's load, counted in the prediction, has yet to
                           # take), at most the longest Retry-After the openai client waits out.
                           retry_after_s=min(SLOT_HINT_MAX_S, max(
                               1.0, ahead, now + predicted_ttft_s + ahead - ticket.deadline_at)),
                           kind="TTFT budget cannot be met")
        if is_saturated and ticket.priority < 0:
            return Outcome(Verdict.REJECT, f"fleet saturated: sheddable request (priority {ticket.priority}) "
                                           "refused", retry_after_s=1.0, kind="fleet saturated")
        if not is_saturated and not any(t.priority >= ticket.priority for t in self._queued.values()):
            return Outcome(Verdict.ADMIT)
        shed = None
        if len(self._queued) >= self.max_queued:
            # Make room by dropping the least important entry: lowest band first, then the tenant
            # with the most waiting (a flood gives way to a newcomer), then the latest deadline.
            waiting = defaultdict(int)
            for queued in self._queued.values():
                waiting[queued.tenant] += 1
            victim = min(self._queued.values(),
                         key=lambda t: (t.priority, -waiting[t.tenant], -t.due_at, -t.arrived_at))
            outranks = victim.priority < ticket.priority or (
                victim.priority == ticket.priority and waiting[victim.tenant] > waiting[ticket.tenant] + 1)
            if not outranks:
                return Outcome(Verdict.REJECT, f"admission queue full ({self.max_queued} waiting)",
                               retry_after_s=1.0, kind="admission queue full")
            del self._queued[victim.request_id]
            shed = victim
        self._queued[ticket.request_id] = ticket
        return Outcome(Verdict.QUEUE, shed=shed, reason="shed for a more important request" if shed else "")

    def _wait_ahead_s(self, ticket: Ticket, predicted_ttft_s: float) -> float:
        """A rough wait behind the queued requests that would go first (each about as long as this one)."""
        ahead = sum(1 for t in self._queued.values() if t.priority > ticket.priority
                    or (t.priority == ticket.priority and t.due_at <= ticket.due_at))
        return ahead * predicted_ttft_s

    def pop_next(self, now: float) -> Ticket | None:
        """The queued ticket to dispatch now, if any."""
        if not self._queued:
            return None
        band = max(t.priority for t in self._queued.values())
        in_band = [t for t in self._queued.values() if t.priority == band]

        def share(tenant: str) -> float:
            state = self._tenants[tenant]
            state.expire(now)
            return state.served_tokens / self.limits(tenant).weight

        tenants = sorted({t.tenant for t in in_band})
        if self._fair_share == "round_robin":  # the next tenant after the one served last in this band
            last = self._last_served.get(band)
            tenant = next((name for name in tenants if last is None or name > last), tenants[0])
        else:
            tenant = min(tenants, key=lambda name: (share(name), name))
        self._last_served[band] = tenant
        ticket = min((t for t in in_band if t.tenant == tenant),
                     key=_dispatch_order)
        del self._queued[ticket.request_id]
        return ticket

    def expired(self, now: float) -> list[Ticket]:
        """Queued tickets whose TTFT budget or deadline (deadline_ms) has passed: they are refused, not served late. (A
        deadline_ms is timed from the router, which ends the request at it and so cancels its Place first; this
        drops one whose cancellation never comes, its router frozen, which was dispatched with no one to stream to.)"""
        late = [t for t in self._queued.values() if t.due_at < now]
        for ticket in late:
            del self._queued[ticket.request_id]
        return late

    def cancel(self, request_id: str) -> bool:
        return self._queued.pop(request_id, None) is not None

    def on_admitted(self, ticket: Ticket, now: float) -> None:
        """The ticket takes a slot of its tenant's, leased for lease_s (renewed if it holds one already)."""
        hold = self._held.get(ticket.request_id)
        if hold is not None:
            hold.expires_at = max(hold.expires_at, now + self.lease_s)
            hold.claim(ticket.holder, now, placed=True)
            # The newest call keeps it: the first call's waiter, run after its resend was admitted, or its late
            # second try, does not take it back (helper-132).
            hold.attempt = max(hold.attempt, ticket.attempt)
            hold.spent |= ticket.resumed
            return
        tenant = self._tenants[ticket.tenant]
        tenant.in_flight += 1
        tenant.admitted[ticket.request_id] = now
        tenant.served.append((now, ticket.num_tokens))
        tenant.served_tokens += ticket.num_tokens
        self._held[ticket.request_id] = hold = _Hold(ticket.tenant, now + self.lease_s, ticket.prompt_digest,
                                                     charged=(now, ticket.num_tokens), attempt=ticket.attempt,
                                                     spent=ticket.resumed)
        hold.claim(ticket.holder, now, placed=True)

    def on_placed(self, request_id: str) -> None:
        """A node was chosen for request_id (and was warm or loaded it): it may run, so its tokens are never given
        back."""
        hold = self._held.get(request_id)
        if hold is not None:
            hold.spent = True

    def renew(self, request_ids: Sequence[str], now: float, holder: str = "", tenants: Sequence[str] = (),
              prompt_digests: Sequence[int] = ()) -> int:
        """Those of request_ids holding a slot are alive (through holder, the router that says so): their leases
        run lease_s from now. How many. Not from a router that has ended its stream of one (a report under way as
        it did).

        tenants (one to an id, "" for an id no node has taken yet): an id a node runs that holds no slot here, of a
        tenant with a concurrency limit, is given one (adopt): it runs, whatever this leader knew of it. A leader
        that took over within a second of its admission, or from a state older than a lease, held none, and its
        tenant ran its whole max_concurrency again beside it (live: nine more, one at a time, helper-134).
        prompt_digests (one to an id, 0: not said): the prompt an adopted slot, or one held without a digest (admitted
        through an older router, or from an older state), holds its id to."""
        renewed = 0
        for i, request_id in enumerate(request_ids):
            hold = self._held.get(request_id)
            digest = prompt_digests[i] if prompt_digests else 0
            if hold is None and tenants and tenants[i]:
                hold = self._adopt(request_id, tenants[i], now, digest)
            if hold is not None and holder not in hold.ended:
                hold.expires_at = max(hold.expires_at, now + self.lease_s)
                hold.claim(holder, now)
                if not hold.prompt_digest and tenants and tenants[i]:  # admitted through an older router, say
                    hold.prompt_digest = digest
                renewed += 1
        return renewed

    def _adopt(self, request_id: str, tenant_name: str, now: float, prompt_digest: int = 0) -> _Hold | None:
        """A slot for request_id, which a router says a node runs, if its tenant has a concurrency limit; None if
        not, or if the id waits in the queue (its slot comes with its dispatch), or its end was reported within a
        lease (the report was under way as it ended: adopted, its slot was held a lease after it ended). Its tokens
        are not charged: their charge, if any, was another leader's."""
        if (self.limits(tenant_name).max_concurrency is None or request_id in self._queued
                or now - self._ended_at.get(request_id, -math.inf) < self.lease_s):
            return None
        tenant = self._tenants[tenant_name]
        tenant.in_flight += 1
        tenant.admitted[request_id] = now
        self._held[request_id] = hold = _Hold(tenant_name, now + self.lease_s, prompt_digest, spent=True)
        return hold

    def end(self, request_id: str, now: float, holder: str = "", another_stream_live: bool = False,
            ran: bool = True, attempt: int = 0) -> bool:
        """A stream of request_id ended through holder (its router; "": not said). Its slot is freed unless another
        stream of the id is said to run (another_stream_live) or another router placed or reported the id live
        within the lease and since holder first did: then it is left to those (leave_to_others). (A router whose
        last word came before holder's first, one that died and whose client resumed through holder, holds
        nothing.) True if the slot was freed.

        attempt: the Place call (Ticket.attempt) that admitted it ended without placing it (its model's load
        failed, its caller went away, leadership was lost; ran is then False). If a later call of its id was
        admitted on the slot since (its router sent it again after a leader change, and this replica was elected
        again), the slot is that call's and nothing changes: freed and refunded, the id ran on unheld, its tokens
        uncounted (helper-130, helper-132). Else, not ran, its tokens are given back too, unless a call placed it
        (it may have run) or it came as a resume (its charge stands for its earlier stream)."""
        hold = self._held.get(request_id)
        if hold is None and ran:  # (on a successor that holds none, helper-135)
            self._note_end(request_id, now)
        if hold is None or (attempt and hold.attempt != attempt):
            return False
        since, _ = hold.holders.pop(holder, (-math.inf, -math.inf))
        if another_stream_live or any(last > since and now - last < self.lease_s for _, last in hold.holders.values()):
            if holder and not another_stream_live:  # (with another stream said to run, it may run through holder)
                hold.ended.add(holder)
            self.leave_to_others(request_id, now)
            return False
        state = self._tenants.get(hold.tenant)
        admitted_at = state.admitted.get(request_id) if state is not None else None
        if admitted_at is not None and ran:  # an end reported, not a lease run out: how long a slot is held
            held = now - admitted_at
            state.held_s = held if state.held_s is None else state.held_s + SLOT_SMOOTHING * (held - state.held_s)
        self._note_end(request_id, now)
        return self.release(request_id, refund=not ran and not hold.spent)

    def _note_end(self, request_id: str, now: float) -> None:
        """request_id's end is known: a live report sent before it, arriving after, gives it no slot (_adopt)."""
        self._ended_at.pop(request_id, None)  # (kept in order of their ends)
        self._ended_at[request_id] = now

    def router_seen(self, router_id: str, incarnation: int, now: float) -> list[str]:
        """A call from the router process incarnation under router_id (0: not said). Seen first while another process
        of that id was known, it may be a new process in a dead one's place (a crash and restart), whose streams
        ended with it (their node streams closed with its connections): its claims go, and each slot no other router
        holds is kept only a short grace (a third of the lease, at most ROUTER_GONE_GRACE_S) unless a resume or a
        live report takes it back. Kept the whole lease, a tenant at its concurrency limit was refused for 15 s
        (helper-167); freed at once, a resume of the dead process's stream through the new one was a new request,
        charged again and shed under load (helper-170). The numbers are random, so which process is the newer is not
        known: a live one whose slots another shortened (a restart overlapping its drain, two routers under one id, a
        leader that heard them in another order) renews them with its next report. The ids whose slots it
        shortened."""
        if not router_id or not incarnation:
            return []
        seen = self._incarnations.setdefault(router_id, {})
        replaced = bool(seen) and incarnation not in seen
        seen.pop(incarnation, None)
        seen[incarnation] = now  # (the latest heard last)
        while len(seen) > _INCARNATIONS_KEPT:
            del seen[next(iter(seen))]
        if not replaced:
            return []
        shortened = []
        grace_at = now + min(self.lease_s / 3, ROUTER_GONE_GRACE_S)
        for request_id, hold in self._held.items():
            if (hold.holders.pop(router_id, None) is not None and hold.expires_at > grace_at
                    and not hold.held_elsewhere(router_id, now, self.lease_s, self._is_registered)):
                hold.expires_at = grace_at
                shortened.append(request_id)
        return shortened

    def leave_to_others(self, request_id: str, now: float) -> None:
        """A stream of request_id ended while another of its id is said to run: the slot stays held, but only for a
        third of the lease unless a router reports the id live again (the other stream's router does; a slot that
        only seemed shared, its other stream gone just before, is freed then, not a whole lease later)."""
        hold = self._held.get(request_id)
        if hold is not None:
            hold.expires_at = min(hold.expires_at, now + self.lease_s / 3)

    def release(self, request_id: str, refund: bool = False) -> bool:
        """The request ended: its slot is free. False if it held none (already released, or expired). refund: it
        never ran, and the tokens admitting it charged its tenant are given back (kept, a tenant with a token limit
        was refused for a minute after a leader's stall or a node dying mid-load, for tokens it never used:
        helper-128)."""
        hold = self._held.pop(request_id, None)
        if hold is None:
            return False
        state = self._tenants.get(hold.tenant)
        if state is not None:
            state.in_flight = max(0, state.in_flight - 1)
            state.admitted.pop(request_id, None)
            if refund and hold.charged in state.served:
                state.served.remove(hold.charged)
                state.served_tokens -= hold.charged[1]
        return True

    def expire_holds(self, now: float) -> list[str]:
        """Free the slots whose lease ran out (their end was never reported); drop idle tenants' state.

        Returns the requests whose slots were freed.
        """
        lapsed = [request_id for request_id, hold in self._held.items() if hold.expires_at <= now]
        for request_id in lapsed:
            self.release(request_id)
        while self._ended_at and next(iter(self._ended_at.values())) <= now - self.lease_s:
            self._ended_at.pop(next(iter(self._ended_at)))
        if now - self._pruned_at >= _PRUNE_EVERY_S:
            self._pruned_at = now
            self.prune(now)
            for router_id, seen in list(self._incarnations.items()):  # (a Deployment's pods have names of their own)
                if next(reversed(seen.values())) <= now - self.lease_s:  # (the latest heard last)
                    del self._incarnations[router_id]
        return lapsed

    def to_state(self, now: float, max_bytes: int) -> dict[str, Any]:
        """What a successor needs to hold tenants to their limits across a failover (JSON, about max_bytes at most):
        for tenants with a concurrency limit, the ids holding their slots, newest first, each with its age, its
        prompt's digest and its routers (with how long ago each first and last placed or reported it), within half
        of max_bytes; then, for tenants with a token limit, the tokens charged within the minute, per
        TOKEN_STATE_S of age, within the rest. Without them a new leader started from nothing: each tenant could run
        its whole max_concurrency again beside its running requests, and a whole minute's tokens again. Bounded in
        bytes: the state is one etcd value, rewritten every second (etcd refuses one over 1.5 MiB, and keeps
        thousands of past writes in memory, helper-133). "left_out": the slots and tenants' windows that did not
        fit."""
        room, left_out = max_bytes // 2, 0
        slots: dict[str, list[list[Any]]] = defaultdict(list)
        limited = [(state.admitted.get(request_id, now), request_id, hold) for request_id, hold in self._held.items()
                   if self.limits(hold.tenant).max_concurrency is not None
                   and (state := self._tenants.get(hold.tenant)) is not None]
        # No more than fit: each entry takes over _MIN_SLOT_BYTES (encoding every hold, every second, took 49 ms of
        # the event loop's second with 10,000 held, helper-137).
        held = heapq.nlargest(room // _MIN_SLOT_BYTES, limited, key=lambda h: h[:2])
        left_out += len(limited) - len(held)
        for admitted_at, request_id, hold in held:
            entry = [request_id, round(now - admitted_at, 1), hold.prompt_digest,
                     [[router, round(now - since, 1), round(now - last, 1)]
                      for router, (since, last) in sorted(hold.holders.items()) if router not in hold.ended]]
            size = len(json.dumps(entry)) + 2 + (0 if hold.tenant in slots else len(json.dumps(hold.tenant)) + 4)
            if size > room:
                left_out += 1
                continue
            room -= size
            slots[hold.tenant].append(entry)
        room += max_bytes - max_bytes // 2
        served: dict[str, list[list[int]]] = {}
        for name, state in self._tenants.items():
            if self.limits(name).tokens_per_minute is None:
                continue
            state.expire(now)
            by_age: dict[int, int] = defaultdict(int)
            for at, tokens in state.served:  # (counted a little younger: held no shorter)
                by_age[math.floor((now - at) / TOKEN_STATE_S) * TOKEN_STATE_S] += tokens
            entries = [[age, tokens] for age, tokens in sorted(by_age.items())]
            size = len(json.dumps({name: entries}))
            if size > room:
                left_out += 1
                continue
            room -= size
            served[name] = entries
        return {"slots": slots, "served": served, "left_out": left_out}

    def restore(self, state: dict[str, Any], now: float, gap_s: float | None) -> int:
        """Take over a predecessor's to_state, written gap_s ago (by the wall clocks; the time no replica led; None:
        not known): its tenants' tokens of the minute, aged by the gap, and its slots, each leased lease_s from now
        (the routers running them renew them; one that ended while no leader heard is freed then). A state older than
        a lease, or of unknown age, gives no slots: each would have lapsed by now unless renewed, and which were
        cannot be known (a state hours old, left by a control plane that stopped, held tenants at their limits for a
        lease, helper-133). What this replica held itself, from an earlier term, is dropped; its queue is kept. The
        slots' tokens are never given back (they may have run). How many slots it took; ValueError if state is not
        a to_state's (nothing is changed then)."""
        tenants: defaultdict[str, _Tenant] = defaultdict(_Tenant)
        held: dict[str, _Hold] = {}
        gap = max(0.0, gap_s or 0.0)
        try:
            for name, entries in state.get("served", {}).items():
                tenant = tenants[str(name)]
                for age, tokens in sorted(((float(a) + gap, int(t)) for a, t in entries), reverse=True):
                    if age < WINDOW_S:  # oldest first
                        tenant.served.append((now - age, tokens))
                        tenant.served_tokens += tokens
            slots = state.get("slots", {}) if gap_s is not None and gap <= self.lease_s else {}
            for name, entries in slots.items():
                tenant = tenants[str(name)]
                for request_id, age, *more in sorted(entries, key=lambda entry: -float(entry[1])):
                    digest, holders = more[:2] if more else (0, [])
                    tenant.in_flight += 1  # (oldest first; [id, age] alone: a state of the version before)
                    tenant.admitted[str(request_id)] = now - float(age) - gap
                    hold = _Hold(str(name), now + self.lease_s, int(digest), spent=True)
                    for router, since, last in holders:
                        hold.holders[str(router)] = (now - float(since) - gap, now - float(last) - gap)
                    held[str(request_id)] = hold
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"admission state: {exc!r}") from None
        self._tenants, self._held = tenants, held
        self._incarnations = {}  # (heard in an earlier term: a process seen since through another leader is no newer)
        return len(held)

    def prune(self, now: float) -> int:
        """Drop the state of tenants with nothing in flight, queued or served within the window. How many."""
        waiting = {t.tenant for t in self._queued.values()}
        idle = [name for name, state in self._tenants.items() if name not in waiting and state.is_idle(now)]
        for name in idle:
            del self._tenants[name]
        return len(idle)


def _duplicate(ticket: Ticket, why: str) -> Outcome:
    """The refusal of ticket as a duplicate of its id's queued or running request (ALREADY_EXISTS)."""
    return Outcome(Verdict.REJECT, f"request_id={ticket.request_id!r}: {why}", kind="request id in use", duplicate=True)


def _other_prompt(ticket: Ticket, digest: int) -> bool:
    """Whether ticket, a resend of an id, has another prompt (or cache salt) than the digest its id was admitted or
    queued with (unknown when either was not said)."""
    return bool(digest and ticket.prompt_digest and ticket.prompt_digest != digest)


def pool_saturation(loads: list[tuple[int, int, int]]) -> float:
    """llm-d's saturation of a pool: mean over nodes of max(waiting / 5, KV used / (0.8 · KV total)).

    loads: (num_waiting, kv_blocks_used, kv_blocks_total) per node. 1.0 or more is saturated.
    """
    if not loads:
        return math.inf
    per_node = [max(waiting / 5.0, (used / (0.8 * total)) if total else 1.0) for waiting, used, total in loads]
    return sum(per_node) / len(per_node)
