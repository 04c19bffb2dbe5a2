"""bench.adoption_rule: the tuning windows' adoption rules, on result files written as bench.sim_matrix writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.adoption_rule import Verdict, judge, load, main
from tests.unit.sim_cli import refused


def _run(cost: float, misses: int = 0) -> dict:
    return {"cost_per_successful_task": cost, "slo_attainment": 1 - misses / 600, "num_requests": 600}


def _write(directory: Path, seeds: list[int], costs: dict[str, list[float]], misses: int = 0) -> Path:
    """A tuning run of baton: per window-setting, one cost per seed."""
    directory.mkdir()
    per_seed = {name: {"baton": [_run(c, misses) for c in values]} for name, values in costs.items()}
    (directory / "results.json").write_text(json.dumps({"options": {"seeds": ",".join(map(str, seeds)), "tuning": True},
                                                        "settings": {}, "per_seed": per_seed}))
    return directory


SEEDS = list(range(10, 20))
CURRENT = {"steady": [100.0] * 10, "overloaded": [100.0] * 10}


def test_a_variant_cheaper_everywhere_with_no_more_misses_passes_both_rules(tmp_path: Path) -> None:
    _, current = load([_write(tmp_path / "current", SEEDS, CURRENT, misses=3)])
    _, variant = load([_write(tmp_path / "variant", SEEDS, {"steady": [99.0] * 10, "overloaded": [99.5] * 10},
                              misses=2)])
    verdict = judge(variant, current)
    assert verdict.mean_change == pytest.approx(-0.75) and verdict.misses == (40, 60)
    assert verdict.rule_1 and verdict.rule_2


def test_one_noisy_window_fails_rule_1_but_not_rule_2_and_a_steady_small_loss_the_reverse(tmp_path: Path) -> None:
    _, current = load([_write(tmp_path / "current", SEEDS, CURRENT)])
    # The overloaded window-setting swings -20 to +26 % seed to seed: +3 % on average, no clear loss.
    noisy = {"steady": [94.0] * 10, "overloaded": [80.0, 126.0] * 5}
    verdict = judge(load([_write(tmp_path / "noisy", SEEDS, noisy)])[1], current)
    assert verdict.worst == ("overloaded", pytest.approx(3.0)) and not verdict.dearer
    assert not verdict.rule_1 and verdict.rule_2
    # The steady one is +0.3 % in every seed: a clear loss, though within rule 1's 2 %.
    steady = {"steady": [100.3] * 10, "overloaded": [98.0] * 10}
    verdict = judge(load([_write(tmp_path / "steady", SEEDS, steady)])[1], current)
    assert [name for name, _, _ in verdict.dearer] == ["steady"]
    assert verdict.rule_1 and not verdict.rule_2


def test_more_misses_per_seed_fail_rule_2(tmp_path: Path) -> None:
    _, current = load([_write(tmp_path / "current", SEEDS, CURRENT, misses=1)])
    _, variant = load([_write(tmp_path / "variant", SEEDS, {"steady": [99.0] * 10, "overloaded": [99.0] * 10},
                              misses=2)])
    verdict = judge(variant, current)
    assert verdict.misses_per_seed[0] == 2 and verdict.cheaper
    assert not verdict.rule_1 and not verdict.rule_2 and not verdict.rule_3 and not verdict.rule_4


def test_seeds_of_several_runs_are_joined_and_paired_and_other_seeds_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    current = _write(tmp_path / "current", SEEDS, CURRENT)
    first = _write(tmp_path / "first", SEEDS[:5], {name: [99.0] * 5 for name in CURRENT})
    second = _write(tmp_path / "second", SEEDS[5:], {name: [101.0] * 5 for name in CURRENT})
    assert main(["--variant", str(first), str(second), "--current", str(current)]) == 0
    assert "mean change over the window-settings: +0.00 %" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["--variant", str(second), str(first), "--current", str(current)])
    assert refused.value.code == 2
    assert "must be the same" in capsys.readouterr().err


def test_the_best_baseline_counts(tmp_path: Path) -> None:
    _, current = load([_write(tmp_path / "current", SEEDS, CURRENT)])
    _, variant = load([_write(tmp_path / "variant", SEEDS, {"steady": [99.0] * 10, "overloaded": [101.0] * 10})])
    baselines = {name: {"dynamo": [_run(100.5)] * 10} for name in CURRENT}
    verdict = judge(variant, current, baselines)
    assert verdict.behind_best == (1, 0) and not verdict.rule_1
    # Rule 3: a clear gain, no clear loss (the other swings), yet behind the best baseline where it was not.
    _, noisy = load([_write(tmp_path / "noisy", SEEDS, {"steady": [98.9] * 10, "overloaded": [98.0, 104.0] * 5})])
    verdict = judge(noisy, current, baselines)
    assert verdict.cheaper and not verdict.dearer and verdict.behind_best == (1, 0)
    assert not verdict.rule_3 and not verdict.rule_4


def test_a_baseline_run_with_no_success_counts_as_no_cheaper_than_any(tmp_path: Path) -> None:
    """A run with no success has no cost per successful task, null in results.json: read as a number, it crashed
    the comparison with the baselines (helper-204)."""
    _, current = load([_write(tmp_path / "current", SEEDS, CURRENT)])
    _, variant = load([_write(tmp_path / "variant", SEEDS, {"steady": [99.0] * 10, "overloaded": [101.0] * 10})])
    baselines = {name: {"dynamo": [_run(100.5)] * 9 + [_run(None)]} for name in CURRENT}  # type: ignore[arg-type]
    assert judge(variant, current, baselines).behind_best == (0, 0)


def test_rule_3_needs_a_clear_gain_somewhere_and_no_clear_loss_anywhere(tmp_path: Path) -> None:
    _, current = load([_write(tmp_path / "current", SEEDS, CURRENT)])
    # Cheaper by 0.3 % in every seed on the steady window-setting; the overloaded one swings -20 to +26 %.
    gain = {"steady": [99.7] * 10, "overloaded": [80.0, 126.0] * 5}
    verdict = judge(load([_write(tmp_path / "gain", SEEDS, gain)])[1], current)
    assert verdict.mean_change > 0 and not verdict.rule_2 and verdict.rule_3
    # No window-setting clearly cheaper: nothing to adopt it for.
    flat = {"steady": [99.0, 101.0] * 5, "overloaded": [80.0, 126.0] * 5}
    assert not judge(load([_write(tmp_path / "flat", SEEDS, flat)])[1], current).rule_3
    # A clear gain on one and a clear loss on the other.
    trade = {"steady": [99.7] * 10, "overloaded": [100.2] * 10}
    verdict = judge(load([_write(tmp_path / "trade", SEEDS, trade)])[1], current)
    assert verdict.cheaper and verdict.dearer and not verdict.rule_3


def test_rule_4_counts_clear_losses_and_gains_above_its_margin_and_leaves_the_overloaded_out_of_its_mean(
    tmp_path: Path,
) -> None:
    mixed_3x = "Mooncake conversation, mixed, 3x, requests 3,000-3,600"
    cheap_fleet = "Mooncake conversation, 2xH100+8xL4, 1x, requests 6,000-6,600"
    _, current = load([_write(tmp_path / "current", SEEDS, {mixed_3x: [100.0] * 10, cheap_fleet: [100.0] * 10,
                                                            "steady": [100.0] * 10, "also steady": [100.0] * 10})])

    def verdict(name: str, steady: list[float], also: list[float], swing: list[float] | None = None) -> Verdict:
        costs = {mixed_3x: swing or [100.0] * 10, cheap_fleet: [100.0] * 10, "steady": steady, "also steady": also}
        return judge(load([_write(tmp_path / name, SEEDS, costs)])[1], current)

    # A clear gain of 0.1 %, a clear loss of 0.04 % (below the margin), an overloaded one swinging -20 to +26 %
    # (+3 % on average, not clear): it passes, though rule 3 (the small loss) and rule 2 (the mean) do not.
    passes = verdict("passes", [99.9] * 10, [100.04] * 10, [80.0, 126.0] * 5)
    assert passes.rule_4 and not passes.rule_3 and not passes.rule_2
    # A clear loss above the margin fails it, on a steady window-setting or an overloaded one.
    assert not verdict("loss", [99.9] * 10, [100.06] * 10).rule_4
    assert not verdict("overloaded loss", [99.9] * 10, [100.0] * 10, [101.0] * 10).rule_4
    # A loss above the margin that is not clear does not (the mean over the steady ones stays below zero).
    assert verdict("unclear loss", [99.8] * 10, [99.0, 101.2] * 5).rule_4
    # A gain must be clear and above the margin.
    assert not verdict("small gain", [99.96] * 10, [100.0] * 10).rule_4
    assert not verdict("unclear gain", [99.0, 100.8] * 5, [100.0] * 10).rule_4
    # The mean over the steady ones must not rise, though no loss is clear.
    mean = verdict("mean", [99.9] * 10, [98.0, 102.6] * 5)
    assert not mean.dearer and not mean.rule_4


def test_rule_4_needs_a_window_setting_that_is_not_overloaded(tmp_path: Path) -> None:
    mixed_3x = "Mooncake conversation, mixed, 3x, requests 3,000-3,600"
    _, current = load([_write(tmp_path / "current", SEEDS, {mixed_3x: [100.0] * 10})])
    verdict = judge(load([_write(tmp_path / "variant", SEEDS, {mixed_3x: [99.0] * 10})])[1], current)
    assert verdict.cheaper and not verdict.rule_4


def test_rule_5_no_harm_lets_a_change_that_moves_nothing_clear_pass_and_a_clear_loss_fail(tmp_path: Path) -> None:
    """Rule 5's part (a): a variant aimed at what the tuning windows do not contain need not gain there; it must
    not lose. The mean of the steady window-settings within the margin passes; a clear loss beyond it anywhere
    (an overloaded window-setting too), more misses, or more window-settings behind the best baseline fail."""
    loaded = "Mooncake conversation, mixed, 3x, requests 3,000-3,600"
    current_costs = {"a": [100.0] * 10, "b": [100.0] * 10, loaded: [100.0] * 10}
    _, current = load([_write(tmp_path / "current", SEEDS, current_costs, misses=2)])

    def verdict(name: str, costs: dict[str, list[float]], misses: int = 2, best: float = 200.0) -> Verdict:
        baselines = {setting: {"weighted_least_loaded": [_run(best)]} for setting in costs}
        return judge(load([_write(tmp_path / name, SEEDS, costs, misses)])[1], current, baselines)

    level = verdict("level", {"a": [100.03, 99.97] * 5, "b": [100.0] * 10, loaded: [95.0, 105.0] * 5})
    assert not level.cheaper and not level.rule_4 and level.no_harm
    # +0.08 % on one steady setting in every seed, 0 on the other: a mean of +0.04 %, within the margin; but its
    # own change is clear of zero beyond the margin, so it fails as a clear loss.
    assert not verdict("one", {"a": [100.08] * 10, "b": [100.0] * 10, loaded: [100.0] * 10}).no_harm
    assert verdict("small", {"a": [100.04] * 10, "b": [100.04] * 10, loaded: [100.0] * 10}).no_harm
    assert not verdict("loaded", {"a": [100.0] * 10, "b": [100.0] * 10, loaded: [103.0] * 10}).no_harm
    # +0.15 % on one steady setting but too noisy to be clear: the steady mean, +0.075 %, is past the margin.
    assert not verdict("drift", {"a": [100.4, 99.9] * 5, "b": [100.0] * 10, loaded: [100.0] * 10}).no_harm
    assert not verdict("misses", {"a": [100.0] * 10, "b": [100.0] * 10, loaded: [100.0] * 10}, misses=3).no_harm
    # +0.01 % on one: within the margin, but now dearer than a baseline the current policy ties with.
    behind = verdict("behind", {"a": [100.01] * 10, "b": [100.0] * 10, loaded: [100.0] * 10}, best=100.0)
    assert behind.behind_best == (1, 0) and not behind.no_harm


def test_rule_5_is_reported_only_when_it_was_the_rule_written_down(tmp_path: Path, capsys) -> None:
    current = _write(tmp_path / "current", SEEDS, CURRENT)
    variant = _write(tmp_path / "variant", SEEDS, CURRENT)
    assert main(["--variant", str(variant), "--current", str(current)]) == 0
    assert "rule 5" not in capsys.readouterr().out
    assert main(["--variant", str(variant), "--current", str(current), "--rule", "5"]) == 0
    assert "rule 5 (a), no harm: passes" in capsys.readouterr().out


def test_baselines_from_several_directories_are_joined_by_window_setting(tmp_path: Path, capsys) -> None:
    """A hold-out run as several bench.sim_matrix runs (one per --only) names all of their directories; each
    window-setting is judged against the baselines of the run that holds it, not refused or left out."""
    current = _write(tmp_path / "current", SEEDS, CURRENT)
    variant = _write(tmp_path / "variant", SEEDS, {"steady": [100.0] * 10, "overloaded": [99.0] * 10})
    for name, setting, cost in (("one", "steady", 200.0), ("two", "overloaded", 99.5)):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "results.json").write_text(json.dumps(
            {"options": {"seeds": "0"}, "settings": {}, "per_seed": {setting: {"dynamo": [_run(cost)]}}}))
    assert main(["--variant", str(variant), "--current", str(current),
                 "--baselines", str(tmp_path / "one"), str(tmp_path / "two")]) == 0
    # Dynamo beats the current policy on the overloaded window-setting only; the variant beats it there too.
    assert "dearer than the best baseline on 0 window-settings, the current policy on 1" in capsys.readouterr().out


def _tuning_results(directory: Path, options: dict, settings: list[str], setups: dict | None = None) -> Path:
    """A results.json as bench.sim_matrix --tuning writes it, Baton's runs on seeds 10 and 11 (10 % misses)."""
    directory.mkdir()
    run = {"cost_per_successful_task": 1.0, "slo_attainment": 0.9, "num_requests": 100}
    result = {"options": {"seeds": "10,11", "limit": 600, "timing_error": 0.3, "max_tokens": 2048,
                          "admission": "none", "tuning": True, **options},
              "settings": {}, "per_seed": {name: {"baton": [run, run]} for name in settings}}
    if setups is not None:
        result["setups"] = setups
    (directory / "results.json").write_text(json.dumps(result))
    return directory


WINDOW = "Mooncake conversation, 8xH100, 1x, requests 3,000-3,600"


def test_runs_that_differ_in_more_than_the_policy_are_refused_naming_the_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """It paired a --limit 100 run with a --limit 200 one and printed a change of +81.8 %."""
    current = _tuning_results(tmp_path / "current", {"limit": 100}, [WINDOW])
    variant = _tuning_results(tmp_path / "variant", {"limit": 200}, [WINDOW])
    err = refused(capsys, main, ["--variant", str(variant), "--current", str(current)])
    assert "limit 100 against 200" in err and "only the policy may differ" in err
    same = _tuning_results(tmp_path / "same", {"limit": 100}, [WINDOW])
    assert main(["--variant", str(same), "--current", str(current)]) == 0
    # What a window-setting replayed, as bench.sim_matrix records it: here another fleet.
    setups = {WINDOW: {"fleet": "8xh100", "skip": 3000}}
    first = _tuning_results(tmp_path / "first", {}, [WINDOW], setups)
    second = _tuning_results(tmp_path / "second", {}, [WINDOW], {WINDOW: {"fleet": "4xh100", "skip": 3000}})
    err = refused(capsys, main, ["--variant", str(second), "--current", str(first)])
    assert f"ran {WINDOW!r} otherwise: fleet '8xh100' against '4xh100'" in err
    err = refused(capsys, main, ["--variant", str(first), "--current", str(first),
                                               "--baselines", str(second)])
    assert "--baselines" in err and "fleet" in err


def test_rule_5_judges_only_runs_of_the_tuning_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    matrix = _tuning_results(tmp_path / "matrix", {"tuning": False}, [WINDOW])
    err = refused(capsys, main, ["--variant", str(matrix), "--current", str(matrix), "--rule", "5"])
    assert "--rule 5" in err and "--tuning" in err
    tuning = _tuning_results(tmp_path / "tuning", {"seeds": [10, 11]}, [WINDOW])  # as bench.sim_matrix writes them now
    assert main(["--variant", str(tuning), "--current", str(tuning), "--rule", "5"]) == 0
    assert "rule 5 (a), no harm: passes" in capsys.readouterr().out


def test_what_is_not_a_matrix_run_is_refused_naming_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    current = _tuning_results(tmp_path / "current", {}, [WINDOW])
    missing = tmp_path / "missing"
    err = refused(capsys, main, ["--variant", str(missing), "--current", str(current)])
    assert f"{missing}: no results.json" in err
    other = tmp_path / "sim"  # `baton sim`'s results
    other.mkdir()
    (other / "results.json").write_text(json.dumps({"args": {}, "runs": []}))
    err = refused(capsys, main, ["--variant", str(other), "--current", str(current)])
    assert "not bench.sim_matrix's results" in err and str(other) in err
    baselines = tmp_path / "baselines"  # runs of the other policies only, given as a side
    baselines.mkdir()
    (baselines / "results.json").write_text(json.dumps({"options": {"seeds": "10,11"}, "settings": {},
                                                        "per_seed": {WINDOW: {"dynamo": []}}}))
    err = refused(capsys, main, ["--variant", str(baselines), "--current", str(current)])
    assert "no runs of baton" in err
