"""Why a tie on a fixed fleet goes one way: the requests that end last under each policy, and where they ran.

On a fleet paid until its last request ends, the whole-fleet cost of a setting whose requests all
succeed moves only with when that is: the last few answers and what ran beside them decide it.

    python -m bench.last_requests --setting "Azure code, mixed, 2x" --seeds 0,1,2 \\
        --policies baton,weighted_least_loaded

prints, per seed and policy, when the fleet drained (after the last arrival) and the requests that
ended last: arrival, end, prompt and output length, node, TTFT and TPOT.
"""

from __future__ import annotations

import argparse
import re
import sys

from bench.sim_matrix import BASELINES, SETTINGS, TUNING, Setting, _args, build_parser, window_of
from simulator.report import build_workload, simulate

WINDOW = re.compile(r"(?P<base>.+), requests (?P<start>[\d,]+)-(?P<end>[\d,]+)")


def find_setting(name: str, options: argparse.Namespace) -> Setting | None:
    """A setting of the matrix or a tuning window by its full name, or a matrix setting's window of
    options.limit requests named as bench.sim_matrix --windows names them ("<setting>, requests 1,200-1,800")."""
    for setting in SETTINGS + TUNING:
        if setting.name == name:
            return setting
    match = WINDOW.fullmatch(name)
    base = next((s for s in SETTINGS if match and s.name == match["base"] and s.limit is None), None)
    if base is None:
        return None
    start, end = (int(match[key].replace(",", "")) for key in ("start", "end"))
    return window_of(base, start, options.limit) if end - start == options.limit else None


def last_requests(setting: Setting, policy: str, seed: int, count: int, options: argparse.Namespace) -> list[str]:
    """The drain and the `count` requests that ended last, one line each."""
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
        lines.append(f"   {record.request.request_id} arrived {record.arrival_s:.2f} s, ended {record.finish_s:.2f} s: "
                     f"prompt {record.request.prompt_len}, output {record.num_generated}, on {record.node_id}, "
                     f"TTFT {record.first_token_s - record.arrival_s:.2f} s, TPOT {tpot_ms:.1f} ms")
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
            print("\n".join(last_requests(setting, policy.strip(), seed, own.count, options)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
