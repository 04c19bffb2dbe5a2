"""Admission slots under a lease: a lost finish notice cannot pin a tenant at its limit; idle tenants leave no state."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import types

import grpc
import pytest
from opentelemetry.metrics import get_meter

from google.protobuf import json_format

from baton.protocol import LIVE_IDS_PER_REPORT
from baton.v1 import common_pb2, scheduler_pb2
from services.common import etcd_keys
from services.common.errors import ResourceExhausted
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.admission import ROUTER_GONE_GRACE_S, Admission, TenantLimits, Ticket, Verdict
from services.scheduler.config import SchedulerConfig
from services.scheduler.gate import AdmissionGate
from services.scheduler.servicer import SchedulerService
from services.scheduler.tasks import workflow_task
from tests.unit.leading import fake_leadership
from tests.unit.test_place_during_election import FakeContext, Refused

CAPPED = {"t": TenantLimits(max_concurrency=1)}


def ticket(rid: str, tenant: str = "t", at: float = 0.0) -> Ticket:
    return Ticket(request_id=rid, tenant=tenant, priority=0, num_tokens=100, arrived_at=at)


def admit(admission: Admission, rid: str, now: float, tenant: str = "t") -> None:
    outcome = admission.offer(ticket(rid, tenant, now), now, is_saturated=False, predicted_ttft_s=0.1)
    assert outcome.verdict == Verdict.ADMIT, outcome.reason
    admission.on_admitted(ticket(rid, tenant, now), now)


def verdict(admission: Admission, rid: str, now: float) -> Verdict:
    return admission.offer(ticket(rid, at=now), now, is_saturated=False, predicted_ttft_s=0.1).verdict


def test_a_slot_whose_end_is_never_reported_is_freed_when_its_lease_runs_out() -> None:
    admission = Admission(limits=CAPPED, lease_s=10.0)
    admit(admission, "lost", 0.0)
    assert verdict(admission, "next", 5.0) == Verdict.REJECT
    assert admission.expire_holds(9.9) == []
    assert verdict(admission, "next", 9.9) == Verdict.REJECT
    assert admission.expire_holds(10.0) == ["lost"]
    assert verdict(admission, "next", 10.0) == Verdict.ADMIT


def test_a_request_reported_live_keeps_its_slot_past_the_lease() -> None:
    admission = Admission(limits=CAPPED, lease_s=10.0)
    admit(admission, "long", 0.0)
    for now in (8.0, 16.0, 24.0):
        assert admission.renew(["long", "unknown"], now) == 1
        assert admission.expire_holds(now + 9.0) == []
    assert verdict(admission, "next", 33.0) == Verdict.REJECT
    assert admission.expire_holds(34.0) == ["long"]  # no report since 24 s


def test_a_late_notice_for_a_lapsed_slot_does_not_free_another_requests_slot() -> None:
    admission = Admission(limits=CAPPED, lease_s=10.0)
    admit(admission, "first", 0.0)
    assert admission.expire_holds(10.0) == ["first"]
    admit(admission, "second", 11.0)
    assert admission.release("first") is False  # its Finished notice, late
    assert verdict(admission, "third", 12.0) == Verdict.REJECT
    assert admission.release("second") is True
    assert admission.release("second") is False  # a repeated notice frees nothing more
    assert admission.in_flight("t") == 0
    assert verdict(admission, "third", 13.0) == Verdict.ADMIT


def test_the_same_request_sent_again_keeps_its_one_slot() -> None:
    """A client resuming through another router (the first died) sends the same request again."""
    admission = Admission(limits=CAPPED, lease_s=10.0)
    admit(admission, "r", 0.0)
    admit(admission, "r", 5.0)  # admitted on the slot it holds, though the tenant is at its limit
    assert admission.in_flight("t") == 1 and admission.num_held == 1
    assert admission.expire_holds(12.0) == []  # the second admission renewed the lease
    assert admission.release("r") and admission.in_flight("t") == 0


def test_idle_tenants_leave_no_state_behind() -> None:
    admission = Admission(lease_s=10.0)
    for i in range(1000):
        admit(admission, f"r{i}", 0.0, tenant=f"tenant-{i}")
        admission.release(f"r{i}")
    admit(admission, "busy", 0.0, tenant="busy")
    assert admission.offer(ticket("queued", "waiting", 0.0), 0.0, True, 0.1).verdict == Verdict.QUEUE
    assert admission.num_tenants == 1002
    admission.renew(["busy"], 55.0)
    admission.expire_holds(30.0)  # within the minute: their served tokens still count for fair share
    assert admission.num_tenants == 1002
    admission.expire_holds(61.0)
    # Left: the one still in flight, and the one with a request queued.
    assert admission.num_tenants == 2
    assert admission.in_flight("busy") == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_the_gate_frees_a_lapsed_slot_on_its_sweep_and_renews_live_ones() -> None:
    clock = FakeClock()
    gate = AdmissionGate(Admission(limits={"t": TenantLimits(max_concurrency=2)}, lease_s=5.0), lambda: False,
                         get_meter("test"), clock=clock)
    assert await gate.enter(ticket("lost", at=clock.now), 0.1) is False
    assert await gate.enter(ticket("live", at=clock.now), 0.1) is False
    with pytest.raises(ResourceExhausted, match="concurrency limit of 2"):
        await gate.enter(ticket("third", at=clock.now), 0.1)
    clock.now += 4.0
    assert gate.renew(["live"]) == 1
    clock.now += 1.0
    gate.sweep()  # "lost" lapsed; "live" has 4 s left
    assert await gate.enter(ticket("third", at=clock.now), 0.1) is False
    with pytest.raises(ResourceExhausted):
        await gate.enter(ticket("fourth", at=clock.now), 0.1)
    gate.finished("third")
    assert await gate.enter(ticket("fourth", at=clock.now), 0.1) is False


async def test_a_replica_that_no_longer_leads_frees_its_old_slots_without_counting_lost_notices(
        caplog: pytest.LogCaptureFixture) -> None:
    """The notices of its slots' requests go to its successor: a deposed leader counted every slot of a failover's
    streams in admission_leases_lapsed, and logged each as a lost finish notice (helper-189)."""
    clock = FakeClock()
    leading = [True]
    gate = AdmissionGate(Admission(limits={"t": TenantLimits(max_concurrency=2)}, lease_s=5.0), lambda: False,
                         get_meter("test"), clock=clock, is_leading=lambda: leading[0])
    counted: list[int] = []
    gate._lapsed = types.SimpleNamespace(add=lambda amount, *labels: counted.append(amount))
    assert await gate.enter(ticket("a", at=clock.now), 0.1) is False
    assert await gate.enter(ticket("b", at=clock.now), 0.1) is False
    leading[0] = False
    clock.now += 6.0
    gate.sweep()
    assert counted == [] and "no finish notice" not in caplog.text
    assert await gate.enter(ticket("c", at=clock.now), 0.1) is False  # freed all the same
    leading[0] = True
    clock.now += 6.0
    gate.sweep()
    assert counted == [1] and "no finish notice" in caplog.text


async def test_the_gate_sweep_drops_tenants_gone_quiet() -> None:
    clock = FakeClock()
    admission = Admission(lease_s=5.0)
    gate = AdmissionGate(admission, lambda: False, get_meter("test"), clock=clock)
    for i in range(100):
        await gate.enter(ticket(f"r{i}", tenant=f"tenant-{i}", at=clock.now), 0.1)
        gate.finished(f"r{i}")
    assert admission.num_tenants == 100
    clock.now += 61.0
    gate.sweep()
    assert admission.num_tenants == 0


async def test_a_finished_notice_with_another_stream_of_its_id_live_keeps_the_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A router tells the leader when a request id's other stream still runs there: the slot they share stays held
    until the last one's notice (released by the first, a refused duplicate let the tenant past its limit)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        admission = service._admission
        admit(admission, "r", service._clock())
        notice = scheduler_pb2.FinishedRequest(request_id="r", outcome=scheduler_pb2.REQUEST_OUTCOME_FAILED)
        await service.Finished(scheduler_pb2.FinishedRequest(request_id="r", another_stream_live=True,
                                                             outcome=scheduler_pb2.REQUEST_OUTCOME_FAILED),
                               FakeContext())  # type: ignore[arg-type]
        assert admission.num_held == 1
        await service.Finished(notice, FakeContext())  # type: ignore[arg-type]
        assert admission.num_held == 0
    finally:
        await service.close()


async def test_a_frozen_routers_notice_does_not_free_the_slot_its_clients_resume_holds_through_another_router(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Router a froze; its client resumed through router b, whose stream took the node's over. a woke to its client
    gone and told the leader its stream ended (cancelled), not knowing of b's: the slot they share was freed while b's
    stream ran, and the tenant, at --max-concurrency 1, ran one more. Each router now says who it is: the slot is
    freed when the last router holding the id ends its stream."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        admission = service._admission
        admission.set_limits(CAPPED)
        now = service._clock()
        admission.on_admitted(Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=now,
                                     holder="router-a"), now)
        # The resume through b shares the slot (a Place of the id while it is held).
        admission.on_admitted(Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=now,
                                     holder="router-b"), now)
        await service.ReportLiveRequests(scheduler_pb2.LiveRequests(router_id="router-b", request_ids=["r"]),
                                         FakeContext())  # type: ignore[arg-type]

        def ended(router: str) -> scheduler_pb2.FinishedRequest:
            return scheduler_pb2.FinishedRequest(request_id="r", router_id=router,
                                                 outcome=scheduler_pb2.REQUEST_OUTCOME_CANCELLED)

        await service.Finished(ended("router-a"), FakeContext())  # type: ignore[arg-type]
        assert admission.num_held == 1
        assert verdict(admission, "another", service._clock()) == Verdict.REJECT  # still at its limit
        await service.Finished(ended("router-b"), FakeContext())  # type: ignore[arg-type]
        assert admission.num_held == 0
    finally:
        await service.close()


@pytest.mark.parametrize("resumed", [True, False])
async def test_a_router_restarted_under_its_id_lets_its_dead_predecessors_slot_go_unless_a_resume_takes_it_back(
        monkeypatch: pytest.MonkeyPatch, resumed: bool) -> None:
    """The leader reads the router process from each Place and live report (router_incarnation): the new process's
    first call keeps the slot its dead predecessor held only a grace, without the Finished notice it never sent. A
    resume of that stream through the new process is admitted on the slot, as before (not a new request, charged
    again: helper-170); with none, the slot lapses at the grace, not a lease later."""
    fake_leadership(monkeypatch, lambda: True)
    clock = [100.0]
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: clock[0])
    service._on_nodes_changed({etcd_keys.node_key("node-a"): json_format.MessageToJson(common_pb2.NodeInfo(
        node_id="node-a", address="127.0.0.1:1", gpu="h100", kv_block_size=16, models=[common_pb2.ModelInfo(
            name="m", max_context_tokens=4096, tokenizer="byte", vocab_size=257, is_warm=True,
            state=common_pb2.MODEL_STATE_WARM, kv_blocks=100_000)])).encode()})
    service._cluster.report_load("node-a", Load(kv_blocks_total=100_000), clock[0])

    async def place(request_id: str, incarnation: int, resume: bool = False) -> None:
        await service.Place(scheduler_pb2.PlaceRequest(
            request_id=request_id, model="m", num_prompt_tokens=10, max_tokens=10, resumed=resume,
            router_id="router-a", router_incarnation=incarnation, context=common_pb2.RequestContext(tenant="t")),
            FakeContext())  # type: ignore[arg-type]

    try:
        admission = service._admission
        admission.set_limits(CAPPED)
        await place("r", 7)  # the old process
        if resumed:
            await place("r", 8, resume=True)  # the new one: r's client resumes through it, t at its limit
        else:
            with pytest.raises(Refused, match="concurrency"):
                await place("s", 8)  # the new one: another of t's requests, while r's slot is in its grace
        clock[0] += ROUTER_GONE_GRACE_S + 0.1
        service._cluster.report_load("node-a", Load(kv_blocks_total=100_000), clock[0])
        service._gate.sweep()
        assert admission.num_held == (1 if resumed else 0)
    finally:
        await service.close()


def test_a_slot_whose_one_router_ends_it_is_freed_at_once() -> None:
    """A router that placed the id and ends it, no other router holding it: freed at once, not left to others (nor
    when the other router fell silent before this one first claimed the id)."""
    admission = Admission(limits=CAPPED, lease_s=15.0)
    admission.on_admitted(Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=0.0,
                                 holder="router-a"), 0.0)
    admission.renew(["r"], 5.0, "router-a")
    assert admission.end("r", 6.0, "router-a") is True and admission.num_held == 0
    # A router whose last word came before the ending router's first (it died; its client resumed through b) holds
    # nothing: b's end frees the slot at once.
    admission.on_admitted(Ticket(request_id="s", tenant="t", priority=0, num_tokens=100, arrived_at=0.0,
                                 holder="router-dead"), 0.0)
    admission.renew(["s"], 5.0, "router-dead")
    admission.renew(["s"], 6.0, "router-b")
    assert admission.end("s", 8.0, "router-b") is True and admission.num_held == 0
    # Two routers both streaming it (a duplicate placed on another node): the first to end leaves the slot held.
    admission.on_admitted(Ticket(request_id="d", tenant="t", priority=0, num_tokens=100, arrived_at=10.0,
                                 holder="router-a"), 10.0)
    admission.renew(["d"], 11.0, "router-b")
    admission.renew(["d"], 13.0, "router-a")
    assert admission.end("d", 14.0, "router-b") is False and admission.num_held == 1
    assert admission.end("d", 15.0, "router-a") is True and admission.num_held == 0


def _placed(admission: Admission, rid: str, router: str, now: float) -> None:
    admission.on_admitted(Ticket(request_id=rid, tenant="t", priority=0, num_tokens=100, arrived_at=now,
                                 holder=router), now)


def test_a_router_restarted_under_its_instance_id_claims_the_id_afresh_when_it_places_it() -> None:
    """router-1 places r and dies; the client resumes through router-2, which dies too; router-1, restarted under the
    same --instance-id, takes the client's next resume and ends it with nothing else running r. Its claim kept the
    first process's start, so dead router-2 still counted and the slot was held a third of a lease (helper-101)."""
    admission = Admission(limits=CAPPED, lease_s=15.0)
    _placed(admission, "r", "router-1", 0.0)
    admission.renew(["r"], 1.0, "router-1")
    _placed(admission, "r", "router-2", 2.0)
    admission.renew(["r"], 4.0, "router-2")
    _placed(admission, "r", "router-1", 5.0)  # the restarted process, the same id
    assert admission.end("r", 6.0, "router-1") is True and admission.num_held == 0


def test_a_router_process_started_in_a_dead_ones_place_keeps_the_dead_ones_slots_only_a_grace() -> None:
    """router-1 crashed with three of tenant t's streams (t at its limit) and was restarted under its id: the nodes
    ended the streams with its connections, but the slots stayed held a lease (15 s), and t was refused meanwhile
    (helper-167). The new process's first call keeps them only a grace (5 s): a resume through it takes its slot
    back, as does a resume through router-2 (which holds c too), and the rest lapse. Freed at once instead, a resume
    was a new request, charged again and shed under load (helper-170)."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=3)}, lease_s=15.0)
    assert admission.router_seen("router-1", 11, 0.0) == []  # the first process this leader knows of
    for rid in ("a", "b", "c"):
        _placed(admission, rid, "router-1", 0.5)
    _placed(admission, "c", "router-2", 1.0)  # c's client resumed through router-2 as well
    admission.renew(["a", "b", "c"], 1.0, "router-1")
    assert admission.router_seen("router-1", 11, 2.0) == []  # the same process again
    assert admission.router_seen("router-1", 0, 2.0) == []  # not said (an older router)
    assert sorted(admission.router_seen("router-1", 22, 2.0)) == ["a", "b"]  # the new process: a grace
    assert admission.router_seen("router-1", 11, 2.5) == []  # the old one (or a leader that heard it late): seen
    _placed(admission, "a", "router-1", 3.0)  # a's client resumes through the new process: its slot
    assert verdict(admission, "next", 6.9) == Verdict.REJECT
    assert admission.expire_holds(7.0) == ["b"]  # nobody took b back
    assert admission.num_held == 2 and verdict(admission, "next", 7.0) == Verdict.ADMIT
    assert admission.expire_holds(15.9) == []  # a and c keep their leases


def test_a_live_router_whose_slots_a_process_under_its_id_shortened_takes_them_back_with_its_next_report() -> None:
    """The processes' numbers are random: a leader that hears a live router after another under its id (a restart
    overlapping its drain, a new leader hearing them in another order, two routers under one id) shortens the live
    one's slots, and its next live report (every 2 s) gives them their lease back: never over the tenant's limit."""
    admission = Admission(limits=CAPPED, lease_s=15.0)
    assert admission.router_seen("router-1", 22, 0.0) == []
    _placed(admission, "x", "router-1", 0.0)
    assert admission.router_seen("router-1", 11, 1.0) == ["x"]
    assert admission.renew(["x"], 2.0, "router-1") == 1
    assert admission.expire_holds(16.9) == [] and verdict(admission, "next", 16.9) == Verdict.REJECT


def test_a_live_report_under_way_as_its_router_ended_the_id_does_not_make_it_a_holder_again() -> None:
    """router-a's report (its ids taken before its stream ended) lands after its Finished: it made a a holder again,
    and b's end then left the slot to a, held a third of a lease after both streams ended (helper-101)."""
    admission = Admission(limits=CAPPED, lease_s=15.0)
    _placed(admission, "r", "router-a", 0.0)
    _placed(admission, "r", "router-b", 1.0)
    admission.renew(["r"], 2.0, "router-b")
    assert admission.end("r", 3.0, "router-a") is False  # b still streams it
    assert admission.renew(["r"], 3.1, "router-a") == 0  # a's late report
    assert admission.end("r", 4.0, "router-b") is True and admission.num_held == 0
    # A router that places the id again (its client sent it once more) holds it again.
    _placed(admission, "s", "router-a", 5.0)
    _placed(admission, "s", "router-b", 5.5)
    assert admission.end("s", 6.0, "router-a") is False
    _placed(admission, "s", "router-a", 6.5)
    assert admission.end("s", 7.0, "router-b") is False and admission.num_held == 1


def test_a_slot_left_to_another_stream_lapses_soon_unless_that_stream_is_reported_live() -> None:
    """Another stream of the id was said to run (the node refused this one as running it), but it may have ended just
    before: kept a whole lease, the slot held nothing and its tenant was refused meanwhile."""
    admission = Admission(limits=CAPPED, lease_s=15.0)
    admit(admission, "orphan", 0.0)
    admit(admission, "shared", 0.0, tenant="u")
    admission.leave_to_others("orphan", 1.0)
    admission.leave_to_others("shared", 1.0)
    assert admission.num_held == 2  # not freed at once: the other stream may well run
    admission.renew(["shared"], 3.0)  # its router reports it live
    assert admission.expire_holds(6.5) == ["orphan"]  # a third of the lease after: no one reported it
    assert admission.expire_holds(17.0) == [] and admission.num_held == 1


@pytest.mark.parametrize("field", ["request_ids", "workflow_ids"])
@pytest.mark.timeout(10)
async def test_a_live_report_longer_than_a_router_sends_is_refused_naming_its_length(
        monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    """Every id of a report is looked up, every report: one list is bounded by --max-live-ids (at least the ids a
    router sends at once), and a report that long is taken."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        admit(service._admission, "r0", service._clock())
        ids = [f"r{n}" for n in range(LIVE_IDS_PER_REPORT + 1)]
        with pytest.raises(Refused) as refused:
            await service.ReportLiveRequests(scheduler_pb2.LiveRequests(**{field: ids}),
                                             FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{field}='{LIVE_IDS_PER_REPORT + 1} ids': more than --max-live-ids ({LIVE_IDS_PER_REPORT})" in str(
            refused.value)
        ack = await service.ReportLiveRequests(scheduler_pb2.LiveRequests(request_ids=ids[:LIVE_IDS_PER_REPORT]),
                                               FakeContext())  # type: ignore[arg-type]
        assert ack.num_held == 1
    finally:
        await service.close()


def test_the_live_report_bound_cannot_be_set_below_what_a_router_sends() -> None:
    with pytest.raises(ValueError, match=f"--max-live-ids: must be at least {LIVE_IDS_PER_REPORT}"):
        SchedulerConfig(max_live_ids=LIVE_IDS_PER_REPORT - 1)


def test_a_successor_holds_tenants_to_the_slots_and_tokens_its_predecessor_admitted() -> None:
    """A new leader started with no slots and no minute of tokens: after a failover each tenant could run its whole
    max_concurrency again beside its running requests, and spend its tokens per minute twice. The leader hands them
    over; the routers running a slot renew it at the successor, and one that ended unheard lapses after a lease."""
    limits = {"t": TenantLimits(max_concurrency=2, tokens_per_minute=1000)}
    leader = Admission(limits=limits, lease_s=10.0)
    for rid, at in (("running", 0.0), ("ended-unheard", 1.0)):
        leader.on_admitted(dataclasses.replace(ticket(rid, at=at), num_tokens=300, holder="router-0"), at)
    state = json.loads(json.dumps(leader.to_state(20.0, max_bytes=10_000)))  # as written to etcd
    successor = Admission(limits=limits, lease_s=10.0)
    assert successor.restore(state, 500.0, gap_s=2.0) == 2  # another host's clock; no leader for 2 s
    assert successor.in_flight("t") == 2 and verdict(successor, "more", 500.0) == Verdict.REJECT
    assert successor.renew(["running"], 505.0, holder="router-0") == 1
    assert successor.expire_holds(510.0) == ["ended-unheard"]
    # A slot free, but 600 of its 1,000 tokens spent within the minute: charged 20 and 19 s before the last write,
    # 22 and 21 s before the takeover.
    big = dataclasses.replace(ticket("big", at=510.0), num_tokens=500)
    assert "tokens per minute" in successor.offer(big, 510.0, False, 0.1).reason
    assert successor.offer(big, 537.5, False, 0.1).verdict == Verdict.REJECT
    assert successor.offer(big, 538.5, False, 0.1).verdict == Verdict.ADMIT  # the first 300 a minute old


def test_a_state_older_than_a_lease_gives_no_slots() -> None:
    """A state hours old (a control plane stopped and started again on the same etcd) held tenants at their limits
    for a lease with slots long gone (helper-133). Its tokens are aged by the gap, so they are gone too."""
    limits = {"t": TenantLimits(max_concurrency=1, tokens_per_minute=1000)}
    leader = Admission(limits=limits, lease_s=10.0)
    leader.on_admitted(dataclasses.replace(ticket("long-gone"), num_tokens=900), 0.0)
    successor = Admission(limits=limits, lease_s=10.0)
    assert successor.restore(leader.to_state(1.0, max_bytes=10_000), 0.0, gap_s=3600.0) == 0
    assert verdict(successor, "new", 0.0) == Verdict.ADMIT


def test_the_hand_over_state_is_bounded_in_bytes_keeping_the_newest_slots() -> None:
    """Bounded by entries (10,000 slots of 128-character ids: 2.2 MB), every write of the state was refused by etcd
    (1.5 MiB at most) and the successor restored one written long before (helper-133)."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=20_000)})
    for n in range(10_000):
        admission.on_admitted(ticket(f"{n:0>128}"), float(n))
    state = admission.to_state(10_000.0, max_bytes=64 * 1024)
    assert len(json.dumps(state)) <= 64 * 1024
    kept = [entry[0] for entry in state["slots"]["t"]]
    assert len(kept) > 150 and kept[0] == f"{9_999:0>128}"  # the newest first
    assert state["left_out"] == 10_000 - len(kept)
    with pytest.raises(ValueError, match="admission state"):
        Admission().restore({"slots": {"t": [[None]]}}, 0.0, 0.0)


async def test_the_leaders_hand_over_state_carries_its_admission_slots() -> None:
    leader = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 100.0)
    leader._admission.set_limits(CAPPED)
    leader._admission.on_admitted(ticket("running"), 99.0)
    successor = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 7.0)
    successor._admission.set_limits(CAPPED)
    successor._take_over_state(json.loads(json.dumps(leader._hand_over_state())))
    assert successor._admission.in_flight("t") == 1 and verdict(successor._admission, "next", 7.0) == Verdict.REJECT
    for service in (leader, successor):
        await service.close()


def test_requests_queued_at_a_successor_are_held_to_the_slots_it_took_over() -> None:
    """Queued here before the takeover (counted against no slot), they were dispatched past the limit once the
    predecessor's slots were restored (helper-133): refuse_over_limits, which the scheduler calls then, refuses
    them; the more urgent band is kept."""
    limits = {"t": TenantLimits(max_concurrency=2)}
    leader = Admission(limits=limits)
    leader.on_admitted(ticket("running"), 0.0)
    successor = Admission(limits=limits)
    for rid, priority in (("batch", 0), ("urgent", 5)):
        waiting = dataclasses.replace(ticket(rid), priority=priority)
        assert successor.offer(waiting, 0.0, True, 0.1).verdict == Verdict.QUEUE
    successor.restore(leader.to_state(1.0, max_bytes=10_000), 1.0, gap_s=0.0)
    assert [t.request_id for t, _ in successor.refuse_over_limits(1.0)] == ["batch"]
    assert successor.num_queued == 1


async def test_the_hand_over_state_fits_etcd_with_ten_thousand_long_ids_of_each_kind() -> None:
    """10,000 open tasks and 10,000 workflows' spend, of 257-character ids, made 5.7 MB, past etcd's 1.5 MiB for a
    request (its --max-request-bytes default): every write of the state was refused, and a successor took over an old
    one. The newest that fit are handed over, in a state small enough to be written every second."""
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 100.0)
    workflows = [f"{n:05d}" + "w" * 252 for n in range(10_000)]
    service._policy.restore_workflow_state({w: 0.5 for w in workflows})
    for n, workflow in enumerate(workflows):
        service._tasks.record(workflow_task(workflow), 1, 3, 0.1, True, 50.0 + n / 1000)  # step 1 of 3: open
    state = service._hand_over_state()
    assert len(json.dumps(state).encode()) < 300_000  # etcd keeps thousands of past writes in memory
    assert 100 < len(state["workflow_spent"]) < 10_000
    assert list(state["workflow_spent"]) == workflows[-len(state["workflow_spent"]):]  # the newest
    assert 100 < len(state["tasks"]["open"]) < 10_000
    await service.close()


async def test_the_hand_over_leaves_out_the_spend_of_workflows_that_ended() -> None:
    """No step of theirs is to come: with them the state grew with the traffic (helper-134)."""
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 100.0)
    service._policy.restore_workflow_state({"done": 1.0, "going": 2.0})
    service._tasks.record(workflow_task("done"), 1, 1, 0.1, True, 100.0)
    assert service._hand_over_state()["workflow_spent"] == {"going": 2.0}
    await service.close()


def test_a_request_a_node_runs_with_no_slot_here_is_given_one_by_its_routers_report() -> None:
    """A leader killed half a second after admitting two streams of a tenant at max_concurrency 2 had not yet
    written them to etcd: its successor, holding no slot for them, let that tenant run nine more, one at a time,
    while they streamed (helper-134). The routers' live reports name the tenant of each request a node runs."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=2)}, lease_s=10.0)
    assert admission.offer(ticket("queued"), 0.0, True, 0.1).verdict == Verdict.QUEUE
    reported = ["a", "b", "asked", "queued", "free-tenant"]
    assert admission.renew(reported, 1.0, "router-0", tenants=["t", "t", "", "t", "free"]) == 2
    assert admission.in_flight("t") == 2 and admission.num_held == 2
    assert admission.end("a", 2.0, holder="router-0")
    # A report sent as "a" ended reaches the leader after its Finished: it does not take the slot again.
    assert admission.renew(["a", "b"], 2.1, "router-0", tenants=["t", "t"]) == 1
    assert admission.in_flight("t") == 1


def test_a_slot_given_from_a_report_holds_its_id_to_the_reported_prompt() -> None:
    """An adopted slot had no prompt digest: a "resume" of another prompt under the running id was let in beside
    the running stream, past its tenant's limit, where a slot the leader admitted or took over refuses it."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=2)}, lease_s=10.0)
    assert admission.renew(["r"], 1.0, "router-0", tenants=["t"], prompt_digests=[12]) == 1
    other = dataclasses.replace(ticket("r", at=1.5), holder="router-1", resumed=True, prompt_digest=13)
    assert admission.offer(other, 1.5, False, 0.1).duplicate
    same = dataclasses.replace(other, prompt_digest=12)
    assert admission.offer(same, 1.5, False, 0.1).verdict == Verdict.ADMIT
    admit(admission, "old", 2.0)  # through a router that sent no digest: its report fills it in
    assert admission.renew(["old"], 2.5, "router-0", tenants=["t"], prompt_digests=[21]) == 1
    assert admission.offer(dataclasses.replace(other, request_id="old", prompt_digest=22), 3.0, False, 0.1).duplicate


async def test_the_leader_gives_a_slot_to_a_placed_request_its_router_reports_and_checks_the_tenants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        service._admission.set_limits(CAPPED)
        report = scheduler_pb2.LiveRequests(router_id="router-0", request_ids=["r"], tenants=["t"],
                                            prompt_digests=[12])
        ack = await service.ReportLiveRequests(report, FakeContext())  # type: ignore[arg-type]
        assert ack.num_held == 1 and verdict(service._admission, "next", service._clock()) == Verdict.REJECT
        other = Ticket(request_id="r", tenant="t", priority=0, num_tokens=10, arrived_at=service._clock(),
                       holder="router-1", resumed=True, prompt_digest=13)  # another prompt under the running id
        assert service._admission.offer(other, service._clock(), False, 0.1).duplicate
        for fields, named in (({"tenants": ["t", "t"]},
                               "tenants='2 tenants': one for each of the 1 request_ids, or none"),
                              ({"tenants": ["x" * 129]}, "tenants[0]="),
                              ({"tenants": ["t"], "prompt_digests": [1, 2]},
                               "prompt_digests='2 prompt digests': one for each of the 1 request_ids, or none")):
            with pytest.raises(Refused) as refused:
                await service.ReportLiveRequests(scheduler_pb2.LiveRequests(request_ids=["r"], **fields),
                                                 FakeContext())  # type: ignore[arg-type]
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and named in str(refused.value)
    finally:
        await service.close()


def test_token_windows_leave_room_for_slots_and_the_slots_keep_their_routers_and_prompts() -> None:
    """Thirty tenants with both limits filled the 16 KiB with per-second token windows and handed over no slot; the
    slots went over without their routers and prompt digests, so a fresh request for a running id through another
    router ran beside it, as did a "resume" of another prompt (helper-135)."""
    limits = {f"t{i:02d}": TenantLimits(max_concurrency=4, tokens_per_minute=10**7) for i in range(30)}
    leader = Admission(limits=limits, lease_s=15.0)
    for second in range(60):
        for i in range(30):
            running = Ticket(request_id=f"t{i:02d}-{second:02d}-0c5d2b1e-4a7e-4c7e-9f3a", tenant=f"t{i:02d}",
                             priority=0, num_tokens=1234, arrived_at=second, holder="router-a", prompt_digest=7)
            leader.on_admitted(running, float(second))
            if second < 59:
                leader.end(running.request_id, second + 0.5, holder="router-a")
    state = json.loads(json.dumps(leader.to_state(60.0, 16 * 1024)))
    assert len(state["slots"]) == 30 and len(state["served"]) == 30 and state["left_out"] == 0
    successor = Admission(limits=limits, lease_s=15.0)
    assert successor.restore(state, 0.0, gap_s=0.5) == 30
    rid = "t00-59-0c5d2b1e-4a7e-4c7e-9f3a"
    fresh = Ticket(request_id=rid, tenant="t00", priority=0, num_tokens=1, arrived_at=0.0, holder="router-b")
    assert successor.offer(fresh, 0.0, False, 0.1).duplicate
    other_prompt = dataclasses.replace(fresh, resumed=True, prompt_digest=8)
    assert successor.offer(other_prompt, 0.0, False, 0.1).duplicate


def test_a_state_of_unknown_age_gives_no_slots() -> None:
    leader = Admission(limits=CAPPED)
    leader.on_admitted(ticket("r"), 0.0)
    assert Admission(limits=CAPPED).restore(leader.to_state(1.0, 10_000), 1.0, gap_s=None) == 0


def test_an_end_reported_before_a_report_sent_while_it_ran_gives_it_no_slot() -> None:
    """On a successor with no slot for it (the case adoption is for), a Finished that overtook a live report sent
    while the request ran: adopted, the ended request held a slot of its tenant's for a lease (helper-135)."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=2)}, lease_s=15.0)
    assert not admission.end("x", 1.0, holder="router-0")
    assert admission.renew(["x"], 1.05, "router-0", tenants=["t"]) == 0 and admission.in_flight("t") == 0


async def test_a_successor_holds_its_own_queue_to_the_slots_it_took_over(monkeypatch: pytest.MonkeyPatch) -> None:
    successor = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    checked = []
    monkeypatch.setattr(successor._gate, "limits_changed", lambda: checked.append(True))
    successor._take_over_admission({"slots": {}, "served": {}, "written_unix": successor._wall_clock()})
    assert checked == [True]
    await successor.close()


async def test_a_live_report_that_comes_as_the_replica_is_elected_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd showed the successor to a router before the successor's own campaign returned: its report, dropped as
    a standby's, gave no slot to the requests running with none there, and their tenant went past its limit until
    the next report (helper-136: five more, in 1 of 19 failovers)."""
    leading = [False]
    fake_leadership(monkeypatch, lambda: leading[0])
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        service._admission.set_limits(CAPPED)
        report = scheduler_pb2.LiveRequests(router_id="router-0", request_ids=["r"], tenants=["t"])
        reporting = asyncio.create_task(service.ReportLiveRequests(report, FakeContext()))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # one turn of the loop: the report reaches the replica before it leads
        assert not reporting.done()
        leading[0] = True
        service._role.elected.set()
        assert (await asyncio.wait_for(reporting, 5)).num_held == 1
    finally:
        await service.close()


def test_a_state_whose_slots_name_only_id_and_age_is_taken_over() -> None:
    """The form an earlier version wrote: one entry it could not read lost the whole admission state (helper-137)."""
    state = {"slots": {"t": [["r", 1.0]]}, "served": {"t": [[0, 100]]}}
    admission = Admission(limits=CAPPED)
    assert admission.restore(state, 10.0, gap_s=0.0) == 1 and admission.in_flight("t") == 1
