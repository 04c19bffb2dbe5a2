"""The held-out matrix's verdict: Baton against the best baseline, and seed by seed against it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.sim_matrix import (
    SETTINGS,
    TUNING,
    Setting,
    _args,
    build_parser,
    held_out_windows,
    main,
    paired_change,
    paired_changes,
    pooled_verdict,
    setup_of,
    verdict,
)
from simulator.report import TRACES, build_workload, merge_seeds, run_one
from tests.unit.sim_cli import refused, write_traces

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
    # A run with no success has no cost per success: the simulator's summary makes it inf.
    assert paired_change([run(1.0), run(float("inf"))], [run(1.0), run(1.0)], KEY) is None
    assert paired_change([run(1.0), run(1.0)], [run(float("inf")), run(1.0)], KEY) is None


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


def test_held_out_windows_skip_the_matrix_and_tuning_windows_and_stop_where_the_trace_ends(tmp_path: Path) -> None:
    rows = [{"timestamp": 10 * j, "input_length": 100, "output_length": 10, "hash_ids": [j]} for j in range(6_700)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = build_parser().parse_args(["--limit", "600", "--traces", str(tmp_path)])
    setting = next(s for s in SETTINGS if s.workload == "mooncake-conversation")
    windows = held_out_windows(setting, options, count=20)
    tuning = {s.skip for s in TUNING if s.workload == "mooncake-conversation"}
    assert tuning == {3000, 6000}
    # The matrix's first 600 and the tuning windows 3,000-3,600 and 6,000-6,600 are left out; 6,600 on
    # would hold only 100 requests.
    assert [w.skip for w in windows] == [600, 1200, 1800, 2400, 3600, 4200, 4800, 5400]
    assert windows[0].name == f"{setting.name}, requests 600-1,200"
    assert [w.skip for w in held_out_windows(setting, options, count=2)] == [600, 1200]


def test_the_pooled_verdict_averages_seeds_within_a_window_then_windows() -> None:
    # Window 1: Baton 1 % dearer than dynamo, the cheaper baseline there, in each seed; window 2: 3 %
    # cheaper than llm_d, the cheaper one there. The seeds differ, so only seed-with-seed pairs give these.
    window1 = {"baton": [run(101.0), run(202.0)], "dynamo": [run(100.0), run(200.0)],
               "llm_d": [run(200.0), run(400.0)]}
    window2 = {"baton": [run(97.0, 0.99), run(194.0, 0.97)], "dynamo": [run(105.0), run(210.0)],
               "llm_d": [run(100.0), run(200.0)]}
    lines = pooled_verdict([window1, window2])
    control = lines.index("Each policy against the cheapest of the others in each window:")
    by_baseline = {line.split(" | ")[0].strip("| "): line for line in lines[2:control - 1]}
    cheapest = by_baseline["the cheapest in each window"]
    # (+1 % and -3 %) / 2, with the interval of two values (the windows, not the four seeds): t(1) = 12.71
    assert cheapest.split(" | ")[1] == "-1.00 ± 25.42 %"
    assert "| 1 of 2 |" in cheapest
    dynamo = by_baseline["dynamo"].split(" | ")
    expected = ((101 / 100 - 1) + (97 / 105 - 1)) / 2 * 100
    assert dynamo[1].startswith(f"{expected:+.2f} ± ")
    assert dynamo[3].startswith("-1.00 ± ")  # SLO: 0 pt in window 1, -2 pt in window 2


def test_the_pooled_table_puts_the_busy_time_floor_beside_the_whole_fleet_cost() -> None:
    # Baton is dearer than dynamo on the whole fleet but cheaper by busy time; llm_d is the cheapest by busy time,
    # so the row against the cheapest in each window compares busy time with llm_d, not with dynamo.
    def costs(fleet: float, busy: float) -> dict:
        return {KEY: fleet, "busy_cost_per_successful_task": busy, "slo_attainment": 1.0}

    window = {"baton": [costs(101.0, 40.0)], "dynamo": [costs(100.0, 60.0)], "llm_d": [costs(200.0, 50.0)]}
    lines = pooled_verdict([window, window])
    assert lines[0].endswith("| busy-time floor (Baton cheaper in) |")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[2:5]}
    assert rows["dynamo"][1].startswith("+1.00 ± ")  # the whole fleet: dearer
    assert rows["dynamo"][4] == "-33.3 ± 0.0 %, 2 of 2 |"  # its floor: 40 against 60
    assert rows["the cheapest in each window"][1].startswith("+1.00 ± ")  # dynamo, the cheapest whole fleet
    assert rows["the cheapest in each window"][4] == "-20.0 ± 0.0 %, 2 of 2 |"  # llm_d, the cheapest floor


def test_the_pooled_control_compares_every_policy_with_the_cheapest_of_the_others() -> None:
    # Three policies that tie on average, each cheapest in one window: every one is dearer than the
    # cheapest of the others, which is what a tie looks like by that comparison.
    windows = [{"baton": [run(a)], "dynamo": [run(b)], "llm_d": [run(c)]}
               for a, b, c in ((99.0, 100.0, 101.0), (101.0, 99.0, 100.0), (100.0, 101.0, 99.0))]
    lines = pooled_verdict(windows)
    control = lines[lines.index("Each policy against the cheapest of the others in each window:") + 4:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in control}
    assert set(rows) == {"baton", "dynamo", "llm_d"}
    for cells in rows.values():
        assert cells[2].startswith("1 of 3")  # cheaper than the rest in its own window only
        assert float(cells[1].split(" ")[0]) > 0  # dearer on average than the cheapest of the others


def test_a_window_where_a_run_had_no_success_is_left_out_of_the_pool() -> None:
    windows = [{"baton": [run(99.0)], "dynamo": [run(100.0)]},
               {"baton": [run(float("inf"), 0.0)], "dynamo": [run(100.0)]}]
    dynamo = next(line for line in pooled_verdict(windows) if line.startswith("| dynamo |")).split(" | ")
    assert dynamo[1].startswith("-1.00 ± ") and dynamo[2] == "1 of 1"


def test_windows_of_another_size_keep_clear_of_the_matrix_and_tuning_requests(tmp_path: Path) -> None:
    rows = [{"timestamp": 10 * j, "input_length": 100, "output_length": 10, "hash_ids": [j]} for j in range(4_200)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = build_parser().parse_args(["--limit", "100", "--traces", str(tmp_path)])
    setting = next(s for s in SETTINGS if s.workload == "mooncake-conversation")
    skips = [w.skip for w in held_out_windows(setting, options, count=40)]
    # 600-3,000 and 3,600-4,200 in windows of 100: the first 600 and 3,000-3,600 hold requests of the
    # matrix and of a tuning window, whatever --limit this run has.
    assert skips == list(range(600, 3000, 100)) + list(range(3600, 4200, 100))


def test_windows_are_refused_for_the_tuning_windows_and_without_a_limit(tmp_path: Path) -> None:
    for argv in (["--windows", "2", "--tuning"], ["--windows", "2", "--limit", "0"]):
        with pytest.raises(SystemExit):
            main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # made before the refusal, it was left empty (helper-163)


def test_a_windows_run_pools_each_setting_over_its_windows(tmp_path: Path) -> None:
    rows = [{"timestamp": 500 * j, "input_length": 64, "output_length": 4, "hash_ids": [j]} for j in range(620)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    main(["--windows", "2", "--limit", "5", "--seeds", "0", "--only", "8xH100, 2x", "--policies", "baton,dynamo",
          "--jobs", "1", "--traces", str(tmp_path), "--out", str(out)])
    summary = (out / "summary.md").read_text()
    name = "Mooncake conversation, 8xH100, 2x"
    assert f"### {name}, requests 600-605 " in summary and f"### {name}, requests 605-610 " in summary
    assert f"### {name}, over 2 windows" in summary
    assert set(json.loads((out / "results.json").read_text())["per_seed"]) == {
        f"{name}, requests 600-605", f"{name}, requests 605-610"}


def test_admission_reaches_the_simulation(tmp_path: Path) -> None:
    """--admission baton puts the leader's gate in front of the policy: 40 prompts at once on one L4, far
    more than it can start within their 5 s budget, are refused at arrival instead of queueing there."""
    rows = [{"timestamp": 0, "input_length": 4000, "output_length": 50, "hash_ids": [j]} for j in range(40)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    setting = Setting("one L4", "mooncake-conversation", "1xl4", 1.0, limit=40)
    completed = {}
    for admission in ("none", "baton"):
        args = _args(setting, build_parser().parse_args(["--admission", admission, "--traces", str(tmp_path)]))
        assert args.admission == admission
        _, _, _, summary, _, _ = run_one((args, "baton", setting.load, 0))
        completed[admission] = summary["num_completed"]
    assert completed["none"] == 40  # each served, however late
    assert completed["baton"] < 40  # the gate refused those it could not start in time


BAD_FLAGS = [
    (["--limit", "0"], "--limit", "'0'"),
    (["--seeds", "10,...,19"], "--seeds", "10-19"),
    (["--seeds", "0,1,0"], "--seeds", "0 given twice"),
    (["--sweep-seeds", "x"], "--sweep-seeds", "'x'"),
    (["--policies", "baton,fastest"], "--policies", "'fastest' is not a policy"),
    (["--timing-error", "2"], "--timing-error", "'2'"),
    (["--max-tokens", "0"], "--max-tokens", "'0'"),
    (["--windows", "-1"], "--windows", "'-1'"),
    (["--only", "16xH100"], "--only", "no setting has '16xH100' in its name"),
    (["--traces", "/nonexistent"], "--traces", "no conversation_trace.jsonl in /nonexistent"),
]


@pytest.mark.parametrize(("argv", "flag", "named"), BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_naming_it_and_its_value(
    argv: list[str], flag: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    traces = write_traces(tmp_path / "traces")
    err = refused(capsys, main, ["--traces", str(traces), *argv, "--out", str(tmp_path / "out")])
    assert f"python -m bench.sim_matrix: error: argument {flag}: " in err and named in err


def test_a_tuning_run_of_fewer_requests_is_named_for_the_requests_it_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--tuning --limit 3 labelled its windows 'requests 3,000-3,600' while it replayed three requests."""
    traces = write_traces(tmp_path / "traces", 6_010)
    out = tmp_path / "out"
    assert main(["--tuning", "--limit", "3", "--only", "8xH100, 2x", "--policies", "baton", "--seeds", "0",
                 "--jobs", "1", "--traces", str(traces), "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert list(result["per_seed"]) == ["Mooncake conversation, 8xH100, 2x, requests 3,000-3,003",
                                        "Mooncake conversation, 8xH100, 2x, requests 6,000-6,003"]
    assert all(run["num_requests"] == 3 for runs in result["per_seed"].values() for run in runs["baton"])
    assert "### Mooncake conversation, 8xH100, 2x, requests 3,000-3,003" in capsys.readouterr().out
    # What each window-setting replayed, for bench.adoption_rule to compare two sides by.
    assert result["setups"]["Mooncake conversation, 8xH100, 2x, requests 6,000-6,003"] == {
        "limit": 3, "timing_error": 0.3, "max_tokens": 2048, "admission": "none", "tuning": True,
        "workload": "mooncake-conversation", "fleet": "8xh100", "load": 2.0, "ttft_s": 5.0, "tpot_s": 0.1,
        "slo_mix": "", "skip": 6000, "agent_tasks": None}


def test_the_agentic_settings_setup_does_not_record_a_limit_it_ignores() -> None:
    """bench.adoption_rule compares two sides' setups: agentic runs made with another --limit replay the same tasks."""
    agentic = next(s for s in SETTINGS if s.workload == "agentic")
    setups = [setup_of(agentic, build_parser().parse_args(["--limit", limit])) for limit in ("300", "600")]
    assert setups[0] == setups[1] and setups[0]["agent_tasks"] == agentic.limit and "limit" not in setups[0]


def test_a_window_that_ends_with_the_trace_is_replayed_and_the_next_is_not(tmp_path: Path) -> None:
    traces = write_traces(tmp_path / "traces", 1_800)
    options = build_parser().parse_args(["--limit", "600", "--traces", str(traces)])
    setting = next(s for s in SETTINGS if s.workload == "mooncake-conversation")
    assert [w.skip for w in held_out_windows(setting, options, count=5)] == [600, 1200]


@pytest.mark.parametrize("command", [
    "--seeds 0,1,2 --sweep-seeds 0,1,2,3,4 --out results/matrix",
    "--seeds 0,1,2 --sweep-seeds 0,1 --admission baton --out results/matrix-admission",
    "--windows 8 --seeds 0,1,2 --only 8xH100 --out results/windows",
    "--tuning --seeds 10,11,12,13,14,15,16,17,18,19 --policies baton --out results/tuning",
])
def test_the_documented_command_lines_still_parse(command: str) -> None:
    build_parser().parse_args(command.split())


def test_a_range_of_seeds_is_every_seed_in_it() -> None:
    options = build_parser().parse_args(["--seeds", "10-12,20", "--sweep-seeds", "0-1"])
    assert options.seeds == (10, 11, 12, 20) and options.sweep_seeds == (0, 1)


def _no_success(job: tuple) -> tuple:
    """run_one, as a run in which no task met its SLO ends: no cost per successful task (inf)."""
    row = run_one(job)
    row[3]["cost_per_successful_task"] = float("inf")
    return row


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"results.json holds {name}, which is not JSON")


def test_a_run_with_no_success_writes_json_that_parsers_take_and_the_rule_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with no success has no cost per successful task: results.json held Infinity, which jq and JavaScript
    refuse. It is null, and a comparison of two sides passes over it as a run with no figure."""
    rows = [{"timestamp": 500 * j, "input_length": 64, "output_length": 4, "hash_ids": [j]} for j in range(20)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr("bench.sim_matrix.run_one", _no_success)
    out = tmp_path / "out"
    assert main(["--limit", "5", "--seeds", "0", "--only", "Mooncake conversation, 8xH100, 2x", "--policies",
                 "baton,dynamo", "--jobs", "1", "--traces", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text(), parse_constant=_refuse_constant)
    runs = result["per_seed"]["Mooncake conversation, 8xH100, 2x"]
    assert runs["baton"][0]["cost_per_successful_task"] is None
    assert paired_changes(runs["baton"], runs["dynamo"], "cost_per_successful_task") is None
