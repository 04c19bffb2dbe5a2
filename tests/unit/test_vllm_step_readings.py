"""The vllm engine's output path: its reading of decode steps, and whose request a closed reader aborts
(no vLLM runs here: fake outputs)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.change_signal import ChangeSignal
from services.common.recent_steps import RecentSteps
from services.node_agent.engines.types import FinishReason
from services.node_agent.engines.vllm.engine import VllmEngine, _Running
from services.node_agent.engines.vllm.gpu_time import GpuTimeShare
from services.node_agent.engines.vllm.progress import ProgressWatch
from services.node_agent.engines.vllm.stop_sequences import StopMatcher

# Long enough that the few microseconds a test takes do not show in the readings.
ELAPSED_S = 30.0


class _Profiler:
    def __init__(self) -> None:
        self.decoded_steps: list[int] = []

    def first_token(self, *args: object) -> None:
        pass

    def decoded(self, interval_s: float, num_steps: int, *args: object) -> None:
        self.decoded_steps.append(num_steps)


def engine() -> VllmEngine:
    """The engine's output path only: what _merge and abort read."""
    vllm = VllmEngine.__new__(VllmEngine)
    vllm._requests, vllm._recent_steps = {}, RecentSteps()
    vllm._profiler, vllm._gpu_time, vllm.load_changed = _Profiler(), GpuTimeShare(), ChangeSignal()
    vllm._progress = ProgressWatch(hung_after_s=0.0)
    return vllm


def decoding(vllm: VllmEngine, request_id: str, elapsed_s: float = ELAPSED_S) -> _Running:
    """A request that has had its first token, its previous output elapsed_s ago."""
    loop = asyncio.get_running_loop()
    running = _Running(prompt_len=8, pump=SimpleNamespace(cancel=lambda: None), queue=asyncio.Queue(),
                       has_first_token=True, num_completion_tokens=1, last_output_at=loop.time() - elapsed_s)
    vllm._requests[request_id] = running
    vllm._gpu_time.start(request_id, loop.time())
    return running


def output(token_ids: list[int], finish_reason: str | None = None) -> Any:
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, finish_reason=finish_reason)],
                           finished=finish_reason is not None, num_cached_tokens=None)


async def test_an_output_of_several_tokens_reads_as_that_many_steps_its_end_of_sequence_included() -> None:
    """Two tokens and the end of sequence came together: three steps, though two tokens are kept."""
    vllm = engine()
    running = decoding(vllm, "r")
    result = vllm._merge("r", running, [output([5, 6]), output([2], "stop")], StopMatcher(()))
    assert result.new_token_ids == [5, 6] and result.finish_reason == FinishReason.STOP
    assert vllm._recent_steps.mean_ms == pytest.approx(ELAPSED_S * 1000 / 3, rel=1e-3)
    assert vllm._profiler.decoded_steps == [3]


async def test_text_past_a_stop_counts_as_steps_taken() -> None:
    vllm = engine()
    running = decoding(vllm, "r")
    vllm._merge("r", running, [output([7, 8]), output([9, 10])], StopMatcher([(8,)]))  # stops at 8
    assert vllm._recent_steps.mean_ms == pytest.approx(ELAPSED_S * 1000 / 4, rel=1e-3)


async def test_after_the_last_decoding_request_leaves_the_next_reading_starts_afresh() -> None:
    vllm = engine()
    first = decoding(vllm, "first", elapsed_s=0.2)  # both readings fit in the mean's one-second window
    vllm._merge("first", first, [output([5])], StopMatcher(()))  # one step in 200 ms
    vllm.abort("first")
    assert vllm._recent_steps.mean_ms == pytest.approx(200, rel=0.1)  # kept while idle
    second = decoding(vllm, "second", elapsed_s=0.2)
    vllm._merge("second", second, [output([5, 6, 7, 8])], StopMatcher(()))
    assert vllm._recent_steps.mean_ms == pytest.approx(50, rel=0.1)  # not (200 + 200) / 5 with the first


async def test_a_reader_closed_late_does_not_abort_a_request_of_the_same_id_admitted_since() -> None:
    """A resume on the same node: the old request is aborted and one of the same id admitted before the old
    stream's reader is closed; closing it must leave the new request running."""
    vllm = engine()
    old = decoding(vllm, "r")
    reader = vllm._outputs("r", old, StopMatcher(()), heartbeat_s=60.0)
    old.queue.put_nowait(output([5]))
    assert (await anext(reader)).new_token_ids == [5]
    vllm.abort("r")
    new = decoding(vllm, "r")
    await reader.aclose()
    assert vllm._requests.get("r") is new


async def test_a_reader_whose_request_was_aborted_ends_without_touching_a_request_of_the_same_id() -> None:
    """Outputs of the old request still queued are not handed out once it is aborted, and its finish there
    does not take the new request out of the engine."""
    vllm = engine()
    old = decoding(vllm, "r")
    reader = vllm._outputs("r", old, StopMatcher(()), heartbeat_s=60.0)
    old.queue.put_nowait(output([5]))
    assert (await anext(reader)).new_token_ids == [5]
    old.queue.put_nowait(output([6], "length"))
    vllm.abort("r")
    new = decoding(vllm, "r")
    assert [item async for item in reader] == []
    assert vllm._requests.get("r") is new


async def test_a_stream_first_read_after_a_resume_of_its_id_hands_out_none_of_the_new_requests_outputs() -> None:
    """A stream opened, then aborted and its id admitted again before anything read it: reading it yields none of
    the new request's outputs, and the new request's finish does not take it out of the engine through the old
    stream."""
    vllm = engine()
    old = decoding(vllm, "r")
    reader = vllm._outputs("r", old, StopMatcher(()), heartbeat_s=60.0)  # not started: nothing looked up yet
    vllm.abort("r")
    new = decoding(vllm, "r")
    new.queue.put_nowait(output([7], "length"))
    assert [item async for item in reader] == []
    assert vllm._requests.get("r") is new and new.queue.qsize() == 1  # still its own to read


async def test_a_request_that_leaves_with_no_output_tells_the_hang_watch_so() -> None:
    """The engine tells its watch of every request that leaves: one aborted with no output carries its time in flight
    into the next one's, so a stopped core whose clients give up is still taken as hung (helper-203)."""
    vllm = engine()
    vllm._progress = ProgressWatch(hung_after_s=60.0)
    now = asyncio.get_running_loop().time()
    vllm._progress.admitted(now - 50.0, 0)  # in flight for 50 s, no output
    decoding(vllm, "r")
    vllm.abort("r")  # its client gave up
    vllm._progress.admitted(now, 0)
    assert vllm._progress.hung_s(now + 11.0, 1) == pytest.approx(61.0, abs=0.5)
