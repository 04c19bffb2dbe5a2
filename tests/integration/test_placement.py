"""Baton's policy on a live mixed fleet: budgets pick the GPU, and every decision explains itself."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "sim-llama-3.1-8b"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_nodes=3, gpus=("h100", "a100", "l4"), model=MODEL, speed=20.0,
                       scheduler_args=("--policy=baton",))
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


def recent(cluster: LocalCluster) -> scheduler_pb2.RecentDecisions:
    assert cluster.scheduler is not None
    with grpc.insecure_channel(cluster.scheduler.address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
            scheduler_pb2.GetRecentDecisionsRequest(limit=1), timeout=5)


def idle(cluster: LocalCluster) -> bool:
    return all(n.load.num_running == 0 and n.load.num_waiting == 0 for n in cluster.cluster_state().nodes)


async def test_on_an_idle_fleet_a_tight_budget_and_slack_alike_go_to_the_h100(mixed: LocalCluster) -> None:
    """The whole fleet is paid while a request runs, so with every GPU idle the fastest serves even a
    request whose budget the cheaper A100 would meet (budgets moving work to cheaper GPUs once the H100
    is loaded: tests/unit/test_baton_policy.py and the simulator's tests)."""
    assert mixed.router is not None
    async with BatonClient(mixed.router.address) as client:
        tight = await client.complete(MODEL, "a long document to read quickly. " * 250, max_tokens=8,
                                      ttft_budget_ms=400)
        wait_until(lambda: idle(mixed), 10, "idle nodes")
        relaxed = await client.complete(MODEL, "a short question", max_tokens=64, ttft_budget_ms=5000)
    assert tight.node_ids == ["node-0"]  # h100
    assert relaxed.node_ids == ["node-0"]  # h100: priced at busy time alone, the cheaper a100 won


async def test_every_decision_records_each_candidates_terms(mixed: LocalCluster) -> None:
    assert mixed.router is not None
    async with BatonClient(mixed.router.address) as client:
        result = await client.complete(MODEL, "explain yourself", max_tokens=4, workflow_id="wf-1", step=1,
                                       total_steps=3)
    decision = recent(mixed).decisions[0]
    assert recent(mixed).policy == "baton"
    assert decision.node_id == result.node_ids[0]
    assert (decision.context.workflow_id, decision.context.step, decision.context.total_steps) == ("wf-1", 1, 3)
    by_node = {c.node_id: c for c in decision.candidates}
    assert set(by_node) == {"node-0", "node-1", "node-2"}
    assert {c.gpu for c in decision.candidates} == {"h100", "a100", "l4"}
    assert by_node["node-2"].predicted_tpot_ms > by_node["node-0"].predicted_tpot_ms  # l4 decodes slower
    assert all(c.cost > 0 and 0 < c.success <= 1 for c in decision.candidates)
