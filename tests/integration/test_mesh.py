"""The mesh end to end: real etcd, every service its own process, a client on the generated stubs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from baton.client import BatonClient, Completion
from baton.cluster import LocalCluster
from baton.protocol import STREAM_HELD_KEY
from baton.v1 import (
    common_pb2,
    kvindex_pb2,
    kvindex_pb2_grpc,
    node_agent_pb2,
    node_agent_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common.block_hash import block_hashes
from tests.integration.conftest import MODEL, eventually, wait_until
from tests.reference import reference_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def stream(cluster: LocalCluster, prompt: str, **fields: object) -> Completion:
    assert cluster.router is not None
    async with BatonClient(cluster.router.address) as client:
        return await client.complete(MODEL, prompt, **fields)


async def test_a_client_streams_a_completion(cluster: LocalCluster) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    result = await stream(cluster, prompt, max_tokens=64)

    expected, reason = reference_completion(list(prompt.encode()), 64)
    assert result.token_ids == expected
    assert result.text == bytes(t for t in expected if t < 256).decode()
    assert result.finish_reason == {"length": common_pb2.FINISH_REASON_LENGTH,
                                    "stop": common_pb2.FINISH_REASON_STOP}[reason.value]
    assert result.usage.prompt_tokens == len(prompt.encode())
    assert result.usage.completion_tokens == len(expected)
    assert len(result.node_ids) == 1 and result.node_ids[0].startswith("node-")


async def test_the_node_that_decoded_reports_its_latest_step_time_to_the_scheduler(cluster: LocalCluster) -> None:
    """The node's own measure of its latest decode steps (the TPOT a request decoding there now sees), carried
    in its load report to the scheduler and shown by GetClusterState."""
    result = await stream(cluster, "How long does a decode step take here? " * 2, max_tokens=32)
    served = result.node_ids[0]

    def reported_ms() -> float:
        return next(n.load.recent_decode_step_ms for n in cluster.cluster_state().nodes if n.info.node_id == served)

    await eventually(lambda: reported_ms() > 0, 10, f"{served} to report its decode step time")
    # Milliseconds of wall time: the fixture's nodes run their modelled steps (about 7 ms on an H100 to 66
    # on an L4, an 8B model) 20 times faster, and report them so.
    assert 0.1 < reported_ms() < 5


async def test_twenty_concurrent_streams_all_complete_with_the_right_tokens(cluster: LocalCluster) -> None:
    prompts = [f"request {i}: tell me about the number {i * 7919}." for i in range(20)]
    results = await asyncio.gather(*(stream(cluster, p, max_tokens=48) for p in prompts))

    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_completion(list(prompt.encode()), 48)[0], prompt
        assert result.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    # Each placement is explained: every node's terms, and the chosen node has the lowest score.
    assert cluster.scheduler is not None
    with grpc.insecure_channel(cluster.scheduler.address) as channel:
        recent = scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
            scheduler_pb2.GetRecentDecisionsRequest(limit=20), timeout=5)
    assert recent.policy == "baton"
    placed = {d.request_id: d for d in recent.decisions}
    for result in results:
        decision = placed[result.request_id]
        assert decision.node_id == result.node_ids[0]
        assert {c.node_id for c in decision.candidates} == {"node-0", "node-1", "node-2"}
        assert decision.node_id == min(decision.candidates, key=lambda c: c.score).node_id


async def test_seeded_sampling_is_reproducible(cluster: LocalCluster) -> None:
    prompt = "Sample me something."
    first = await stream(cluster, prompt, max_tokens=40, temperature=0.8, seed=1234)
    again = await stream(cluster, prompt, max_tokens=40, temperature=0.8, seed=1234)
    other = await stream(cluster, prompt, max_tokens=40, temperature=0.8, seed=4321)
    assert first.token_ids == again.token_ids
    assert first.token_ids == reference_completion(list(prompt.encode()), 40, 0.8, 1234)[0]
    assert other.token_ids != first.token_ids


async def test_a_repeated_prompt_goes_to_the_node_that_caches_it(cluster: LocalCluster) -> None:
    prompt = "A long shared system prompt that many requests repeat word for word. " * 6
    first = await stream(cluster, prompt, max_tokens=16)
    assert first.usage.cached_tokens == 0
    # Let the first request's completion reach the scheduler's view of load.
    wait_until(lambda: all(n.load.num_running == 0 for n in cluster.cluster_state().nodes), 10, "idle nodes")

    second = await stream(cluster, prompt, max_tokens=16)
    num_prompt = len(prompt.encode())
    assert second.usage.cached_tokens == (num_prompt - 1) // 16 * 16
    assert second.token_ids == first.token_ids


async def test_the_cached_prefix_alone_decides_where_a_prompt_goes(cluster: LocalCluster) -> None:
    """Where every tie-break points at one node, the prompt goes to the node whose cache holds it:
    an uncached prompt of the same length shows where it would go without the KV index."""
    length = 3000
    uncached = [(7 * i) % 200 + 32 for i in range(length)]
    cached = [(11 * i + 3) % 200 + 32 for i in range(length)]
    assert cluster.router is not None and cluster.kvindex is not None
    async with BatonClient(cluster.router.address) as client:
        blind = await client.complete(MODEL, prompt_token_ids=uncached, max_tokens=4, ignore_eos=True)
    holder = next(node for node in cluster.nodes if node.name != blind.node_ids[0])
    # The holder computes the prompt, unknown to the router: only its KV events tell the scheduler.
    warm = node_agent_pb2.NodeGenerateRequest(request_id="warm-holder", model=MODEL, prompt_token_ids=cached,
                                              sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
    async with grpc.aio.insecure_channel(holder.address) as channel:
        [_ async for _ in node_agent_pb2_grpc.NodeAgentStub(channel).Generate(warm, timeout=30)]

    async def indexed_on_holder() -> bool:
        async with grpc.aio.insecure_channel(cluster.kvindex.address) as channel:
            reply = await kvindex_pb2_grpc.KVIndexStub(channel).QueryOverlap(
                kvindex_pb2.OverlapRequest(model=MODEL, block_hashes=block_hashes(cached)), timeout=5)
        return dict(reply.matched_blocks).get(holder.name, 0) > 0

    await eventually(indexed_on_holder, 20, "the holder's blocks of the prompt in the kvindex")
    wait_until(lambda: all(n.load.num_running == 0 for n in cluster.cluster_state().nodes), 10, "idle nodes")
    async with BatonClient(cluster.router.address) as client:
        placed = await client.complete(MODEL, prompt_token_ids=cached, max_tokens=4, ignore_eos=True)
    assert placed.node_ids == [holder.name]
    assert placed.usage.cached_tokens == (length - 1) // 16 * 16


async def test_a_nodes_checkpoints_say_how_much_of_the_prompt_it_found_cached(cluster: LocalCluster) -> None:
    """The router counts what each move's node prefilled again from its checkpoints (a node that dies before its
    finish sends no usage): a prompt computed once is found cached the second time, all but its last block."""
    prompt = [(13 * i + 5) % 200 + 32 for i in range(100)]
    node = cluster.nodes[0]

    async def cached_per_chunk(request_id: str) -> set[int]:
        request = node_agent_pb2.NodeGenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=prompt,
                                                     sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
        async with grpc.aio.insecure_channel(node.address) as channel:
            chunks = [c async for c in node_agent_pb2_grpc.NodeAgentStub(channel).Generate(request, timeout=30)]
        assert sum(len(c.token_ids) for c in chunks) == 3
        return {c.checkpoint.num_cached_tokens for c in chunks if c.token_ids}

    assert await cached_per_chunk("checkpoint-cold") == {0}
    assert await cached_per_chunk("checkpoint-warm") == {(len(prompt) - 1) // 16 * 16}


async def test_a_resume_of_a_stream_its_node_still_serves_takes_its_place(cluster: LocalCluster) -> None:
    """A client whose router froze (or lost it) resumes through another router, which may place the resume on the
    node still serving the old stream: that node refused it as a duplicate, and the client got INVALID_ARGUMENT.
    The resume now ends the old stream (ABORTED, which its router does not take for a node failure); a fresh
    request of a running id is still refused (ALREADY_EXISTS)."""
    prompt = list(b"a stream resumed on its own node")

    def ask(request_id: str, context: list[int], max_tokens: int,
            **fields: object) -> node_agent_pb2.NodeGenerateRequest:
        return node_agent_pb2.NodeGenerateRequest(
            request_id=request_id, model=MODEL, prompt_token_ids=context,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True), **fields)  # type: ignore

    async def refusal(stream: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            while await stream.read() is not grpc.aio.EOF:
                pass
        return refused.value

    async def completed(stream: grpc.aio.UnaryStreamCall) -> int:
        chunks = [c async for c in stream]
        assert chunks[-1].finish_reason
        return sum(len(c.token_ids) for c in chunks)

    async with grpc.aio.insecure_channel(cluster.nodes[0].address) as channel:
        stub = node_agent_pb2_grpc.NodeAgentStub(channel)
        old = stub.Generate(ask("resumed-here", prompt, 4000), timeout=60)
        tokens: list[int] = []
        while not tokens:
            tokens += (await old.read()).token_ids
        duplicate = await refusal(stub.Generate(ask("resumed-here", prompt, 4000), timeout=10))
        assert duplicate.code() == grpc.StatusCode.ALREADY_EXISTS and "already running" in str(duplicate)
        # One that asks for more than the running stream had left, or resumes none of its prompt, is sent elsewhere
        # (UNAVAILABLE marked baton-stream-held: its router places it on another node, not taking this one for
        # failed), and the running stream goes on.
        for max_tokens, num_resumed in ((10**8, len(tokens)), (4, len(prompt) + len(tokens))):
            refused = await refusal(stub.Generate(
                ask("resumed-here", prompt + tokens, max_tokens, num_resumed_tokens=num_resumed), timeout=10))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE and "cannot take over" in str(refused)
            assert dict(refused.trailing_metadata() or ()).get(STREAM_HELD_KEY) == cluster.nodes[0].name
        assert (await stub.GetLoad(node_agent_pb2.GetLoadRequest())).num_running == 1
        more = len(tokens)
        while len(tokens) == more:
            tokens += (await old.read()).token_ids
        resume = ask("resumed-here", prompt + tokens, 4, num_resumed_tokens=len(tokens))
        assert await completed(stub.Generate(resume, timeout=30)) == 4
        ended = await refusal(old)
        assert ended.code() == grpc.StatusCode.ABORTED and "a resume of it took" in str(ended)

        # Sent again before its first token came (its router froze during the prefill): no tokens to resume, but the
        # client's resend (`resent`) takes the running stream's place all the same.
        first = stub.Generate(ask("resent-here", prompt, 4000), timeout=60)
        assert (await first.read()).HasField("started")
        assert await completed(stub.Generate(ask("resent-here", prompt, 4, resent=True), timeout=30)) == 4
        assert (await refusal(first)).code() == grpc.StatusCode.ABORTED


async def test_list_models_names_the_served_model(cluster: LocalCluster) -> None:
    assert cluster.router is not None
    async with BatonClient(cluster.router.address) as client:
        models = await client.list_models()
    assert [(m.name, m.num_warm_nodes, m.tokenizer) for m in models] == [(MODEL, 3, "byte")]
    assert models[0].max_context_tokens == 8192


BAD_REQUESTS = [
    (dict(model=MODEL, prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(model=MODEL, prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=0"),
    (dict(model=MODEL, prompt="hi", max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=-3"),
    (dict(model=MODEL, prompt="hi", max_tokens=9000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=9000"),
    (dict(model="no-such-model", prompt="hi"), grpc.StatusCode.NOT_FOUND, "no-such-model"),
    (dict(model=MODEL, prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature=-1.0"),
    (dict(model=MODEL, prompt="x" * 8192), grpc.StatusCode.INVALID_ARGUMENT, "context window of 8192"),
    (dict(model=MODEL, prompt_token_ids=router_pb2.PromptTokens(ids=[72, 105, 300])),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[2]=300"),
    (dict(model=MODEL, prompt_token_ids=router_pb2.PromptTokens(ids=[5, -1])),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1]=-1"),
]


@pytest.mark.parametrize(("fields", "code", "named"), BAD_REQUESTS, ids=[c[2] for c in BAD_REQUESTS])
async def test_bad_input_gets_a_clear_status(
    cluster: LocalCluster, fields: dict[str, object], code: grpc.StatusCode, named: str
) -> None:
    assert cluster.router is not None
    async with grpc.aio.insecure_channel(cluster.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stub.Generate(router_pb2.GenerateRequest(**fields), timeout=10):
                pass
    assert raised.value.code() == code
    assert named in raised.value.details()


async def test_bad_requests_do_not_disturb_good_ones(cluster: LocalCluster) -> None:
    good = [stream(cluster, f"good request {i}", max_tokens=32) for i in range(4)]
    bad = [stream(cluster, "", max_tokens=32) for _ in range(4)]
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    for i, result in enumerate(results[:4]):
        assert isinstance(result, Completion)
        assert result.token_ids == reference_completion(list(f"good request {i}".encode()), 32)[0]
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in results[4:])


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "grpcurl"
    return subprocess.run([str(binary), "-plaintext", *args], capture_output=True, text=True, timeout=30)


def test_grpcurl_lists_services_and_calls_generate(cluster: LocalCluster) -> None:
    assert cluster.router is not None and cluster.scheduler is not None
    listed = grpcurl(cluster.router.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"baton.v1.Router", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    assert "baton.v1.Scheduler" in grpcurl(cluster.scheduler.address, "list").stdout
    for node in cluster.nodes:
        assert "baton.v1.NodeAgent" in grpcurl(node.address, "list").stdout
    # A method by its full name (reflection found services and messages only: "Symbol not found").
    described = grpcurl(cluster.router.address, "describe", "baton.v1.Router.Generate")
    assert described.returncode == 0, described.stderr
    assert "rpc Generate ( .baton.v1.GenerateRequest ) returns ( stream .baton.v1.GenerateChunk )" in described.stdout
    assert grpcurl(cluster.router.address, "describe", "baton.v1.Router.NoSuchMethod").returncode != 0

    request = json.dumps({"model": MODEL, "prompt": "Hello, grpcurl", "max_tokens": 8})
    called = grpcurl("-d", request, cluster.router.address, "baton.v1.Router/Generate")
    assert called.returncode == 0, called.stderr
    chunks = [json.loads(doc) for doc in called.stdout.replace("}\n{", "}\x00{").split("\x00")]
    tokens = [t for chunk in chunks for t in chunk.get("token_ids", [])]
    assert tokens == reference_completion(list(b"Hello, grpcurl"), 8)[0]
    assert chunks[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")

    health = grpcurl(cluster.router.address, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"


async def test_reflection_v1_describes_a_method_as_v1alpha_does(cluster: LocalCluster) -> None:
    """`buf curl` and grpcurl from 1.8.8 ask grpc.reflection.v1 first; grpcio-reflection serves v1alpha only."""
    assert cluster.router is not None
    request = reflection_pb2.ServerReflectionRequest
    async with grpc.aio.insecure_channel(cluster.router.address) as channel:
        for version in ("v1", "v1alpha"):
            call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                         request_serializer=request.SerializeToString,
                                         response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            listed, described = [r async for r in call(iter([
                request(list_services=""), request(file_containing_symbol="baton.v1.Router.Generate")]))]
            names = {s.name for s in listed.list_services_response.service}
            assert {"baton.v1.Router", "grpc.reflection.v1.ServerReflection"} <= names, version
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in described.file_descriptor_response.file_descriptor_proto]
            assert any(m.name == "Generate" for f in files for s in f.service if s.name == "Router" for m in s.method)


async def test_a_trace_spans_router_scheduler_and_node(cluster: LocalCluster, trace_file: Path) -> None:
    result = await stream(cluster, "trace this request", max_tokens=8)
    assert result.token_ids

    def spans_by_trace() -> dict[str, set[str]]:
        traces: dict[str, set[str]] = {}
        if trace_file.exists():
            for line in trace_file.read_text().splitlines():
                span = json.loads(line)
                traces.setdefault(span["trace_id"], set()).add(f"{span['service']} {span['name']}")
        return traces

    wanted = {
        "router /baton.v1.Router/Generate",
        "scheduler /baton.v1.Scheduler/Place",
        f"node_agent/{result.node_ids[0]} /baton.v1.NodeAgent/Generate",
    }
    wait_until(lambda: any(wanted <= names for names in spans_by_trace().values()), 10,
               "one trace with router, scheduler and node agent spans")


async def test_a_slow_reader_gets_coalesced_chunks(cluster: LocalCluster) -> None:
    """A client that stops reading gets the backlog in few large messages, not one per token."""
    prompt = "a client that reads slowly"
    num_tokens = 8000
    assert cluster.router is not None
    # Without BDP probing the receive window stays at 64 KiB, so the router soon has to wait.
    async with grpc.aio.insecure_channel(cluster.router.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest(model=MODEL, prompt=prompt, max_tokens=num_tokens, ignore_eos=True)
        )
        first = await call.read()
        # Stop reading until the node has generated everything.
        wait_until(lambda: all(n.load.num_running == 0 for n in cluster.cluster_state().nodes), 60,
                   "the generation to finish on the node")
        chunks = [first]
        while (chunk := await call.read()) != grpc.aio.EOF:
            chunks.append(chunk)

    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference_completion(list(prompt.encode()), num_tokens, ignore_eos=True)[0]
    assert [c.index for c in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert len(chunks) < num_tokens / 4
