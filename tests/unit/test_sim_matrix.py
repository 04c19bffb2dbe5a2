"""The held-out matrix's verdict: Baton against the best baseline, and seed by seed against it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench.sim_matrix import SETTINGS, TUNING, _args, build_parser, paired_change, verdict
from simulator.report import TRACES, build_workload, merge_seeds

KEY = "cost_per_successful_task"


def run(cost: float, slo: float = 1.0) -> dict:
    return {KEY: cost, "busy_cost_per_successful_task": cost / 2, "slo_attainment": slo}


def test_the_seed_by_seed_change_pairs_each_seed_with_the_same_seed() -> None:
    # Dearer on average, but seed by seed cheaper in two of three: pairing must not sort or pool the seeds.
    mine = [run(99.0), run(198.0), run(330.0)]
    theirs = [run(100.0), run(200.0), run(300.0)]
    mean, ci, cheaper = paired_change(mine, theirs, KEY)
    assert round(mean, 6) == round(((0.99 - 1) + (0.99 - 1) + (1.1 - 1)) / 3 * 100, 6)
    assert ci > 0 and cheaper == 2


def test_a_seed_without_successes_gives_no_paired_figure() -> None:
    assert paired_change([run(1.0), run(0.0)], [run(1.0), run(1.0)], KEY) is None


def test_the_verdict_names_the_cheapest_baseline_and_the_seeds_where_baton_was_cheaper() -> None:
    per_seed = {"baton": [run(101.0), run(99.0)], "dynamo": [run(100.0), run(100.0)],
                "llm_d": [run(150.0), run(150.0)]}
    rows = {policy: merge_seeds(runs) for policy, runs in per_seed.items()}
    line = verdict(rows, per_seed)
    assert "seed by seed against dynamo: +0.00 ± " in line
    assert "cheaper in 1 of 2 seeds" in line
    assert "seed by seed" not in verdict(rows)  # without the seeds' runs, only the means


def test_the_tuning_windows_share_no_request_with_the_matrix() -> None:
    matrix_limit = build_parser().get_default("limit")  # the matrix replays each trace's first N requests
    assert all(s.skip >= matrix_limit for s in TUNING)
    assert {(s.workload, s.fleet) for s in TUNING} <= {(s.workload, s.fleet) for s in SETTINGS}


def test_a_tuning_window_replays_the_requests_after_its_skip(tmp_path: Path) -> None:
    rows = [{"timestamp": 1000 * j, "input_length": 100 + j, "output_length": 10, "hash_ids": [j]} for j in range(10)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = build_parser().parse_args(["--limit", "3", "--traces", str(tmp_path)])
    window = next(s for s in TUNING if s.workload == "mooncake-conversation" and s.load == 1.0)
    first = build_workload(_args(dataclasses.replace(window, skip=0), options), 1.0)
    later = build_workload(_args(dataclasses.replace(window, skip=6), options), 1.0)
    assert [r.prompt_len for r in first.requests] == [100, 101, 102]
    assert [r.prompt_len for r in later.requests] == [106, 107, 108]
