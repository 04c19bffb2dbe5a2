"""bench.burst_holdout: rule 5's hold-out windows and its verdict on two runs of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.burst_holdout import gain, main, windows
from bench.sim_matrix import build_parser
from simulator.report import TRACES


def _run(cost: float, misses: int) -> dict:
    return {"cost_per_successful_task": cost, "slo_attainment": 1 - misses / 600, "num_requests": 600}


def _side(misses: list[int], cost: float = 100.0) -> dict[str, list[dict]]:
    """Three seeds per window, the same misses in each."""
    return {f"window {i}": [_run(cost, m)] * 3 for i, m in enumerate(misses)}


def _azure(path: Path, rows: int) -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{i // 6000:02d}:{i // 100 % 60:02d}.{i % 100:02d}00000,512,16" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def test_the_hold_out_is_azure_at_3x_outside_the_tuning_windows_without_the_burst_it_was_built_on(
        tmp_path: Path) -> None:
    _azure(tmp_path / TRACES["azure-code"], 8_818)
    _azure(tmp_path / TRACES["azure-conv"], 9_000)
    chosen = windows(build_parser().parse_args(["--traces", str(tmp_path)]))
    code = [w for w in chosen if w.workload == "azure-code"]
    conv = [w for w in chosen if w.workload == "azure-conv"]
    assert [w.skip for w in code] == [600, 1200, 2400, 3600, 4200, 4800, 5400, 6600, 7200, 7800]
    assert [w.skip for w in conv] == [600, 1200, 1800, 2400, 3600, 4200, 4800, 5400]
    assert all(w.load == 3.0 and w.fleet == "4xh100,4xa100,4xl4" for w in chosen)
    assert code[0].name == "Azure code, mixed, 3x, requests 600-1,200"
    at_5x = windows(build_parser().parse_args(["--traces", str(tmp_path)]), load=5.0, traces="code")
    assert [w.skip for w in at_5x] == [w.skip for w in code] and {w.load for w in at_5x} == {5.0}
    assert at_5x[0].name == "Azure code, mixed, 5x, requests 600-1,200"


def test_fewer_misses_clear_of_zero_at_no_dearer_a_cost_pass() -> None:
    current = _side([10, 4, 0, 7, 2])
    verdict = gain(_side([6, 1, 0, 3, 1]), current)
    assert verdict.misses[0] == pytest.approx(-2.4) and verdict.misses[0] + verdict.misses[1] < 0
    assert verdict.passes
    assert gain(_side([6, 1, 0, 3, 1], cost=100.04), current).passes  # dearer, within the margin


def test_no_gain_a_noisy_gain_one_window_or_a_dearer_fleet_fail() -> None:
    current = _side([10, 4, 0, 7, 2])
    assert not gain(current, current).passes  # the same misses
    assert not gain(_side([0, 9, 0, 12, 0]), current).passes  # fewer on average, not clear of zero
    assert not gain(_side([0, 4, 0, 7, 2]), current).passes  # one window alone can never be clear of zero
    dearer = gain(_side([6, 1, 0, 3, 1], cost=100.2), current)
    assert dearer.cost_change == pytest.approx(0.2) and not dearer.passes


def test_costs_are_paired_seed_by_seed() -> None:
    """Each seed draws its own timing error, so a seed's run is compared with the same seed's run."""
    current = {"w": [_run(100.0, 0), _run(200.0, 0)]}
    same = gain({"w": [_run(100.0, 0), _run(200.0, 0)]}, current)
    assert same.cost_change == pytest.approx(0.0)  # unpaired (100 against 200, 200 against 100): +25 %


def test_two_runs_of_other_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="other windows"):
        gain(_side([1, 2]), _side([1, 2, 3]))


def test_runs_of_other_seeds_or_without_a_success_are_refused(tmp_path: Path, capsys) -> None:
    for name, seeds in (("variant", [0, 1, 2]), ("current", [3, 4, 5])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"seeds": seeds, "per_window": _side([1])}))
    with pytest.raises(SystemExit):
        main(["--variant", str(tmp_path / "variant"), "--current", str(tmp_path / "current")])
    assert "--variant ran seeds [0, 1, 2], --current [3, 4, 5]" in capsys.readouterr().err
    failed = {"w": [{**_run(0.0, 600), "cost_per_successful_task": float("inf")}] * 3}  # no success: no figure
    with pytest.raises(ValueError, match="no window had a success"):
        gain(failed, failed)


def _seeded(misses: list[list[int]], cost: float = 100.0) -> dict[str, list[dict]]:
    """Per window, each seed's misses."""
    return {f"window {i}": [_run(cost, m) for m in seeds] for i, seeds in enumerate(misses)}


def test_across_the_seeds_a_gain_in_one_window_passes_where_across_the_windows_it_cannot() -> None:
    current = _seeded([[30, 28, 35, 31], [0, 0, 0, 0], [2, 1, 0, 1], [0, 0, 0, 0]])
    variant = _seeded([[12, 15, 10, 14], [0, 0, 0, 0], [2, 1, 0, 1], [0, 0, 0, 0]])
    verdict = gain(variant, current)
    assert verdict.misses_per_seed[0] == pytest.approx(-18.25)
    assert verdict.passes_across_seeds and not verdict.passes  # the third look's criterion fails it


def test_across_the_seeds_noise_a_clearly_worse_window_or_a_dearer_fleet_fail() -> None:
    current = _seeded([[30, 28, 35, 31], [0, 0, 0, 0]])
    assert not gain(current, current).passes_across_seeds  # the same misses
    noisy = gain(_seeded([[10, 40, 12, 45], [0, 0, 0, 0]]), current)
    assert noisy.misses_per_seed[0] < 0 and not noisy.passes_across_seeds  # fewer on average, not clear of zero
    shifted = gain(_seeded([[10, 10, 12, 11], [3, 4, 3, 5]]), current)  # the misses moved to another window
    assert shifted.misses_per_seed[0] + shifted.misses_per_seed[1] < 0
    assert shifted.worse_windows == ("window 1",) and not shifted.passes_across_seeds
    dearer = gain(_seeded([[10, 10, 12, 11], [0, 0, 0, 0]], cost=100.2), current)
    assert not dearer.passes_across_seeds
    # More misses in a window on average, but not clear of zero: not counted against the variant.
    noisy_window = gain(_seeded([[10, 10, 12, 11], [4, 0, 0, 0]]), current)
    assert noisy_window.worse_windows == () and noisy_window.passes_across_seeds


def test_windows_with_another_number_of_seeds_are_refused() -> None:
    with pytest.raises(ValueError, match="ran 2 seeds, the first window 3"):
        gain(_seeded([[1, 2, 3], [1, 2]]), _seeded([[1, 2, 3], [1, 2]]))


def test_the_criterion_written_down_is_the_one_printed(tmp_path: Path, capsys) -> None:
    for name, misses in (("variant", [[1, 2, 1], [0, 0, 0]]), ("current", [[9, 8, 9], [0, 0, 0]])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"seeds": [3, 4, 5], "per_window": _seeded(misses)}))
    sides = ["--variant", str(tmp_path / "variant"), "--current", str(tmp_path / "current")]
    main(sides)
    printed = capsys.readouterr().out
    assert "rule 5 (b), a gain on the hold-out: fails" in printed and "across the seeds" not in printed
    main([*sides, "--across", "seeds"])
    printed = capsys.readouterr().out
    assert "-7.33 ± 2.87 over 3 seeds" in printed
    assert "the eleventh round's part (b), a gain across the seeds: passes" in printed and "rule 5 (b)" not in printed
