"""A Place whose fields make no sense is refused at once, by the field's name and value; the next is placed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from baton.v1 import common_pb2, scheduler_pb2
from services.common import etcd_keys
from services.common.failure_cause import RETRY_CAUSES
from services.common.load import Load
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import NodeSpec
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership
from tests.unit.sim_profiles import sim_profiles
from tests.unit.test_place_during_election import FakeContext, Refused

MODEL = "m"
GOOD = {"request_id": "r", "model": MODEL, "num_prompt_tokens": 16, "max_tokens": 8}


@pytest.mark.parametrize(("fields", "named"), [
    ({"max_tokens": -5}, "max_tokens=-5"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"num_prompt_tokens": 0}, "num_prompt_tokens=0"),
    ({"model": ""}, "model=''"),
    ({"context": common_pb2.RequestContext(tpot_budget_ms=-5)}, "tpot_budget_ms=-5"),
    ({"context": common_pb2.RequestContext(ttft_budget_ms=-1)}, "ttft_budget_ms=-1"),
    ({"context": common_pb2.RequestContext(deadline_ms=-2)}, "deadline_ms=-2"),
    ({"context": common_pb2.RequestContext(step=4, total_steps=3, workflow_id="w")}, "step=4"),
    ({"context": common_pb2.RequestContext(step=1)}, "step=1: needs a workflow_id"),
    # One key per full 16-token block of the prompt: 100,000 claimed for 2 tokens counted as load on the node.
    ({"num_prompt_tokens": 2, "block_hashes": range(100_000)}, "block_hashes='100000 hashes': more than the 0"),
    ({"num_prompt_tokens": 47, "block_hashes": range(3)}, "block_hashes='3 hashes': more than the 2 full blocks"),
    # A model no node lists: no context to check against, but no model holds 2^31 - 1 tokens.
    ({"num_prompt_tokens": 2**31 - 1}, "num_prompt_tokens=2147483647: does not fit"),
    ({"max_tokens": 2**31 - 1}, "max_tokens=2147483647: num_prompt_tokens (16) + max_tokens exceeds"),
    ({"context": common_pb2.RequestContext(tenant="t" * 100_000)}, "tenant='tttt"),
    ({"context": common_pb2.RequestContext(workflow_id="w" * 258)}, "258 characters, longer than 257"),
    ({"request_id": "r" * 258}, "258 characters, longer than 257"),
    ({"retry_cause": "c" * 129}, "retry_cause='cccc"),
    ({"retry_cause": "node b failed"}, "retry_cause='node b failed': not a cause of a move"),
    ({"alternative_models": [MODEL] * 17}, "alternative_models='17 models': at most 16"),
    ({"num_generated_tokens": 16}, "num_generated_tokens=16: must be 0 or more and less than num_prompt_tokens (16)"),
    ({"num_generated_tokens": -1}, "num_generated_tokens=-1: must be 0 or more"),
])
@pytest.mark.timeout(10)
async def test_a_place_with_a_senseless_field_is_refused_by_name_and_the_next_is_placed(
        monkeypatch: pytest.MonkeyPatch, fields: dict, named: str) -> None:
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL}))])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
    try:
        with pytest.raises(Refused) as refused:
            request = scheduler_pb2.PlaceRequest(**{**GOOD, **fields})
            await service.Place(request, FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in str(refused.value)
        placement = await service.Place(scheduler_pb2.PlaceRequest(**GOOD), FakeContext())  # type: ignore[arg-type]
        assert placement.node_id == "n0"
    finally:
        await service.close()


@pytest.mark.parametrize(("fields", "named"), [
    ({"num_prompt_tokens": 8192}, "num_prompt_tokens=8192: does not fit the context window of m (8192)"),
    ({"num_prompt_tokens": 8000, "max_tokens": 193}, "max_tokens=193: num_prompt_tokens (8000) + max_tokens exceeds "
                                                     "the context window of m (8192)"),
])
@pytest.mark.timeout(10)
async def test_a_place_longer_than_its_models_context_is_refused_at_once(
        monkeypatch: pytest.MonkeyPatch, fields: dict, named: str) -> None:
    """The model's context as its nodes register it bounds a Place (it waited out the caller's deadline for a
    node that could hold it, then UNAVAILABLE); what fits it is placed."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._node_infos = {"n0": common_pb2.NodeInfo(node_id="n0", models=[
        common_pb2.ModelInfo(name=MODEL, max_context_tokens=8192, is_warm=True)])}
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL}))])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
    try:
        with pytest.raises(Refused) as refused:
            await service.Place(scheduler_pb2.PlaceRequest(**{**GOOD, **fields}),
                                FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in str(refused.value)
        fitting = {**GOOD, "num_prompt_tokens": 8000, "max_tokens": 192, "block_hashes": range(500)}
        placement = await service.Place(scheduler_pb2.PlaceRequest(**fitting), FakeContext())  # type: ignore[arg-type]
        assert placement.node_id == "n0"
    finally:
        await service.close()


async def test_a_senseless_place_is_refused_at_once_even_while_no_leader_is_elected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input does not wait out an election (up to the call's deadline) to be refused."""
    fake_leadership(monkeypatch, lambda: False)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(service.Place(scheduler_pb2.PlaceRequest(**{**GOOD, "max_tokens": -5}),
                                                 FakeContext()), 5)  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await service.close()


@pytest.mark.parametrize("limit", [-1, -100])
async def test_recent_decisions_with_a_negative_limit_are_refused_naming_it(limit: int) -> None:
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    try:
        with pytest.raises(Refused) as refused:
            await service.GetRecentDecisions(scheduler_pb2.GetRecentDecisionsRequest(limit=limit),
                                             FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"limit={limit}: must be 0" in str(refused.value)
    finally:
        await service.close()


def _metered_leader(monkeypatch: pytest.MonkeyPatch) -> tuple[SchedulerService, InMemoryMetricReader]:
    """A leading scheduler whose metrics a reader collects."""
    fake_leadership(monkeypatch, lambda: True)
    reader = InMemoryMetricReader()
    telemetry = Telemetry("scheduler/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    service = SchedulerService(SchedulerConfig(), telemetry)
    service._role.elected.set()
    return service, reader


async def test_a_place_whose_deadline_no_node_could_meet_is_invalid_unless_it_resumes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What no node serving the model could do is bad input (no retry hint); a stream its client resumes asks for
    what is left of its deadline, which only the fleet's load can refuse: DEADLINE_EXCEEDED, no hint (it has less left
    each time it is sent)."""
    service, reader = _metered_leader(monkeypatch)
    model = "sim-llama-3.1-8b"
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({model}), profiles=sim_profiles("h100", model))])
    service._cluster.report_load("n0", Load(kv_blocks_total=100_000), time.monotonic())
    hopeless = {**GOOD, "model": model, "max_tokens": 2000, "context": common_pb2.RequestContext(deadline_ms=5)}
    try:
        for resumed, retry_cause, code in ((False, "", grpc.StatusCode.INVALID_ARGUMENT),
                                           (True, "", grpc.StatusCode.DEADLINE_EXCEEDED),
                                           (True, "stream_broken", grpc.StatusCode.DEADLINE_EXCEEDED)):
            with pytest.raises(Refused) as refused:
                await service.Place(scheduler_pb2.PlaceRequest(**hopeless, resumed=resumed, retry_cause=retry_cause),
                                    FakeContext())  # type: ignore[arg-type]
            assert refused.value.code == code and "deadline_ms=5: cannot be met" in str(refused.value)
    finally:
        await service.close()
    # The first two counted as admission refusals, as the gate's own are (they bypassed the gate's count); not the
    # move, admitted once already (helper-205).
    metrics = reader.get_metrics_data()
    assert sorted((p.attributes["reason"], p.value) for rm in metrics.resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics if m.name == "baton.scheduler.admissions" for p in m.data.data_points) == [
        ("deadline cannot be met", 1), ("deadline_ms no node could meet", 1)]


async def test_a_ttft_budget_is_not_refused_as_bad_input_on_caches_no_kvindex_answered_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No kvindex answered (none is registered here): the prompt's caches read as empty, and an 8,000-token prompt's
    100 ms budget, which only its cache could meet, is the fleet's to refuse, with a retry hint, not bad input
    (helper-209)."""
    service, _ = _metered_leader(monkeypatch)
    model = "sim-llama-3.1-8b"
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({model}), profiles=sim_profiles("h100", model))])
    service._cluster.report_load("n0", Load(kv_blocks_total=100_000), time.monotonic())
    try:
        with pytest.raises(Refused) as refused:
            await service.Place(scheduler_pb2.PlaceRequest(
                request_id="r", model=model, num_prompt_tokens=8000, max_tokens=8, block_hashes=range(1, 501),
                context=common_pb2.RequestContext(ttft_budget_ms=100)), FakeContext())  # type: ignore[arg-type]
    finally:
        await service.close()
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


@pytest.mark.timeout(10)
async def test_a_retry_cause_no_router_sends_is_refused_and_labels_no_metric(monkeypatch: pytest.MonkeyPatch) -> None:
    """retry_cause labels the placements metric: a value of the caller's choosing would add a series each; only
    the causes of a move are taken, and those refused are counted under one label."""
    service, reader = _metered_leader(monkeypatch)
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL}))])
    service._cluster.report_load("n0", Load(kv_blocks_total=1000), time.monotonic())
    try:
        for n in range(3):
            with pytest.raises(Refused) as refused:
                await service.Place(scheduler_pb2.PlaceRequest(**GOOD, retry_cause=f"cause-{n}"),
                                    FakeContext())  # type: ignore[arg-type]
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"retry_cause='cause-{n}': not a cause of a move" in str(refused.value)
        for cause in sorted(RETRY_CAUSES):
            placement = await service.Place(scheduler_pb2.PlaceRequest(**GOOD, retry_cause=cause),
                                            FakeContext())  # type: ignore[arg-type]
            assert placement.node_id == "n0"
    finally:
        await service.close()
    metrics = reader.get_metrics_data()
    assert sorted((p.attributes["outcome"], p.attributes["retry"], p.value) for rm in metrics.resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics if m.name == "baton.scheduler.placements"
                  for p in m.data.data_points) == [
        ("INVALID_ARGUMENT", "unknown", 3), *(("OK", cause, 1) for cause in sorted(RETRY_CAUSES))]



@pytest.mark.parametrize(("fields", "named"), [
    ({"kv_blocks_used": -2**63}, "kv_blocks_used (node 'n0')=-9223372036854775808: must be 0 to"),
    ({"kv_blocks_total": 2**62}, "kv_blocks_total (node 'n0')=4611686018427387904: must be 0 to"),
    ({"num_running": -1}, "num_running (node 'n0')=-1"),
    ({"pending_prefill_tokens": -5}, "pending_prefill_tokens (node 'n0')=-5"),
    ({"num_received": -1}, "num_received (node 'n0')=-1"),
    ({"recent_decode_step_ms": float("nan")}, "recent_decode_step_ms (node 'n0')=nan: must be 0 to 3600000 ms"),
    ({"recent_decode_step_ms": -1.0}, "recent_decode_step_ms (node 'n0')=-1.0"),
])
@pytest.mark.timeout(10)
async def test_a_load_report_no_engine_makes_is_refused_by_name_and_placement_goes_on(
        monkeypatch: pytest.MonkeyPatch, fields: dict, named: str) -> None:
    """One report of kv_blocks_used=-2^63 made every Place fail UNKNOWN (an int64 overflow in the decision's record)
    while the router waited for "a leader" (helper-181). It is refused, and the node's last good report stands."""
    fake_leadership(monkeypatch, lambda: True)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    service._role.elected.set()
    service._cluster.set_nodes([NodeSpec(node_id="n0", address="n0:1", gpu="h100", price_per_hour=1.0,
                                         warm_models=frozenset({MODEL}), profiles=sim_profiles("h100", MODEL))])

    async def reports() -> AsyncIterator[common_pb2.NodeLoad]:
        yield common_pb2.NodeLoad(node_id="n0", kv_blocks_total=1000, num_running=2)
        yield common_pb2.NodeLoad(node_id="n0", **{"kv_blocks_total": 1000, **fields})

    try:
        with pytest.raises(Refused) as refused:
            await service.ReportLoad(reports(), FakeContext())  # type: ignore[arg-type]
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert named in str(refused.value)
        assert service._cluster.get("n0").load.num_running == 2  # type: ignore[union-attr]
        placement = await service.Place(scheduler_pb2.PlaceRequest(**GOOD), FakeContext())  # type: ignore[arg-type]
        assert placement.node_id == "n0"
    finally:
        await service.close()


@pytest.mark.parametrize(("profile", "why"), [
    ({"a_ms": float("nan")}, "a_ms=nan: not a finite time of 0 or more"),
    ({"d_ms": -1e6, "b_ms_per_tok": -5.0}, "b_ms_per_tok=-5.0: not a finite time of 0 or more"),
    ({"f_ms_per_ctx_tok": float("inf")}, "f_ms_per_ctx_tok=inf"),
    ({"num_kv_blocks": -1}, "num_kv_blocks=-1: negative"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens=0: not positive"),
])
async def test_a_registered_profile_no_engine_measures_is_not_used(profile: dict, why: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A NaN or negative profile took every placement: the NaN score compared first won the minimum (helper-181).
    Such a profile is not used, and the scheduler says why once: the node is placed as one without a profile."""
    good = dict(a_ms=5.0, b_ms_per_tok=0.1, max_num_batched_tokens=2048, kv_block_size=16, num_kv_blocks=100,
                source=common_pb2.PROFILE_SOURCE_CALIBRATED)
    models = [common_pb2.ModelInfo(name=MODEL, is_warm=True, profile=common_pb2.EngineProfile(**{**good, **profile})),
              common_pb2.ModelInfo(name="other", profile=common_pb2.EngineProfile(**good))]
    info = common_pb2.NodeInfo(node_id="bad", address="bad:1", gpu="h100", models=models)
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/test", "none"))
    registration = {etcd_keys.node_key("bad"): json_format.MessageToJson(info).encode()}
    try:
        service._on_nodes_changed(registration)
        assert set(service._cluster.get("bad").spec.profiles) == {"other"}  # type: ignore[union-attr]
        warning = f"node 'bad' registered a profile for 'm' that cannot be used ({why}"
        assert warning in caplog.text
        service._on_nodes_changed(registration)  # another node's change: not said again
        assert caplog.text.count(warning) == 1
    finally:
        await service.close()
