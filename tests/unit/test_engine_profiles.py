"""Placement reads the profiles nodes register, and says which fallback placed a node without one."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from google.protobuf import json_format

from baton.v1 import common_pb2, scheduler_pb2
from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.load import Load
from services.common.profile_proto import profile_from_proto, profile_to_proto
from services.common.telemetry import Telemetry
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.factory import build_host, node_info
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import ClusterView, NodeSpec, NodeStatus
from services.scheduler.model_planner import ModelPlanner
from services.scheduler.placement import PlaceAsk, Placer
from services.scheduler.policies import Option, PlacementRequest, make_policy
from services.scheduler.retry_budget import RetryBudget
from services.scheduler.servicer import SchedulerService, node_spec
from simulator.simulation import Simulation, fleet
from tests.unit.leading import fake_leadership
from tests.unit.sim_profiles import sim_profiles

pytestmark = pytest.mark.timeout(10)

MODEL = "tiny-llama"  # not a sim model: what a node can predict of it is only what it registered
CALIBRATED = sim_profiles("h100", "sim-llama-3-8b")["sim-llama-3-8b"]


def calibrated(slowdown: float = 1.0) -> EngineProfile:
    """A calibrated profile, every coefficient slowdown times the reference one."""
    timing = CALIBRATED.timing
    slower = dataclasses.replace(timing, **{f.name: getattr(timing, f.name) * slowdown
                                            for f in dataclasses.fields(timing)})
    return dataclasses.replace(CALIBRATED, timing=slower, source=ProfileSource.CALIBRATED, num_samples=40)


def status(node_id: str, profile: EngineProfile | None, **load: int) -> NodeStatus:
    spec = NodeSpec(node_id, node_id, "cpu", 1.0, frozenset({MODEL}), engine="vllm",
                    profiles={MODEL: profile} if profile else {})
    return NodeStatus(spec=spec, load=Load(kv_blocks_total=25_000, **load))


def request(prompt: int, deadline_ms: int = 0) -> PlacementRequest:
    return PlacementRequest(request_id="r", model=MODEL, num_prompt_tokens=prompt, num_prompt_blocks=prompt // 16,
                            max_tokens=16, deadline_ms=deadline_ms)


@pytest.mark.parametrize("policy", ["baton", "weighted_least_loaded"])
def test_a_node_calibrated_slower_loses_the_long_prompt_to_one_calibrated_faster(policy: str) -> None:
    # Same GPU label, same load: only the registered profiles tell them apart.
    slow_first = [status("a", calibrated(3.0)), status("b", calibrated())]
    fast_first = [status("a", calibrated()), status("b", calibrated(3.0))]
    assert make_policy(policy).choose(request(4000), slow_first, {}, 0.0).node_id == "b"
    assert make_policy(policy).choose(request(4000), fast_first, {}, 0.0).node_id == "a"
    assert make_policy(policy).choose(request(4000), fast_first, {}, 0.0).fallback == ""


def test_with_no_profile_registered_the_fallback_places_and_is_named_in_the_decision() -> None:
    nodes = [status("a", None, num_running=3), status("b", None)]
    placed = make_policy("baton").choose(request(4000), nodes, {}, 0.0)
    assert placed.node_id == "b"  # the fallback: KV overlap and load
    assert "no engine profile registered by any candidate (a, b)" in placed.fallback
    assert "placed by dynamo's KV-load cost" in placed.fallback


def test_a_node_without_a_profile_beside_profiled_ones_is_named_not_silently_dropped() -> None:
    nodes = [status("a", None), status("b", calibrated(3.0))]
    placed = make_policy("baton").choose(request(4000), nodes, {}, 0.0)
    assert placed.node_id == "b"
    assert placed.fallback == "no engine profile registered by a: not scored, placed among the candidates that have one"
    weighted = make_policy("weighted_least_loaded").choose(request(4000), nodes, {}, 0.0)
    assert weighted.fallback == "no engine profile registered by a: counted as the slowest profiled node"
    alone = make_policy("weighted_least_loaded").choose(request(4000), [status("a", None)], {}, 0.0)
    assert alone.fallback == "no engine profile registered by any candidate (a): placed by fewest in flight"


def _placer(*nodes: NodeStatus) -> Placer:
    view = ClusterView(load_timeout_s=5.0)
    view.set_nodes([n.spec for n in nodes])
    for n in nodes:
        view.report_load(n.spec.node_id, n.load, 0.0)
    return Placer(view, make_policy("baton"), RetryBudget(ratio=0.0, min_retries_per_s=5.0), ModelPlanner())


def test_admission_predicts_deadlines_from_registered_profiles_and_says_when_it_cannot() -> None:
    impossible = PlaceAsk(request(4000, deadline_ms=5))
    placer = _placer(status("a", calibrated()))
    with pytest.raises(Exception, match="deadline_ms=5: cannot be met"):
        placer.start(impossible, 1.0)
    unprofiled = _placer(status("a", None))
    plan = unprofiled.start(impossible, 1.0)
    assert unprofiled.ticket(plan, unprofiled.options(plan, lambda _: {}), 1.0) is not None  # not refused
    assert plan.unpredicted == ("admission: no candidate registered an engine profile, so its time to first token "
                                "and deadline were not predicted and nothing was refused on them")


def test_a_sim_node_registers_its_configured_profile_and_the_scheduler_reads_it() -> None:
    config = NodeAgentConfig(node_id="n1", gpu="a100", model="sim-llama-3-8b", max_num_batched_tokens=512,
                             max_num_seqs=3)
    info = node_info(config, build_host(config))
    registered = json_format.Parse(json_format.MessageToJson(info), common_pb2.NodeInfo())  # as etcd holds it
    spec = node_spec(registered)
    profile = spec.profiles["sim-llama-3-8b"]
    assert profile.source is ProfileSource.CONFIGURED
    assert profile.timing == sim_profiles("a100", "sim-llama-3-8b")["sim-llama-3-8b"].timing
    assert (spec.engine, spec.max_num_batched_tokens, profile.max_num_batched_tokens) == ("sim", 512, 512)
    assert profile.max_num_seqs == 3 and "3 sequences" in profile.describe()
    assert profile_from_proto(common_pb2.ModelInfo(name="x")) is None  # none registered: none read
    with_profile = common_pb2.ModelInfo(name="x", profile=profile_to_proto(calibrated(2.0)))
    assert profile_from_proto(with_profile) == calibrated(2.0)


def test_the_simulators_nodes_register_profiles_and_the_policy_reads_only_those() -> None:
    simulation = Simulation(fleet("1xh100,1xl4"), make_policy("baton"))
    nodes = {s.spec.node_id: s for s in simulation._view.nodes()}
    assert nodes["h100-0"].profile("sim-llama-3.1-8b") == sim_profiles("h100", "sim-llama-3.1-8b", num_kv_blocks=25426)[
        "sim-llama-3.1-8b"]
    # Take the profiles away and the policy cannot predict: it says so instead of reading the sim table.
    bare = [dataclasses.replace(s, spec=dataclasses.replace(s.spec, profiles={})) for s in nodes.values()]
    sim_request = dataclasses.replace(request(100), model="sim-llama-3.1-8b")
    assert "no engine profile" in make_policy("baton").choose_among([Option(sim_request, bare, {})], 0.0)[1].fallback


async def test_get_recent_decisions_names_the_fallback_that_placed_a_node_without_a_profile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([status("n0", None).spec])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())

    class Context:
        def time_remaining(self) -> float:
            return 30.0

    try:
        placement = await asyncio.wait_for(service.Place(scheduler_pb2.PlaceRequest(
            request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=8), Context()), 5)  # type: ignore[arg-type]
        recent = await service.GetRecentDecisions(scheduler_pb2.GetRecentDecisionsRequest(), Context())  # type: ignore[arg-type]
    finally:
        await service.close()
    assert placement.node_id == "n0"
    fallback = recent.decisions[0].fallback
    assert "no engine profile registered by any candidate (n0): placed by dynamo's KV-load cost" in fallback
    assert "admission: no candidate registered an engine profile" in fallback


async def test_a_moves_decision_says_why_it_moved_and_which_nodes_it_avoided(monkeypatch: pytest.MonkeyPatch) -> None:
    """A move's decision looked like a first placement: no cause, and the node it left simply missing from the
    candidates (helper-158)."""
    fake_leadership(monkeypatch, lambda: True)
    clock = [100.0]
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"), clock=lambda: clock[0])
    service._role.elected.set()
    service._cluster.set_nodes([status("n0", None).spec, status("n1", None).spec])
    for node_id in ("n0", "n1"):
        service._cluster.report_load(node_id, Load(kv_blocks_total=1000), clock[0])

    class Context:
        def time_remaining(self) -> float:
            return 30.0

    try:
        await asyncio.wait_for(service.Place(scheduler_pb2.PlaceRequest(
            request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=8), Context()), 5)  # type: ignore[arg-type]
        moved = await asyncio.wait_for(service.Place(scheduler_pb2.PlaceRequest(
            request_id="r1", model=MODEL, num_prompt_tokens=16, max_tokens=8, retry_cause="stalled",
            exclude_node_ids=["n0"], resumed=True), Context()), 5)  # type: ignore[arg-type]
        asked = scheduler_pb2.GetRecentDecisionsRequest()
        recent = await service.GetRecentDecisions(asked, Context())  # type: ignore[arg-type]
    finally:
        await service.close()
    assert moved.node_id == "n1"
    move, first = recent.decisions  # newest first
    assert (move.retry_cause, list(move.excluded_node_ids)) == ("stalled", ["n0"])
    assert (first.retry_cause, list(first.excluded_node_ids)) == ("", [])
    assert move.waited_ms == first.waited_ms == 0  # nothing waited: the clock never moved
