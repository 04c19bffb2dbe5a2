"""The admission gate's queue: a request waits while the fleet is saturated and goes when it frees; one
whose deadline passes while it waits is refused, not served late; a client that leaves frees its place;
a full queue sheds its least important entry for a more important one. Time is a fake clock; each test
steps the event loop only as far as the gate's own awaits."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
from opentelemetry.metrics import get_meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.errors import Aborted, AlreadyExists, InvalidArgument, ResourceExhausted
from services.scheduler.admission import Admission, TenantLimits, Ticket
from services.scheduler.gate import AdmissionGate

pytestmark = pytest.mark.timeout(20)


class Fleet:
    """A fake clock and a saturation switch."""

    def __init__(self) -> None:
        self.now = 100.0
        self.saturated = True

    def clock(self) -> float:
        return self.now

    def is_saturated(self) -> bool:
        return self.saturated


def ticket(rid: str, at: float, priority: int = 0, deadline_at: float = math.inf) -> Ticket:
    return Ticket(request_id=rid, tenant="t", priority=priority, num_tokens=100, arrived_at=at,
                  deadline_at=deadline_at)


async def queued(gate: AdmissionGate, admission: Admission, t: Ticket) -> asyncio.Task[bool]:
    """enter(t) as a task, run until it waits in the queue (its first await)."""
    before = admission.num_queued
    entering = asyncio.create_task(gate.enter(t, 0.1))
    await asyncio.sleep(0)  # one turn of the loop: enter runs to its first await, or returns
    assert not entering.done() and admission.num_queued == before + 1
    return entering


@pytest.fixture
async def gate_and_fleet():
    fleet, admission = Fleet(), Admission(max_queued=1)
    gate = AdmissionGate(admission, fleet.is_saturated, get_meter("test"), clock=fleet.clock)
    dispatcher = asyncio.create_task(gate.run())
    yield gate, admission, fleet
    dispatcher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dispatcher


async def test_a_request_waits_while_the_fleet_is_saturated_and_goes_when_it_frees(gate_and_fleet) -> None:
    gate, admission, fleet = gate_and_fleet
    entering = await queued(gate, admission, ticket("q", fleet.now))
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(entering, 5) is True  # it waited, then was admitted
    assert admission.num_queued == 0 and admission.num_held == 1


@pytest.mark.parametrize("which", ["ttft_budget_ms", "deadline_ms"])
async def test_a_request_whose_deadline_passes_in_the_queue_is_refused_not_served_late(gate_and_fleet,
                                                                                      which: str) -> None:
    """Either of its deadlines. (A deadline_ms passes at the router first, which cancels the Place; one whose
    cancellation never came, its router frozen, was dispatched with no one to stream to.)"""
    gate, admission, fleet = gate_and_fleet
    late = ticket("late", fleet.now)
    late = dataclasses.replace(late, **{"deadline_at" if which == "ttft_budget_ms" else "ends_by": fleet.now + 1.0})
    entering = await queued(gate, admission, late)
    fleet.now += 2.0
    gate.capacity_changed()
    with pytest.raises(ResourceExhausted, match=rf"its .*\({which}\) passed while it waited for admission"):
        await asyncio.wait_for(entering, 5)
    assert admission.num_queued == 0 and admission.num_held == 0


async def test_a_client_that_leaves_the_queue_frees_its_place(gate_and_fleet) -> None:
    gate, admission, fleet = gate_and_fleet
    entering = await queued(gate, admission, ticket("gone", fleet.now))
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering
    assert admission.num_queued == 0
    # The queue (of one) has room again: the next request queues instead of being refused as full.
    following = await queued(gate, admission, ticket("next", fleet.now))
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(following, 5) is True


async def test_a_full_queue_sheds_its_least_important_entry_for_a_more_important_one(gate_and_fleet) -> None:
    gate, admission, fleet = gate_and_fleet
    low = await queued(gate, admission, ticket("low", fleet.now, priority=0))
    high = asyncio.create_task(gate.enter(ticket("high", fleet.now, priority=1), 0.1))
    with pytest.raises(ResourceExhausted, match="request low: shed for a more important request"):
        await asyncio.wait_for(low, 5)
    assert not high.done() and admission.num_queued == 1
    with pytest.raises(ResourceExhausted, match="queue full"):  # one of the same band does not shed it
        await gate.enter(ticket("peer", fleet.now, priority=1), 0.1)
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(high, 5) is True


async def test_a_cancelled_dispatcher_stops_even_just_after_a_request_queued() -> None:
    """The dispatcher waits on a change that a request it queues has just signalled; cancelled then,
    it used to go on running (Python 3.11's wait_for returned the wait's result and dropped the
    cancellation), so a scheduler closing its gate could wait for it for ever."""
    fleet, admission = Fleet(), Admission()
    gate = AdmissionGate(admission, fleet.is_saturated, get_meter("test"), clock=fleet.clock)
    dispatcher = asyncio.create_task(gate.run())
    await asyncio.sleep(0)  # one turn: the dispatcher runs to its wait for a change
    entering = await queued(gate, admission, ticket("q", fleet.now))  # signals a change
    dispatcher.cancel()
    done, _ = await asyncio.wait({dispatcher}, timeout=5)
    assert dispatcher in done and dispatcher.cancelled()
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering


async def test_a_request_cancelled_as_its_place_comes_does_not_hold_up_the_next(gate_and_fleet) -> None:
    """The dispatcher hands a queued request its place and waits for it to be placed; a client that
    leaves in that same turn is never placed, so the dispatcher must not wait for it (it stalled a
    second, dispatching nothing, before the fix)."""
    gate, admission, fleet = gate_and_fleet
    admission.max_queued = 2
    leaving = await queued(gate, admission, ticket("leaving", fleet.now))
    staying = await queued(gate, admission, ticket("staying", fleet.now))
    fleet.saturated = False
    gate.capacity_changed()
    await asyncio.sleep(0)  # one turn: the dispatcher hands "leaving" its place
    assert admission.num_queued == 1
    leaving.cancel()  # in the same turn, before "leaving" runs again
    with pytest.raises(asyncio.CancelledError):
        await leaving
    for _ in range(10):  # a few turns of the loop, no time: the dispatcher goes on to the next
        if staying.done():
            break
        await asyncio.sleep(0)
    assert staying.done() and staying.result() is True
    assert admission.num_held == 1  # the slot "leaving" was handed with its place is free again, and its tokens
    assert admission._tenants["t"].served_tokens == 100  # (those of "staying" alone)


async def test_queued_requests_a_lowered_limit_leaves_out_are_refused_not_dispatched_past_it(gate_and_fleet) -> None:
    """An operator lowered a tenant's limits while its requests waited on a saturated fleet: all of them were
    dispatched, past the new limit (nothing checks the limits at dispatch). Those the first to go leave out are
    refused as a new request would be."""
    gate, admission, fleet = gate_and_fleet
    admission.max_queued = 3
    admission.set_limits({"t": TenantLimits(max_concurrency=3)})
    waiting = [await queued(gate, admission, ticket(f"q{n}", fleet.now + n)) for n in range(3)]
    admission.set_limits({"t": TenantLimits(max_concurrency=1)})
    gate.limits_changed()
    for refused in waiting[1:]:
        with pytest.raises(ResourceExhausted, match="tenant's limits were lowered while it waited for admission: "
                                                    "tenant 't' is at its concurrency limit of 1"):
            await asyncio.wait_for(refused, 5)
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(waiting[0], 5) is True and admission.in_flight("t") == 1


def _call(attempt: int, at: float) -> Ticket:
    """Place call number attempt of request r1 through router-0 (its router sends it again after a leader change)."""
    return dataclasses.replace(ticket("r1", at), holder="router-0", attempt=attempt)


@pytest.mark.parametrize("then", ["cancelled", "ends unplaced"])
async def test_a_resend_admitted_as_its_first_call_is_handed_its_place_keeps_the_slot(gate_and_fleet,
                                                                                    then: str) -> None:
    """The dispatcher hands the first call its place; before that call's waiter runs, its router's resend is
    admitted on the same slot. The first call, abandoned, is then cancelled (its slot was freed and refunded while
    the resend ran) or its waiter runs and it ends unplaced (its waiter took the slot back first, helper-132)."""
    gate, admission, fleet = gate_and_fleet
    admission.set_limits({"t": TenantLimits(tokens_per_minute=1000)})
    first = await queued(gate, admission, _call(1, fleet.now))
    fleet.saturated = False
    gate.capacity_changed()
    await asyncio.sleep(0)  # one turn: the dispatcher hands the first call its place; its waiter has not run
    assert await gate.enter(_call(2, fleet.now), 0.1) is False
    if then == "cancelled":
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    else:
        assert await first is True
        gate.finished("r1", holder="router-0", ran=False, attempt=1)
    assert admission.num_held == 1 and admission._tenants["t"].served_tokens == 100


async def test_a_request_handed_its_place_holds_its_tenants_slot_before_its_waiter_runs(gate_and_fleet) -> None:
    """Between the dispatcher handing a queued request its place and the request's own task running, it was neither
    queued nor admitted: another request of its tenant judged then was let past the tenant's limit (helper-127)."""
    gate, admission, fleet = gate_and_fleet
    admission.set_limits({"t": TenantLimits(max_concurrency=1)})
    first = await queued(gate, admission, ticket("first", fleet.now))
    fleet.saturated = False
    gate.capacity_changed()
    await asyncio.sleep(0)  # one turn: the dispatcher hands "first" its place; "first" has not run since
    assert admission.num_queued == 0 and not first.done()
    with pytest.raises(ResourceExhausted, match="concurrency limit of 1"):
        await gate.enter(ticket("second", fleet.now), 0.1)
    assert await asyncio.wait_for(first, 5) is True and admission.num_held == 1


async def test_refusals_are_counted_by_kind_with_no_tenants_limit_in_a_label() -> None:
    """The metric's reason was the message up to its first colon: for a tenant's limit the whole message, a label
    value per tenant and limit; and a queued request shed or left to its deadline was counted only as queued."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    fleet = Fleet()
    admission = Admission(max_queued=1, limits={"acme": TenantLimits(max_concurrency=0)})
    gate = AdmissionGate(admission, fleet.is_saturated, meter, clock=fleet.clock)
    dispatcher = asyncio.create_task(gate.run())
    try:
        with pytest.raises(ResourceExhausted, match="'acme' is at its concurrency limit of 0"):
            await gate.enter(Ticket(request_id="a", tenant="acme", priority=0, num_tokens=10, arrived_at=fleet.now,
                                    deadline_at=math.inf), 0.1)
        low = await queued(gate, admission, ticket("low", fleet.now, priority=0))
        late = asyncio.create_task(gate.enter(ticket("late", fleet.now, priority=1, deadline_at=fleet.now + 1), 0.1))
        with pytest.raises(ResourceExhausted, match="shed"):
            await asyncio.wait_for(low, 5)
        fleet.now += 2.0
        gate.capacity_changed()
        with pytest.raises(ResourceExhausted, match="passed while it waited for admission"):
            await asyncio.wait_for(late, 5)
    finally:
        dispatcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dispatcher
    metrics = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
    points = next(m for m in metrics if m.name == "baton.scheduler.admissions").data.data_points
    refused = {tuple(sorted(p.attributes.items())): p.value for p in points if p.attributes["verdict"] == "reject"}
    assert refused == {
        (("band", "0"), ("reason", "tenant concurrency limit"), ("tenant", "acme"), ("verdict", "reject")): 1,
        (("band", "0"), ("reason", "shed for a more important request"), ("verdict", "reject")): 1,
        (("band", "1"), ("reason", "deadline passed in queue"), ("verdict", "reject")): 1,
    }


def _points(reader: InMemoryMetricReader, name: str) -> list:
    metrics = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
    return next(m for m in metrics if m.name == name).data.data_points


async def test_a_clients_priority_labels_its_band_only_within_ten_either_way() -> None:
    """band was the raw priority, any int32 a client sends: a live probe's six priorities (1000 to 1003, -5,
    2**31 - 1) made six series of each admission metric; past +-10 a band is labelled by its side only."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    fleet = Fleet()
    fleet.saturated = False
    admission = Admission()
    gate = AdmissionGate(admission, fleet.is_saturated, meter, clock=fleet.clock)
    for i, priority in enumerate((1000, 1001, 1002, 1003, -5, 2**31 - 1, 10, -10, -11, -2**31)):
        assert await gate.enter(ticket(f"admitted-{i}", fleet.now, priority=priority), 0.1) is False
    gate.refused("deadline cannot be met", 12345)
    fleet.saturated = True
    dispatcher = asyncio.create_task(gate.run())
    try:
        waiting = [await queued(gate, admission, ticket(f"queued-{p}", fleet.now, priority=p)) for p in (500, 501)]
        fleet.saturated = False
        gate.capacity_changed()
        assert await asyncio.wait_for(asyncio.gather(*waiting), 5) == [True, True]
    finally:
        dispatcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dispatcher
    admitted = {p.attributes["band"]: p.value for p in _points(reader, "baton.scheduler.admissions")
                if p.attributes["verdict"] == "admit"}
    assert admitted == {">10": 5, "-5": 1, "10": 1, "-10": 1, "<-10": 2}
    assert {p.attributes["band"] for p in _points(reader, "baton.scheduler.admissions")
            if p.attributes["verdict"] != "admit"} == {">10"}  # queued twice, refused once
    assert {p.attributes["band"]: p.value for p in _points(reader, "baton.scheduler.queue_depth")} == {">10": 0}
    assert [(p.attributes["band"], p.count) for p in _points(reader, "baton.scheduler.queue_wait")] == [(">10", 2)]


async def test_a_request_larger_than_its_tenants_whole_minute_is_bad_input_not_a_wait() -> None:
    """Refused with a retry hint, the openai client waited about 115 s over two retries that could never fit."""
    fleet = Fleet()
    admission = Admission(limits={"small": TenantLimits(tokens_per_minute=100)})
    gate = AdmissionGate(admission, fleet.is_saturated, get_meter("test"), clock=fleet.clock)
    fleet.saturated = False
    big = Ticket(request_id="big", tenant="small", priority=0, num_tokens=205, arrived_at=fleet.now, max_tokens=200)
    with pytest.raises(InvalidArgument, match=r"max_tokens=200: with its prompt, 205 tokens, more than the whole "
                                              r"limit of tenant 'small', 100 tokens per minute"):
        await gate.enter(big, 0.1)
    fits = Ticket(request_id="fits", tenant="small", priority=0, num_tokens=100, arrived_at=fleet.now, max_tokens=95)
    assert await gate.enter(fits, 0.1) is False  # admitted at once
    with pytest.raises(ResourceExhausted, match="over its limit of 100 tokens per minute"):  # this one must wait
        await gate.enter(dataclasses.replace(fits, request_id="next"), 0.1)


async def test_a_duplicate_of_a_queued_request_is_refused_already_exists_and_the_first_still_goes(
        gate_and_fleet) -> None:
    """The duplicate took the first's place in the queue: the first's caller waited for a dispatch that never came."""
    gate, admission, fleet = gate_and_fleet
    first = await queued(gate, admission, ticket("same", fleet.now))
    with pytest.raises(AlreadyExists, match="'same': is already waiting for admission"):
        await gate.enter(ticket("same", fleet.now), 0.1)
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(first, 5) is True


async def test_a_resend_takes_its_queued_asks_place_and_the_first_ask_ends_aborted(gate_and_fleet) -> None:
    """Its first router froze while it waited; its client resent it through another router. The first ask ends
    ABORTED and the resend is dispatched."""
    gate, admission, fleet = gate_and_fleet
    first = await queued(gate, admission, ticket("same", fleet.now))
    resend = asyncio.create_task(gate.enter(dataclasses.replace(ticket("same", fleet.now), resumed=True), 0.1))
    with pytest.raises(Aborted, match=r"'same': it was sent again \(by its client, through another router"):
        await asyncio.wait_for(first, 5)
    assert not resend.done() and admission.num_queued == 1
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(resend, 5) is True


async def test_a_first_ask_cancelled_as_its_resend_takes_its_place_leaves_the_resend_queued(gate_and_fleet) -> None:
    """The first ask's call is cancelled (its frozen router's deadline) in the same turn as its resend takes its
    place: its cleanup took the resend's entry out of the queue, and the resend waited for a dispatch that never
    came."""
    gate, admission, fleet = gate_and_fleet
    first = await queued(gate, admission, ticket("same", fleet.now))
    resend = asyncio.create_task(gate.enter(dataclasses.replace(ticket("same", fleet.now), resumed=True), 0.1))
    await asyncio.sleep(0)  # the resend runs to its wait; the first ask's wake-up is due, not yet run
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert admission.num_queued == 1
    fleet.saturated = False
    gate.capacity_changed()
    assert await asyncio.wait_for(resend, 5) is True
