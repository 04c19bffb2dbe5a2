"""The leader exports cost per successful task two ways (the whole fleet, and busy GPU time with model
loads) as an OpenTelemetry gauge."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from baton.v1 import common_pb2, scheduler_pb2
from services.common import etcd_keys
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerService
from services.scheduler.tasks import request_task, workflow_task
from tests.unit.leading import fake_leadership
from tests.unit.test_place_during_election import FakeContext, Refused


def exported(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict, float]]]:
    metrics = reader.get_metrics_data()
    if metrics is None:  # nothing observed at all
        return {}
    return {m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
            for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


@pytest.mark.parametrize("leading", [True, False])
async def test_the_leader_exports_the_kpi_and_a_standby_does_not(monkeypatch: pytest.MonkeyPatch,
                                                                  leading: bool) -> None:
    fake_leadership(monkeypatch, lambda: leading)
    reader = InMemoryMetricReader()
    telemetry = Telemetry("scheduler/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    service = SchedulerService(SchedulerConfig(), telemetry)
    service._tasks.record("r1", 1, 1, 0.002, ok=True, now=time.monotonic())
    service._tasks.record("r2", 1, 1, 0.001, ok=False, now=time.monotonic())
    service._tasks.add_overhead(0.001)
    service._tasks.add_fleet_time(3600.0, 0.01)  # an hour of a fleet costing $0.01 an hour, idle or not
    metrics = exported(reader)
    if leading:
        assert sorted(metrics["baton.scheduler.cost_per_successful_task"], key=str) == [
            ({"accounting": "busy"}, pytest.approx(0.003)), ({"accounting": "fleet"}, pytest.approx(0.01))]
        assert ({"outcome": "succeeded"}, 1) in metrics["baton.scheduler.tasks"]
        assert ({"outcome": "open"}, 1) in metrics["baton.scheduler.tasks"]  # r2 may still be retried
    else:
        assert not metrics.get("baton.scheduler.cost_per_successful_task")
    # Which replica leads, on every replica: a standby's /metrics was empty, its target_info too (helper-116).
    assert metrics["baton.scheduler.is_leader"] == [({}, 1 if leading else 0)]
    await service.close()


async def test_a_draining_node_is_paid_for_until_it_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node draining out of the fleet gets no new work but is still provisioned: the whole-fleet cost
    counts it until its registration is gone (it was dropped the moment it began draining)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))

    def registered(node_id: str, price: float, draining: bool) -> tuple[str, bytes]:
        info = common_pb2.NodeInfo(node_id=node_id, address="127.0.0.1:1", gpu="h100", price_per_hour=price,
                                   draining=draining)
        return etcd_keys.node_key(node_id), json_format.MessageToJson(info).encode()

    service._on_nodes_changed(dict([registered("a", 4.0, False), registered("b", 2.5, False)]))
    assert service.fleet_price_per_hour() == pytest.approx(6.5)
    service._on_nodes_changed(dict([registered("a", 4.0, False), registered("b", 2.5, True)]))
    assert [s.spec.node_id for s in service._cluster.nodes()] == ["a"]  # no new work goes to b
    assert service.fleet_price_per_hour() == pytest.approx(6.5)
    service._on_nodes_changed(dict([registered("a", 4.0, False)]))
    assert service.fleet_price_per_hour() == pytest.approx(4.0)
    await service.close()


async def test_a_dead_node_leaves_the_fleets_price_with_its_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a node's lease has lapsed and it has gone silent, it is gone from the fleet as `baton status` lists it,
    and from the price paid: etcd's grace for its key (which keeps a node alive through an etcd freeze) does not keep
    a dead node priced. A lapsed node that still reports (etcd froze, the node did not) is still paid for."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    items = dict(_registered(node_id, price) for node_id, price in (("a", 4.0), ("b", 2.5), ("c", 1.0)))
    service._nodes.lapsed = frozenset({etcd_keys.node_key("b"), etcd_keys.node_key("c")})  # their leases ended
    service._on_nodes_changed(items)
    service._cluster.report_load("c", Load(), service._clock())  # c reports on; b went silent
    assert service.fleet_price_per_hour() == pytest.approx(5.0)
    await service.close()


async def test_a_draining_node_that_died_leaves_the_fleets_price_with_its_registration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A draining node reports no load, so once its lease lapses it is taken for gone, as any silent lapsed node."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    items = dict([_registered("a", 4.0), _registered("b", 2.5, draining=True)])
    service._on_nodes_changed(items)
    assert service.fleet_price_per_hour() == pytest.approx(6.5)
    service._nodes.lapsed = frozenset({etcd_keys.node_key("b")})
    service._on_nodes_changed(items)
    assert service.fleet_price_per_hour() == pytest.approx(4.0)
    await service.close()


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -5.0, 1e308])
async def test_a_price_that_is_not_a_price_counts_as_nothing_instead_of_poisoning_the_ledger(
        monkeypatch: pytest.MonkeyPatch, bad: float) -> None:
    """A registration or a notice from outside this code base may carry any double: inf or NaN would stay in the
    ledger for good, a negative price would pay the operator."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._on_nodes_changed(dict([_registered("a", 1.0), _registered("b", bad)]))
    assert service.fleet_price_per_hour() == pytest.approx(1.0)
    finished = scheduler_pb2.FinishedRequest(
        request_id="r", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED,
        gpu_ms_by_node={"a": 3_600_000, "b": 3_600_000, "gone": 3_600_000}, price_per_hour_by_node={"gone": bad})
    await service.Finished(finished, FakeContext())  # type: ignore[arg-type]
    assert service._tasks.stats().cost_per_successful_task == pytest.approx(1.0)
    await service.close()


@pytest.mark.parametrize(("fields", "named"), [
    ({"gpu_ms_by_node": {"a": float("nan")}}, "gpu_ms_by_node['a']=nan: must be 0 to 604800000 (a week)"),
    ({"gpu_ms_by_node": {"a": 1.0, "b": float("inf")}}, "gpu_ms_by_node['b']=inf: must be 0 to 604800000"),
    ({"gpu_ms_by_node": {"a": -1e300}}, "gpu_ms_by_node['a']=-1e+300: must be 0 to 604800000"),
    # Finite, but at any price the cost per task was infinite for good (helper-179).
    ({"gpu_ms_by_node": {"a": 1e308}}, "gpu_ms_by_node['a']=1e+308: must be 0 to 604800000"),
    ({"outcome": 99}, "outcome=99: not a RequestOutcome (0 to 4)"),
    ({"ttft_ms": -1}, "ttft_ms=-1: must not be negative"),
    ({"num_output_tokens": -5}, "num_output_tokens=-5: must not be negative"),
    ({"model": "m", "num_output_tokens": 2**31 - 1}, "num_output_tokens=2147483647: must be 0 to m's context (8192)"),
    # Held as a Place's are: 150 notices with 3 MB ids took a leader from 71 MB to 992 MB for good, and a step past
    # its total opened a task no step could end (helper-196).
    ({"request_id": "r" * 300}, "300 characters, longer than 257"),
    ({"context": {"workflow_id": "w" * 258}}, "258 characters, longer than 257"),
    ({"context": {"workflow_id": "w", "step": 9, "total_steps": 2}}, "step=9: must be 1 to total_steps=2"),
    ({"context": {"step": 4}}, "step=4: needs a workflow_id"),
    ({"gpu_ms_by_node": {"n" * 129: 1.0}}, "129 characters, longer than 128 (a node agent's --node-id)"),
    ({"gpu_ms_by_node": {f"n{i}": 1.0 for i in range(65)}}, "gpu_ms_by_node='65 nodes': more than the 64"),
])
async def test_a_finished_notice_that_makes_no_sense_is_refused_by_name_and_the_ledger_keeps_the_next(
        monkeypatch: pytest.MonkeyPatch, fields: dict, named: str) -> None:
    """GPU time that is not a time, an outcome outside the enum or an output length no request could have had is
    INVALID_ARGUMENT, charged to nothing (NaN or inf stayed in the ledger for good); a node this leader never saw
    is charged as before, at the notice's price."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    info = common_pb2.NodeInfo(node_id="a", address="127.0.0.1:1", gpu="h100", price_per_hour=1.0,
                               models=[common_pb2.ModelInfo(name="m", max_context_tokens=8192)])
    service._on_nodes_changed({etcd_keys.node_key("a"): json_format.MessageToJson(info).encode()})
    good = {"request_id": "r", "outcome": scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED}
    try:
        with pytest.raises(Refused) as refused:
            await service.Finished(scheduler_pb2.FinishedRequest(**{**good, **fields}),
                                   FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in str(refused.value)
        assert service._tasks.stats().succeeded == 0
        await service.Finished(scheduler_pb2.FinishedRequest(
            **good, model="m", num_output_tokens=8192, gpu_ms_by_node={"a": 3_600_000, "gone": 3_600_000},
            price_per_hour_by_node={"gone": 2.0}), FakeContext())  # type: ignore[arg-type]
        assert service._tasks.stats().cost_per_successful_task == pytest.approx(3.0)
    finally:
        await service.close()


async def test_a_request_id_and_a_workflow_id_that_are_equal_are_two_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """One key space: a lone request reusing an ended workflow's id (and a workflow named as an ended request) was
    taken for a late notice of that task, and its success went uncounted (helper-115)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    ok = scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED
    try:
        for notice in (scheduler_pb2.FinishedRequest(request_id="s1", outcome=ok, context=common_pb2.RequestContext(
                           workflow_id="x", step=1, total_steps=1)),
                       scheduler_pb2.FinishedRequest(request_id="x", outcome=ok),
                       scheduler_pb2.FinishedRequest(request_id="y", outcome=ok),
                       scheduler_pb2.FinishedRequest(request_id="s2", outcome=ok, context=common_pb2.RequestContext(
                           workflow_id="y", step=1, total_steps=1))):
            await service.Finished(notice, FakeContext())  # type: ignore[arg-type]
        assert service._tasks.stats().succeeded == 4
    finally:
        await service.close()


async def test_a_lone_request_answered_late_has_failed_at_once_and_one_refused_waits_for_its_resend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests an etcd freeze made late were answered, yet their tasks stayed open for --task-timeout-s (5
    minutes), waiting for a resend their clients had no reason to send, their cost out of the KPI (helper-173). A
    request refused or failed may be sent again under its id: its task waits for that. So does a workflow until
    every step is answered (helper-176: one whose step 2 was late stayed open once its step 3 had succeeded)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        for notice in (scheduler_pb2.FinishedRequest(request_id="late", outcome=scheduler_pb2.REQUEST_OUTCOME_LATE,
                                                     gpu_ms_by_node={"a": 1_000}),
                       scheduler_pb2.FinishedRequest(request_id="failed",
                                                     outcome=scheduler_pb2.REQUEST_OUTCOME_FAILED),
                       # Sent twice: the other stream may yet succeed (helper-174).
                       scheduler_pb2.FinishedRequest(request_id="twice", outcome=scheduler_pb2.REQUEST_OUTCOME_LATE,
                                                     another_stream_live=True),
                       scheduler_pb2.FinishedRequest(request_id="step", outcome=scheduler_pb2.REQUEST_OUTCOME_LATE,
                                                     context=common_pb2.RequestContext(workflow_id="w", step=1,
                                                                                       total_steps=2))):
            await service.Finished(notice, FakeContext())  # type: ignore[arg-type]
        stats = service._tasks.stats()
        assert (stats.succeeded, stats.failed) == (0, 1)
        assert not service._tasks.is_open(request_task("late")) and service._tasks.is_open(request_task("failed"))
        assert service._tasks.is_open(request_task("twice"))
        await service.Finished(scheduler_pb2.FinishedRequest(request_id="twice",
                                                             outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED),
                               FakeContext())  # type: ignore[arg-type]
        assert service._tasks.stats().succeeded == 1
        assert service._tasks.is_open(workflow_task("w"))
        # A frozen router's attempt at step 1, told when it wakes: given up by its client (helper-177).
        await service.Finished(scheduler_pb2.FinishedRequest(
            request_id="step-frozen", outcome=scheduler_pb2.REQUEST_OUTCOME_CANCELLED,
            context=common_pb2.RequestContext(workflow_id="w", step=1, total_steps=2)),
            FakeContext())  # type: ignore[arg-type]
        step2 = scheduler_pb2.FinishedRequest(request_id="step2", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED,
                                              context=common_pb2.RequestContext(workflow_id="w", step=2, total_steps=2))
        await service.Finished(step2, FakeContext())  # type: ignore[arg-type]
        assert not service._tasks.is_open(workflow_task("w")) and service._tasks.stats().failed == 2
    finally:
        await service.close()


def _registered(node_id: str, price: float, draining: bool = False) -> tuple[str, bytes]:
    info = common_pb2.NodeInfo(node_id=node_id, address="127.0.0.1:1", gpu="h100", price_per_hour=price,
                               draining=draining)
    return etcd_keys.node_key(node_id), json_format.MessageToJson(info).encode()


async def test_a_scheduler_that_first_sees_a_node_draining_charges_its_streams_at_its_price(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader that took over (or restarted) while a node drains never saw it live; the GPU time of
    the streams finishing there is still charged at that node's price, not at nothing."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    info = common_pb2.NodeInfo(node_id="b", address="127.0.0.1:1", gpu="h100", price_per_hour=3.6, draining=True)
    service._on_nodes_changed({etcd_keys.node_key("b"): json_format.MessageToJson(info).encode()})
    finished = scheduler_pb2.FinishedRequest(request_id="r", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED,
                                             gpu_ms_by_node={"b": 3_600_000})  # an hour of b's GPU
    await service.Finished(finished, FakeContext())  # type: ignore[arg-type]
    assert service._tasks.stats().cost_per_successful_task == pytest.approx(3.6)
    await service.close()


async def test_a_leader_that_never_saw_a_node_charges_its_gpu_time_at_the_routers_price(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node that left before this leader began (it died, and the request moved on) is known only to the router
    that streamed from it: its notice carries the node's price, and the GPU time is charged at it, not at nothing.
    A node the leader knows is charged at the leader's own price."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._on_nodes_changed(dict([_registered("a", 1.0)]))
    finished = scheduler_pb2.FinishedRequest(
        request_id="r", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED,
        gpu_ms_by_node={"gone": 3_600_000, "a": 3_600_000},  # an hour on each
        price_per_hour_by_node={"gone": 3.6, "a": 9.0})
    await service.Finished(finished, FakeContext())  # type: ignore[arg-type]
    assert service._tasks.stats().cost_per_successful_task == pytest.approx(4.6)
    await service.close()


async def test_a_successor_counts_the_fleet_for_the_time_no_leader_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader died 1 s after it last counted the fleet, and its successor took over 3 s later (the lease's
    TTL): the fleet was paid those 4 s too. Before, the successor counted only from its own takeover."""
    fake_leadership(monkeypatch, lambda: True)
    wall = [1_000.0]
    info = common_pb2.NodeInfo(node_id="a", address="127.0.0.1:1", gpu="h100", price_per_hour=3.6)
    nodes = {etcd_keys.node_key("a"): json_format.MessageToJson(info).encode()}
    leader = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 50.0,
                              wall_clock=lambda: wall[0])
    leader._on_nodes_changed(nodes)
    leader._count_fleet_time()
    wall[0] += 1.0
    state = leader._hand_over_state()  # its last write before it died
    wall[0] += 3.0
    successor = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 7.0,
                                 wall_clock=lambda: wall[0])  # another host's monotonic clock
    successor._on_nodes_changed(nodes)
    successor._take_over_state(state)
    assert successor._tasks.stats().fleet_cost_usd == pytest.approx(4.0 / 3600 * 3.6)
    # A control plane started again an hour later on the same etcd: that hour is not taken for a failover gap.
    wall[0] += 3600.0
    restarted = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), wall_clock=lambda: wall[0])
    restarted._take_over_state(state)
    assert restarted._tasks.stats().fleet_cost_usd == pytest.approx(0.0)
    for service in (leader, successor, restarted):
        await service.close()


async def test_a_workflow_step_the_routers_report_running_keeps_its_task_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2 of a workflow ran (or queued) past the task timeout: the routers' live reports name its workflow,
    and the leader does not end the task as abandoned (it failed the whole workflow before)."""
    fake_leadership(monkeypatch, lambda: True)
    now = [0.0]
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: now[0])
    timeout_s = service._tasks.timeout_s
    service._tasks.record(workflow_task("wf"), 1, 2, 0.01, ok=True, now=0.0)
    now[0] = timeout_s - 10.0
    await service.ReportLiveRequests(scheduler_pb2.LiveRequests(request_ids=["s2"], workflow_ids=["wf"]), None)
    assert service._tasks.expire(timeout_s + 10.0) == 0
    assert service._tasks.record(workflow_task("wf"), 2, 2, 0.01, ok=True, now=timeout_s + 20.0) is True
    await service.close()


async def test_a_standby_refuses_a_finished_notice_naming_the_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router whose view of the leader lags sends a notice to a standby: its ledger is overwritten when it takes
    over, so it refuses the notice (the router sends it to the leader named) rather than count it there."""
    from baton.protocol import LEADER_KEY
    from services.scheduler.leadership import LeaderRole
    from tests.unit.test_place_during_election import Refused

    fake_leadership(monkeypatch, lambda: False)
    monkeypatch.setattr(LeaderRole, "leader", lambda self: ("scheduler-1", "127.0.0.1:9"))

    async def successor_already_shown(self: LeaderRole, timeout_s: float) -> None:
        return None  # (this test feeds no etcd view to wait on)

    monkeypatch.setattr(LeaderRole, "wait_successor_shown", successor_already_shown)
    hints: list[object] = []

    class Context(FakeContext):
        async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
            hints.append(dict(trailing_metadata).get(LEADER_KEY))  # type: ignore[call-overload]
            await super().abort(code, details)

    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    notice = scheduler_pb2.FinishedRequest(request_id="r1", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED)
    with pytest.raises(Refused) as refused:
        await service.Finished(notice, Context())  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and hints == ["127.0.0.1:9"]
    assert service._tasks.stats().succeeded == 0
    await service.close()


async def test_a_deposed_leader_that_knows_no_successor_refuses_a_finished_notice_and_counts_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its election lease ended and etcd's view still shows itself: it names no leader, yet refuses the notice
    (its ledger is replaced when a leader takes over) rather than count it."""
    from services.scheduler.leadership import LeaderRole
    from tests.unit.test_place_during_election import Refused

    async def no_successor_shown(self: LeaderRole, timeout_s: float) -> None:
        return None  # (this test feeds no etcd view to wait on)

    fake_leadership(monkeypatch, lambda: False)
    monkeypatch.setattr(LeaderRole, "leader", lambda self: ("scheduler-0", "127.0.0.1:9"))  # itself, deposed
    monkeypatch.setattr(LeaderRole, "wait_successor_shown", no_successor_shown)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._tasks.record("earlier", 1, 1, 0.002, ok=True, now=time.monotonic())
    ledger = service._tasks.stats()
    notice = scheduler_pb2.FinishedRequest(request_id="r1", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED)
    with pytest.raises(Refused) as refused:
        await service.Finished(notice, FakeContext())  # type: ignore[arg-type]
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "does not lead" in str(refused.value)
    assert service._tasks.stats() == ledger  # succeeded, failed, open and cost as they were
    await service.close()


async def test_a_leader_whose_keep_alive_is_late_still_counts_a_finished_notice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lease unconfirmed for a moment (is_leader false), the leader holds the notice until a refresh confirms
    it, and counts it, rather than refuse it without naming anyone (the notice was then lost)."""
    from services.scheduler.leadership import LeaderRole

    async def confirmed_after_a_late_keep_alive(self: LeaderRole, timeout_s: float) -> bool:
        return True

    fake_leadership(monkeypatch, lambda: False)
    monkeypatch.setattr(LeaderRole, "wait_confirmed", confirmed_after_a_late_keep_alive)
    monkeypatch.setattr(LeaderRole, "leader", lambda self: ("scheduler-0", "127.0.0.1:9"))  # itself
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()  # it took over long ago
    notice = scheduler_pb2.FinishedRequest(request_id="r1", outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED)
    await service.Finished(notice, FakeContext())  # type: ignore[arg-type]
    assert service._tasks.stats().succeeded == 1
    await service.close()


async def test_a_lone_request_retried_past_the_task_timeout_is_not_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first attempt failed (its task stays open for a retry); the retry, reported running, keeps it open."""
    fake_leadership(monkeypatch, lambda: True)
    now = [0.0]
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: now[0])
    timeout_s = service._tasks.timeout_s
    service._tasks.record(request_task("r1"), 1, 1, 0.01, ok=False, now=0.0)
    now[0] = timeout_s - 10.0
    await service.ReportLiveRequests(scheduler_pb2.LiveRequests(request_ids=["r1"]), None)
    assert service._tasks.expire(timeout_s + 10.0) == 0
    await service.close()


async def test_the_observed_ttft_ratio_tells_a_budget_met_from_one_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the SDK's default bounds (0, 5, 10, ...) a ratio of 0.9 and one of 1.5 fell in the same bucket."""
    fake_leadership(monkeypatch, lambda: True)
    reader = InMemoryMetricReader()
    telemetry = Telemetry("scheduler/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    service = SchedulerService(SchedulerConfig(), telemetry)
    for i, ttft_ms in enumerate((900, 1500)):
        await service.Finished(scheduler_pb2.FinishedRequest(  # type: ignore[arg-type]
            request_id=f"r{i}", ttft_ms=ttft_ms, context=common_pb2.RequestContext(ttft_budget_ms=1000),
            outcome=scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED), FakeContext())
    metrics = reader.get_metrics_data()
    [point] = [p for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
               if m.name == "baton.scheduler.observed_ttft_ratio" for p in m.data.data_points]
    met, missed = point.explicit_bounds.index(1.0), point.explicit_bounds.index(1.5)
    assert sum(point.bucket_counts[:met + 1]) == 1 and point.bucket_counts[missed] == 1
    await service.close()
