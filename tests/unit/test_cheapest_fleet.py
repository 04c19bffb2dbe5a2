"""The cheapest-fleet search replays the window of the trace it is asked for, and refuses bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cheapest_fleet import args_for, build_parser, main
from simulator.report import TRACES, build_workload
from tests.unit.sim_cli import refused, write_traces


def test_the_search_replays_the_requests_after_its_skip(tmp_path: Path) -> None:
    rows = [{"timestamp": 1000 * j, "input_length": 100 + j, "output_length": 10, "hash_ids": [j]} for j in range(10)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = build_parser().parse_args(["--limit", "3", "--traces", str(tmp_path)])
    later = build_parser().parse_args(["--limit", "3", "--skip", "6", "--traces", str(tmp_path)])
    for options, lengths in ((first, [100, 101, 102]), (later, [106, 107, 108])):
        args = args_for(options, "2xh100")
        assert [r.prompt_len for r in build_workload(args, options.load).requests] == lengths


BAD_FLAGS = [
    (["--workload", "mooncake"], "--workload", "'mooncake'"),
    (["--limit", "0"], "--limit", "'0'"),
    # A skip past the trace's end gave 'none' for every fleet.
    (["--skip", "12"], "--skip", "12 is at or past the end of conversation_trace.jsonl, which has 10 requests"),
    (["--workload", "agentic", "--skip", "3"], "--skip", "agentic"),
    (["--load", "0"], "--load", "'0'"),
    # Refused by the inner parser, named as baton sim's --loads (helper-163).
    (["--load", "2000"], "--load", "'2000' must be from 0.001 to 1000"),
    (["--target", "0"], "--target", "'0'"),
    (["--target", "1.5"], "--target", "'1.5'"),
    (["--seeds", "400,400"], "--seeds", "400 given twice"),
    (["--policies", "fastest"], "--policies", "'fastest' is not a policy"),
    (["--ttft-slo", "0"], "--ttft-slo", "'0'"),
    (["--timing-error", "-0.1"], "--timing-error", "'-0.1'"),
    (["--traces", "/nonexistent"], "--traces", "no conversation_trace.jsonl in /nonexistent"),
]


@pytest.mark.parametrize(("argv", "flag", "named"), BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_in_its_own_name_naming_the_flag_and_its_value(
    argv: list[str], flag: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Its errors once came from the simulator's parser, which it hands its options to: `baton sim: error:`."""
    traces = write_traces(tmp_path / "traces")
    err = refused(capsys, main, ["--traces", str(traces), *argv, "--out", str(tmp_path / "out")])
    assert f"python -m bench.cheapest_fleet: error: argument {flag}: " in err and named in err
    assert "baton sim" not in err


def test_the_documented_command_line_still_parses() -> None:
    options = build_parser().parse_args("--skip 3600 --seeds 400,401,402 --out results/cheapest-3600".split())
    assert options.seeds == (400, 401, 402)
