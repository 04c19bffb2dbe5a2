"""step(max_decode_steps=k) runs exactly the steps k single calls would, merged."""

from __future__ import annotations

import pytest

from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.models import get_model
from services.node_agent.engines.sim.timing import load_coefficients
from services.node_agent.engines.types import EngineRequest, FinishReason, SamplingParams, StepResult

MODEL = get_model("sim-llama-3-8b")


def core(num_blocks: int) -> SimEngineCore:
    return SimEngineCore(MODEL, load_coefficients("h100", MODEL.perf_model), num_kv_blocks=num_blocks,
                         max_num_batched_tokens=256)


def requests() -> list[EngineRequest]:
    shared = [7] * 40
    return [
        EngineRequest(f"r{i}", tuple(shared + [i % 200] * (10 + 13 * i)),
                      SamplingParams(max_tokens=20 + 17 * i, temperature=0.7 if i % 2 else 0.0, seed=i))
        for i in range(6)
    ]


def run(engine: SimEngineCore, max_decode_steps: int) -> tuple[dict[str, list[int]], list[str], float, list, float]:
    for request in requests():
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    events = []
    total_s = 0.0
    while engine.has_unfinished_requests():
        result: StepResult = engine.step(max_decode_steps=max_decode_steps)
        total_s += result.duration_s
        events.extend(result.kv_events)
        for output in result.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                assert output.finish_reason == FinishReason.LENGTH
                finished.append(output.request_id)
    engine.step_ended()
    return tokens, finished, total_s, events, engine.load().recent_decode_step_ms


@pytest.mark.parametrize("num_blocks", [4096, 40])  # roomy, and tight enough to preempt
def test_merged_decode_steps_equal_single_steps(num_blocks: int) -> None:
    single = run(core(num_blocks), 1)
    merged = run(core(num_blocks), 64)
    assert merged[0] == single[0]  # every token
    assert merged[1] == single[1]  # finish order
    assert merged[2] == pytest.approx(single[2], rel=1e-9)  # modelled time
    assert merged[3] == single[3]  # KV events
    assert merged[4] == pytest.approx(single[4], rel=1e-9)  # the load's mean of its latest decode steps


def test_merged_decode_steps_join_the_loads_mean_once_their_time_has_passed() -> None:
    engine = core(4096)
    for request in requests()[:2]:
        engine.add_request(request)
    while not engine.load().recent_decode_step_ms:  # through the prefills to the first decode step
        engine.step()
        engine.step_ended()
    before = engine.load().recent_decode_step_ms
    merged = engine.step(max_decode_steps=8)
    assert merged.duration_s > 0 and engine.load().recent_decode_step_ms == before  # still running
    engine.step_ended()
    assert engine.load().recent_decode_step_ms != before


def test_merging_stops_at_the_duration_limit_and_after_a_finish() -> None:
    engine = core(4096)
    for request in requests()[:2]:
        engine.add_request(request)
    while engine.load().num_waiting or engine.load().pending_prefill_tokens:  # until both decode
        engine.step()
    one = engine.step()  # a single decode step: its duration is the unit
    limited = engine.step(max_decode_steps=1000, max_duration_s=one.duration_s * 3.5)
    assert all(len(o.new_token_ids) <= 4 for o in limited.outputs)
    rest = engine.step(max_decode_steps=10_000)
    assert [o.finish_reason for o in rest.outputs].count(FinishReason.LENGTH) == 1  # stops after a finish
