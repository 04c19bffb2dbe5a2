"""`baton sim`, `baton sim-admission` and `baton sim-models`: bad input is refused before any run, with exit 2
and a message naming the flag and the value; input that once gave a silently wrong result is refused or now
means what it says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from baton import cli
from simulator import admission_study, model_study, simulation
from simulator.flags import seeds_text
from simulator.report import TRACES, build_parser, build_workload, parse_args
from tests.processes import is_alive
from tests.unit.sim_cli import refused, write_traces

pytestmark = pytest.mark.timeout(30)

NUM_REQUESTS = 10


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    return write_traces(tmp_path / "traces", NUM_REQUESTS)


def _sim(argv: list[str]) -> int:
    return cli.main(["sim", *argv])


def _admission(argv: list[str]) -> int:
    return cli.main(["sim-admission", *argv])


def _models(argv: list[str]) -> int:
    return cli.main(["sim-models", *argv])


BAD_SIM_FLAGS = [
    # A budget of 0 or less: no request met it (0 of 10 successes, an infinite cost) or nan rows.
    (["--ttft-slo", "0"], "--ttft-slo", "'0'"),
    (["--tpot-slo", "-0.1"], "--tpot-slo", "'-0.1'"),
    (["--ttft-slo", "inf"], "--ttft-slo", "'inf'"),
    # A negative load gave negative arrival times; 0 divided by zero.
    (["--loads", "-1"], "--loads", "'-1'"),
    (["--loads", "0"], "--loads", "'0'"),
    (["--loads", "1,inf"], "--loads", "'inf'"),
    (["--loads", "abc"], "--loads", "'abc'"),
    (["--loads", "1,1"], "--loads", "1 given twice"),
    (["--prompt-scale", "-2"], "--prompt-scale", "'-2'"),
    # Mooncake's --limit 0 replayed one request, Azure's none, the agentic workload 200 tasks.
    (["--limit", "0"], "--limit", "'0'"),
    (["--workload", "agentic", "--limit", "0"], "--limit", "'0'"),
    (["--skip", "-1"], "--skip", "'-1'"),
    # Above 1 a GPU could draw a negative speed; nan crashed; a negative error acted as its absolute value.
    (["--timing-error", "1.5"], "--timing-error", "'1.5'"),
    (["--timing-error", "1"], "--timing-error", "'1'"),
    (["--timing-error", "nan"], "--timing-error", "'nan'"),
    (["--timing-error", "-0.2"], "--timing-error", "'-0.2'"),
    (["--fleet", "h100"], "--fleet", "'h100' is not COUNTxGPU"),
    (["--fleet", "2XH100"], "--fleet", "'2XH100'"),
    (["--fleet", "2xH100"], "--fleet", "lower case"),
    (["--fleet", "2xh100,,1xl4"], "--fleet", "empty fleet part"),
    (["--fleet", "1.5xh100"], "--fleet", "'1.5'"),
    (["--fleet", "0xh100"], "--fleet", "'0xh100'"),
    (["--fleet=-2xh100"], "--fleet", "'-2'"),
    (["--fleet", "2xrtx4090"], "--fleet", "unknown GPU 'rtx4090'; known: h100, a100"),
    (["--fleet="], "--fleet", "''"),
    (["--policies", "fastest"], "--policies", "'fastest' is not a policy; known: round_robin"),
    (["--policies="], "--policies", "no policy given"),
    (["--policies", "baton,,dynamo"], "--policies", "empty policy"),
    # The same seed twice was averaged as if two seeds.
    (["--policies", "baton,baton"], "--policies", "baton given twice"),
    (["--seeds", "abc"], "--seeds", "'abc'"),
    # 0 or fewer processes quietly meant one.
    (["--jobs", "0"], "--jobs", "'0'"),
    (["--seeds", "1.5"], "--seeds", "'1.5'"),
    (["--seeds", "0,,1"], "--seeds", "empty seed"),
    (["--seeds", "0,1,1"], "--seeds", "1 given twice"),
    (["--seeds", "3,1-4"], "--seeds", "3 given twice"),
    (["--seeds", "5-3"], "--seeds", "'5-3'"),
    # Python's random draws seed -1 as seed 1: a second run of seed 1's arrivals, averaged as another seed's.
    (["--seeds=-1"], "--seeds", "'-1' is negative"),
    (["--max-tokens", "0"], "--max-tokens", "'0'"),
    (["--model", "gpt-9"], "--model", "'gpt-9' is not a simulated model; known: "),
    (["--kill", "600"], "--kill", "'600'"),
    (["--kill", "inf:h100-0"], "--kill", "'inf'"),
    (["--kill=-5:h100-0"], "--kill", "'-5:h100-0'"),
    (["--fleet", "2xh100,1xl4", "--kill", "5:h100-2"], "--kill", "no node 'h100-2' in the fleet '2xh100,1xl4'; "
     "its nodes: h100-0, h100-1, l4-2"),
    (["--workload", "agentic", "--skip", "5"], "--skip", "agentic"),
    # Each a hang, a memory error or a table of inf or nan; the agentic workload ignored a prompt scale (helper-161).
    (["--prompt-scale", "1e9"], "--prompt-scale", "'1e9' must be at most 100"),
    (["--workload", "agentic", "--prompt-scale", "2"], "--prompt-scale", "agentic"),
    (["--seeds", "0-99999999"], "--seeds", "more than 10,000 seeds"),
    (["--fleet", "99999999999xh100"], "--fleet", "more than 4096 nodes in all"),
    (["--slo-mix", "1:inf:0.1"], "--slo-mix", "needs finite numbers"),
    (["--slo-mix", "1:0.0001:0.1"], "--slo-mix", "budgets of at least 0.001 s"),
    (["--loads", "1e-320"], "--loads", "'1e-320' must be from 0.001 to 1000"),
]


@pytest.mark.parametrize(("argv", "flag", "named"), BAD_SIM_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_SIM_FLAGS])
def test_baton_sim_refuses_a_bad_flag_naming_it_and_its_value(
    argv: list[str], flag: str, named: str, traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(capsys, _sim, [*argv, "--traces", str(traces), "--out", str(tmp_path / "out"), "--jobs", "1"])
    assert f"baton sim: error: argument {flag}: " in err and named in err
    assert not (tmp_path / "out").exists()


def test_a_skip_at_or_past_the_end_of_the_trace_is_refused_naming_its_length(
    traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """It gave a table of nan."""
    for workload in ("mooncake-conversation", "azure-code"):
        err = refused(capsys, _sim, ["--workload", workload, "--skip", str(NUM_REQUESTS), "--traces", str(traces),
                                     "--out", str(tmp_path / "out")])
        assert f"argument --skip: {NUM_REQUESTS} is at or past the end of {TRACES[workload]}" in err
        assert f"which has {NUM_REQUESTS} requests" in err


@pytest.mark.parametrize(("content", "named"), [
    ("not json\n", "does not read as a trace: JSONDecodeError"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 3}\n', "KeyError: 'hash_ids'"),
    ("", "holds no requests"),
])
def test_a_trace_that_does_not_read_as_one_is_refused_before_any_run(
    content: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """It was a traceback, or for an empty file a table of nan or inf, once the runs were under way (helper-161,
    helper-163: sim-admission reads the conversation trace too)."""
    folder = write_traces(tmp_path / "traces")
    (folder / TRACES["mooncake-conversation"]).write_text(content)
    for main, prog in ((_sim, "baton sim"), (_admission, "baton sim-admission")):
        err = refused(capsys, main, ["--traces", str(folder), "--out", str(tmp_path / "out"), "--jobs", "1"])
        assert f"{prog}: error: argument --traces: " in err and named in err
        assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_hold_results_is_refused_before_any_run(
    traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Found after every run had ended, and their results lost (helper-161)."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    for main, prog in ((_sim, "baton sim"), (_admission, "baton sim-admission"), (_models, "baton sim-models")):
        err = refused(capsys, main, ["--traces", str(traces), "--out", str(taken), "--jobs", "1"])
        assert f"{prog}: error: argument --out: '{taken}': not a folder results can be written in" in err


def test_missing_traces_are_refused_by_every_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nonexistent")
    for main, prog in ((_sim, "baton sim"), (_admission, "baton sim-admission"), (_models, "baton sim-models")):
        err = refused(capsys, main, ["--traces", missing, "--out", str(tmp_path / "out")])
        assert f"{prog}: error: argument --traces: no " in err and missing in err


BAD_STUDY_FLAGS = [
    (_admission, ["--limit", "0"], "--limit", "'0'"),
    (_admission, ["--policy", "fastest"], "--policy", "'fastest' is not a policy; known: "),
    (_admission, ["--loads", "0.5,-1"], "--loads", "'-1'"),
    (_admission, ["--ttft-slo", "0"], "--ttft-slo", "'0'"),
    (_admission, ["--timing-error", "1.2"], "--timing-error", "'1.2'"),
    (_admission, ["--fleet", "4xh100,"], "--fleet", "empty fleet part"),
    (_admission, ["--model", "gpt-9"], "--model", "'gpt-9'"),
    # It crashed on an empty workload.
    (_models, ["--limit", "0"], "--limit", "'0'"),
    (_models, ["--split", "6"], "--split", "'6'"),
    (_models, ["--split", "a,2"], "--split", "'a'"),
    (_models, ["--split=-1,2"], "--split", "'-1'"),
    (_models, ["--fleet", "2xa100", "--split", "6,2"], "--split", "6,2 makes 8 nodes; the fleet 2xa100 has 2"),
    (_models, ["--start-share", "1.5"], "--start-share", "'1.5'"),
    (_models, ["--end-share", "-0.1"], "--end-share", "'-0.1'"),
    (_models, ["--swap-idle-s=-5"], "--swap-idle-s", "'-5' must be 0 s or more"),
    (_models, ["--swap-idle-s", "nan"], "--swap-idle-s", "'nan'"),
    (_models, ["--models", "sim-llama-2-7b"], "--models", "two models"),
    (_models, ["--models", "sim-llama-2-7b,sim-llama-2-7b"], "--models", "given twice"),
    (_models, ["--models", "sim-llama-2-7b,gpt-9"], "--models", "'gpt-9' is not a simulated model"),
]


@pytest.mark.parametrize(("main", "argv", "flag", "named"), BAD_STUDY_FLAGS,
                         ids=[f"{m.__name__}: {' '.join(a)}" for m, a, _, _ in BAD_STUDY_FLAGS])
def test_the_studies_refuse_a_bad_flag_naming_it_and_its_value(
    main: Callable[[list[str]], int], argv: list[str], flag: str, named: str, traces: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(capsys, main, [*argv, "--traces", str(traces), "--out", str(tmp_path / "out"), "--jobs", "1"])
    assert f"argument {flag}: " in err and named in err
    assert not (tmp_path / "out").exists()


def test_the_agentic_workload_replays_as_many_tasks_as_limit_says() -> None:
    """--limit 0 gave the default 200 tasks (`args.limit or 200`); it is refused now (above)."""
    tasks = {r.task_id for r in build_workload(parse_args(["--workload", "agentic", "--limit", "3"]), 1.0).requests}
    assert len(tasks) == 3
    default = build_workload(parse_args(["--workload", "agentic"]), 1.0)
    assert len({r.task_id for r in default.requests}) == 200


class _Stop(Exception):
    """Raised by a fake simulation once it has seen the fleet it was given."""


def _warm_models(monkeypatch: pytest.MonkeyPatch, traces: Path, tmp_path: Path, argv: list[str]) -> list[str]:
    """The model each node of `baton sim-models argv` starts with warm ("": none)."""
    seen: list[str] = []

    def simulation(nodes: list, *args: object, **kwargs: object) -> None:
        seen.extend(node.warm for node in nodes)
        raise _Stop

    monkeypatch.setattr(model_study, "Simulation", simulation)
    with pytest.raises(_Stop):
        _models([*argv, "--loads", "1", "--limit", "5", "--jobs", "1", "--traces", str(traces),
                 "--out", str(tmp_path / "out")])
    return seen


def test_a_fleet_that_names_a_gpu_twice_adds_up_as_the_simulator_reads_it() -> None:
    """The flag's own check refused `4xh100,2xh100` as "given twice" while the simulator took it: one parser now."""
    assert parse_args(["--fleet", "4xh100,2xh100,1xl4"]).fleet == "4xh100,2xh100,1xl4"
    assert [node.node_id for node in simulation.fleet("2xh100,1xl4,1xh100")] == ["h100-0", "h100-1", "l4-2", "h100-3"]
    with pytest.raises(ValueError, match="'2xh100,h100': 'h100' is not COUNTxGPU"):
        simulation.fleet("2xh100,h100")


def test_sim_models_splits_a_fleet_of_any_size_between_the_two_models(
    monkeypatch: pytest.MonkeyPatch, traces: Path, tmp_path: Path,
) -> None:
    """The default split, 6,2, made every node of a 2-node fleet model A; a split short of the fleet gave the
    rest model B whatever B's count said."""
    a, b = "sim-llama-3.1-8b", "sim-llama-2-7b"
    assert _warm_models(monkeypatch, traces, tmp_path, []) == [a] * 6 + [b] * 2
    assert _warm_models(monkeypatch, traces, tmp_path, ["--fleet", "2xa100"]) == [a, b]
    assert _warm_models(monkeypatch, traces, tmp_path, ["--fleet", "4xa100", "--split", "1,2"]) == [a, b, b, ""]


DOCUMENTED = [  # docs/simulator.md, docs/evaluation.md and the Makefile
    "--workload mooncake-conversation --fleet 4xh100,4xa100,4xl4 --loads 0.5,1,2 --out results/sim",
    "--workload mooncake-conversation --fleet 16xh100 --policies dynamo --limit 2000 --kill 300:h100-0",
    "--skip 3000 --limit 600 --seeds 0,1,2 --admission baton --slo-mix 0.3:1:0.03,0.7:30:0.2",
]


@pytest.mark.parametrize("command", DOCUMENTED)
def test_the_documented_command_lines_still_parse(command: str) -> None:
    parse_args(command.split())


def test_a_range_of_seeds_is_every_seed_in_it() -> None:
    assert parse_args(["--seeds", "360-379"]).seeds == tuple(range(360, 380))
    assert parse_args(["--seeds", "10-12,20"]).seeds == (10, 11, 12, 20)
    assert seeds_text((*range(10, 20), 25, 26)) == "10-19,25,26"  # as the summaries print them


@pytest.mark.parametrize("command", [
    "sim-admission --fleet 4xh100 --loads 0.5,1,2,3 --limit 3000",
    "sim-models --fleet 8xa100 --split 6,2 --loads 2,4,6 --limit 8000",
])
def test_the_makefiles_studies_still_parse(command: str, traces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for study in (admission_study, model_study):
        monkeypatch.setattr(study, "run_all", lambda run_one, jobs, num_workers: [])
        monkeypatch.setattr(study, "write_results", lambda out, table, results: None)
    assert cli.main([*command.split(), "--traces", str(traces)]) == 0


def test_a_run_with_an_slo_mix_writes_its_results(traces: Path, tmp_path: Path) -> None:
    """results.json could not hold --slo-mix's classes: the run ended in a TypeError after every simulation."""
    out = tmp_path / "out"
    assert _sim(["--limit", "3", "--policies", "baton", "--slo-mix", "0.3:1:0.03,0.7:30:0.2", "--jobs", "1",
                 "--traces", str(traces), "--out", str(out)]) == 0
    classes = json.loads((out / "results.json").read_text())["args"]["slo_mix"]
    assert classes[0] == {"name": "class0", "share": 0.3, "ttft_budget_ms": 1000, "tpot_budget_ms": 30}


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"results.json holds {name}, which is not JSON")


def test_a_run_in_which_nothing_succeeds_says_so_and_writes_json_that_parsers_take(
        traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A TTFT budget of 1 ms: the table printed nan and inf with no word of why, and results.json held NaN and
    Infinity, which jq and JavaScript refuse."""
    out = tmp_path / "out"
    assert _sim(["--limit", "3", "--policies", "baton", "--ttft-slo", "0.001", "--jobs", "1",
                 "--traces", str(traces), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| 1x | baton"))
    assert "nan" not in row and "inf" not in row
    assert "| no success | no success |" in row and "n/a / n/a / n/a" in row
    assert "no task met its SLO, so there is no cost per successful task" in printed
    summary = json.loads((out / "results.json").read_text(), parse_constant=_refuse_constant)["runs"][0]["summary"]
    assert summary["num_tasks_ok"] == 0
    assert summary["cost_per_successful_task"] is None and summary["ttft_p50"] is None


def test_an_admission_study_in_which_nothing_ran_writes_its_table(traces: Path, tmp_path: Path) -> None:
    """A TTFT budget of 1 ms refused every request, and the goodput divided by a run of no length (helper-161)."""
    assert _admission(["--traces", str(traces), "--out", str(tmp_path / "out"), "--jobs", "1", "--limit", "5",
                       "--loads", "1", "--ttft-slo", "0.001"]) == 0
    assert "| 1x |" in (tmp_path / "out" / "table.md").read_text()


_HOLDING_STUDY = """
import os, sys, time
from pathlib import Path
from simulator.study import run_all

def hold(n):
    (Path(sys.argv[1]) / f"worker-{os.getpid()}").write_text("")
    time.sleep(60)

if __name__ == "__main__":
    run_all(hold, [1, 2], 2)
"""


def test_a_study_stopped_by_sigterm_stops_its_workers(tmp_path: Path) -> None:
    """Its workers ran their jobs to the end, orphaned (helper-161)."""
    script = tmp_path / "study.py"
    script.write_text(_HOLDING_STUDY)
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    study = subprocess.Popen([sys.executable, str(script), str(markers)], env=env)
    try:
        deadline = time.monotonic() + 20
        while len(list(markers.iterdir())) < 2:  # both workers run a job (the files are how they say so)
            assert time.monotonic() < deadline and study.poll() is None, "the workers never started"
            time.sleep(0.05)
        workers = [int(marker.name.removeprefix("worker-")) for marker in markers.iterdir()]
        study.send_signal(signal.SIGTERM)
        assert study.wait(timeout=10) == 128 + signal.SIGTERM
        for pid in workers:  # each is gone (or a zombie its forkserver has yet to reap)
            deadline = time.monotonic() + 10
            while is_alive(pid):
                assert time.monotonic() < deadline, f"worker {pid} still runs its job"
                time.sleep(0.05)
    finally:
        if study.poll() is None:
            study.kill()
            study.wait()


def test_baton_sim_help_shows_every_flags_default() -> None:
    """It showed none (helper-161)."""
    parser = build_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help and action.dest != "help":
            assert "default" in formatter._expand_help(action), action.option_strings[0]
    loads = next(a for a in parser._actions if a.dest == "loads")
    assert formatter._expand_help(loads).endswith("(default: 1)")
