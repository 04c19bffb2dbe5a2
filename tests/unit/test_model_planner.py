"""The leader's model placement: load what is short of warm capacity, where it costs least to do so."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from google.protobuf import json_format

from baton.v1 import common_pb2, scheduler_pb2
from services.common import etcd_keys
from services.common.errors import Unavailable
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.admission import TenantLimits, Ticket
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import ClusterView, NodeSpec
from services.scheduler.leadership import LeaderRole
from services.scheduler.model_planner import ModelAction, ModelPlanner
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership
from tests.unit.test_place_during_election import FakeContext, Refused

A, B = "sim-llama-3-8b", "sim-llama-2-7b"


def spec(node_id: str, warm: set[str] = frozenset(), cold: set[str] = frozenset(), loading: set[str] = frozenset(),
         load_s: float = 49.0, price: float = 2.0) -> NodeSpec:
    return NodeSpec(node_id, node_id, "a100", price, frozenset(warm), cold_models=frozenset(cold | loading),
                    loading_models=frozenset(loading), load_time_s={m: load_s for m in {*warm, *cold, *loading}})


def view(*specs: NodeSpec, loads: dict[str, Load] | None = None, now: float = 0.0) -> ClusterView:
    cluster = ClusterView(load_timeout_s=10.0)
    cluster.set_nodes(list(specs), now=0.0)
    for node_id, load in (loads or {}).items():
        cluster.report_load(node_id, load, now)
    return cluster


SATURATED = Load(num_waiting=8, kv_blocks_used=10, kv_blocks_total=1000)
CALM = Load(num_running=1, kv_blocks_used=10, kv_blocks_total=1000)
IDLE = Load(kv_blocks_total=1000)


def test_nothing_is_loaded_without_demand() -> None:
    planner = ModelPlanner()
    assert planner.plan(view(spec("n0", cold={A})), now=100.0) == []


def test_a_model_nobody_has_warm_is_loaded_on_a_free_gpu() -> None:
    planner = ModelPlanner()
    planner.note_demand(A, 99.0)
    cluster = view(spec("n0", warm={B}, cold={A}), spec("n1", cold={A, B}))
    assert planner.plan(cluster, now=100.0) == [ModelAction("load", "n1", A, "no node has it warm")]


def test_saturated_warm_capacity_gets_another_node_and_calm_capacity_does_not() -> None:
    planner = ModelPlanner()
    planner.note_demand(A, 99.0)
    nodes = (spec("n0", warm={A}), spec("n1", cold={A}))
    assert planner.plan(view(*nodes, loads={"n0": CALM}, now=99.0), now=100.0) == []
    actions = planner.plan(view(*nodes, loads={"n0": SATURATED}, now=99.0), now=100.0)
    assert [(a.kind, a.node_id) for a in actions] == [("load", "n1")]
    assert "saturated" in actions[0].reason


def test_a_load_under_way_is_not_capacity_and_is_not_repeated() -> None:
    planner = ModelPlanner()
    planner.note_demand(A, 99.0)
    loading_in_etcd = view(spec("n0", loading={A}), spec("n1", cold={A}))
    assert planner.plan(loading_in_etcd, now=100.0) == []
    ordered_not_yet_seen = view(spec("n0", cold={A}), spec("n1", cold={A}))
    assert planner.plan(ordered_not_yet_seen, now=100.0, busy_nodes=frozenset({"n0"}), loading=frozenset({A})) == []


def test_an_idle_node_is_swapped_only_when_its_model_stays_warm_elsewhere() -> None:
    planner = ModelPlanner(idle_swap_s=10.0)
    planner.note_demand(A, 99.0)
    planner.note_demand(B, 99.0)
    only_b = view(spec("n0", warm={B}, cold={A}))
    assert planner.plan(only_b, now=100.0) == []  # B is wanted and n0 is its only warm node
    two_b = view(spec("n0", warm={B}, cold={A}), spec("n1", warm={B}))
    assert planner.plan(two_b, now=100.0) == [ModelAction("unload", "n0", B, f"make room for {A}"),
                                              ModelAction("load", "n0", A, "no node has it warm")]


def test_two_swaps_of_one_round_never_take_every_warm_copy_of_a_wanted_model() -> None:
    """Two models short at once each swapped out one of the two warm copies of a third, still wanted: none was left
    warm, and its next request waited 65 s for a load (helper-158). One swap is made; the other waits."""
    c = "sim-llama-3.1-8b"
    planner = ModelPlanner(idle_swap_s=10.0)
    planner.note_demand(c, 80.0)
    planner.note_demand(A, 99.0)
    planner.note_demand(B, 99.0)
    both_c = view(spec("n0", warm={c}, cold={A, B}), spec("n1", warm={c}, cold={A, B}),
                  loads={"n0": IDLE, "n1": IDLE}, now=95.0)
    actions = planner.plan(both_c, now=100.0)
    unloaded = [action for action in actions if action.kind == "unload"]
    assert [action.model for action in unloaded] == [c] and len([a for a in actions if a.kind == "load"]) == 1
    assert planner.reserved_nodes() == frozenset()  # nor is the other copy drained for the second


def test_a_node_in_use_is_not_swapped() -> None:
    planner = ModelPlanner(idle_swap_s=10.0)
    planner.note_demand(A, 99.0)
    busy = view(spec("n0", warm={B}, cold={A}), loads={"n0": CALM}, now=99.0)
    assert planner.plan(busy, now=100.0) == []
    just_changed = ClusterView(load_timeout_s=10.0)
    just_changed.set_nodes([spec("n0", warm={B}, cold={A})], now=95.0)
    assert planner.plan(just_changed, now=100.0) == []  # idle for 5 s only


def test_a_free_gpu_is_preferred_to_a_swap_and_the_quicker_load_among_free_ones() -> None:
    planner = ModelPlanner(idle_swap_s=0.0)
    planner.note_demand(A, 99.0)
    cluster = view(spec("n0", warm={B}, cold={A}, load_s=5), spec("n1", cold={A}, load_s=60),
                   spec("n2", cold={A}, load_s=30), spec("n3", warm={B}))
    assert planner.plan(cluster, now=100.0) == [ModelAction("load", "n2", A, "no node has it warm")]


def test_idle_models_are_unloaded_but_never_the_last_warm_copy() -> None:
    planner = ModelPlanner(idle_unload_s=60.0)
    cluster = view(spec("n0", warm={A}), spec("n1", warm={A}), spec("n2", warm={B}))
    actions = planner.plan(cluster, now=100.0)
    assert [(a.kind, a.node_id, a.model) for a in actions] == [("unload", "n0", A)]
    assert planner.plan(cluster, now=30.0) == []  # not idle long enough



# A saturated on n0; B on n1 (three running) and n2 (one running), both with A on disk.
SWAP_NODES = (spec("n0", warm={A}), spec("n1", warm={B}, cold={A}), spec("n2", warm={B}, cold={A}))
BUSIER = Load(num_running=3, kv_blocks_used=10, kv_blocks_total=1000)


def wanting_both() -> ModelPlanner:
    planner = ModelPlanner(idle_swap_s=10.0)
    planner.note_demand(A, 99.0)
    planner.note_demand(B, 99.0)
    return planner


def b_busy() -> ClusterView:
    return view(*SWAP_NODES, loads={"n0": SATURATED, "n1": BUSIER, "n2": CALM}, now=99.0)


def test_with_every_other_node_busy_one_is_drained_for_the_swap_and_released_once_demand_calms() -> None:
    """A is saturated on n0; B's nodes are never idle (placement spreads B over both), so none could
    be swapped after 10 s idle: the less loaded one is reserved, gets nothing new, and is swapped as
    soon as its requests end (without the reservation A never got a second node)."""
    planner = wanting_both()
    busy = b_busy()
    assert planner.plan(busy, now=100.0) == [] and planner.reserved_nodes() == {"n2"}
    drained = view(*SWAP_NODES, loads={"n0": SATURATED, "n1": BUSIER, "n2": Load(kv_blocks_total=1000)}, now=100.0)
    assert [(a.kind, a.node_id, a.model) for a in planner.plan(drained, now=101.0)] == [("unload", "n2", B),
                                                                                         ("load", "n2", A)]
    assert planner.reserved_nodes() == frozenset()
    planner.plan(busy, now=102.0)
    assert planner.reserved_nodes() == {"n2"}
    calm = view(*SWAP_NODES, loads={"n0": CALM, "n1": BUSIER, "n2": CALM}, now=102.0)
    assert planner.plan(calm, now=103.0) == [] and planner.reserved_nodes() == frozenset()


def test_no_node_is_drained_when_its_model_would_be_left_saturated_or_without_a_warm_copy() -> None:
    planner = wanting_both()
    lone_b = (spec("n0", warm={A}), spec("n1", warm={B}, cold={A}))
    planner.plan(view(*lone_b, loads={"n0": SATURATED, "n1": CALM}, now=99.0), now=100.0)
    assert planner.reserved_nodes() == frozenset()
    both_busy_b = (*lone_b, spec("n2", warm={B}, cold={A}))
    planner.plan(view(*both_busy_b, loads={"n0": SATURATED, "n1": SATURATED, "n2": SATURATED}, now=99.0), now=100.0)
    assert planner.reserved_nodes() == frozenset()


def test_a_reservation_is_dropped_when_its_node_could_no_longer_go() -> None:
    """n2 is reserved for A; then B's other node goes silent (or saturates): n2 is B's last good copy,
    so it is not swapped, and it takes B's requests again."""
    planner = wanting_both()
    busy = b_busy()
    planner.plan(busy, now=100.0)
    assert planner.reserved_nodes() == {"n2"}
    drained = {"n0": SATURATED, "n2": Load(kv_blocks_total=1000)}

    def just_drained(cluster: ClusterView) -> ClusterView:
        cluster.get("n2").last_placed_at = 100.0  # it served until a moment ago: not idle for a swap
        return cluster

    saturated_b = just_drained(view(*SWAP_NODES, loads={**drained, "n1": SATURATED}, now=100.0))
    assert planner.plan(saturated_b, now=101.0) == [] and "n2" not in planner.reserved_nodes()
    planner.release()
    planner.plan(busy, now=102.0)
    assert planner.reserved_nodes() == {"n2"}
    silent_b = just_drained(view(*SWAP_NODES, loads=drained, now=100.0))
    silent_b.report_load("n1", CALM, 80.0)  # last heard 22 s ago: not live
    assert planner.plan(silent_b, now=102.0) == [] and planner.reserved_nodes() == frozenset()


def test_a_node_just_swapped_is_not_drained_again_before_its_load_has_paid() -> None:
    planner = wanting_both()
    cluster = ClusterView(load_timeout_s=10.0)
    cluster.set_nodes(list(SWAP_NODES), now=70.0)  # B came to n1 and n2 30 s ago; its load takes 49 s
    for now in (100.0, 120.0):
        for node_id, load in {"n0": SATURATED, "n1": CALM, "n2": CALM}.items():
            cluster.report_load(node_id, load, now)
        planner.plan(cluster, now=now)
        assert planner.reserved_nodes() == (frozenset() if now == 100.0 else {"n1"})


def test_a_reservation_holds_while_its_model_loads_elsewhere_and_goes_when_leadership_does() -> None:
    planner = wanting_both()
    busy = b_busy()
    planner.plan(busy, now=100.0)
    assert planner.plan(busy, now=101.0, loading=frozenset({A})) == [] and planner.reserved_nodes() == {"n2"}
    planner.release()
    assert planner.reserved_nodes() == frozenset()


def test_a_successor_keeps_its_predecessors_demand_and_the_idleness_the_load_reports_showed() -> None:
    """A leader died a second after a request for B ran on n0, B's only warm node, while A waited for a GPU. Its
    successor, a standby that saw the load reports but placed nothing, took B for unwanted and n0 for idle since it
    first saw it, and swapped B out at once (helper-126). Handed the demand, it keeps B; and a node shown busy by a
    report of a second ago is not idle for idle_swap_s either."""
    leader = ModelPlanner(idle_swap_s=10.0)
    leader.note_demand(A, 1_000.0)
    leader.note_demand(B, 1_000.0)
    state = leader.demand_state(now=1_001.0)
    assert state == {A: 1.0, B: 1.0}

    only_copy = view(spec("n0", warm={B}, cold={A}))
    forgetful = ModelPlanner(idle_swap_s=10.0)
    forgetful.note_demand(A, 50.0)
    assert [a.kind for a in forgetful.plan(only_copy, now=50.0)] == ["unload", "load"]  # as it was
    successor = ModelPlanner(idle_swap_s=10.0)
    successor.restore_demand(state, now=50.0)  # another host's clock
    assert successor.plan(only_copy, now=50.0) == []  # B is wanted and n0 is its only warm copy

    # B warm on another node too, so n0 may go once idle: idle since the report that last showed it busy.
    reported = view(spec("n0", warm={B}, cold={A}), spec("n1", warm={B}), loads={"n0": CALM}, now=49.0)
    reported.report_load("n0", Load(kv_blocks_total=1000), 49.5)
    assert successor.plan(reported, now=50.0) == []
    assert successor.plan(reported, now=59.2) == [ModelAction("unload", "n0", B, f"make room for {A}"),
                                                  ModelAction("load", "n0", A, "no node has it warm")]


async def test_the_leaders_hand_over_state_carries_its_models_demand() -> None:
    """What the scheduler writes for its successor (every second, while it leads) and what that successor restores:
    the models asked for lately, by age, so the successor's planner sees them wanted."""
    leader = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 1_000.0)
    leader._planner.note_demand(B, 998.0)
    state = leader._hand_over_state()
    successor = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 7.0)
    successor._take_over_state(state)
    assert successor._planner.demand_state(now=7.0) == {B: 2.0}
    for service in (leader, successor):
        await service.close()


class _ShortCall(FakeContext):
    def time_remaining(self) -> float:
        return 0.5


async def test_a_request_waiting_for_a_gpu_no_one_frees_is_refused_before_its_call_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its model only on the disk of a node serving another model in use, so the planner frees no GPU: the leader
    answered nothing until the router's call timed out, and the router, taking the leader for lost, waited 30 s more
    for another, then blamed the leader (helper-126). Now the leader refuses it within the call, saying why."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([spec("n0", warm={B}, cold={A})])
    service._cluster.report_load("n0", CALM, time.monotonic())
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=A, num_prompt_tokens=16, max_tokens=8)
    try:
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(request, _ShortCall()), 5)  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no live node has it warm, or a free GPU to load it" in str(refused.value)
        waited = re.search(r"; waited (\S+) s for the model planner to load it", str(refused.value))
        assert waited is not None and 0.3 <= float(waited[1]) < 0.5  # within the call's 0.5 s, its reply's room left
    finally:
        await service.close()


@pytest.mark.parametrize("at_limit", [True, False])
async def test_a_request_its_tenants_limits_refuse_asks_for_no_load_of_its_model(
        monkeypatch: pytest.MonkeyPatch, at_limit: bool) -> None:
    """Its model only on the disk of a busy node: the demand was noted before admission, so a tenant at its limit,
    asking again and again, had the planner swap the model in for requests that were every one refused. A request
    its tenant's limits let in still asks for the load (then waits for it), as before."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([spec("n0", warm={B}, cold={A})])
    service._cluster.report_load("n0", CALM, time.monotonic())
    service._admission.set_limits({"t": TenantLimits(max_concurrency=1)})
    if at_limit:  # its one slot is taken by a request that runs
        service._admission.on_admitted(Ticket(request_id="r0", tenant="t", priority=0, num_tokens=48,
                                              arrived_at=time.monotonic()), time.monotonic())
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=A, num_prompt_tokens=16, max_tokens=32,
                                         context=common_pb2.RequestContext(tenant="t"))
    try:
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(request, _ShortCall()), 5)  # type: ignore[arg-type]
        if at_limit:
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 't' is at its concurrency limit of 1" in str(refused.value)
        else:  # no GPU is freed for it within the call (n0's model is in use)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert (A in service._planner.demand_state(time.monotonic())) is not at_limit
    finally:
        await service.close()


async def test_the_cluster_state_names_a_node_drained_for_a_swap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reserved node gets nothing new while its requests end: it sat unused with nothing saying why (helper-126).
    The leader's GetClusterState names the model it is reserved for (`baton status` prints it:
    tests/unit/test_cli_status.py)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 100.0)
    try:
        service._cluster = b_busy()
        service._planner.note_demand(A, 99.0)
        service._planner.note_demand(B, 99.0)
        service._planner.plan(service._cluster, now=100.0)
        asked = scheduler_pb2.GetClusterStateRequest()
        state = await service.GetClusterState(asked, FakeContext())  # type: ignore[arg-type]
        assert [n.reserved_for_model for n in state.nodes] == ["", "", A]  # n0, n1, n2
    finally:
        await service.close()


async def test_the_cluster_state_shows_a_draining_node_with_the_streams_it_still_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node shutting down (SIGTERM) is no candidate, but runs its streams on and is paid for: the cluster state
    left it out, `baton status` counting one node fewer while four streams ran there (helper-158)."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: 100.0)
    try:
        infos = {n: common_pb2.NodeInfo(node_id=n, address=f"{n}:1", gpu="h100", price_per_hour=2.0,
                                        draining=n == "n1") for n in ("n0", "n1")}
        service._on_nodes_changed({etcd_keys.node_key(n): json_format.MessageToJson(info).encode()
                                   for n, info in infos.items()})

        async def reports() -> AsyncIterator[common_pb2.NodeLoad]:
            yield common_pb2.NodeLoad(node_id="n1", num_running=4, kv_blocks_total=1000)

        await service.ReportLoad(reports(), FakeContext())  # type: ignore[arg-type]
        state = await service.GetClusterState(scheduler_pb2.GetClusterStateRequest(), FakeContext())  # type: ignore
        assert [(n.info.node_id, n.info.draining, n.load.num_running) for n in state.nodes] == [
            ("n0", False, 0), ("n1", True, 4)]
        assert state.nodes[1].load_age_ms == 0
        assert [s.spec.node_id for s in service._cluster.nodes()] == ["n0"]  # no candidate
    finally:
        await service.close()


def _leader_with_two_cold_nodes(monkeypatch: pytest.MonkeyPatch) -> SchedulerService:
    """A leading scheduler whose nodes n0 and n1 both have model A cold, on free GPUs."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([spec("n0", cold={A}), spec("n1", cold={A})])
    for node_id in ("n0", "n1"):
        service._cluster.report_load(node_id, Load(kv_blocks_total=1000), time.monotonic())
    return service


@pytest.mark.parametrize("resumed", [False, True])
async def test_a_request_whose_cold_node_fails_to_load_it_is_placed_on_another(
        monkeypatch: pytest.MonkeyPatch, resumed: bool) -> None:
    """The node chosen to load the request's model died mid-load: the request, which ran nowhere, was refused, and
    the openai client's retries were placed on the dead node again, still a candidate until its lease ended
    (helper-126). The leader places it again without that node."""
    service = _leader_with_two_cold_nodes(monkeypatch)
    tried: list[str] = []

    async def ensure_warm(node_id: str, address: str, model: str, reason: str) -> None:
        tried.append(node_id)
        if len(tried) == 1:
            raise Unavailable(f"loading {model} on node {node_id} failed: UNAVAILABLE: Stream removed")

    monkeypatch.setattr(service._loader, "ensure_warm", ensure_warm)
    # Admitted again, it is not charged twice: the failed attempt gives its tokens back (helper-128).
    service._admission.set_limits({"t": TenantLimits(tokens_per_minute=40)})
    # (A resumed one keeps its slot too: released and admitted again, it was charged twice, helper-131.)
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=A, num_prompt_tokens=16, max_tokens=8,
                                         context=common_pb2.RequestContext(tenant="t"), resumed=resumed,
                                         router_id="router-0")
    try:
        placement = await asyncio.wait_for(service.Place(request, FakeContext()), 5)  # type: ignore[arg-type]
        assert len(tried) == 2 and tried[0] != tried[1] and placement.node_id == tried[1]
        assert service._admission.in_flight("t") == 1 and service._admission._tenants["t"].served_tokens == 24
    finally:
        await service.close()


@pytest.mark.parametrize("resumed", [False, True])
async def test_a_call_abandoned_mid_load_leaves_the_slot_to_its_resend(monkeypatch: pytest.MonkeyPatch,
                                                                      resumed: bool) -> None:
    """A router abandons its Place when etcd shows a new leader and sends it again, here to the same replica (elected
    again). The resend is admitted on the first call's slot and placed; the first call, cancelled while its node
    loaded the model, freed that slot and gave its tokens back while the resend ran (helper-130)."""
    service = _leader_with_two_cold_nodes(monkeypatch)
    loading, never = asyncio.Event(), asyncio.Event()

    async def ensure_warm(node_id: str, address: str, model: str, reason: str) -> None:
        if not loading.is_set():  # the first call's load hangs
            loading.set()
            await never.wait()

    monkeypatch.setattr(service._loader, "ensure_warm", ensure_warm)
    service._admission.set_limits({"t": TenantLimits(tokens_per_minute=40)})
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=A, num_prompt_tokens=16, max_tokens=8,
                                         context=common_pb2.RequestContext(tenant="t"), router_id="router-0",
                                         resumed=resumed)
    try:
        first = asyncio.create_task(service.Place(request, FakeContext()))  # type: ignore[arg-type]
        await asyncio.wait_for(loading.wait(), 5)
        await asyncio.wait_for(service.Place(request, FakeContext()), 5)  # type: ignore[arg-type]
        first.cancel()  # its router gave it up
        with pytest.raises(asyncio.CancelledError):
            await first
        assert service._admission.in_flight("t") == 1 and service._admission._tenants["t"].served_tokens == 24
    finally:
        await service.close()


async def test_a_request_admitted_as_its_leader_lost_the_lease_gives_its_slot_and_tokens_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Admitted, then refused because the replica lost its lease before deciding: the request ran nowhere, and its
    router sends it to the successor. Kept, its slot and tokens counted against its tenant here until the lease
    ran out (helper-128), should this replica lead again."""
    leading = [True]
    fake_leadership(monkeypatch, lambda: leading[0])

    async def shown(self: LeaderRole, timeout_s: float) -> None:
        return None

    monkeypatch.setattr(LeaderRole, "wait_successor_shown", shown)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([spec("n0", warm={A})])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
    enter = service._gate.enter

    async def enter_then_lose_the_lease(*args: object) -> bool:
        waited = await enter(*args)  # type: ignore[arg-type]
        leading[0] = False
        return waited

    monkeypatch.setattr(service._gate, "enter", enter_then_lose_the_lease)
    service._admission.set_limits({"t": TenantLimits(tokens_per_minute=40)})
    request = scheduler_pb2.PlaceRequest(request_id="r1", model=A, num_prompt_tokens=16, max_tokens=8,
                                         context=common_pb2.RequestContext(tenant="t"), router_id="router-0")
    try:
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(request, FakeContext()), 5)  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert service._admission.in_flight("t") == 0 and service._admission._tenants["t"].served_tokens == 0
    finally:
        await service.close()
