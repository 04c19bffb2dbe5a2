"""The simulated engine's pure core: vLLM-v1-style continuous batching over a paged KV cache."""

from __future__ import annotations

import math
from collections import deque

from services.common.errors import shown
from services.common.load import Load
from services.common.recent_steps import RecentSteps
from services.node_agent.engines.sim.kv_cache import KVBlock, KVCache
from services.node_agent.engines.sim.models import SimModelSpec
from services.node_agent.engines.sim.sequence import SimSequence
from services.node_agent.engines.sim.timing import TimingModel
from services.node_agent.engines.sim.tokens import next_token
from services.node_agent.engines.types import (
    EngineRequest,
    FinishReason,
    KVEvent,
    RequestOutput,
    RequestPhase,
    RequestProgress,
    StepResult,
)


class DuplicateRequest(ValueError):
    """A request_id already queued or running here."""


class RequestRefused(ValueError):
    """A request that could never be served here, by the field at fault (the caller names the request)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={shown(value)}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


class SimEngineCore:
    """Schedules, "executes" and times engine steps; no clock, no I/O.

    Each step() returns how long it would take on the modelled GPU; the caller
    decides whether to sleep that long (node agent) or advance a virtual clock.
    """

    def __init__(
        self,
        model: SimModelSpec,
        timing: TimingModel,
        num_kv_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} "
                "must both be >= 1"
            )
        self.model = model
        self.timing = timing
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._cache = KVCache(num_kv_blocks, block_size)
        self._requests: dict[str, SimSequence] = {}
        self._num_received = 0  # requests handed to add_request(), refused ones included (Load.num_received)
        self._waiting: deque[SimSequence] = deque()
        # Uncomputed tokens of the waiting requests, kept as they come and go (queues grow long).
        self._waiting_tokens = 0
        # Prefill tokens of the step under way: step() counts them computed when it starts, but until its
        # modelled time has passed (step_ended) they are still ahead of a new request (the vLLM engine
        # counts a whole uncached prompt pending until its first token).
        self._stepping_prefill = 0
        # In admission order: the tail is the first to be preempted.
        self._running: list[SimSequence] = []
        # The waiting head that last failed to fit, and the cache state it failed against.
        self._blocked: tuple[SimSequence, int, int, int] | None = None
        # The modelled times of the latest steps that carried decode tokens (Load.recent_decode_step_ms), and
        # those of the step under way, noted once its time has passed (as the pending prefill above).
        self._recent_steps = RecentSteps()
        self._stepping_decode_ms: list[float] = []

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; DuplicateRequest or RequestRefused (ValueErrors) if it could never be served."""
        self._num_received += 1
        rid = request.request_id
        prompt = request.prompt_token_ids
        max_tokens = request.sampling.max_tokens
        if rid in self._requests:
            raise DuplicateRequest(f"request_id {rid!r} is already running")
        if not prompt:
            raise RequestRefused("prompt_token_ids", [], "must not be empty")
        if max_tokens < 1:
            raise RequestRefused("max_tokens", max_tokens, "must be >= 1")
        if min(prompt) < 0 or max(prompt) >= self.model.vocab_size:  # C-speed check first: prompts are long
            i, bad = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < self.model.vocab_size)
            raise RequestRefused(f"prompt_token_ids[{i}]", bad, f"outside the vocabulary [0, {self.model.vocab_size})")
        if not 0 <= request.num_resumed_tokens < len(prompt):
            raise RequestRefused("num_resumed_tokens", request.num_resumed_tokens,
                                 f"must be 0 or more and below the prompt length {len(prompt)}")
        if len(prompt) + max_tokens > self.model.max_context_tokens:
            raise RequestRefused("prompt_token_ids", f"{len(prompt)} tokens",
                                 f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                                 f"{self.model.name}'s context of {self.model.max_context_tokens}")
        # The final token's KV is never computed, hence the - 1.
        num_blocks_needed = -(-(len(prompt) + max_tokens - 1) // self.block_size)
        if num_blocks_needed > self._cache.num_total_blocks:
            raise RequestRefused("prompt_token_ids", f"{len(prompt)} tokens",
                                 f"with max_tokens ({max_tokens}) needs {num_blocks_needed} KV blocks, the cache "
                                 f"has {self._cache.num_total_blocks}")
        seq = SimSequence(request, self.block_size)
        self._requests[rid] = seq
        self._waiting.append(seq)
        self._waiting_tokens += seq.num_uncomputed_tokens

    def count_refused(self) -> None:
        """A request refused before add_request (by the node's own checks): received all the same."""
        self._num_received += 1

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request now and free its blocks; its ABORT output is returned here, never by step()."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
            self._waiting_tokens -= seq.num_uncomputed_tokens
        self._cache.free(request_id)
        return self._output(seq, [], FinishReason.ABORT)

    def progress(self, request_id: str) -> RequestProgress | None:
        """Where request_id stands: queued behind how many, prefilling, or decoding; None if unknown."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if not seq.is_prefilling:
            return RequestProgress(RequestPhase.DECODING, num_computed_tokens=seq.num_prompt_tokens,
                                   num_prompt_tokens=seq.num_prompt_tokens)
        try:
            ahead = self._waiting.index(seq)
        except ValueError:
            return RequestProgress(RequestPhase.PREFILLING, num_computed_tokens=seq.num_computed_tokens,
                                   num_prompt_tokens=seq.num_tokens)
        return RequestProgress(RequestPhase.QUEUED, num_ahead=ahead, num_prompt_tokens=seq.num_tokens)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._requests)

    def reset_prefix_cache(self) -> None:
        """Forget all cached blocks; AllBlocksCleared goes out with the next events."""
        self._cache.reset()

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events not yet returned by step() (e.g. a reset while idle)."""
        return self._cache.drain_events()

    def load(self) -> Load:
        """Queue depths and KV usage right now."""
        return Load(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_blocks_used=self._cache.num_used_blocks,
            kv_blocks_total=self._cache.num_total_blocks,
            active_decode_blocks=sum(
                self._cache.num_blocks_held(seq.request_id) for seq in self._running if not seq.is_prefilling
            ),
            pending_prefill_tokens=self._waiting_tokens + self._stepping_prefill
            + sum(seq.num_uncomputed_tokens for seq in self._running if seq.is_prefilling),
            num_received=self._num_received,
            recent_decode_step_ms=self._recent_steps.mean_ms,
        )

    def cached_block_hashes(self) -> list[int]:
        """Every block hash in the prefix cache: what a KV index of this engine should hold."""
        return self._cache.cached_block_hashes()

    def expected_decode_step_ms(self) -> float:
        """Modelled time of a decode step with the running batch plus one more sequence."""
        context = sum(seq.num_tokens for seq in self._running)
        return self.timing.decode_step_ms(len(self._running) + 1, context)

    def step(self, max_decode_steps: int = 1, max_duration_s: float = math.inf) -> StepResult:
        """Schedule one batch, produce its tokens and return its modelled duration.

        With max_decode_steps > 1 a batch that only decodes (nothing waiting or prefilling) runs
        up to that many steps in one call — exactly the steps single calls would run, merged —
        stopping after a step that finishes a request, before one that would need memory it
        lacks, and once max_duration_s is reached. A simulator uses it to skip the event-loop
        round trip per token; the real-time driver runs one step at a time.
        """
        self.step_ended()
        if max_decode_steps > 1:
            merged = self._decode_steps(max_decode_steps, max_duration_s)
            if merged is not None:
                return merged
        scheduled = self._schedule()
        decode = [(seq, n) for seq, n in scheduled if not seq.is_prefilling]
        self._stepping_prefill = sum(n for seq, n in scheduled if seq.is_prefilling)
        duration_ms = self.timing.step_ms(
            decode_seqs=len(decode),
            decode_context_tokens=sum(seq.num_computed_tokens + n for seq, n in decode),
            prefill_chunks=[n for seq, n in scheduled if seq.is_prefilling],
        )
        if decode:
            self._stepping_decode_ms.append(duration_ms)
        else:  # nothing decodes: the next decode step starts a fresh mean
            self._recent_steps.stopped()
        outputs: list[RequestOutput] = []
        num_step_tokens = sum(n for _, n in scheduled)
        for seq, num_new in scheduled:
            seq.gpu_ms += duration_ms * num_new / num_step_tokens
            seq.num_computed_tokens += num_new
            self._cache.commit_full_blocks(
                seq.request_id, seq.cache_keys, seq.token_ids, seq.num_computed_tokens // self.block_size
            )
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a chunk of a longer prefill: no token yet
            seq.is_prefilling = False
            new_token_ids, finish = self._sample(seq)
            outputs.append(self._output(seq, new_token_ids, finish))
            if finish is not None:
                self._finish(seq)
        return StepResult(
            duration_s=duration_ms / 1000.0, outputs=outputs, kv_events=self._cache.drain_events()
        )

    def step_ended(self) -> None:
        """The last step's modelled time has passed: its prefill chunks are computed (load() no longer
        counts them pending) and its decode steps' times join the load's mean. The driver calls it when it
        hands out the step's outputs; the next step() does it too, for a driver that does not."""
        self._stepping_prefill = 0
        for step_ms in self._stepping_decode_ms:
            self._recent_steps.note(step_ms)
        self._stepping_decode_ms.clear()

    def _schedule(self) -> list[tuple[SimSequence, int]]:
        """Pick this step's (request, new tokens) pairs: running first, then waiting FCFS."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[SimSequence, int]] = []
        has_preempted = False
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self._cache.allocate(seq.request_id, seq.num_computed_tokens + num_new):
                victim = self._running.pop()
                self._preempt(victim)
                has_preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new))
                budget -= num_new
                index += 1
        # Like vLLM, admit nobody in a step that had to preempt: memory is the bottleneck.
        while not has_preempted and self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            hits = self._prefix_hits(seq)
            num_computed = len(hits) * self.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            attempt = (seq, num_new, self._cache.version, self._cache.num_free_blocks)
            if attempt == self._blocked:
                break  # the same request and chunk failed against this same cache state: it still would
            if not self._cache.allocate(seq.request_id, num_computed + num_new, hits):
                self._blocked = attempt
                break
            self._waiting.popleft()
            self._waiting_tokens -= seq.num_uncomputed_tokens
            self._running.append(seq)
            seq.num_computed_tokens = num_computed
            seq.is_prefilling = True
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_computed
            scheduled.append((seq, num_new))
            budget -= num_new
        return scheduled

    def _prefix_hits(self, seq: SimSequence) -> list[KVBlock]:
        """The cached blocks of seq's prefix; reused while the cache's findable set is unchanged
        (a request waiting for memory is matched again every step otherwise)."""
        if seq.prefix_match is not None and seq.prefix_match[0] == self._cache.version:
            return seq.prefix_match[1]
        # Full blocks only, and never the last token: something must be computed to sample from.
        hits = self._cache.match_prefix(seq.cache_keys[: (seq.num_tokens - 1) // self.block_size])
        seq.prefix_match = (self._cache.version, hits)
        return hits

    def _preempt(self, seq: SimSequence) -> None:
        """Free a running request's blocks and requeue it first; it recomputes, keeping its tokens."""
        self._cache.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.is_prefilling = True
        self._waiting.appendleft(seq)
        self._waiting_tokens += seq.num_uncomputed_tokens

    def _decode_steps(self, max_steps: int, max_duration_s: float) -> StepResult | None:
        """Several decode-only steps merged into one result; None when the batch is not decode-only
        or its first step needs memory (the general path preempts)."""
        running = self._running
        if self._waiting or not running or any(seq.is_prefilling for seq in running):
            return None
        block_size = self.block_size
        tokens: dict[str, list[int]] = {seq.request_id: [] for seq in running}
        finished: dict[str, FinishReason] = {}
        context = sum(seq.num_computed_tokens + 1 for seq in running)
        duration_ms = 0.0
        for step in range(max_steps):
            # The same allocations, in the same order, as _schedule would make for this step (a
            # sequence whose block table already covers its next token needs none).
            if not all(seq.num_computed_tokens < self._cache.num_blocks_held(seq.request_id) * block_size
                       or self._cache.allocate(seq.request_id, seq.num_computed_tokens + 1) for seq in running):
                if step == 0:
                    return None
                break
            step_ms = self.timing.step_ms(decode_seqs=len(running), decode_context_tokens=context,
                                          prefill_chunks=[])
            if step > 0 and (duration_ms + step_ms) / 1000.0 > max_duration_s:
                break
            duration_ms += step_ms
            self._stepping_decode_ms.append(step_ms)
            context += len(running)
            share_ms = step_ms / len(running)
            for seq in running:
                seq.gpu_ms += share_ms
                seq.num_computed_tokens += 1
                if seq.num_computed_tokens % block_size == 0:
                    self._cache.commit_full_blocks(seq.request_id, seq.cache_keys, seq.token_ids,
                                                   seq.num_computed_tokens // block_size)
                new_token_ids, finish = self._sample(seq)
                tokens[seq.request_id].extend(new_token_ids)
                if finish is not None:
                    finished[seq.request_id] = finish
            if finished:
                break
        outputs = [self._output(seq, tokens[seq.request_id], finished.get(seq.request_id)) for seq in running]
        for seq in list(running):
            if seq.request_id in finished:
                self._finish(seq)
        return StepResult(duration_s=duration_ms / 1000.0, outputs=outputs, kv_events=self._cache.drain_events())

    def _sample(self, seq: SimSequence) -> tuple[list[int], FinishReason | None]:
        """Choose the next token of a request whose whole context is computed, and check stops."""
        sampling = seq.sampling
        eos = self.model.eos_token_id
        token = next_token(seq.hasher.state, seq.num_tokens, sampling, eos)
        # EOS ends the request but is not emitted: consumers only ever see byte tokens.
        if token == eos and not sampling.ignore_eos:
            return [], FinishReason.STOP
        seq.append_token(token)
        finish: FinishReason | None = None
        if any(seq.ends_with(stop) for stop in sampling.stop):
            finish = FinishReason.STOP
        elif seq.num_completion_tokens >= sampling.max_tokens:
            finish = FinishReason.LENGTH
        return [token], finish

    def _finish(self, seq: SimSequence) -> None:
        """Retire a finished request; its full blocks stay cached until evicted."""
        self._running.remove(seq)
        del self._requests[seq.request_id]
        self._cache.free(seq.request_id)

    def _output(
        self, seq: SimSequence, new_token_ids: list[int], finish: FinishReason | None
    ) -> RequestOutput:
        """A RequestOutput with the request's running usage counts."""
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            finish_reason=finish,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_completion_tokens=seq.num_completion_tokens,
            gpu_ms=seq.gpu_ms,
        )
