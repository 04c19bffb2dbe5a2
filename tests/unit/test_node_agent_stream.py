"""The node agent's Generate stream says where a request stands before its first token."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest

from baton.protocol import DRAINED_KEY
from baton.v1 import common_pb2, node_agent_pb2
from services.common.telemetry import Telemetry
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.engine import SimEngine
from services.node_agent.engines.sim.models import get_model, load_time_s
from services.node_agent.engines.sim.timing import load_coefficients
from services.node_agent.engines.types import EngineRequest, SamplingParams
from services.node_agent.model_host import LocalModel, ModelHost
from services.node_agent.servicer import NodeAgentService

pytestmark = pytest.mark.timeout(30)

MODEL = "sim-llama-3-8b"


def _one_at_a_time(name: str, speed: float = 0.0) -> SimEngine:
    """An engine whose batch holds one request: the second one queues. Its steps take their modelled time at speed
    (0: none)."""
    spec = get_model(name)
    core = SimEngineCore(spec, load_coefficients("h100", spec.perf_model), num_kv_blocks=512, max_num_seqs=1)
    return SimEngine(core, name, speed)


@contextlib.asynccontextmanager
async def _node(shutdown_grace_s: float = 10.0, speed: float = 0.0) -> AsyncIterator[NodeAgentService]:
    spec = get_model(MODEL)
    local = LocalModel(MODEL, spec.max_context_tokens, spec.vocab_size, "byte", int(spec.weights_bytes),
                       load_time_s(spec))
    host = ModelHost("n0", [local], lambda name: _one_at_a_time(name, speed), warm=MODEL, speed=speed)
    task = asyncio.get_running_loop().create_task(host.run())
    config = NodeAgentConfig(etcd="127.0.0.1:1", node_id="n0", shutdown_grace_s=shutdown_grace_s)
    service = NodeAgentService(config, host, Telemetry("node_agent/test", "none"))
    try:
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await service.close()


def _request(request_id: str, max_tokens: int) -> node_agent_pb2.NodeGenerateRequest:
    return node_agent_pb2.NodeGenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=[97] * 40,
                                              sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                 ignore_eos=True))


async def test_a_request_behind_a_full_batch_is_announced_queued_then_decoding() -> None:
    async with _node() as node:
        running = node.Generate(_request("running", 400), None)  # type: ignore[arg-type]
        waiting = node.Generate(_request("waiting", 2), None)  # type: ignore[arg-type]
        async with contextlib.aclosing(running), contextlib.aclosing(waiting):
            started = await anext(running)
            assert started.progress.phase == node_agent_pb2.REQUEST_PHASE_QUEUED
            while not (await anext(running)).token_ids:
                pass
            # The batch is full: the second request waits, and its stream says so from the start.
            second = await anext(waiting)
            assert second.HasField("started")
            assert (second.progress.phase, second.progress.num_ahead) == (node_agent_pb2.REQUEST_PHASE_QUEUED, 0)
            assert second.progress.num_prompt_tokens == 40
            chunks = [chunk async for chunk in waiting]
    assert [len(c.token_ids) for c in chunks if c.token_ids] and chunks[-1].finish_reason
    heartbeats = [c for c in chunks if not c.token_ids and not c.finish_reason]
    assert all(c.progress.phase == node_agent_pb2.REQUEST_PHASE_QUEUED for c in heartbeats)


async def test_a_prompt_no_longer_counts_as_pending_once_its_step_has_run() -> None:
    """The live sim engine reports a step's prefill chunk as done once the step's time has passed, even
    when the engine then has nothing left to do (while it runs, the core counts it pending: its own
    tests)."""
    engine = _one_at_a_time(MODEL)
    task = asyncio.get_running_loop().create_task(engine.run())
    try:
        outputs = engine.generate(EngineRequest("r1", tuple(range(40)), SamplingParams(max_tokens=1)), 1.0)
        first = await anext(outputs)  # the prefill step's output: the first token, and the end
        assert first is not None and first.finish_reason is not None
        assert engine.load().pending_prefill_tokens == 0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_stream_closed_after_its_last_chunk_leaves_a_request_of_its_id_admitted_since_running() -> None:
    # A router died while the node was writing a stream's last chunk: the stream's handler is closed only later,
    # after the next router has resumed the request on this node under the same id. Closing the old handler
    # must end its own request, not the new one (before, it aborted by id and the new stream went silent).
    async with _node() as node:
        old = node.Generate(_request("r", 3), None)  # type: ignore[arg-type]
        async with contextlib.aclosing(old):
            while not (await anext(old)).finish_reason:
                pass
            new = node.Generate(_request("r", 5), None)  # type: ignore[arg-type]
            async with contextlib.aclosing(new):
                assert (await anext(new)).HasField("started")
                await old.aclose()
                tokens: list[int] = []
                while True:
                    chunk = await anext(new)
                    assert chunk.token_ids or chunk.finish_reason or chunk.HasField("progress"), \
                        "the request is gone from the engine: its stream went silent"
                    tokens += chunk.token_ids
                    if chunk.finish_reason:
                        break
    assert len(tokens) == 5


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...]) -> None:
        super().__init__(details)
        self.code, self.details, self.metadata = code, details, dict(metadata)


class _Context:
    """The part of a servicer context that Generate uses to end a stream with a status."""

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()) -> None:
        raise _Aborted(code, details, trailing_metadata)


async def test_a_stream_still_running_as_the_shutdown_grace_ends_is_handed_on_as_drained() -> None:
    """Cut by the server's stop when the grace ran out, each stream was moved as a crash ("stream_broken"), and an
    operator could not tell a drain from one (helper-158). A moment before, the node ends it UNAVAILABLE with
    DRAINED_KEY: its router moves it, cause "drained"."""
    async with _node(shutdown_grace_s=0.2, speed=1.0) as node:  # (in real time: 400 tokens take seconds)
        running = node.Generate(_request("long", 400), _Context())  # type: ignore[arg-type]
        async with contextlib.aclosing(running):
            while not (await anext(running)).token_ids:
                pass
            await node.before_stop()  # SIGTERM: draining, and the grace runs
            await asyncio.wait_for(node._handing_on.wait(), 5)
            with pytest.raises(_Aborted) as ended:
                async for chunk in running:
                    assert not chunk.finish_reason
    assert ended.value.code == grpc.StatusCode.UNAVAILABLE
    assert ended.value.metadata[DRAINED_KEY] == "n0"
    assert ended.value.details == "shutting down, its grace of 0.2 s ending; another node goes on with the stream"


async def test_a_stream_whose_last_output_comes_as_the_grace_nears_its_end_finishes_there() -> None:
    """The output that comes after the hand-on moment is sent first: the finishing one finishes the stream (it was
    dropped, and another node asked to redo its token, helper-162)."""
    async with _node(shutdown_grace_s=0.2) as node:
        running = node.Generate(_request("short", 3), _Context())  # type: ignore[arg-type]
        tokens = 0
        async with contextlib.aclosing(running):
            async for chunk in running:
                tokens += len(chunk.token_ids)
                if tokens == 2:
                    node._handing_on.set()  # the moment falls between its last two outputs
            assert chunk.finish_reason and tokens == 3


async def test_a_node_shutting_down_stays_draining_when_its_models_change() -> None:
    """A model turning warm during the grace re-registered the node as a candidate (helper-162)."""
    async with _node() as node:
        await node.before_stop()
        assert json.loads(node._registration())["draining"] is True


@pytest.mark.parametrize("speed", [4.0, 50.0])
async def test_a_sped_up_engine_reports_the_gpu_time_its_steps_took_here(speed: float) -> None:
    """At --speed 4 the streams were charged their modelled GPU time while the fleet was charged wall time: one node
    3.5 times the time it existed, the busy-time floor above the whole fleet's cost (helper-185)."""
    async def gpu_ms(engine_speed: float) -> float:
        engine = _one_at_a_time(MODEL, engine_speed)
        runner = asyncio.create_task(engine.run())
        try:
            last = None
            async for output in engine.generate(EngineRequest("r", tuple(range(40)), SamplingParams(
                    max_tokens=8, ignore_eos=True)), 5.0):
                if output is not None:
                    last = output
            assert last is not None and last.finish_reason is not None
            return last.gpu_ms
        finally:
            runner.cancel()

    modelled = await gpu_ms(0.0)  # no time passes: the modelled time is all there is
    assert modelled > 0
    assert await gpu_ms(speed) == pytest.approx(modelled / speed)
