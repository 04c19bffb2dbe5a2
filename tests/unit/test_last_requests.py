"""bench.last_requests: which requests ended last in a matrix setting, and where they ran."""

from __future__ import annotations

import json
from pathlib import Path

from bench.last_requests import by_gpu, main, placed_beside
from simulator.metrics import Slo
from simulator.report import TRACES
from simulator.simulation import RequestRecord
from simulator.workload import SimRequest


def test_it_names_the_request_that_ended_last_and_when_the_fleet_drained(tmp_path: Path, capsys) -> None:
    # Three short answers, then one long one: it arrives last and ends last.
    rows = [{"timestamp": 100 * j, "input_length": 64, "output_length": 4, "hash_ids": [j]} for j in range(3)]
    rows.append({"timestamp": 300, "input_length": 64, "output_length": 400, "hash_ids": [3]})
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--setting", "Mooncake conversation, 8xH100, 2x", "--policies", "baton", "--count", "2",
                 "--limit", "4", "--traces", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("seed 0 baton: the fleet drained ")
    assert lines[1].startswith("   r3 arrived 0.15 s") and "output 400, on h100-" in lines[1]
    assert len(lines) == 3


def test_an_unknown_setting_is_refused_naming_it(capsys) -> None:
    assert main(["--setting", "8xH100 at 9x"]) == 2
    assert "no setting named '8xH100 at 9x'" in capsys.readouterr().err


def test_a_tuning_window_is_traced_from_its_own_requests(tmp_path: Path, capsys) -> None:
    """The tuning windows (bench.sim_matrix --tuning) are where Baton's variants are judged, so where they lose
    is traced there: the window replays the trace from its skip, not from the start."""
    rows = [{"timestamp": 100 * j, "input_length": 64, "output_length": 4, "hash_ids": [j]} for j in range(3003)]
    rows.append({"timestamp": 300_300, "input_length": 64, "output_length": 400, "hash_ids": [3003]})
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--setting", "Mooncake conversation, 8xH100, 2x, requests 3,000-3,600", "--policies", "baton",
                 "--count", "1", "--limit", "4", "--traces", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "output 400, on h100-" in lines[1] and len(lines) == 2


def test_another_window_of_a_matrix_setting_is_traced_as_the_windows_runs_name_it(tmp_path: Path, capsys) -> None:
    """bench.sim_matrix --windows and bench.burst_holdout report windows such as "<setting>, requests 1,200-1,800";
    where one of them loses, it is traced from that window's requests. A window of another size is refused."""
    rows = [{"timestamp": 100 * j, "input_length": 64, "output_length": 4, "hash_ids": [j]} for j in range(1203)]
    rows.append({"timestamp": 120_300, "input_length": 64, "output_length": 400, "hash_ids": [1203]})
    (tmp_path / TRACES["mooncake-conversation"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--policies", "baton", "--count", "1", "--limit", "4", "--traces", str(tmp_path)]
    assert main(["--setting", "Mooncake conversation, 8xH100, 2x, requests 1,200-1,204", *common]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "output 400, on h100-" in lines[1]  # the window's last request, not the trace's first ones
    assert main(["--setting", "Mooncake conversation, 8xH100, 2x, requests 1,200-1,800", *common]) == 2
    assert "no setting named 'Mooncake conversation, 8xH100, 2x, requests 1,200-1,800'" in capsys.readouterr().err


def test_by_gpu_counts_where_requests_ran_and_which_budget_each_late_one_missed() -> None:
    """A round's trace asks where the misses moved (docs/evaluation.md, the twentieth round): each request counts
    on the GPU kind it ran on last, late past its own TTFT budget or past another, or failed."""
    def record(node: str, ttft_s: float | None, tpot_s: float, ttft_budget_ms: int = 0) -> RequestRecord:
        request = SimRequest(f"r{node}{ttft_s}", 0.0, (), 64, 11, "t", ttft_budget_ms=ttft_budget_ms)
        finish = None if ttft_s is None else ttft_s + 10 * tpot_s
        return RequestRecord(request, 0.0, first_token_s=ttft_s, finish_s=finish, num_generated=11, node_id=node)

    records = [record("h100-0", 0.1, 0.01), record("h100-1", 6.0, 0.01), record("h100-1", 0.5, 0.01, 400),
               record("l4-3", 0.2, 0.2), record("l4-4", None, 0.0), record("", None, 0.0)]
    assert by_gpu(records, Slo(ttft_s=5.0, tpot_s=0.1)) == [
        "   h100: placed 3, late 2 (TTFT 2), failed 0",  # 6 s past the 5 s default; 0.5 s past its own 400 ms
        "   l4: placed 2, late 1 (TTFT 0), failed 1",  # 200 ms a token past 100 ms; one never began
        "   not placed: placed 1, late 0 (TTFT 0), failed 1",
    ]


def test_placed_beside_counts_the_requests_that_arrived_on_its_node_while_it_decoded() -> None:
    """Why the last long answer decoded slower under one policy (docs/explored/tail-moves.md): the prompts placed
    on its node while it decoded rode in its steps. Arrivals before its first token, after its end, or on another
    node do not count."""
    def record(name: str, node: str, arrival_s: float, first_s: float | None = None,
               finish_s: float | None = None) -> RequestRecord:
        return RequestRecord(SimRequest(name, arrival_s, (), 100, 10, "t"), arrival_s, first_token_s=first_s,
                             finish_s=finish_s, num_generated=10, node_id=node)

    long = record("long", "h100-0", 0.0, 0.1, 10.0)
    records = [long, record("before", "h100-0", 0.05), record("during", "h100-0", 3.0),
               record("elsewhere", "h100-1", 3.0), record("after", "h100-0", 10.0), record("last", "h100-0", 9.9)]
    assert [r.request.request_id for r in placed_beside(long, records)] == ["during", "last"]
    assert [r.request.request_id for r in placed_beside(long, records, "h100-1")] == ["elsewhere"]
