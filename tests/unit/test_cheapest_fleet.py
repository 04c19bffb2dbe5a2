"""The cheapest-fleet search replays the window of the trace it is asked for."""

from __future__ import annotations

import json
from pathlib import Path

from bench.cheapest_fleet import args_for, build_parser
from simulator.report import TRACES, build_workload


def test_the_search_replays_the_requests_after_its_skip(tmp_path: Path) -> None:
    rows = [{"timestamp": 1000 * j, "input_length": 100 + j, "output_length": 10, "hash_ids": [j]} for j in range(10)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = build_parser().parse_args(["--limit", "3", "--traces", str(tmp_path)])
    later = build_parser().parse_args(["--limit", "3", "--skip", "6", "--traces", str(tmp_path)])
    for options, lengths in ((first, [100, 101, 102]), (later, [106, 107, 108])):
        args = args_for(options, "2xh100")
        assert [r.prompt_len for r in build_workload(args, options.load).requests] == lengths
