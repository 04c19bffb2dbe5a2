"""The simulated engine in real time: drives SimEngineCore's steps on the event loop's clock."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator

from services.common.change_signal import ChangeSignal
from services.common.load import Load
from services.common.timeouts import within
from services.node_agent.engines.base import EngineInputError, OutputStream
from services.node_agent.engines.sim.core import DuplicateRequest, RequestRefused, SimEngineCore
from services.node_agent.engines.types import (
    EngineRequest,
    KVEvent,
    RequestOutput,
    RequestProgress,
    SamplingParams,
)

log = logging.getLogger(__name__)

# Behind schedule by more than this, the clock is reset rather than caught up in a burst.
_MAX_LAG_S = 0.05


class _OutputBuffer:
    """Outputs of one request not yet read; a slow reader gets them merged."""

    def __init__(self) -> None:
        self._pending: list[RequestOutput] = []
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._pending.append(output)
        self._ready.set()

    async def take(self, timeout_s: float) -> RequestOutput | None:
        """Everything pending, merged; None if nothing came within timeout_s."""
        if not self._ready.is_set():
            try:
                await within(self._ready.wait(), timeout_s)
            except TimeoutError:
                return None
        self._ready.clear()
        pending, self._pending = self._pending, []
        merged = pending[-1]
        if len(pending) > 1:
            merged.new_token_ids = [t for output in pending for t in output.new_token_ids]
        return merged


class SimEngine:
    """Runs the simulated engine core in real time, scaled by `speed` (0: no waiting at all)."""

    tokenizer = "byte"

    def __init__(self, core: SimEngineCore, model: str, speed: float) -> None:
        self._core = core
        self._speed = speed
        self.model = model
        self.max_context_tokens = core.model.max_context_tokens
        self.vocab_size = core.model.vocab_size
        self.kv_block_size = core.block_size
        self._buffers: dict[str, _OutputBuffer] = {}
        self._wake = asyncio.Event()
        self._kv_events: list[KVEvent] = []
        self._kv_ready = asyncio.Event()
        self.load_changed = ChangeSignal()
        self.profile_changed = ChangeSignal()

    def resumes_exactly(self, sampling: SamplingParams) -> bool:
        """Always: tokens are a pure function of (seed, position, context)."""
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self._core.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
            result = self._core.step()
            # Each output goes to the reader its request had when the step ran: while the step's time passes, the
            # request may be aborted and a new one of the same id added (a stream resumed here after its router
            # died), and the old sequence's token must not reach the new reader (it got its first token twice).
            readers = [(self._in_wall_time(output), self._buffers.get(output.request_id)) for output in result.outputs]
            if self._speed > 0:
                # The step's outputs exist only once the modelled GPU time has passed.
                deadline = max(deadline + result.duration_s / self._speed, loop.time() - _MAX_LAG_S)
                await asyncio.sleep(max(0.0, deadline - loop.time()))
            else:
                await asyncio.sleep(0)
            self._core.step_ended()
            for output, buffer in readers:
                if output.finish_reason is not None:
                    self.load_changed.notify()
                if buffer is not None and self._buffers.get(output.request_id) is buffer:
                    buffer.put(output)
            if result.kv_events:
                self._kv_events.extend(result.kv_events)
                self._kv_ready.set()

    def _in_wall_time(self, output: RequestOutput) -> RequestOutput:
        """output with its GPU time as the steps took it here: the modelled time over speed, as the fleet's own time
        is counted (at --speed 4 a node's streams were charged 3.5 times the wall time it existed, and the busy-time
        floor came out above the whole fleet's cost: helper-185). Unchanged at speed 0, where no time passes."""
        if self._speed <= 0:
            return output
        return dataclasses.replace(output, gpu_ms=output.gpu_ms / self._speed)

    def profile(self) -> None:
        """The sim engine measures nothing: its node registers the configured coefficients it runs."""
        return None

    def expected_step_ms(self) -> float:
        """Wall-clock time of the next decode step (0 when timing is off)."""
        return self._core.expected_decode_step_ms() / self._speed if self._speed > 0 else 0.0

    def generate(self, request: EngineRequest, heartbeat_s: float) -> OutputStream:
        """Admit request now (EngineInputError if it cannot be served) and return its outputs."""
        try:
            self._core.add_request(request)
        except DuplicateRequest as exc:  # named as the vLLM engine names it
            raise EngineInputError("request_id", request.request_id, "is already running on this node") from exc
        except RequestRefused as exc:
            raise EngineInputError(exc.field, exc.value, exc.reason) from exc
        request_id = request.request_id
        buffer = self._buffers[request_id] = _OutputBuffer()
        self._wake.set()
        self.load_changed.notify()
        return OutputStream(self._outputs(request_id, buffer, heartbeat_s), lambda: self._release(request_id, buffer))

    async def _outputs(
        self, request_id: str, buffer: _OutputBuffer, heartbeat_s: float
    ) -> AsyncGenerator[RequestOutput | None, None]:
        try:
            while True:
                output = await buffer.take(heartbeat_s)
                yield output
                if output is not None and output.finish_reason is not None:
                    return
        finally:
            self._release(request_id, buffer)

    def _release(self, request_id: str, buffer: _OutputBuffer) -> None:
        """The reader of buffer is done (finished, or gone: client cancelled, stream closed): its request, if
        still running, is aborted and its KV blocks freed. Only its own: closed late, after a request of the
        same id was added, it must not abort that one."""
        if self._buffers.get(request_id) is buffer:
            self.abort(request_id)

    def refused_before_admission(self) -> None:
        self._core.count_refused()
        self.load_changed.notify()

    def abort(self, request_id: str) -> None:
        """Stop request_id and free its KV blocks; nothing happens if it already finished."""
        self._buffers.pop(request_id, None)
        if self._core.abort_request(request_id) is not None:
            self._wake.set()
            self.load_changed.notify()

    def progress(self, request_id: str) -> RequestProgress | None:
        return self._core.progress(request_id)

    def load(self) -> Load:
        """The core's load, its decode steps' mean in wall-clock time, as expected_step_ms (0 when timing is off)."""
        load = self._core.load()
        step_ms = load.recent_decode_step_ms / self._speed if self._speed > 0 else 0.0
        return dataclasses.replace(load, recent_decode_step_ms=step_ms)

    async def next_kv_events(self) -> list[KVEvent]:
        await self._kv_ready.wait()
        self._kv_ready.clear()
        events, self._kv_events = self._kv_events, []
        return events

    def cached_block_hashes(self) -> list[int]:
        return self._core.cached_block_hashes()
