"""Why a tie on a fixed fleet goes one way: the requests that end last under each policy, and where they ran.

On a fleet paid until its last request ends, the whole-fleet cost of a setting whose requests all
succeed moves only with when that is: the last few answers and what ran beside them decide it.

    python -m bench.last_requests --setting "Azure code, mixed, 2x" --seeds 0,1,2 \\
        --policies baton,weighted_least_loaded

prints, per seed and policy, when the fleet drained (after the last arrival) and the requests that
ended last: arrival, end, prompt and output length, node, TTFT and TPOT, and the requests that arrived while
it decoded and ran on its node (their prompts rode in its steps), against the mean on each other GPU of its
kind. With --by-gpu, also where the requests ran and where they missed their SLO, per GPU kind:

    python -m bench.last_requests --setting "Mooncake conversation, 2xH100+8xL4, 1x" --seeds 360 \\
        --policies baton --count 0 --by-gpu

    seed 360 baton: the fleet drained ...
       h100: placed 449, late 160 (TTFT 160), failed 0
       l4: placed 151, late 84 (TTFT 53), failed 0

(late: finished past one of its budgets, the TTFT one or another; each request held to its own budgets, as
the matrix's SLO attainment counts it.)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

from bench.sim_matrix import BASELINES, SETTINGS, TUNING, Setting, _args, build_parser, tuning_windows, window_of
from services.common.slo import Outcome
from simulator.metrics import Slo
from simulator.report import build_workload, simulate
from simulator.simulation import RequestRecord

WINDOW = re.compile(r"(?P<base>.+), requests (?P<start>[\d,]+)-(?P<end>[\d,]+)")


def find_setting(name: str, options: argparse.Namespace) -> Setting | None:
    """A setting of the matrix or a tuning window by its full name, or a matrix setting's window of
    options.limit requests named as bench.sim_matrix --windows names them ("<setting>, requests 1,200-1,800")."""
    for setting in SETTINGS + TUNING + tuning_windows(options.limit):  # the tuning windows as --limit names them too
        if setting.name == name:
            return setting
    match = WINDOW.fullmatch(name)
    base = next((s for s in SETTINGS if match and s.name == match["base"] and s.limit is None), None)
    if base is None:
        return None
    start, end = (int(match[key].replace(",", "")) for key in ("start", "end"))
    return window_of(base, start, options.limit) if end - start == options.limit else None


def _kind(node_id: str) -> str:
    return node_id.rsplit("-", 1)[0]


def by_gpu(records: list[RequestRecord], slo: Slo) -> list[str]:
    """Per GPU kind (the node id's prefix, "h100" of "h100-2"): the requests last placed there, those that ended
    late (and how many of them past their TTFT budget) and those that failed."""
    placed: Counter[str] = Counter()
    late: Counter[str] = Counter()
    late_ttft: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for record in records:
        kind = _kind(record.node_id) if record.node_id else "not placed"
        placed[kind] += 1
        outcome = slo.outcome(record)
        if outcome == Outcome.LATE:
            late[kind] += 1
            late_ttft[kind] += record.ttft_s is not None and record.ttft_s * 1000 > slo.for_record(record).ttft_ms
        elif outcome != Outcome.SUCCEEDED:
            failed[kind] += 1
    return [f"   {kind}: placed {placed[kind]}, late {late[kind]} (TTFT {late_ttft[kind]}), failed {failed[kind]}"
            for kind in sorted(placed)]


def placed_beside(record: RequestRecord, records: list[RequestRecord], node_id: str = "") -> list[RequestRecord]:
    """The requests that arrived while record decoded and ran on its node (or on node_id): on its own node their
    prompts' chunks rode in its steps (a request that moved is counted on the node it ended on)."""
    assert record.first_token_s is not None and record.finish_s is not None
    return [r for r in records if r is not record and r.node_id == (node_id or record.node_id)
            and record.first_token_s <= r.arrival_s < record.finish_s]


def last_requests(setting: Setting, policy: str, seed: int, count: int, options: argparse.Namespace,
                  per_gpu: bool = False) -> list[str]:
    """The drain and the `count` requests that ended last, one line each; per_gpu: and a line per GPU kind."""
    args = _args(setting, options)
    result = simulate(args, policy, build_workload(args, setting.load), seed)
    last_arrival = max(r.arrival_s for r in result.records)
    lines = [f"seed {seed} {policy}: the fleet drained {result.provisioned_s - last_arrival:.2f} s after the last "
             f"arrival ({result.provisioned_s:.2f} s)"]
    for record in sorted(result.records, key=lambda r: -r.ended_s)[:count]:
        if record.first_token_s is None or record.finish_s is None:
            why = record.failed or "no token"
            lines.append(f"   {record.request.request_id} arrived {record.arrival_s:.2f} s: {why}")
            continue
        tpot_ms = (record.finish_s - record.first_token_s) / max(1, record.num_generated - 1) * 1000
        beside = placed_beside(record, result.records)
        peers = [n for n in result.price_per_hour if _kind(n) == _kind(record.node_id) and n != record.node_id]
        on_peers = [placed_beside(record, result.records, n) for n in peers]
        per_peer = sum(len(p) for p in on_peers) / max(1, len(peers))
        tokens_per_peer = sum(r.request.prompt_len for p in on_peers for r in p) / max(1, len(peers))
        lines.append(f"   {record.request.request_id} arrived {record.arrival_s:.2f} s, ended {record.finish_s:.2f} s: "
                     f"prompt {record.request.prompt_len}, output {record.num_generated}, on {record.node_id}, "
                     f"TTFT {record.first_token_s - record.arrival_s:.2f} s, TPOT {tpot_ms:.1f} ms; placed beside it "
                     f"while it decoded: {len(beside)} requests, {sum(r.request.prompt_len for r in beside):,} "
                     f"prompt tokens (meanwhile on each other {_kind(record.node_id)}: {per_peer:.1f} requests, "
                     f"{tokens_per_peer:,.0f} prompt tokens)")
    if per_gpu:
        lines += by_gpu(result.records, Slo(args.ttft_slo, args.tpot_slo))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.last_requests", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True,
                        help="a setting of the matrix or a tuning window (bench.sim_matrix --tuning), by its full "
                        "name, or another window of a matrix setting as --windows names it "
                        "(\"<setting>, requests 1,200-1,800\")")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--policies", default=",".join(("baton", *BASELINES)))
    parser.add_argument("--count", type=int, default=4, help="how many of the last requests to show")
    parser.add_argument("--by-gpu", action="store_true",
                        help="also, per GPU kind, the requests placed there and those that ended late or failed")
    own, rest = parser.parse_known_args(argv)
    options = build_parser().parse_args(rest)  # the matrix's own options (--timing-error, --admission, ...)
    setting = find_setting(own.setting, options)
    if setting is None:
        names = [s.name for s in SETTINGS + TUNING]
        print(f"--setting: no setting named {own.setting!r}; the matrix and its tuning windows have: "
              f"{'; '.join(names)}; or a matrix setting's window of --limit ({options.limit}) requests, "
              f"\"<setting>, requests <from>-<to>\"", file=sys.stderr)
        return 2
    for seed in (int(s) for s in own.seeds.split(",")):
        for policy in own.policies.split(","):
            print("\n".join(last_requests(setting, policy.strip(), seed, own.count, options, own.by_gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
