"""The held-out matrix's verdict: Baton against the best baseline, and seed by seed against it."""

from __future__ import annotations

from bench.sim_matrix import paired_change, verdict
from simulator.report import merge_seeds

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
