"""The leader's admission gate: Place calls wait here while the fleet is saturated."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence

from opentelemetry.metrics import Meter

from services.common.change_signal import ChangeSignal, wait_or_timeout
from services.common.errors import Aborted, AlreadyExists, BatonError, InvalidArgument, ResourceExhausted
from services.common.telemetry import MAX_LABEL_VALUES, BoundedLabel
from services.scheduler.admission import ROUTER_GONE_GRACE_S, Admission, Outcome, Ticket, Verdict

log = logging.getLogger(__name__)

# How often queued deadlines are checked even when nothing else happens.
_TICK_S = 0.05
# Longest time between sweeps for admitted requests whose lease ran out.
_SWEEP_S = 1.0
# Admission takes every int32 priority as a band of its own, but its metrics label by value only the priorities
# from -10 to 10 (beyond them ">10" or "<-10"): a label per priority would let any client add series at will.
MAX_LABELLED_BAND = 10


def band_label(priority: int) -> str:
    """The `band` label of a priority: the priority itself within +-MAX_LABELLED_BAND, else which side it is."""
    if priority > MAX_LABELLED_BAND:
        return f">{MAX_LABELLED_BAND}"
    if priority < -MAX_LABELLED_BAND:
        return f"<-{MAX_LABELLED_BAND}"
    return str(priority)


def _refusal(ticket: Ticket, outcome: Outcome, message: str) -> BatonError:
    """The error refusing ticket for outcome, told as message: bad input if no wait would let it in (a 429 with a
    retry hint would send it again in vain), a duplicate, or a wait with outcome's retry hint."""
    if outcome.never:
        return InvalidArgument("max_tokens", ticket.max_tokens, message)
    if outcome.duplicate:
        return AlreadyExists(message)
    # Rounded up: a hint a millisecond early is a retry in vain (helper-159).
    return ResourceExhausted(message, retry_after_ms=math.ceil(round(outcome.retry_after_s * 1000, 6)))


class AdmissionGate:
    """Admits, queues or refuses each new request; dispatches the queue as capacity frees."""

    def __init__(self, admission: Admission, is_saturated: Callable[[], bool], meter: Meter,
                 clock: Callable[[], float] = time.monotonic, max_tenant_labels: int = MAX_LABEL_VALUES,
                 is_leading: Callable[[], bool] = lambda: True) -> None:
        self._admission = admission
        # Whether this replica leads: the routers report their requests' ends and lives to the leader alone.
        self._is_leading = is_leading
        self._is_saturated = is_saturated
        self._clock = clock
        self._waiting: dict[str, asyncio.Future[asyncio.Event]] = {}
        self._capacity = ChangeSignal()
        self._swept_at = -math.inf
        # A Place names any tenant its caller likes (a router without --auth passes its client's on).
        self._tenant = BoundedLabel(max_tenant_labels)
        self._decisions = meter.create_counter("baton.scheduler.admissions",
                                               description="admission verdicts, by verdict, reason and band")
        self._queue_wait = meter.create_histogram("baton.scheduler.queue_wait", unit="ms",
                                                  description="time requests waited for admission, by band and tenant")
        self._depth = meter.create_up_down_counter("baton.scheduler.queue_depth",
                                                   description="requests waiting for admission, by band")
        self._lapsed = meter.create_counter("baton.scheduler.admission_leases_lapsed",
                                            description="concurrency slots freed because their lease ran out "
                                                        "(the request's end was never reported)")

    def capacity_changed(self) -> None:
        self._capacity.notify()

    def refused(self, reason: str, priority: int) -> None:
        """Count a request the placement core refused before it reached the gate (a deadline no node could meet,
        or none on the fleet as it is), as the gate counts its own refusals."""
        self._decisions.add(1, {"verdict": "reject", "reason": reason, "band": band_label(priority)})

    async def enter(self, ticket: Ticket, predicted_ttft_s: float) -> bool:
        """Return once ticket is admitted (True if it had to wait); ResourceExhausted if refused.

        A caller that waited must place the request before its next await: the dispatcher looks
        at saturation again as soon as it runs, and the placement must count by then.
        """
        outcome = self._admission.offer(ticket, self._clock(), self._is_saturated(), predicted_ttft_s)
        band = {"band": band_label(ticket.priority)}
        if outcome.shed is not None:
            self._refuse_queued(outcome.shed, outcome.reason, "shed for a more important request")
        if outcome.replaced is not None:  # its resend took its place: the first ask ends (its router frozen, say)
            self._depth.add(-1, {"band": band_label(outcome.replaced.priority)})
            first = self._waiting.pop(ticket.request_id, None)
            if first is not None and not first.done():
                first.set_exception(Aborted(f"request_id={ticket.request_id!r}: it was sent again (by its client, "
                                            "through another router, or by its router after a leader change), "
                                            "and the resend took its place in the admission queue"))
        if outcome.verdict == Verdict.REJECT:
            raise self.refuse(ticket, outcome)
        if outcome.verdict == Verdict.QUEUE:
            self._decisions.add(1, {"verdict": "queue", **band})
            self._depth.add(1, band)
            future: asyncio.Future[asyncio.Event] = asyncio.get_running_loop().create_future()
            self._waiting[ticket.request_id] = future
            self.capacity_changed()
            try:
                placed = await future
            except asyncio.CancelledError:
                # The client went away (or the router's deadline passed): leave the queue, unless its resend took
                # its place there (the queue's entry and the waiter are then the resend's).
                if self._waiting.get(ticket.request_id) is future:
                    if self._admission.cancel(ticket.request_id):
                        self._depth.add(-1, band)
                    del self._waiting[ticket.request_id]
                if future.done() and not future.cancelled() and future.exception() is None:
                    # Its place came in the same turn as the cancellation: the dispatcher waits for it
                    # to be placed; it never will be, so let the dispatcher go on (else it stalls 1 s), and the slot
                    # it was given is free again.
                    if self._admission.end(ticket.request_id, self._clock(), ticket.holder, ran=False,
                                           attempt=ticket.attempt):
                        self.capacity_changed()
                    future.result().set()
                raise
            self._queue_wait.record((self._clock() - ticket.arrived_at) * 1000,
                                    {**band, "tenant": self._tenant(ticket.tenant)})
            self._admit(ticket)
            placed.set()  # the dispatcher resumes only after our caller's next await
            return True
        self._decisions.add(1, {"verdict": "admit", **band})
        self._admit(ticket)
        return False

    def refuse(self, ticket: Ticket, outcome: Outcome) -> BatonError:
        """Count the refusal of ticket for outcome (a refusal of Admission's, here or found before the gate:
        Plan.limits_refusal); the error to raise."""
        # A tenant's limit is counted per tenant, by a label of its own (its limit is in no label).
        tenant = {"tenant": self._tenant(ticket.tenant)} if outcome.kind.startswith("tenant") else {}
        self._decisions.add(1, {"verdict": "reject", "reason": outcome.kind, "band": band_label(ticket.priority),
                                **tenant})
        return _refusal(ticket, outcome, outcome.reason)

    def _admit(self, ticket: Ticket) -> None:
        self._admission.on_admitted(ticket, self._clock())

    def router_seen(self, router_id: str, incarnation: int) -> None:
        """A call from that process of router_id: the first from a new one shortens the slots its predecessor alone
        held to a grace (Admission.router_seen); the sweep frees those nobody took back."""
        shortened = self._admission.router_seen(router_id, incarnation, self._clock())
        if shortened:
            log.info("router %s is another process now: the %d admission slots its old one alone held are kept "
                     "%.0f s at most for a resume or a live report to take back, e.g. %s", router_id, len(shortened),
                     min(self._admission.lease_s / 3, ROUTER_GONE_GRACE_S), shortened[0][:128])

    def finished(self, request_id: str, another_stream_live: bool = False, holder: str = "", ran: bool = True,
                 attempt: int = 0) -> None:
        """A request ended through holder (its router): its slot is free, unless another stream of its id is said to
        run or another router holds the id (then held as long as a router reports it live). Not ran: the Place call
        attempt admitted it but placed nothing (Admission.end)."""
        if self._admission.end(request_id, self._clock(), holder, another_stream_live, ran, attempt):
            self.capacity_changed()

    def placed(self, request_id: str) -> None:
        """request_id was placed: it may run, and its tokens stay charged."""
        self._admission.on_placed(request_id)

    def renew(self, request_ids: Sequence[str], holder: str = "", tenants: Sequence[str] = (),
              prompt_digests: Sequence[int] = ()) -> int:
        """These requests are still being served, through holder (a router): their slots' leases start again; those
        a node runs with no slot here get one (Admission.renew). How many are held."""
        return self._admission.renew(request_ids, self._clock(), holder, tenants, prompt_digests)

    def sweep(self) -> None:
        """Free the slots whose lease ran out: their requests' end was never reported."""
        self._swept_at = self._clock()
        lapsed = self._admission.expire_holds(self._swept_at)
        if lapsed and not self._is_leading():
            # A replica that led no longer hears of its slots' requests: their notices go to its successor. Counted
            # as lost notices, each failover showed its streams' every slot lost (helper-189).
            log.info("freed %d admission slots held from when this replica led", len(lapsed))
            self.capacity_changed()
        elif lapsed:
            log.warning("freed %d admission slots whose lease of %.0f s ran out (no finish notice), e.g. %s",
                        len(lapsed), self._admission.lease_s, lapsed[0][:128])
            self._lapsed.add(len(lapsed))
            self.capacity_changed()

    def limits_changed(self) -> None:
        """Tenants' limits changed: queued requests that lowered ones no longer let in are refused as a new request
        would be (dispatched, they ran past the new limits)."""
        for ticket, outcome in self._admission.refuse_over_limits(self._clock()):
            self._refuse_queued(ticket, f"its tenant's limits were lowered while it waited for admission: "
                                        f"{outcome.reason}", outcome.kind, outcome)

    def _refuse_queued(self, ticket: Ticket, reason: str, kind: str, outcome: Outcome | None = None) -> None:
        """Refuse a queued request (counted as queued when it came, and now as refused); with outcome, its retry hint
        and whether any wait could help are outcome's (else a second)."""
        band = band_label(ticket.priority)
        self._depth.add(-1, {"band": band})
        tenant = {"tenant": self._tenant(ticket.tenant)} if kind.startswith("tenant") else {}
        self._decisions.add(1, {"verdict": "reject", "reason": kind, "band": band, **tenant})
        future = self._waiting.pop(ticket.request_id, None)
        if future is not None and not future.done():
            outcome = outcome or Outcome(Verdict.REJECT, retry_after_s=1.0)
            future.set_exception(_refusal(ticket, outcome, reason if outcome.never
                                          else f"request {ticket.request_id}: {reason}"))

    async def run(self) -> None:
        """Dispatch queued requests while the fleet has room; refuse those whose deadline passed."""
        while True:
            await wait_or_timeout(self._capacity.since_now(), _TICK_S)
            if self._clock() - self._swept_at >= _SWEEP_S:
                self.sweep()
            now = self._clock()
            for ticket in self._admission.expired(now):
                which = "deadline (deadline_ms)" if ticket.ends_by < now else "TTFT budget (ttft_budget_ms)"
                self._refuse_queued(ticket, f"its {which} passed while it waited for admission",
                                    "deadline passed in queue")
            while self._admission.num_queued and not self._is_saturated():
                ticket = self._admission.pop_next(self._clock())
                if ticket is None:
                    break
                self._depth.add(-1, {"band": band_label(ticket.priority)})
                future = self._waiting.pop(ticket.request_id, None)
                if future is None or future.done():
                    continue
                # It takes its slot now, not when its waiter runs: in between it was neither queued nor admitted,
                # and its tenant's limits counted one fewer (helper-127). (Its waiter's admission renews it.)
                self._admit(ticket)
                placed = asyncio.Event()
                future.set_result(placed)
                # Let its placement register before judging saturation again.
                await wait_or_timeout(placed, 1.0)
