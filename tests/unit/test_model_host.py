"""A node's models: one warm at a time, loads that take their time, unloads that lose no work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.engine import SimEngine
from services.node_agent.engines.sim.models import get_model, load_time_s
from services.node_agent.engines.sim.timing import load_coefficients
from services.node_agent.engines.types import AllBlocksCleared, EngineRequest, SamplingParams
from services.node_agent.model_host import LocalModel, ModelHost, ModelState

A, B = "sim-llama-3-8b", "sim-llama-2-7b"


def local(name: str) -> LocalModel:
    spec = get_model(name)
    return LocalModel(name, spec.max_context_tokens, spec.vocab_size, "byte", int(spec.weights_bytes),
                      load_time_s(spec))


def make_engine(name: str) -> SimEngine:
    spec = get_model(name)
    return SimEngine(SimEngineCore(spec, load_coefficients("h100", spec.perf_model), num_kv_blocks=512), name, 0)


@contextlib.asynccontextmanager
async def hosting(warm: str = "", speed: float = 0.0) -> AsyncIterator[ModelHost]:
    host = ModelHost("n0", [local(A), local(B)], make_engine, warm=warm, speed=speed)
    task = asyncio.get_running_loop().create_task(host.run())
    try:
        yield host
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_cold_model_serves_nothing_until_loaded() -> None:
    async with hosting(warm=A) as host:
        assert host.state == {A: ModelState.WARM, B: ModelState.COLD}
        with pytest.raises(Unavailable, match="cold"):
            host.engine_for(B)
        with pytest.raises(NotFound, match="sim-llama-3.1-8b"):
            host.engine_for("sim-llama-3.1-8b")
        with pytest.raises(FailedPrecondition, match="unload it first"):
            await host.load_model(B)


async def test_a_call_that_names_no_model_is_invalid_not_a_model_the_node_lacks() -> None:
    """LoadModel, UnloadModel and Generate without a model: INVALID_ARGUMENT, as the router says it, not NOT_FOUND."""
    async with hosting(warm=A) as host:
        with pytest.raises(InvalidArgument, match=r"^model='': required$"):
            await host.load_model("")
        with pytest.raises(InvalidArgument, match=r"^model='': required$"):
            host.unload_model("")
        with pytest.raises(InvalidArgument, match=r"^model='': required$"):
            host.engine_for("")
        assert host.state == {A: ModelState.WARM, B: ModelState.COLD}


async def test_a_model_the_node_lacks_is_named_cut_short_and_the_node_says_what_it_has() -> None:
    """A 100 kB name filled the whole message, and what the node has was cut off (helper-158)."""
    async with hosting(warm=A) as host:
        with pytest.raises(NotFound) as caught:
            host.engine_for("x" * 100_000)
        message = str(caught.value)
        assert len(message) < 300 and "(100000 characters)" in message
        assert message.endswith(f"not on node n0 (it has: {', '.join(sorted([A, B]))})")


async def test_a_load_takes_the_modelled_time_and_a_second_caller_joins_it() -> None:
    # 49 s of modelled load at speed 1000: 49 ms.
    async with hosting(speed=1000.0) as host:
        changed = host.models_changed.since_now()
        first = asyncio.get_running_loop().create_task(host.load_model(A))
        await changed.wait()
        assert host.state[A] is ModelState.LOADING
        with pytest.raises(Unavailable, match="loading"):
            host.engine_for(A)
        # Neither refusal sends the caller to the other (each said to do what the other refuses, helper-126).
        with pytest.raises(FailedPrecondition, match=f"has model '{A}' loading; wait for its load to end, then unload"):
            await host.load_model(B)
        with pytest.raises(FailedPrecondition, match="is still loading on node .*; unload it once its load has ended"):
            host.unload_model(A)
        waited = await host.load_model(A)
        assert await first == pytest.approx(waited, abs=0.02)
        assert waited >= local(A).load_time_s / 1000 * 0.9
        assert host.state[A] is ModelState.WARM and host.engine_for(A).model == A


async def test_unload_refuses_while_requests_run_and_clears_the_kv_index_after() -> None:
    async with hosting(warm=A) as host:
        engine = host.engine_for(A)
        outputs = engine.generate(EngineRequest("r1", tuple(range(40)), SamplingParams(max_tokens=200)), 1.0)
        with pytest.raises(FailedPrecondition, match="1 requests in flight"):
            host.unload_model(A)
        async for output in outputs:
            if output is not None and output.finish_reason is not None:
                break
        host.unload_model(A)
        assert host.state[A] is ModelState.COLD and host.load().kv_blocks_total == 0
        batches = []
        while not batches or batches[-1] != (A, [AllBlocksCleared()]):
            batches.append(await asyncio.wait_for(host.next_kv_events(), 5))
        await host.load_model(B)
        assert host.warm_model == B


async def test_an_engine_that_fails_takes_the_node_down_with_it() -> None:
    class Broken(Exception):
        pass

    def broken_engine(name: str) -> SimEngine:
        engine = make_engine(name)

        async def run() -> None:
            raise Broken(name)

        engine.run = run  # type: ignore[method-assign]
        return engine

    host = ModelHost("n0", [local(A)], broken_engine, warm=A)
    with pytest.raises(ExceptionGroup) as failed:
        await asyncio.wait_for(host.run(), 5)
    assert failed.group_contains(Broken)


async def test_an_engine_whose_start_is_the_load_is_not_made_to_wait_a_modelled_time_and_reports_its_start() -> None:
    """vLLM: loading is starting the engine. The host must not first sleep the last start's duration
    (a reload took twice as long), and load_time_s is what this start took."""
    clock = [100.0]

    def starting_engine(name: str) -> SimEngine:
        clock[0] += 7.0  # the engine's start-up, on the injected clock
        return make_engine(name)

    measured = LocalModel(A, 8192, 128256, "byte", 1, load_time_s=3600.0, load_is_modelled=False)
    host = ModelHost("n0", [measured], starting_engine, speed=1.0, clock=lambda: clock[0])
    task = asyncio.get_running_loop().create_task(host.run())
    try:
        await asyncio.wait_for(host.load_model(A), timeout=5)  # an hour's sleep would time out
        assert host.state[A] is ModelState.WARM
        assert host.local(A).load_time_s == 7.0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
