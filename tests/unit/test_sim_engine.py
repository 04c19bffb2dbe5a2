"""The simulated engine core: batching, chunked prefill, prefix caching, preemption, determinism."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.common.block_hash import block_hashes
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.models import GPU_SPECS, SimModelSpec, get_model, kv_capacity_blocks
from services.node_agent.engines.sim.timing import TimingModel, load_coefficients
from services.node_agent.engines.sim.tokens import ContextHasher, next_token
from services.node_agent.engines.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineRequest,
    FinishReason,
    RequestOutput,
    RequestPhase,
    RequestProgress,
    SamplingParams,
    StepResult,
)

MODEL = get_model("sim-llama-3-8b")
TIMING = load_coefficients("h100", MODEL.perf_model)
PRINTABLE = set(b"abcdefghijklmnopqrstuvwxyz ,.")


def make_core(num_kv_blocks: int = 2000, **kwargs: int) -> SimEngineCore:
    return SimEngineCore(MODEL, TIMING, num_kv_blocks, **kwargs)


def prompt(n: int, salt: int = 0) -> tuple[int, ...]:
    """n lowercase letters, a different sequence for each salt."""
    return tuple(97 + ((i + 1) * 2654435761 + salt * 40503) % 2**32 % 26 for i in range(n))


def request(
    request_id: str,
    prompt_ids: tuple[int, ...],
    max_tokens: int = 10,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: tuple[tuple[int, ...], ...] = (),
    ignore_eos: bool = True,
) -> EngineRequest:
    """A request; EOS is ignored unless asked so that lengths are exact."""
    sampling = SamplingParams(max_tokens, temperature, seed=seed, stop=stop, ignore_eos=ignore_eos)
    return EngineRequest(request_id, prompt_ids, sampling)


@dataclasses.dataclass
class Run:
    """Everything a core produced until it went idle."""

    steps: list[StepResult]
    tokens: dict[str, list[int]]
    finals: dict[str, RequestOutput]

    @property
    def events(self) -> list[object]:
        return [event for step in self.steps for event in step.kv_events]


def run_until_idle(core: SimEngineCore, max_steps: int = 10_000) -> Run:
    run = Run([], {}, {})
    counts: dict[str, int] = {}
    while core.has_unfinished_requests():
        assert len(run.steps) < max_steps
        step = core.step()
        run.steps.append(step)
        for out in step.outputs:
            assert out.request_id not in run.finals, "output after the request finished"
            run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            # Counts are cumulative, so no token is ever emitted twice (e.g. after preemption).
            if out.request_id in counts:
                assert out.num_completion_tokens == counts[out.request_id] + len(out.new_token_ids)
            counts[out.request_id] = out.num_completion_tokens
            if out.finish_reason is not None:
                run.finals[out.request_id] = out
    return run


def solo_tokens(req: EngineRequest) -> list[int]:
    core = make_core()
    core.add_request(req)
    return run_until_idle(core).tokens[req.request_id]


# --- batching and chunked prefill ---------------------------------------------------------


def test_requests_decode_together_one_token_each_per_step() -> None:
    core = make_core()
    for i in range(3):
        core.add_request(request(f"r{i}", prompt(20, i), max_tokens=5))
    run = run_until_idle(core)
    assert len(run.steps) == 5
    for step in run.steps:
        assert sorted(out.request_id for out in step.outputs) == ["r0", "r1", "r2"]
        assert all(len(out.new_token_ids) == 1 for out in step.outputs)
    # First step prefills the three prompts together; later steps are pure decode.
    assert run.steps[0].duration_s == pytest.approx(TIMING.prefill_ms([20, 20, 20]) / 1000)
    assert run.steps[1].duration_s == pytest.approx(TIMING.decode_step_ms(3, 3 * 21) / 1000)
    assert {out.finish_reason for out in run.steps[-1].outputs} == {FinishReason.LENGTH}


def test_long_prompt_is_prefilled_in_chunks_before_its_first_token() -> None:
    core = make_core(max_num_batched_tokens=2048)
    core.add_request(request("long", prompt(5000), max_tokens=2))
    first, second, third = core.step(), core.step(), core.step()
    assert first.outputs == [] and second.outputs == []
    assert [len(out.new_token_ids) for out in third.outputs] == [1]
    assert first.duration_s == pytest.approx(TIMING.prefill_ms([2048]) / 1000)
    assert third.duration_s == pytest.approx(TIMING.prefill_ms([5000 - 4096]) / 1000)


def test_decodes_share_a_step_with_a_prefill_chunk() -> None:
    core = make_core(max_num_batched_tokens=100)
    core.add_request(request("short", prompt(10), max_tokens=5))
    core.step()
    core.add_request(request("long", prompt(300, 1), max_tokens=5))
    step = core.step()
    assert [out.request_id for out in step.outputs] == ["short"]
    # One decode token leaves 99 of the budget for the long prompt's chunk.
    assert step.duration_s == pytest.approx(TIMING.step_ms(1, 11, [99]) / 1000)
    assert core.load().pending_prefill_tokens == 300  # while the step runs, its chunk is still to compute
    core.step_ended()
    assert core.load().pending_prefill_tokens == 300 - 99


def test_max_num_seqs_caps_the_running_batch() -> None:
    core = make_core(max_num_seqs=2)
    for i in range(3):
        core.add_request(request(f"r{i}", prompt(8, i), max_tokens=3))
    assert sorted(out.request_id for out in core.step().outputs) == ["r0", "r1"]
    assert (core.load().num_running, core.load().num_waiting) == (2, 1)
    run = run_until_idle(core)
    assert set(run.finals) == {"r0", "r1", "r2"}


def test_progress_says_queued_behind_how_many_then_prefilling_then_decoding() -> None:
    core = make_core(max_num_seqs=1, max_num_batched_tokens=2048)
    core.add_request(request("long", prompt(5000), max_tokens=2))
    core.add_request(request("next", prompt(8, 1), max_tokens=2))
    core.add_request(request("last", prompt(8, 2), max_tokens=2))
    assert core.progress("last") == RequestProgress(RequestPhase.QUEUED, num_ahead=2, num_prompt_tokens=8)
    core.step()
    assert core.progress("long") == RequestProgress(RequestPhase.PREFILLING, num_computed_tokens=2048,
                                                    num_prompt_tokens=5000)
    assert core.progress("last") == RequestProgress(RequestPhase.QUEUED, num_ahead=1, num_prompt_tokens=8)
    core.step()
    core.step()
    assert core.progress("long") is not None and core.progress("long").phase is RequestPhase.DECODING
    assert core.progress("nobody") is None


# --- prefix caching -------------------------------------------------------------------------


@pytest.mark.parametrize("length", [100, 96, 17, 16])
def test_repeated_prompt_hits_all_full_blocks_but_the_last_token(length: int) -> None:
    core = make_core()
    core.add_request(request("first", prompt(length), max_tokens=3))
    assert run_until_idle(core).finals["first"].num_cached_tokens == 0
    core.add_request(request("second", prompt(length), max_tokens=3))
    first_step = core.step()
    cached = 16 * ((length - 1) // 16)
    assert first_step.outputs[0].num_cached_tokens == cached
    assert first_step.duration_s == pytest.approx(TIMING.prefill_ms([length - cached]) / 1000)
    assert run_until_idle(core).finals["second"].num_cached_tokens == cached


def test_prompt_extending_an_earlier_completion_hits_the_cache() -> None:
    core = make_core()
    first = request("first", prompt(50), max_tokens=40)
    core.add_request(first)
    completion = run_until_idle(core).tokens["first"]
    turn2 = first.prompt_token_ids + tuple(completion) + prompt(7, 3)
    core.add_request(request("turn2", turn2, max_tokens=2))
    # The first request computed KV for all but its final token: 89 tokens, 5 full blocks.
    assert run_until_idle(core).finals["turn2"].num_cached_tokens == 16 * ((50 + 40 - 1) // 16)


def test_stored_events_carry_chained_block_hashes() -> None:
    core = make_core(max_num_batched_tokens=2048)
    long_prompt = prompt(5000)
    core.add_request(request("long", long_prompt, max_tokens=1))
    expected = block_hashes(long_prompt)
    first, second = core.step(), core.step()
    assert first.kv_events == [
        BlockStored(tuple(expected[:128]), None, long_prompt[: 128 * 16], 16),
    ]
    assert second.kv_events == [
        BlockStored(tuple(expected[128:256]), expected[127], long_prompt[128 * 16 : 256 * 16], 16),
    ]


def test_generated_tokens_fill_blocks_that_are_stored_too() -> None:
    core = make_core()
    core.add_request(request("r", prompt(20), max_tokens=20))
    run = run_until_idle(core)
    full = prompt(20) + tuple(run.tokens["r"])
    stored = [e for e in run.events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [(block_hashes(full)[0],), (block_hashes(full)[1],)]
    assert stored[1].parent_block_hash == block_hashes(full)[0]
    assert stored[1].token_ids == full[16:32]


def test_reset_prefix_cache_publishes_all_cleared_and_forgets_hits() -> None:
    core = make_core()
    core.add_request(request("a", prompt(40), max_tokens=2))
    run_until_idle(core)
    core.reset_prefix_cache()
    assert core.drain_kv_events() == [AllBlocksCleared()]
    core.add_request(request("b", prompt(40), max_tokens=2))
    assert run_until_idle(core).finals["b"].num_cached_tokens == 0


# --- eviction and preemption ----------------------------------------------------------------


def test_small_cache_evicts_old_unreferenced_blocks_lru() -> None:
    core = make_core(num_kv_blocks=10)
    a, b, c = prompt(64, 1), prompt(64, 2), prompt(64, 3)
    for rid, ids in (("a", a), ("b", b)):
        core.add_request(request(rid, ids, max_tokens=1))
        run_until_idle(core)
    core.add_request(request("c", c, max_tokens=1))
    removed = [e for e in run_until_idle(core).events if isinstance(e, BlockRemoved)]
    # Two free blocks, then the two least recently used: a's chain, tail first.
    assert removed == [BlockRemoved((block_hashes(a)[3], block_hashes(a)[2]))]
    core.add_request(request("a-again", a, max_tokens=1))
    assert run_until_idle(core).finals["a-again"].num_cached_tokens == 32


def test_blocks_of_a_running_request_are_never_evicted() -> None:
    core = make_core(num_kv_blocks=8)
    runner = request("runner", prompt(32), max_tokens=30)
    core.add_request(runner)
    core.step()
    for i in range(6):
        core.add_request(request(f"x{i}", prompt(48, 10 + i), max_tokens=1))
    run = run_until_idle(core)
    last_step = {out.request_id: i for i, step in enumerate(run.steps) for out in step.outputs}
    runner_done = last_step["runner"]
    assert all(last_step[f"x{i}"] < runner_done for i in range(6))
    removed = {
        h
        for step in run.steps[: runner_done + 1]
        for e in step.kv_events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    }
    assert removed, "the small cache should force evictions"
    assert removed.isdisjoint(block_hashes(prompt(32)))
    assert run.tokens["runner"] == solo_tokens(runner)[1:]  # its first token came before the loop


def test_preempted_requests_complete_with_the_tokens_they_would_have_produced_alone() -> None:
    # Each request needs 5 blocks by its end; 10 blocks cannot hold all three.
    core = make_core(num_kv_blocks=10)
    reqs = [
        request("greedy", prompt(32, 1), max_tokens=40),
        request("seeded", prompt(32, 2), max_tokens=40, temperature=0.8, seed=7),
        request("hot", prompt(32, 3), max_tokens=40, temperature=1.5, seed=9),
    ]
    for req in reqs:
        core.add_request(req)
    loads = []
    run = Run([], {}, {})
    while core.has_unfinished_requests():
        step = core.step()
        loads.append(core.load())
        for out in step.outputs:
            run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.num_completion_tokens == len(run.tokens[out.request_id])
            assert core.load().kv_blocks_used <= 10
    assert loads[0].num_waiting == 0
    assert any(load.num_waiting > 0 for load in loads), "expected a preemption"
    for req in reqs:
        assert run.tokens[req.request_id] == solo_tokens(req)
        assert len(run.tokens[req.request_id]) == 40
    assert core.load().kv_blocks_used == 0


# --- determinism ----------------------------------------------------------------------------


def test_greedy_output_does_not_depend_on_batch_company() -> None:
    target = request("target", prompt(30), max_tokens=25)
    core = make_core()
    core.add_request(request("noise0", prompt(700, 5), max_tokens=40))
    core.add_request(target)
    core.add_request(request("noise1", prompt(3, 6), max_tokens=2))
    assert run_until_idle(core).tokens["target"] == solo_tokens(target)


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    same = solo_tokens(request("a", prompt(30), max_tokens=30, temperature=0.8, seed=1))
    assert solo_tokens(request("b", prompt(30), max_tokens=30, temperature=0.8, seed=1)) == same
    assert solo_tokens(request("c", prompt(30), max_tokens=30, temperature=0.8, seed=2)) != same
    assert solo_tokens(request("d", prompt(30), max_tokens=30)) != same


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 42)])
def test_resuming_from_a_checkpoint_gives_the_remaining_tokens(temperature: float, seed: int | None) -> None:
    full = solo_tokens(request("full", prompt(40), 30, temperature=temperature, seed=seed))
    resumed = solo_tokens(
        request("resume", prompt(40) + tuple(full[:12]), 18, temperature=temperature, seed=seed)
    )
    assert resumed == full[12:]


def test_tokens_are_printable_and_eos_ends_some_requests() -> None:
    core = make_core()
    for i in range(20):
        core.add_request(
            request(f"r{i}", prompt(10, i), max_tokens=400, ignore_eos=False, seed=i, temperature=0.7)
        )
    run = run_until_idle(core)
    assert all(set(tokens) <= PRINTABLE for tokens in run.tokens.values())
    stopped = [out for out in run.finals.values() if out.finish_reason is FinishReason.STOP]
    assert stopped, "about one in 400 tokens is EOS"
    # EOS is not emitted: the completion stops short of max_tokens.
    assert all(out.num_completion_tokens < 400 for out in stopped)


def test_next_token_is_a_pure_function_of_context() -> None:
    greedy = SamplingParams(max_tokens=1)
    state = ContextHasher.from_tokens(prompt(10)).state
    assert next_token(state, 10, greedy) == next_token(state, 999, greedy)
    hasher = ContextHasher.from_tokens(prompt(9))
    hasher.extend(prompt(10)[9])
    assert hasher.state == state


# --- stop conditions and aborts -------------------------------------------------------------


def test_stop_sequence_ends_the_request_and_is_included() -> None:
    full = solo_tokens(request("full", prompt(20), max_tokens=30))
    stop = tuple(full[10:13])
    end = next(i + 3 for i in range(len(full)) if tuple(full[i : i + 3]) == stop)
    core = make_core()
    core.add_request(request("stopped", prompt(20), max_tokens=30, stop=(stop,)))
    run = run_until_idle(core)
    assert run.tokens["stopped"] == full[:end]
    assert run.finals["stopped"].finish_reason is FinishReason.STOP


def test_abort_frees_blocks_and_reports_immediately() -> None:
    core = make_core()
    core.add_request(request("keep", prompt(40, 1), max_tokens=5))
    core.step()
    baseline = core.load().kv_blocks_used
    core.add_request(request("drop", prompt(100, 2), max_tokens=50))
    core.add_request(request("queued", prompt(10, 3), max_tokens=5))
    core.step()
    core.step()
    assert core.load().kv_blocks_used > baseline
    out = core.abort_request("drop")
    assert out is not None and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert (out.num_prompt_tokens, out.num_completion_tokens) == (100, 2)
    assert core.abort_request("drop") is None
    assert core.abort_request("never-seen") is None
    queued = core.abort_request("queued")
    assert queued is not None and queued.num_completion_tokens == 2
    assert core.load().kv_blocks_used == baseline
    run = run_until_idle(core)
    assert set(run.tokens) == {"keep"}
    assert core.load().kv_blocks_used == 0


def test_abort_of_a_waiting_request() -> None:
    core = make_core()
    core.add_request(request("w", prompt(10), max_tokens=5))
    out = core.abort_request("w")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert not core.has_unfinished_requests()
    assert core.step().outputs == []


def test_request_validation() -> None:
    core = make_core(num_kv_blocks=4)
    core.add_request(request("dup", prompt(5)))
    with pytest.raises(ValueError, match="already"):
        core.add_request(request("dup", prompt(5)))
    with pytest.raises(ValueError, match="empty"):
        core.add_request(request("empty", ()))
    with pytest.raises(ValueError, match="context"):
        make_core().add_request(request("long", prompt(8000), max_tokens=193))
    with pytest.raises(ValueError, match="KV blocks"):
        core.add_request(request("big", prompt(60), max_tokens=6))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request(request("bad", (1, 300)))
    with pytest.raises(ValueError, match="max_tokens"):
        core.add_request(request("zero", prompt(5), max_tokens=0))
    core.add_request(request("fits", prompt(60), max_tokens=5))


# --- load and capacity ----------------------------------------------------------------------


def test_load_reports_queues_blocks_and_pending_prefill() -> None:
    core = make_core(max_num_batched_tokens=2048)
    core.add_request(request("long", prompt(5000), max_tokens=3))
    core.add_request(request("short", prompt(30, 1), max_tokens=3))
    load = core.load()
    assert (load.num_running, load.num_waiting, load.pending_prefill_tokens) == (0, 2, 5030)
    assert (load.kv_blocks_used, load.kv_blocks_total) == (0, 2000)
    core.step()
    load = core.load()
    assert (load.num_running, load.num_waiting) == (1, 1)
    # Until the step's modelled time has passed, its 2,048-token chunk is still ahead of a new request
    # (a scheduler that saw it done sent the next prompt behind it as if the node were free).
    assert load.pending_prefill_tokens == 5030
    core.step_ended()
    assert core.load().pending_prefill_tokens == 5030 - 2048
    assert (load.active_decode_blocks, load.kv_blocks_used) == (0, 128)
    for _ in range(2):  # the rest of the long prompt (904 tokens) and all of the short one
        core.step()
        core.step_ended()
    load = core.load()
    assert load.pending_prefill_tokens == 0
    assert load.active_decode_blocks == math.ceil(5000 / 16) + math.ceil(30 / 16)
    assert load.kv_blocks_used == load.active_decode_blocks


def test_load_reports_the_time_of_its_latest_decode_steps_prefill_riding_in_them_included() -> None:
    """What a request decoding there now sees: a prompt arriving at a node chunks into its decode steps,
    which run far slower than the batch alone would make them. A step counts once its time has passed,
    as a vLLM node could only see it; after a pause in decoding the mean starts afresh."""
    core = make_core(max_num_batched_tokens=2048)
    assert core.load().recent_decode_step_ms == 0  # nothing has decoded
    core.add_request(request("decoding", prompt(30), max_tokens=20))
    core.step()  # its prefill: not a decode step
    core.step_ended()
    assert core.load().recent_decode_step_ms == 0
    plain = []
    for _ in range(5):
        plain.append(core.step().duration_s * 1000)
        core.step_ended()
    assert core.load().recent_decode_step_ms == pytest.approx(sum(plain) / 5)
    core.add_request(request("burst", prompt(8000, 1), max_tokens=3))
    riding = core.step().duration_s * 1000  # a 2,048-token chunk rides in the decode step
    assert riding > 3 * max(plain)
    assert core.load().recent_decode_step_ms == pytest.approx(sum(plain) / 5)  # the step has not yet run
    core.step_ended()
    assert core.load().recent_decode_step_ms == pytest.approx((sum(plain) + riding) / 6)
    run_until_idle(core)
    core.step_ended()
    stopped = core.load().recent_decode_step_ms
    assert stopped > 0  # idle: the steps before it stopped
    core.add_request(request("later", prompt(30, 2), max_tokens=5))
    core.step()  # a prefill alone: nothing decodes, so the next decode step starts afresh
    core.step_ended()
    assert core.load().recent_decode_step_ms == stopped
    fresh = core.step().duration_s * 1000
    core.step_ended()
    assert core.load().recent_decode_step_ms == pytest.approx(fresh)


def test_load_counts_every_request_handed_in_refused_ones_too() -> None:
    """The scheduler matches its placements against this count, in the same snapshot as the queues."""
    core = make_core()
    core.add_request(request("a", prompt(30), max_tokens=3))
    with pytest.raises(ValueError):
        core.add_request(request("a", prompt(30), max_tokens=3))  # a duplicate: refused, but it arrived
    assert (core.load().num_received, core.load().num_waiting) == (2, 1)


def test_kv_capacity_formula() -> None:
    expected = math.floor((80e9 * 0.9 - 16.1e9 - 2.4 * 2**30) / 131072 / 16)
    assert kv_capacity_blocks(GPU_SPECS["h100"].hbm_bytes, MODEL) == expected == 25426
    llama2 = get_model("sim-llama-2-7b")
    assert kv_capacity_blocks(GPU_SPECS["l4"].hbm_bytes, llama2) == math.floor(
        (24e9 * 0.9 - 13.5e9 - 2.4 * 2**30) / 524288 / 16
    )
    huge = SimModelSpec("huge", "Llama-2-70b-hf", 140e9, 327680, 4096)
    assert kv_capacity_blocks(GPU_SPECS["a10g"].hbm_bytes, huge) == 0


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="sim-llama-2-7b"):
        get_model("gpt-5")


def test_timing_model_is_used_as_given() -> None:
    flat = TimingModel(0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0)
    core = SimEngineCore(MODEL, flat, 100)
    core.add_request(request("r", prompt(10), max_tokens=2))
    assert [step.duration_s for step in run_until_idle(core).steps] == [0.001, 0.002]


@pytest.mark.parametrize("max_decode_steps", [1, 64])
def test_every_step_is_charged_to_its_requests_by_the_tokens_they_computed(max_decode_steps: int) -> None:
    core = make_core()
    core.add_request(request("long", prompt(3000), max_tokens=20))
    core.add_request(request("short", prompt(100, salt=1), max_tokens=20))
    total_s, last = 0.0, {}
    while core.has_unfinished_requests():
        result = core.step(max_decode_steps)
        total_s += result.duration_s
        last.update({o.request_id: o.gpu_ms for o in result.outputs})
    assert last["long"] + last["short"] == pytest.approx(total_s * 1000)
    # Decode steps are shared equally; the long prompt's prefill is charged to it alone.
    assert last["long"] > 1.5 * last["short"]
