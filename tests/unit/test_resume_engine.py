"""A generation resumed on the sim engine from its first k tokens continues exactly as if never interrupted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.node_agent.engines.base import EngineInputError
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.engine import SimEngine
from services.node_agent.engines.sim.models import get_model
from services.node_agent.engines.sim.timing import load_coefficients
from services.node_agent.engines.types import EngineRequest, FinishReason, RequestOutput, SamplingParams

MODEL = get_model("sim-llama-3-8b")
TIMING = load_coefficients("h100", MODEL.perf_model)
N = 24
SAMPLINGS = [pytest.param(0.0, None, id="greedy"), pytest.param(0.9, 42, id="seeded")]


def _prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    """n lowercase letters, a different sequence for each salt."""
    return tuple(97 + ((i + 1) * 2654435761 + salt * 40503) % 2**32 % 26 for i in range(n))


PROMPT = _prompt(40)


def _sampling(
    max_tokens: int, temperature: float, seed: int | None, stop: tuple[tuple[int, ...], ...] = ()
) -> SamplingParams:
    # EOS ignored so that lengths are exact.
    return SamplingParams(max_tokens, temperature, seed=seed, stop=stop, ignore_eos=True)


def _run(request: EngineRequest, core: SimEngineCore | None = None) -> tuple[list[int], FinishReason | None]:
    """The request's tokens and finish reason, run alone (or on the given core) until it finishes."""
    core = core or SimEngineCore(MODEL, TIMING, 2000)
    core.add_request(request)
    tokens: list[int] = []
    finish: FinishReason | None = None
    for _ in range(1000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            assert finish is None, "output after the request finished"
            tokens.extend(out.new_token_ids)
            finish = out.finish_reason
    assert not core.has_unfinished_requests()
    return tokens, finish


def _uninterrupted(temperature: float, seed: int | None, stop: tuple[tuple[int, ...], ...] = ()) -> list[int]:
    tokens, _ = _run(EngineRequest("full", PROMPT, _sampling(N, temperature, seed, stop)))
    return tokens


def _resumed(
    full: list[int],
    k: int,
    temperature: float,
    seed: int | None,
    stop: tuple[tuple[int, ...], ...] = (),
    num_resumed_tokens: int | None = None,
) -> EngineRequest:
    """The request that continues `full` after its first k tokens, as the router sends it."""
    return EngineRequest(
        "resumed",
        PROMPT + tuple(full[:k]),
        _sampling(N - k, temperature, seed, stop),
        num_resumed_tokens=k if num_resumed_tokens is None else num_resumed_tokens,
    )


@pytest.mark.parametrize(("temperature", "seed"), SAMPLINGS)
@pytest.mark.parametrize("k", [1, 2, 7, 16, N - 1])
def test_a_resumed_run_yields_exactly_the_remaining_tokens(k: int, temperature: float, seed: int | None) -> None:
    full = _uninterrupted(temperature, seed)
    assert len(full) == N
    tokens, finish = _run(_resumed(full, k, temperature, seed))
    assert tokens == full[k:]
    assert finish is FinishReason.LENGTH


@pytest.mark.parametrize(("temperature", "seed"), SAMPLINGS)
def test_resuming_on_the_node_that_cached_the_first_run_changes_nothing(temperature: float, seed: int | None) -> None:
    core = SimEngineCore(MODEL, TIMING, 2000)
    full, _ = _run(EngineRequest("full", PROMPT, _sampling(N, temperature, seed)), core)
    tokens, finish = _run(_resumed(full, 18, temperature, seed), core)
    assert (tokens, finish) == (full[18:], FinishReason.LENGTH)


def _fresh_stop_at(full: list[int], length: int, after: int) -> int:
    """The first k >= after whose stop sequence full[k-length+1 : k+1] does not end at an earlier token."""
    for k in range(max(after, length - 1), len(full) - 1):
        stop = full[k - length + 1 : k + 1]
        if not any(full[j - length + 1 : j + 1] == stop for j in range(length - 1, k)):
            return k
    raise AssertionError(f"no fresh {length}-token stop sequence in {full}")


@pytest.mark.parametrize("after", [2, 9, 17])
@pytest.mark.parametrize(("temperature", "seed"), SAMPLINGS)
def test_a_stop_sequence_spanning_the_resume_point_stops_where_the_uninterrupted_run_did(
    temperature: float, seed: int | None, after: int
) -> None:
    full = _uninterrupted(temperature, seed)
    k = _fresh_stop_at(full, 3, after)
    # Its first two tokens were received before the node failed; the third comes after the move.
    stop = (tuple(full[k - 2 : k + 1]),)
    uninterrupted, finish = _run(EngineRequest("full-stop", PROMPT, _sampling(N, temperature, seed, stop)))
    assert (uninterrupted, finish) == (full[: k + 1], FinishReason.STOP)

    tokens, finish = _run(_resumed(full, k, temperature, seed, stop))
    assert (tokens, finish) == ([full[k]], FinishReason.STOP)


@pytest.mark.parametrize("after", [2, 9, 17])
@pytest.mark.parametrize(("temperature", "seed"), SAMPLINGS)
def test_without_num_resumed_tokens_the_spanning_stop_sequence_is_missed(
    temperature: float, seed: int | None, after: int
) -> None:
    full = _uninterrupted(temperature, seed)
    k = _fresh_stop_at(full, 3, after)
    stop = (tuple(full[k - 2 : k + 1]),)
    tokens, finish = _run(_resumed(full, k, temperature, seed, stop, num_resumed_tokens=0))
    # The resumed tokens count as prompt, and a stop sequence never reaches into the prompt.
    assert tokens[0] == full[k]
    assert len(tokens) > 1
    assert tokens == full[k : k + len(tokens)]


def test_a_stop_sequence_reaching_into_the_original_prompt_stops_neither_run() -> None:
    full = _uninterrupted(0.0, None)
    stop = ((PROMPT[-1], full[0], full[1]),)
    uninterrupted, finish = _run(EngineRequest("full-stop", PROMPT, _sampling(N, 0.0, None, stop)))
    assert (uninterrupted, finish) == (full, FinishReason.LENGTH)
    tokens, finish = _run(_resumed(full, 1, 0.0, None, stop))
    assert (tokens, finish) == (full[1:], FinishReason.LENGTH)


@pytest.mark.parametrize("num_resumed_tokens", [-1, len(PROMPT) + 3, len(PROMPT) + 4])
def test_num_resumed_tokens_outside_the_prompt_is_refused(num_resumed_tokens: int) -> None:
    core = SimEngineCore(MODEL, TIMING, 2000)
    request = EngineRequest("bad", PROMPT + (97, 98, 99), _sampling(4, 0.0, None), num_resumed_tokens)
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        core.add_request(request)
    assert not core.has_unfinished_requests()


def test_num_resumed_tokens_just_below_the_prompt_length_is_accepted() -> None:
    full = _uninterrupted(0.0, None)
    # Only the first prompt token is the original prompt; everything after it was generated.
    request = EngineRequest("edge", PROMPT + tuple(full[:5]), _sampling(N - 5, 0.0, None), len(PROMPT) + 4)
    tokens, finish = _run(request)
    assert (tokens, finish) == (full[5:], FinishReason.LENGTH)


@pytest.mark.asyncio
async def test_a_request_aborted_while_its_step_runs_and_resumed_under_its_id_gets_no_token_of_the_old_one() -> None:
    # A router dies mid-stream: its node stream breaks (the node aborts the request) while a step that decodes
    # it is running, and the next router resumes it on the same node under the same id before that step's
    # outputs are handed out. The old sequence's token must not reach the resumed stream: it got its first
    # token twice (121 tokens for max_tokens=120, against a real cluster).
    full = _uninterrupted(0.0, None)
    k = 5
    core = SimEngineCore(MODEL, TIMING, 2000)
    engine = SimEngine(core, MODEL.name, 0)
    resumed: list = []
    step = core.step

    def step_then_resume():
        result = step()
        if not resumed and any(o.num_completion_tokens == k + 1 for o in result.outputs):
            # The step holding the old sequence's token k has run; while its time passes, before its outputs
            # go out, the request is aborted and resumed from its first k tokens.
            resumed.append(None)
            asyncio.get_running_loop().call_soon(resume)
        return result

    def resume():
        engine.abort("r")
        request = EngineRequest("r", PROMPT + tuple(full[:k]), _sampling(N - k, 0.0, None), num_resumed_tokens=k)
        resumed[0] = engine.generate(request, heartbeat_s=5.0)

    core.step = step_then_resume
    runner = asyncio.create_task(engine.run())
    try:
        # Its heartbeats (None) end the wait once it is aborted: it gets no output then.
        first = engine.generate(EngineRequest("r", PROMPT, _sampling(N, 0.0, None)), heartbeat_s=0.01)
        async for output in first:
            if resumed and resumed[0] is not None:
                break
        assert full[:k] + await _read_to_end(resumed[0]) == full
    finally:
        runner.cancel()


@pytest.mark.asyncio
async def test_a_stream_closed_late_does_not_abort_the_request_resumed_under_its_id() -> None:
    # The node aborted the old request and a resumed one of the same id was added before the old stream's
    # generator was closed (an async generator left at a yield is closed later, by the event loop).
    full = _uninterrupted(0.0, None)
    core = SimEngineCore(MODEL, TIMING, 2000)
    engine = SimEngine(core, MODEL.name, 0)
    runner = asyncio.create_task(engine.run())
    try:
        old = engine.generate(EngineRequest("r", PROMPT, _sampling(N, 0.0, None)), heartbeat_s=5.0)
        first = await anext(old)
        while first is None:
            first = await anext(old)
        k = len(first.new_token_ids)
        engine.abort("r")
        new = engine.generate(EngineRequest("r", PROMPT + tuple(full[:k]), _sampling(N - k, 0.0, None),
                                            num_resumed_tokens=k), heartbeat_s=5.0)
        await old.aclose()
        assert full[:k] + await _read_to_end(new) == full
    finally:
        runner.cancel()


async def _read_to_end(stream: AsyncIterator[RequestOutput | None]) -> list[int]:
    """The tokens of an engine stream up to its finish; a heartbeat (None) means it went silent."""
    tokens: list[int] = []
    async for output in stream:
        assert output is not None, "the stream went silent"
        tokens += output.new_token_ids
        if output.finish_reason is not None:
            break
    return tokens


@pytest.mark.asyncio
async def test_a_stream_closed_before_it_was_read_ends_its_request() -> None:
    # A node stream broken before its first output was read: an async generator never started runs no cleanup
    # of its own, so the engine's stream must end the request itself.
    core = SimEngineCore(MODEL, TIMING, 2000)
    engine = SimEngine(core, MODEL.name, 0)
    stream = engine.generate(EngineRequest("r", PROMPT, _sampling(N, 0.0, None)), heartbeat_s=5.0)
    assert core.has_unfinished_requests()
    await stream.aclose()
    assert not core.has_unfinished_requests() and engine.progress("r") is None


@pytest.mark.asyncio
async def test_an_id_already_running_is_refused_naming_request_id() -> None:
    # As the vLLM engine names it, so a client's error names the field it sent (it said "request" before).
    core = SimEngineCore(MODEL, TIMING, 2000)
    engine = SimEngine(core, MODEL.name, 0)
    first = engine.generate(EngineRequest("dup", PROMPT, _sampling(N, 0.0, None)), heartbeat_s=5.0)
    with pytest.raises(EngineInputError) as refused:
        engine.generate(EngineRequest("dup", PROMPT, _sampling(N, 0.0, None)), heartbeat_s=5.0)
    assert (refused.value.field, refused.value.value) == ("request_id", "dup")
    # Refused, it still arrived: the scheduler counts the node's received requests to know its placements landed.
    assert core.load().num_received == 2
    await first.aclose()
