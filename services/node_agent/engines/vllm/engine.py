"""The vllm engine: vLLM v1's AsyncLLM in the node agent's process tree, behind Baton's Engine interface.

AsyncLLM runs the model in its own EngineCore (and worker) processes; this object lives on the
node agent's event loop. Prompts go in as token ids (a resumed request's prompt ends with the
tokens it generated before), outputs stream back as DELTAs, KV events come from vLLM's ZMQ
publisher and are re-keyed to Baton's block keys, load comes from vLLM's scheduler stats.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import tempfile
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.change_signal import ChangeSignal
from services.common.engine_profile import EngineProfile
from services.common.load import Load
from services.common.recent_steps import RecentSteps
from services.common.timeouts import within
from services.node_agent.engines.base import EngineInputError, OutputStream
from services.node_agent.engines.types import (
    EngineRequest,
    FinishReason,
    KVEvent,
    RequestOutput,
    RequestPhase,
    RequestProgress,
    SamplingParams,
)
from services.node_agent.engines.vllm.block_keys import BlockKeyMap
from services.node_agent.engines.vllm.calibration import Sweep
from services.node_agent.engines.vllm.gpu_time import GpuTimeShare
from services.node_agent.engines.vllm.kv_subscriber import KvEventSubscriber
from services.node_agent.engines.vllm.profiler import VllmProfiler
from services.node_agent.engines.vllm.progress import ProgressWatch
from services.node_agent.engines.vllm.stop_sequences import StopMatcher

log = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 1.0
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(frozen=True)
class VllmSettings:
    """How to start one AsyncLLM."""

    model_dir: str
    # KV cache size in bytes; 0: vLLM sizes it from free memory.
    kv_cache_bytes: int = 0
    # Longest context; 0: the model's own.
    max_model_len: int = 0
    # Tokens per KV block; 0: vLLM's default for the device (CPU needs a multiple of 32).
    block_size: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Eager mode starts in seconds; compiled graphs take minutes to build on a CPU.
    enforce_eager: bool = True
    # Share of GPU memory that must be free at start (vLLM checks it even with kv_cache_bytes set).
    gpu_memory_utilization: float = 0.9
    # Measure the engine's profile at start-up (calibration.py), registered when done; without it the
    # node has no profile and the scheduler places it by its stated fallback.
    calibrate: bool = True
    # With requests in flight and no output of any for this long, the engine is taken as hung (progress.py) and run()
    # raises, as on its engine core's death; 0: never.
    hung_after_s: float = 60.0


def tokenizer_name(model_dir: str) -> str:
    """The tokenizer name a vllm model registers: the router loads it from that directory."""
    return f"hf:{Path(model_dir).resolve()}"


@dataclass
class _Running:
    """One request in vLLM, as this engine follows it."""

    prompt_len: int
    pump: asyncio.Task[None]
    queue: asyncio.Queue[Any]
    num_completion_tokens: int = 0
    # Until vLLM reports it (at the first output): what this node's cache held of the prompt when it came.
    num_cached_tokens: int = 0
    has_first_token: bool = False
    # Loop time of its latest output.
    last_output_at: float = 0.0


class VllmEngine:
    """One model served by vLLM's AsyncLLM; the model's directory is read when it starts."""

    def __init__(self, model: str, settings: VllmSettings) -> None:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from services.node_agent.engines.vllm.keyed_sampler import PositionKeyedSampler

        self.model = model
        self.tokenizer = tokenizer_name(settings.model_dir)
        self.load_changed = ChangeSignal()
        #: Set when the engine's profile is new (calibrated, refined): the registration is rewritten.
        self.profile_changed = ChangeSignal()
        self._calibrate = settings.calibrate
        self._progress = ProgressWatch(settings.hung_after_s)
        self._events_dir = tempfile.TemporaryDirectory(prefix="baton-kv-events-")
        events_endpoint = f"ipc://{self._events_dir.name}/kv-events"
        replay_endpoint = f"ipc://{self._events_dir.name}/kv-events-replay"
        args = AsyncEngineArgs(
            model=settings.model_dir,
            served_model_name=model,
            enable_prefix_caching=True,
            enforce_eager=settings.enforce_eager,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=events_endpoint, replay_endpoint=replay_endpoint,
                                            topic="kv"),
            # Seeded requests are sampled by (seed, position) in vLLM's worker, so that they resume exactly.
            logits_processors=[PositionKeyedSampler],
            worker_extension_cls=f"{PositionKeyedSampler.__module__}.WorkerProbe",
        )
        if settings.kv_cache_bytes:
            args.kv_cache_memory_bytes = settings.kv_cache_bytes
        if settings.max_model_len:
            args.max_model_len = settings.max_model_len
        if settings.block_size:
            args.block_size = settings.block_size
        self._stats: Any = None  # vLLM's SchedulerStats of its latest step
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger_factory()])
        config = self._llm.vllm_config
        self.max_context_tokens: int = config.model_config.max_model_len
        self.vocab_size: int = config.model_config.get_vocab_size()
        self.kv_block_size: int = config.cache_config.block_size
        self.num_kv_blocks: int = config.cache_config.num_gpu_blocks or 0
        self._requests: dict[str, _Running] = {}
        # Each admission's own id in vLLM: a request resumed here while its earlier stream still runs is added again
        # under its id at once, while vLLM's abort of the earlier one (in its cancelled pump) has yet to run; under one
        # id the new one could be refused as running, or aborted by that late abort.
        self._admissions = itertools.count()
        self._num_received = 0  # requests handed to generate(), refused ones included (Load.num_received)
        self._gpu_time = GpuTimeShare()
        self._keys = BlockKeyMap()
        self._kv_events: list[KVEvent] = []
        self._kv_ready = asyncio.Event()
        # The oldest decoding request's time per step (each token vLLM produced for it), about the last second:
        # the load's mean of decode steps and expected_step_ms.
        self._recent_steps = RecentSteps()
        # Whether vLLM's kernels give the same logits for a context however it was computed (prefill or
        # decode, in any batch); unknown, so False, until run() has asked the workers.
        self._deterministic_kernels = False
        # Connected before any request runs: no batch is published before the first engine step.
        self._subscriber = KvEventSubscriber(events_endpoint, replay_endpoint)
        self._step_limits = (config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs)
        self._profiler = VllmProfiler(self._step_limits[0], self.kv_block_size, self.num_kv_blocks,
                                      lambda: self.profile_changed.notify(), max_num_seqs=self._step_limits[1])

    def _stat_logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _LatestStats(StatLoggerBase):
            """Keeps vLLM's scheduler stats of the latest step for the load report."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is not None:
                    engine._stats = scheduler_stats

            def log_engine_initialized(self) -> None:
                pass

        return _LatestStats

    # -- the engine loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Follow vLLM's KV events until cancelled; then abort what is in flight and stop vLLM.
        Raises vLLM's error if its engine core dies, so that the node agent exits."""
        try:
            self._deterministic_kernels = await self._has_deterministic_kernels()
            async with asyncio.TaskGroup() as group:
                group.create_task(self._follow_kv_events())
                group.create_task(self._watch_engine_core())
                if self._calibrate:
                    group.create_task(self._calibrate_profile())
        finally:
            for running in self._requests.values():
                running.pump.cancel()
            self._llm.shutdown()
            self._events_dir.cleanup()

    async def _has_deterministic_kernels(self) -> bool:
        """CPU: one thread per worker (measured in docs/vllm.md: several threads can diverge), on a CPU
        without AMX (single-threaded resume diverged on one with it); GPU: vLLM's batch-invariant mode."""
        from vllm import envs
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return bool(envs.VLLM_BATCH_INVARIANT)
        threads = await self._llm.collective_rpc("baton_num_threads")
        log.info("vLLM workers of %s run %s CPU threads", self.model, threads)
        if not cpu_resumes_exactly():
            log.info("not a CPU where resume was measured exact: resumes of %s are not promised exact (docs/vllm.md)",
                     self.model)
            return False
        return all(n == 1 for n in threads)

    def resumes_exactly(self, sampling: SamplingParams) -> bool:
        """Greedy and seeded requests continue token for token when re-prefilled with what they
        generated, on deterministic kernels; a request sampled without a seed never does."""
        return self._deterministic_kernels and (sampling.temperature == 0 or sampling.seed is not None)

    async def _calibrate_profile(self) -> None:
        sweep = Sweep().fitted_to(self.max_context_tokens, *self._step_limits)
        loop = asyncio.get_running_loop()
        await self._profiler.calibrate(self._llm, sweep, self.vocab_size, lambda: not self._requests, loop.time)

    def profile(self) -> EngineProfile | None:
        """The profile measured at start-up and refined since; None until calibrated."""
        return self._profiler.profile

    async def _watch_engine_core(self) -> None:
        loop = asyncio.get_running_loop()
        looked_at = loop.time()
        while not self._llm.errored:
            await asyncio.sleep(_WATCH_INTERVAL_S)  # AsyncLLM exposes death as a flag, not an awaitable
            if (late_s := loop.time() - looked_at - _WATCH_INTERVAL_S) > _WATCH_INTERVAL_S:
                # This process did not run (paused): the engine's outputs of that time are not read yet.
                self._progress.not_watched(loop.time(), late_s)
            looked_at = loop.time()
            if (stuck_s := self._progress.hung_s(loop.time(), len(self._requests))) is not None:
                # Raised as a death is: the node agent exits, its lease ends and its streams move on.
                raise RuntimeError(f"vLLM engine of {self.model} gave no output for {stuck_s:.0f} s with "
                                   f"{len(self._requests)} requests in flight (--engine-hung-s "
                                   f"{self._progress.hung_after_s:g}): taken as hung")
        raise RuntimeError(f"vLLM engine core of {self.model} died: {self._llm.dead_error}")

    async def _follow_kv_events(self) -> None:
        async for events in self._subscriber.batches():
            for event in events:
                translated = self._keys.translate(event)
                if translated is not None:
                    self._kv_events.append(translated)
            if self._kv_events:
                self._kv_ready.set()

    # -- requests ------------------------------------------------------------------------------------

    def generate(self, request: EngineRequest, heartbeat_s: float) -> OutputStream:
        """Admit request now (EngineInputError naming the value if vLLM could not serve it)."""
        self._num_received += 1
        self._check(request)
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        from services.node_agent.engines.vllm.keyed_sampler import keyed_extra_args

        sampling = request.sampling
        prompt = list(request.prompt_token_ids)
        keyed = sampling.temperature > 0 and sampling.seed is not None
        params = VllmSamplingParams(
            n=1,
            max_tokens=sampling.max_tokens,
            # Keyed: the logits processor leaves one token finite and vLLM's greedy path emits it.
            temperature=0.0 if keyed else sampling.temperature,
            top_p=1.0 if keyed else sampling.top_p,
            extra_args=keyed_extra_args(sampling.seed, sampling.temperature, sampling.top_p, len(prompt))
            if keyed else None,
            ignore_eos=sampling.ignore_eos,
            detokenize=False,  # the router turns tokens into text
            output_kind=RequestOutputKind.DELTA,
        )
        resumed = prompt[len(prompt) - request.num_resumed_tokens:] if request.num_resumed_tokens else []
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._progress.admitted(asyncio.get_running_loop().time(), len(self._requests))
        pump = asyncio.get_running_loop().create_task(
            self._pump(f"{request.request_id}#{next(self._admissions)}", prompt, params, queue, request.cache_salt))
        running = self._requests[request.request_id] = _Running(
            prompt_len=len(prompt), pump=pump, queue=queue,
            num_cached_tokens=self._keys.cached_prefix_tokens(prompt, request.cache_salt))
        self._gpu_time.start(request.request_id, asyncio.get_running_loop().time())
        self._profiler.admitted(request.request_id, len(self._requests), asyncio.get_running_loop().time())
        self.load_changed.notify()
        request_id = request.request_id
        return OutputStream(self._outputs(request_id, running, StopMatcher(sampling.stop, resumed), heartbeat_s),
                            lambda: self._release(request_id, running))

    def _check(self, request: EngineRequest) -> None:
        rid, prompt, max_tokens = request.request_id, request.prompt_token_ids, request.sampling.max_tokens
        if rid in self._requests:
            raise EngineInputError("request_id", rid, "is already running on this node")
        if not prompt:
            raise EngineInputError("prompt_token_ids", [], "must not be empty")
        if max_tokens < 1:
            raise EngineInputError("max_tokens", max_tokens, "must be >= 1")
        temperature, top_p = request.sampling.temperature, request.sampling.top_p
        if not (math.isfinite(temperature) and temperature >= 0):
            raise EngineInputError("temperature", temperature, "must be >= 0 (0: greedy)")
        if not 0 < top_p <= 1:
            raise EngineInputError("top_p", top_p, "must be in (0, 1]")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            i, bad = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size)
            raise EngineInputError(f"prompt_token_ids[{i}]", bad,
                                   f"token id {bad} is outside {self.model}'s vocabulary [0, {self.vocab_size})")
        if len(prompt) + max_tokens > self.max_context_tokens:
            raise EngineInputError("prompt_token_ids", f"{len(prompt)} tokens",
                                   f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                                   f"{self.model}'s max_model_len of {self.max_context_tokens}")
        if not 0 <= request.num_resumed_tokens < len(prompt):
            raise EngineInputError("num_resumed_tokens", request.num_resumed_tokens,
                                   f"must be below the prompt length {len(prompt)}")

    async def _pump(self, vllm_request_id: str, prompt: list[int], params: Any, queue: asyncio.Queue[Any],
                    cache_salt: str = "") -> None:
        """Move vLLM's outputs of one request into its queue; cancelled, vLLM aborts the request."""
        try:
            # vLLM's cache_salt keeps its prefix cache per salt (per tenant, when authentication is on).
            inputs = {"prompt_token_ids": prompt, **({"cache_salt": cache_salt} if cache_salt else {})}
            async for output in self._llm.generate(inputs, params, vllm_request_id):
                self._progress.output(asyncio.get_running_loop().time())
                queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the reader, which raises it in the stream
            queue.put_nowait(exc)

    async def _outputs(self, request_id: str, running: _Running, stops: StopMatcher,
                       heartbeat_s: float) -> AsyncGenerator[RequestOutput | None, None]:
        finished = False
        try:
            # Until it finishes, or is aborted (its reader then ends without a finish: the stream broke).
            while not finished and self._requests.get(request_id) is running:
                try:
                    first = await within(running.queue.get(), heartbeat_s)
                except TimeoutError:
                    yield None
                    continue
                pending = [first]
                while not running.queue.empty():
                    pending.append(running.queue.get_nowait())
                output = self._merge(request_id, running, pending, stops)
                finished = output.finish_reason is not None
                yield output
        finally:
            self._release(request_id, running)

    def _release(self, request_id: str, running: _Running) -> None:
        """running's reader is done, or it finished: it leaves vLLM and the load, if it is still there. Only its
        own request: a reader closed late (after its request was aborted and another of the same id admitted, as
        a resume on this node does) must not abort the new one."""
        if self._requests.get(request_id) is running:
            self.abort(request_id)

    def _merge(self, request_id: str, running: _Running, pending: list[Any], stops: StopMatcher) -> RequestOutput:
        """One Baton output from the vLLM outputs that came since the last read."""
        new_token_ids: list[int] = []
        finish: FinishReason | None = None
        # The steps since the last read: every token vLLM produced, an end of sequence or text past a stop included.
        num_steps = sum(len(item.outputs[0].token_ids) for item in pending if not isinstance(item, Exception))
        for item in pending:
            if isinstance(item, Exception):
                if _is_input_error(item):
                    raise EngineInputError("prompt_token_ids", f"{running.prompt_len} tokens",
                                           f"vLLM refused the request: {item}") from item
                raise item
            completion = item.outputs[0]
            token_ids = list(completion.token_ids)
            if item.num_cached_tokens is not None and not running.has_first_token:
                running.num_cached_tokens = item.num_cached_tokens
            if completion.finish_reason == "stop" and token_ids:
                token_ids.pop()  # end of sequence: ends the request, never emitted (as on the sim engine)
            keep = stops.feed(token_ids)
            if keep is not None:
                new_token_ids += token_ids[:keep]
                finish = FinishReason.STOP
                break
            new_token_ids += token_ids
            if item.finished:
                finish = _FINISH_REASONS.get(completion.finish_reason or "abort", FinishReason.ABORT)
                break
        now = asyncio.get_running_loop().time()
        self._observe_step(request_id, running, len(new_token_ids), num_steps, now)
        running.last_output_at = now
        running.has_first_token = running.has_first_token or bool(new_token_ids) or finish is not None
        running.num_completion_tokens += len(new_token_ids)
        gpu_ms = self._gpu_time.gpu_ms(request_id, now)
        if finish is not None:
            self._release(request_id, running)  # finished: out of the load at once (and of vLLM, after a stop)
        return RequestOutput(
            request_id=request_id,
            new_token_ids=new_token_ids,
            finish_reason=finish,
            num_prompt_tokens=running.prompt_len,
            num_cached_tokens=running.num_cached_tokens,
            num_completion_tokens=running.num_completion_tokens,
            gpu_ms=gpu_ms,
        )

    def _observe_step(self, request_id: str, running: _Running, num_new_tokens: int, num_steps: int,
                      now: float) -> None:
        """Hand the profiler, and the load's mean of decode steps, this output's reading of the steps since
        the request's last output (the oldest decoding request's only)."""
        if not num_new_tokens:
            return
        if not running.has_first_token:
            self._profiler.first_token(request_id, num_new_tokens, running.prompt_len - running.num_cached_tokens, now)
            return
        decoding = [r for r in self._requests.values() if r.has_first_token]
        if decoding and decoding[0] is running:
            self._recent_steps.note((now - running.last_output_at) * 1000.0, num_steps)
            self._profiler.decoded(now - running.last_output_at, num_steps, len(decoding),
                                   sum(r.prompt_len + r.num_completion_tokens for r in decoding),
                                   len(self._requests) - len(decoding), now)

    def refused_before_admission(self) -> None:
        self._num_received += 1
        self.load_changed.notify()

    def abort(self, request_id: str) -> None:
        """Stop request_id in vLLM (its pump's cancellation aborts it there); a no-op once finished."""
        running = self._requests.pop(request_id, None)
        if running is None:
            return
        self._progress.left(asyncio.get_running_loop().time(), len(self._requests))
        running.pump.cancel()
        self._gpu_time.finish(request_id, asyncio.get_running_loop().time())
        if not any(r.has_first_token for r in self._requests.values()):
            self._recent_steps.stopped()  # nothing decodes: the next decode reading starts a fresh mean
        self.load_changed.notify()

    # -- load and KV cache ---------------------------------------------------------------------------

    def progress(self, request_id: str) -> RequestProgress | None:
        """vLLM does not say where a request is in its queue: decoding once it has a first token,
        else prefilling (which covers waiting in vLLM's own queue), as far as this node can tell."""
        running = self._requests.get(request_id)
        if running is None:
            return None
        if running.has_first_token:
            return RequestProgress(RequestPhase.DECODING, num_prompt_tokens=running.prompt_len)
        return RequestProgress(RequestPhase.PREFILLING, num_prompt_tokens=running.prompt_len)

    def expected_step_ms(self) -> float:
        """The decode step time lately observed (the load's mean; vLLM's API does not report step times);
        0 until a request has decoded, which leaves the router to its stall floor."""
        return self._recent_steps.mean_ms

    def load(self) -> Load:
        """Queue depths and KV blocks from vLLM's latest scheduler stats, bounded by what is in flight here."""
        num_in_flight = len(self._requests)
        stats = self._stats
        num_running = min(stats.num_running_reqs, num_in_flight) if stats is not None else num_in_flight
        usage = stats.kv_cache_usage if stats is not None else 0.0
        block = self.kv_block_size
        return Load(
            num_running=num_running,
            num_waiting=num_in_flight - num_running,
            kv_blocks_used=round(usage * self.num_kv_blocks) if num_in_flight else 0,
            kv_blocks_total=self.num_kv_blocks,
            active_decode_blocks=sum(math.ceil((r.prompt_len + r.num_completion_tokens) / block)
                                     for r in self._requests.values() if r.has_first_token),
            # The uncached prompt, until its first token: vLLM does not say how many of its chunks are done
            # (the sim engine counts what is left to compute, the chunk of the step under way included).
            pending_prefill_tokens=sum(r.prompt_len - r.num_cached_tokens for r in self._requests.values()
                                       if not r.has_first_token),
            num_received=self._num_received,
            recent_decode_step_ms=self._recent_steps.mean_ms,
        )

    async def next_kv_events(self) -> list[KVEvent]:
        await self._kv_ready.wait()
        self._kv_ready.clear()
        events, self._kv_events = self._kv_events, []
        return events

    def cached_block_hashes(self) -> list[int]:
        """Baton's keys of every block vLLM has reported cached and not removed."""
        return self._keys.cached_keys()


def _is_input_error(exc: Exception) -> bool:
    """Whether vLLM refused a request for its content (not because the engine failed)."""
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, ValueError | VLLMClientError)


def cpu_resumes_exactly(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU is of the kind where a re-prefilled resume was measured to match decoding (docs/vllm.md):
    native bf16 dot products (avx512_bf16) and no AMX tiles. False where its flags cannot be read."""
    try:
        with open(cpuinfo) as lines:
            flags = next((line.split() for line in lines if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags and "amx_tile" not in flags
