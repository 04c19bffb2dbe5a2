"""bench.tail_moves: the exploration of moving a long answer onto a GPU that has gone idle."""

from __future__ import annotations

import json
from pathlib import Path

from bench.last_requests import find_setting
from bench.sim_matrix import _args, build_parser
from bench.tail_moves import TailMoves, main
from simulator.report import TRACES, build_workload, simulate


def _sixteen_requests(tmp_path: Path) -> list[str]:
    """Arguments that replay 16 requests arriving together on 8 H100s: every other one answers 800 tokens, the
    rest 10."""
    rows = [{"timestamp": j, "input_length": 64, "output_length": 800 if j % 2 == 0 else 10, "hash_ids": [j]}
            for j in range(16)]
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--setting", "Mooncake conversation, 8xH100, 2x", "--seeds", "0", "--limit", "16",
            "--traces", str(tmp_path)]


def test_long_answers_sharing_a_gpu_are_moved_to_idle_ones_and_finish_whole(tmp_path: Path, capsys) -> None:
    """Sixteen requests on 8 H100s: Baton pairs the eight long answers on four GPUs and the short ones on the
    other four. Once the short ones end, one long answer of each pair moves to an idle GPU (its context prefilled
    again there) and every request still ends with its whole answer, so all 16 succeed in both runs."""
    assert main(_sixteen_requests(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(4 moves); successes 16 / 16;" in lines[0]
    assert lines[1].startswith("baton with moves against without, whole fleet per success: ")


def test_no_move_is_made_below_the_remaining_length_asked(tmp_path: Path, capsys) -> None:
    assert main([*_sixteen_requests(tmp_path), "--min-remaining", "900"]) == 0
    assert "(0 moves); successes 16 / 16;" in capsys.readouterr().out


def test_a_moved_request_leaves_its_old_engine_and_ends_whole_on_the_new_one(tmp_path: Path) -> None:
    """A move is a migration: the old node's engine drops the request (else both GPUs would decode it) and the new
    one generates only what was left, so every answer has exactly its length."""
    left_behind: list[str] = []

    class Checked(TailMoves):
        def _kick(self, node) -> None:
            before = set(node.flights)
            super()._kick(node)
            left_behind.extend(r for r in before - set(node.flights)
                               if node.core is not None and node.core.progress(r) is not None)

    options = build_parser().parse_args(_sixteen_requests(tmp_path)[4:])
    setting = find_setting("Mooncake conversation, 8xH100, 2x", options)
    args = _args(setting, options)
    movers: list[Checked] = []

    def mover(*a, **k) -> Checked:
        movers.append(Checked(*a, **k))
        return movers[-1]

    result = simulate(args, "baton", build_workload(args, setting.load), 0, simulation=mover)
    assert movers[0].num_moves == 4 and left_behind == []
    assert sorted(r.num_generated for r in result.records) == [10] * 8 + [800] * 8
