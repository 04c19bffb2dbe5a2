"""The simulator: prompts built from trace blocks, trace loading and sessions, placement with a real
prefix cache, migration after a node failure, closed-loop tasks, and the summary's SLO accounting."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from services.common.block_hash import block_hashes
from services.node_agent.engines.sim.models import get_model, load_time_s
from services.scheduler.model_planner import ModelPlanner
from services.scheduler.policies import make_policy
from services.scheduler.retry_budget import RetryBudget
from simulator.metrics import Slo, summarize, task_stats
from simulator.model_study import shifted
from simulator.report import TRACES
from simulator.simulation import RunResult, Simulation, fleet
from simulator.workload import (
    SimRequest,
    TokenBook,
    Workload,
    agentic_workflows,
    load_azure,
    load_mooncake,
    trace_length,
)
from tests.unit.sim_cli import write_traces

pytestmark = pytest.mark.timeout(10)


def _request(hash_ids: tuple[int, ...], prompt_len: int, request_id: str = "r0", arrival_s: float = 0.0,
             output_len: int = 32) -> SimRequest:
    return SimRequest(request_id, arrival_s, hash_ids, prompt_len, output_len, task_id=f"t-{request_id}")


# -- TokenBook --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "num_keys"), [(1536, 96), (1300, 64 + 17), (10, 0)],
                         ids=["three-trace-blocks", "partial-trace-block", "under-one-kv-block"])
def test_block_hashes_equal_hashing_the_prompt_tokens(prompt_len: int, num_keys: int) -> None:
    request = _request((11, 12, 13), prompt_len)
    book = TokenBook()
    tokens = book.tokens(request)
    assert len(tokens) == prompt_len
    expected = tuple(block_hashes(tokens))
    assert len(expected) == num_keys
    assert book.block_hashes(request) == expected
    # Memoised chains and tokens passed in give the same keys.
    assert book.block_hashes(request, tokens) == expected


def test_shared_hash_ids_share_exactly_their_blocks() -> None:
    book = TokenBook()
    first = book.block_hashes(_request((1, 2, 3), 1536))
    second = book.block_hashes(_request((1, 2, 9), 1536))
    assert first[:64] == second[:64]
    assert all(a != b for a, b in zip(first[64:], second[64:], strict=True))
    # The same hash id after a different parent is a different chain (the memo is keyed by parent).
    moved = book.block_hashes(_request((5, 2, 3), 1536))
    assert not set(moved) & set(first)
    assert moved == tuple(block_hashes(TokenBook().tokens(_request((5, 2, 3), 1536))))


# -- load_mooncake ----------------------------------------------------------------------------------


def _write_trace(path: Path) -> Path:
    rows = [
        {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 1536, "output_length": 20, "hash_ids": [1, 2, 3]},  # extends r0
        {"timestamp": 3000, "input_length": 1536, "output_length": 30, "hash_ids": [1, 5, 6]},  # shares only 1
        {"timestamp": 4000, "input_length": 600, "output_length": 0, "hash_ids": [7, 8]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_mooncake_sessions_arrivals_and_lengths(tmp_path: Path) -> None:
    workload = load_mooncake(_write_trace(tmp_path / "trace.jsonl"), speedup=2.0)
    r0, r1, r2, r3 = workload.requests
    assert [r.arrival_s for r in workload.requests] == [0.0, 0.25, 1.0, 1.5]
    assert [r.prompt_len for r in workload.requests] == [1024, 1536, 1536, 600]
    assert [r.output_len for r in workload.requests] == [10, 20, 30, 1]
    assert r1.hash_ids == (1, 2, 3)
    # r1 extends r0's two full blocks: the same task, its second of two steps.
    assert (r1.task_id, r1.step, r1.total_steps) == (r0.task_id, 2, 2)
    assert (r0.step, r0.total_steps) == (1, 2)
    # r2 shares only the opening block: a task of its own.
    assert len({r0.task_id, r2.task_id, r3.task_id}) == 3
    assert (r2.step, r2.total_steps, r3.step, r3.total_steps) == (1, 1, 1, 1)
    assert workload.tasks[r0.task_id] == [r0, r1]
    assert len(workload.tasks) == 3


def test_mooncake_prompt_scale_scales_input_lengths(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl")
    assert [r.prompt_len for r in load_mooncake(trace, prompt_scale=0.5).requests] == [512, 768, 768, 300]
    # Scaled up, each block of a row becomes two of its own: the prompts grow, and the conversation stays one (they
    # were cut to the row's blocks, so that 2 and 10 gave the same prompts, helper-161).
    doubled = load_mooncake(trace, prompt_scale=2.0).requests
    assert [r.prompt_len for r in doubled] == [2048, 3072, 3072, 1200]
    assert [len(r.hash_ids) for r in doubled] == [4, 6, 6, 4]
    assert doubled[1].hash_ids[:4] == doubled[0].hash_ids and doubled[2].hash_ids[:2] == doubled[0].hash_ids[:2]
    assert [(r.task_id, r.step) for r in doubled] == [(r.task_id, r.step) for r in load_mooncake(trace).requests]
    # At 1.5 a block stands for the last trace block its tokens come from: r2 shares r0's first block only (its first
    # trace block), where ceil(1.5) copies of each made it share two, as if it shared more of r0 (helper-163).
    halves = load_mooncake(trace, prompt_scale=1.5).requests
    shared = next(i for i, (a, b) in enumerate(zip(halves[0].hash_ids, halves[2].hash_ids, strict=False)) if a != b)
    assert shared == 1 and halves[1].hash_ids[:len(halves[0].hash_ids)] == halves[0].hash_ids
    assert [r.arrival_s for r in load_mooncake(trace, limit=2).requests] == [0.0, 0.5]


@pytest.mark.parametrize("loader", [load_mooncake, load_azure])
def test_a_window_that_would_replay_nothing_or_run_time_backwards_is_refused(tmp_path: Path, loader) -> None:
    """Mooncake's limit 0 replayed one request and Azure's none; a skip past the end replayed none (a table of
    nan); a negative speed-up made arrivals negative."""
    trace = write_traces(tmp_path, num_requests=10) / TRACES["mooncake-conversation" if loader is load_mooncake
                                                                else "azure-conv"]
    with pytest.raises(ValueError, match="limit must be at least 1"):
        loader(trace, limit=0)
    with pytest.raises(ValueError, match=f"skip 10 is at or past the end of {trace.name}, which has 10 requests"):
        loader(trace, skip=10)
    with pytest.raises(ValueError, match="speedup must be a finite number above 0"):
        loader(trace, speedup=-1.0)
    assert len(loader(trace, skip=9).requests) == 1
    assert trace_length(trace) == 10


# -- Simulation -------------------------------------------------------------------------------------


def _repeat_prompt(policy: str) -> list:
    """r0 lands on h100-1 (h100-0 is busy with another prompt); r1 repeats r0 once both are idle, so
    every tie-break (lower node id, fewer running) points at h100-0 and only the cache points at h100-1."""
    other = _request((7, 8, 9, 10), 2048, "busy", 0.0)
    first = _request((1, 2, 3, 4), 2048, "r0", 0.01)
    second = _request((1, 2, 3, 4), 2048, "r1", 10.0)
    result = Simulation(fleet("2xh100"), make_policy(policy)).run(Workload("repeat", [other, first, second]))
    records = {r.request.request_id: r for r in result.records}
    assert all(r.finish_s is not None and r.num_generated == 32 and not r.failed for r in records.values())
    return [records["r0"].cached_tokens, records["r1"].cached_tokens]


@pytest.mark.parametrize("policy", ["dynamo", "llm_d_precise"])
def test_kv_aware_policy_sends_a_repeated_prompt_to_its_cache(policy: str) -> None:
    first, second = _repeat_prompt(policy)
    assert first == 0
    assert second >= 2048 - 16


def test_round_robin_sends_a_repeated_prompt_to_a_cold_node() -> None:
    assert _repeat_prompt("round_robin") == [0, 0]


def test_the_scheduler_sees_a_prefill_chunk_as_pending_until_its_step_has_run() -> None:
    """A request arriving while another's prompt is mid-step sees that chunk still ahead of it (the sim
    engine counted it computed when the step began, so a scheduler sent the next prompt to that node as
    if it were free); once the step's time has passed, it is no longer counted."""
    policy = make_policy("dynamo")
    seen: dict[str, int] = {}
    choose = policy.choose

    def spying(request, candidates, matched_blocks, now):
        seen[request.request_id] = candidates[0].load.pending_prefill_tokens
        return choose(request, candidates, matched_blocks, now)

    policy.choose = spying
    first = _request((1, 2, 3, 4), 2048, "first", 0.0, output_len=1)  # one step: its prefill, then it ends
    during = _request((5,), 100, "during", 0.001, output_len=1)  # first's step takes about 50 ms
    after = _request((6,), 100, "after", 5.0)  # the node idle since
    result = Simulation(fleet("1xh100"), policy).run(Workload("steps", [first, during, after]))
    assert all(r.finish_s is not None for r in result.records)
    assert seen == {"first": 0, "during": 2048, "after": 0}


def test_an_answer_that_would_overrun_the_context_is_cut_there_not_refused_on_its_true_length() -> None:
    """As the router serves a client that sets no max_tokens: a prompt that fits may generate up to the
    context's end; only a prompt the context cannot hold is refused. (The simulator refused the first
    on the trace's true output length, which no live router knows.)"""
    fits = _request(tuple(range(14)), 7000, "fits", output_len=2000)  # 512 tokens a trace block
    too_long = _request(tuple(range(100, 116)), 8192, "too-long", arrival_s=0.5)
    result = Simulation(fleet("1xh100"), make_policy("dynamo"), model="sim-llama-3-8b").run(
        Workload("context", [fits, too_long]))
    records = {r.request.request_id: r for r in result.records}
    assert (records["fits"].failed, records["fits"].num_generated) == ("", 8192 - 7000)
    assert "does not fit" in records["too-long"].failed


def test_request_on_a_failed_node_completes_elsewhere() -> None:
    migrations = []
    for node_id in ("h100-0", "h100-1"):
        workload = Workload("long", [_request((1, 2), 1024, output_len=2000)])
        result = Simulation(fleet("2xh100"), make_policy("dynamo"), failures=((1.0, node_id),)).run(workload)
        [record] = result.records
        assert (record.failed, record.num_generated) == ("", 2000)
        assert record.finish_s is not None
        migrations.append(record.num_migrations)
    # Exactly one of the two kills hit the node it ran on.
    assert sorted(migrations) == [0, 1]


def test_moves_a_spent_retry_budget_holds_back_wait_for_it_as_the_router_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router waits out a move the leader's retry budget refuses for now (relay.move_wait_s); the simulator failed
    the request instead, as the router had lost its generation (helper-167). Four streams of a dead node, a budget of
    two moves in 10 s: two move at once, two when the first two leave the window, and none is lost."""
    monkeypatch.setattr("simulator.simulation.RetryBudget",
                        lambda ratio, min_retries_per_s: RetryBudget(ratio=0.0, min_retries_per_s=0.2))
    requests = [_request((i, i + 1), 512, f"r{i}", output_len=2048) for i in range(8)]
    result = Simulation(fleet("2xh100"), make_policy("least_loaded"), failures=((1.0, "h100-0"),)).run(
        Workload("moves", requests))
    moved = sorted(r.finish_s or math.inf for r in result.records if r.num_migrations)
    assert all(not r.failed for r in result.records) and len(moved) == 4
    assert moved[1] + 9.0 < moved[2]  # the last two waited for the window to move on


def _agentic_run() -> tuple[Workload, RunResult]:
    workload = agentic_workflows(num_tasks=2, steps=3, system_len=1024, step_len=256, output_len=16,
                                 think_s=5.0, rate_per_s=1.0)
    return workload, Simulation(fleet("1xh100"), make_policy("dynamo")).run(workload)


def test_closed_loop_step_leaves_think_time_after_the_previous_finished() -> None:
    workload, result = _agentic_run()
    records = {r.request.request_id: r for r in result.records}
    assert len(records) == 6
    for steps in workload.tasks.values():
        assert [s.step for s in steps] == [1, 2, 3]
        for previous, step in zip(steps, steps[1:], strict=False):
            done, sent = records[previous.request_id], records[step.request_id]
            assert done.finish_s is not None and sent.finish_s is not None
            assert sent.arrival_s - done.finish_s >= 5.0 - 1e-9


# -- summarize --------------------------------------------------------------------------------------


def test_summary_with_a_huge_slo_counts_every_task() -> None:
    workload, result = _agentic_run()
    summary = summarize(result, workload, Slo(ttft_s=1e9, tpot_s=1e9))
    assert (summary.num_requests, summary.num_completed, summary.slo_attainment) == (6, 6, 1.0)
    assert (summary.num_tasks, summary.num_tasks_ok) == (2, 2)
    assert 0 < summary.gpu_cost < summary.fleet_cost
    # The headline counts the GPU for the whole run, idle time included; the floor only its busy time.
    # Steps follow completions (closed loop): the fleet is paid until the last one ends.
    assert summary.fleet_cost == pytest.approx(fleet("1xh100")[0].price_per_hour * result.makespan_s / 3600)
    assert summary.cost_per_successful_task == pytest.approx(summary.fleet_cost / summary.num_tasks)
    assert summary.busy_cost_per_successful_task == pytest.approx(summary.gpu_cost / summary.num_tasks)


def test_each_request_is_held_to_its_own_budgets_and_the_policy_reads_them() -> None:
    """A 60,000-token prompt takes the idle H100; 10 ms later a short request comes. With its own TPOT
    budget of 14 ms it waits for the H100 (an A100 decode step is about 11 ms, too close); allowed
    300 ms, it starts at once on the idle A100 (behind the long prefill it would end later). Each is
    then classified by its own budgets, not the run's default (here 1 ms, which no request could make)."""
    big = dataclasses.replace(_request(tuple(range(1000, 1118)), 60_000, request_id="big", output_len=64),
                              ttft_budget_ms=60_000, tpot_budget_ms=300)
    h100, a100 = (n.node_id for n in fleet("1xh100,1xa100"))
    for tpot_budget_ms, expected in ((14, h100), (300, a100)):
        short = dataclasses.replace(_request((9100,), 512, request_id="short", arrival_s=0.01, output_len=64),
                                    ttft_budget_ms=60_000, tpot_budget_ms=tpot_budget_ms)
        workload = Workload("budgets", [big, short])
        result = Simulation(fleet("1xh100,1xa100"), make_policy("baton"), ttft_budget_ms=1,
                            tpot_budget_ms=1).run(workload)
        assert {r.request.request_id: r.node_id for r in result.records} == {"big": h100, "short": expected}
        summary = summarize(result, workload, Slo(ttft_s=0.001, tpot_s=0.001))
        assert (summary.num_tasks_ok, summary.slo_attainment) == (2, 1.0)


def test_a_migrated_requests_lost_attempt_is_paid_for() -> None:
    """Per-request GPU cost, which the task ledger sums, includes the attempt a node failure lost: the
    requests' costs add up to the fleet's busy cost."""
    workload = Workload("long", [_request((1, 2), 1024, output_len=2000)])
    ran_on = Simulation(fleet("2xh100"), make_policy("dynamo")).run(workload).records[0].node_id
    result = Simulation(fleet("2xh100"), make_policy("dynamo"), failures=((1.0, ran_on),)).run(workload)
    [record] = result.records
    assert record.num_migrations == 1 and record.finish_s is not None and record.node_id != ran_on
    # All but the step the failure cut short, whose output never came (the ledger's overhead keeps it).
    assert record.gpu_cost == pytest.approx(result.gpu_cost, rel=0.01)
    summary = summarize(result, workload, Slo(ttft_s=1e9, tpot_s=1e9))
    assert summary.busy_cost_per_successful_task == pytest.approx(result.gpu_cost)


def test_summary_with_zero_ttft_slo_has_no_successful_task() -> None:
    workload, result = _agentic_run()
    summary = summarize(result, workload, Slo(ttft_s=0.0))
    assert (summary.slo_attainment, summary.num_tasks_ok, summary.goodput_rps) == (0.0, 0, 0.0)
    assert math.isinf(summary.cost_per_successful_task) and math.isinf(summary.busy_cost_per_successful_task)


def test_admission_in_the_simulator_refuses_what_cannot_make_its_budget_and_queues_the_rest() -> None:
    requests = [SimRequest(f"r{i}", 0.0, (7000 + i,), 400, 400, task_id=f"t{i}",
                           priority=-1 if i % 4 == 0 else 0) for i in range(60)]
    workload = Workload(name="burst", requests=requests)
    fifo = Simulation(fleet("1xh100"), make_policy("dynamo"), ttft_budget_ms=500).run(workload)
    gated = Simulation(fleet("1xh100"), make_policy("dynamo"), ttft_budget_ms=500, admission="baton",
                       max_queued=20).run(workload)
    assert all(r.finish_s is not None for r in fifo.records)  # FIFO serves everything, late or not
    refused = [r for r in gated.records if r.failed]
    assert refused and all(r.finish_s is None for r in refused)
    assert all(r.failed.startswith(("refused", "shed", "deadline")) for r in refused)
    assert len([r for r in gated.records if r.finish_s is not None]) + len(refused) == 60


def test_a_deadline_no_node_could_meet_is_refused_in_the_simulator_and_the_others_served() -> None:
    """As Place refuses it at once (INVALID_ARGUMENT), the simulated request fails as refused, naming its
    deadline, and the run goes on."""
    hopeless = dataclasses.replace(_request((1,), 2000, "hopeless", output_len=2000), deadline_ms=5)
    workload = Workload("deadline", [hopeless, *(_request((10 + i,), 256, f"r{i}", arrival_s=0.1 * i)
                                                for i in range(5))])
    result = Simulation(fleet("1xh100"), make_policy("baton"), admission="baton").run(workload)
    records = {r.request.request_id: r for r in result.records}
    assert records["hopeless"].failed.startswith("refused: deadline_ms=5: cannot be met")
    assert all(records[f"r{i}"].num_generated == 32 for i in range(5))
    # As the live router counts it: a lone request refused as bad input is no task, a workflow's step is its failure.
    assert task_stats(result, Slo()).failed == 0 and task_stats(result, Slo()).succeeded == 5
    step = dataclasses.replace(hopeless, task_id="w", step=2, total_steps=2)
    first = dataclasses.replace(_request((3,), 64, "first"), task_id="w", step=1, total_steps=2)
    flow = Simulation(fleet("1xh100"), make_policy("baton"), admission="baton").run(Workload("flow", [first, step]))
    assert (task_stats(flow, Slo()).succeeded, task_stats(flow, Slo()).failed) == (0, 1)


def test_a_move_that_cannot_end_in_what_its_deadline_has_left_is_ended_not_counted_as_refused() -> None:
    """As the live leader ends it (DEADLINE_EXCEEDED, not an admission refusal): a stream admitted once on the H100,
    moved off it with 2.5 s of its deadline left to an L4 predicted to need about 10 s, ends there with the tokens it
    had, a failed task; the admission study's count of refusals leaves it out (it counted it as refused before)."""
    request = dataclasses.replace(_request((1, 2), 1024, "long", output_len=2000), deadline_ms=16_500)
    result = Simulation(fleet("1xh100,1xl4"), make_policy("baton"), admission="baton",
                        failures=((14.0, "h100-0"),)).run(Workload("move", [request]))
    [record] = result.records
    assert record.failed.startswith("its move ended: deadline_ms=2500: cannot be met in what the resumed stream has")
    assert (record.num_migrations, record.finish_s) == (1, None) and 1800 < record.num_generated < 2000
    assert (task_stats(result, Slo()).succeeded, task_stats(result, Slo()).failed) == (0, 1)
    assert not record.failed.startswith(("refused", "shed"))  # what simulator/admission_study.py counts as refused


def test_a_move_is_judged_on_what_the_answers_longer_than_its_stream_had_left() -> None:
    """The simulator tells the leader how many tokens a moved stream generated, as the router does: 1,086 into its
    answer, where 3 of 23 answers seen ran 2,000 tokens, it is judged on the 914 they had left (predicted 10 s on the
    A100 left, with 8.5 s of its deadline) and ended at once. Judged on the typical answer (213 tokens) it was placed,
    and the A100 ran it for 10 s to end it after its deadline."""
    history = [dataclasses.replace(_request((100 + i,), 64, f"h{i}", arrival_s=0.05 * i), output_len=2000 if i < 3
                                   else 100) for i in range(23)]
    long = dataclasses.replace(_request((1, 2), 1024, "long", arrival_s=20.0, output_len=2000), deadline_ms=16_500)
    result = Simulation(fleet("1xh100,1xa100"), make_policy("baton"), admission="baton",
                        failures=((28.0, "h100-0"),)).run(Workload("move", [*history, long]))
    record = {r.request.request_id: r for r in result.records}["long"]
    assert record.failed.startswith("its move ended: deadline_ms=8500: cannot be met in what the resumed stream has "
                                    "left; the 914 tokens it is expected to generate yet")
    assert (record.num_migrations, record.num_generated) == (1, 1086)


# -- model placement --------------------------------------------------------------------------------


def test_the_planner_loads_a_model_nobody_has_warm_and_requests_wait_for_the_load_not_fail() -> None:
    a, b = "sim-llama-3.1-8b", "sim-llama-2-7b"
    nodes = [dataclasses.replace(n, warm=a, cold=(b,)) for n in fleet("2xa100")]
    requests = [dataclasses.replace(_request((i,), 512, f"r{i}", arrival_s=i * 0.5), model=b) for i in range(20)]
    workload = Workload("all-b", requests)
    static = Simulation(nodes, make_policy("baton"), model=a).run(workload)
    assert all("no live node has it warm" in r.failed for r in static.records)
    simulation = Simulation(nodes, make_policy("baton"), model=a, planner=ModelPlanner(idle_swap_s=5.0))
    result = simulation.run(workload)
    assert all(r.num_generated == 32 for r in result.records)
    (at, load), *_ = [(t, action) for t, action in simulation.model_actions if action.kind == "load"]
    assert load.model == b and at >= 5.0  # a node idle 5 s was swapped
    first = min(r.first_token_s for r in result.records if r.first_token_s is not None)
    assert first >= at + load_time_s(get_model(b))  # nothing served before the load finished
    assert sum(result.busy_s.values()) >= load_time_s(get_model(b))  # and the load was paid for


def test_a_demand_shift_moves_warm_capacity_to_the_model_in_demand() -> None:
    workload = Workload("w", [_request((i,), 256, f"r{i}", arrival_s=float(i)) for i in range(1000)])
    moved = shifted(workload, "sim-llama-3.1-8b", "sim-llama-2-7b", 0.0, 1.0)
    early = [r.model for r in moved.requests[:200]]
    late = [r.model for r in moved.requests[-200:]]
    assert early.count("sim-llama-2-7b") < 60 and late.count("sim-llama-2-7b") > 140


def test_the_fleet_is_paid_until_the_last_request_ends() -> None:
    requests = [_request((1, 2), 1024, "r0", 0.0, output_len=400), _request((3, 4), 1024, "r1", 10.0, output_len=400)]
    workload = Workload("two", requests)
    for policy in ("round_robin", "baton"):
        result = Simulation(fleet("2xh100"), make_policy(policy)).run(workload)
        summary = summarize(result, workload, Slo())
        assert result.makespan_s > 10.0  # the last request ends after it arrives...
        # ...and the operator pays both GPUs until then, idle or not: a slow drain costs.
        assert summary.fleet_cost == pytest.approx(2 * fleet("1xh100")[0].price_per_hour * result.makespan_s / 3600)
        assert summary.drain_s == pytest.approx(result.makespan_s - 10.0)  # after the last arrival


def test_an_slo_mix_gives_every_step_of_a_task_its_class_budgets(tmp_path: Path) -> None:
    from simulator.report import parse_args
    from simulator.workload import parse_slo_mix, with_slo_mix

    workload = load_mooncake(_write_trace(tmp_path / "t.jsonl"))
    mixed = with_slo_mix(workload, parse_slo_mix("0.5:1:0.03,0.5:30:0.2"))
    classes = {"class0": (1000, 30), "class1": (30_000, 200)}
    for steps in mixed.tasks.values():
        assert len({(r.tenant, r.ttft_budget_ms, r.tpot_budget_ms) for r in steps}) == 1
        assert (steps[0].ttft_budget_ms, steps[0].tpot_budget_ms) == classes[steps[0].tenant]
    with pytest.raises(SystemExit):
        parse_args(["--slo-mix", "0.5:1:0.03"])  # shares that do not add up to 1 are refused


def test_a_node_killed_after_the_last_request_ended_adds_nothing_to_the_fleets_bill() -> None:
    """The fleet is paid until the last request ends: a --kill scheduled after that billed it until the kill."""
    workload = Workload("short", [_request((i,), 256, f"r{i}", arrival_s=0.1 * i) for i in range(4)])
    quiet = Simulation(fleet("2xh100"), make_policy("dynamo")).run(workload)
    late_kill = Simulation(fleet("2xh100"), make_policy("dynamo"), failures=((9999.0, "h100-0"),)).run(workload)
    assert late_kill.provisioned_s == quiet.provisioned_s < 60
    assert late_kill.fleet_cost == quiet.fleet_cost


def test_the_planner_keeps_planning_while_a_request_waits_for_its_models_load() -> None:
    """Planning stopped once nothing else was left to happen, and a request waiting for a load failed with "no node
    could load its model" (every request for B on a fleet with A warm, B on every disk)."""
    nodes = [dataclasses.replace(n, warm="sim-llama-3.1-8b", cold=("sim-llama-3.1-8b", "sim-llama-2-7b"))
             for n in fleet("1xa100")]
    wants_b = [dataclasses.replace(_request((i,), 256, f"b{i}", arrival_s=0.1 * i), model="sim-llama-2-7b")
               for i in range(3)]
    simulation = Simulation(nodes, make_policy("baton"), planner=ModelPlanner(idle_swap_s=10.0))
    result = simulation.run(Workload("shift", wants_b))
    assert [r.failed for r in result.records] == ["", "", ""]
    assert all(r.num_generated == 32 for r in result.records)
    assert [action.model for _, action in simulation.model_actions if action.kind == "load"] == ["sim-llama-2-7b"]


def test_a_request_whose_model_is_never_loaded_fails_after_the_schedulers_wait_not_never() -> None:
    """Planning goes on while a request waits for a load, so one the planner never serves must end: as Place waits
    at most --model-load-timeout-s."""
    nodes = [dataclasses.replace(n, warm="sim-llama-3.1-8b", cold=("sim-llama-3.1-8b", "sim-llama-2-7b"))
             for n in fleet("1xa100")]
    wants_b = dataclasses.replace(_request((1,), 256, "b"), model="sim-llama-2-7b")
    result = Simulation(nodes, make_policy("baton"), planner=ModelPlanner(idle_swap_s=1e9)).run(
        Workload("never", [wants_b]))
    assert [r.failed for r in result.records] == ["no node could load its model within 300 s"]
    assert 300 < result.provisioned_s < 302


def test_a_model_load_that_ends_after_the_last_request_is_paid_to_its_end() -> None:
    """Billed until the last request ended, a swap the planner began near the end had its whole load in busy time
    but not in the fleet's bill: the busy-time floor came out above the whole-fleet headline."""
    nodes = [dataclasses.replace(n, warm=("sim-llama-3.1-8b" if i == 0 else "sim-llama-2-7b"),
                                 cold=("sim-llama-3.1-8b", "sim-llama-2-7b")) for i, n in enumerate(fleet("2xa100"))]
    wants_a = [_request((i,), 2000, f"a{i}", arrival_s=0.05 * i, output_len=512) for i in range(400)]
    simulation = Simulation(nodes, make_policy("baton"), planner=ModelPlanner(idle_swap_s=10.0))
    result = simulation.run(Workload("late swap", wants_a))
    assert any(action.kind == "load" for _, action in simulation.model_actions)
    assert all(busy <= result.provisioned_s for busy in result.busy_s.values())
    assert result.gpu_cost <= result.fleet_cost


def test_a_request_waiting_for_its_models_load_fails_at_its_deadline_as_place_gives_up() -> None:
    nodes = [dataclasses.replace(n, warm="sim-llama-3.1-8b", cold=("sim-llama-3.1-8b", "sim-llama-2-7b"))
             for n in fleet("1xa100")]
    wants_b = dataclasses.replace(_request((1,), 256, "b"), model="sim-llama-2-7b", deadline_ms=20_000)
    result = Simulation(nodes, make_policy("baton"), planner=ModelPlanner(idle_swap_s=1e9)).run(
        Workload("late", [wants_b]))
    assert [r.failed for r in result.records] == ["deadline_ms=20000: passed while it waited for its model's load"]
    assert 20 < result.provisioned_s < 22


def test_a_request_waiting_for_a_load_fails_once_no_node_has_its_model_on_disk_as_place_does() -> None:
    """Place wakes when the fleet changes and gives up at once when no live node has the model even cold; the
    simulator waited for its next planning round (here 10 s) to find that out."""
    nodes = [dataclasses.replace(n, warm="sim-llama-3.1-8b",
                                 cold=("sim-llama-3.1-8b", "sim-llama-2-7b") if i == 0 else ("sim-llama-3.1-8b",))
             for i, n in enumerate(fleet("2xa100"))]
    wants_b = dataclasses.replace(_request((1,), 256, "b"), model="sim-llama-2-7b")
    result = Simulation(nodes, make_policy("baton"), planner=ModelPlanner(idle_swap_s=1e9), plan_interval_s=10.0,
                        failures=((2.5, "a100-0"),), lease_ttl_s=3.0).run(Workload("gone", [wants_b]))
    [record] = result.records
    assert "sim-llama-2-7b" in record.failed  # no node serves it
    assert result.provisioned_s == pytest.approx(5.5)  # the dead node's lease ended at 2.5 + 3 s
