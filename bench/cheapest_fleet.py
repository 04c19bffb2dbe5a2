"""The cheapest fleet each policy needs to hold an SLO target at a given load.

For each policy and each fleet family (k H100s, k A100s, k L4s, k × (one H100 + two L4s)) it
searches the smallest k whose run meets the target SLO attainment (a binary search: attainment
grows with k), then reports per policy the cheapest of those fleets by price per hour, with its
cost per successful task both ways: the whole fleet for the whole run (the headline) and busy GPU
time (the floor). Over several seeds of the timing error (`--seeds`), a fleet holds the target when
its attainment averaged over them does, and the costs are their means. A policy that needs a
smaller fleet for the same load and SLO is the one an operator saves with; this is the comparison
the whole-fleet KPI implies.

    python -m bench.cheapest_fleet --out results/cheapest      # the table in docs/evaluation.md
    python -m bench.cheapest_fleet --skip 3600 --seeds 400,401,402 --out results/cheapest-3600
        # the same search on a later window of the trace (requests 3,600-4,200)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.sim_matrix import BASELINES
from services.node_agent.engines.sim.models import GPU_SPECS
from simulator import flags
from simulator.report import TRACES, check_trace, parse_args, run_one
from simulator.study import results_json, worker_pool


@dataclass(frozen=True)
class Family:
    name: str
    fleet: Callable[[int], str]
    max_k: int


FAMILIES = (
    Family("H100", lambda k: f"{k}xh100", 8),
    Family("A100", lambda k: f"{k}xa100", 8),
    Family("L4", lambda k: f"{k}xl4", 16),
    Family("H100 + 2 L4", lambda k: f"{k}xh100,{2 * k}xl4", 6),
)


def price_per_hour(fleet: str) -> float:
    return sum(int(count) * GPU_SPECS[gpu].price_per_hour
               for count, gpu in (part.split("x") for part in fleet.split(",")))


def _run(job: tuple[argparse.Namespace, str, int]) -> dict:
    args, policy, seed = job
    (load,) = args.loads
    return run_one((args, policy, load, seed))[3]


def _mean(summaries: list[dict], key: str) -> float:
    return sum(s[key] for s in summaries) / len(summaries)


def _target(text: str) -> float:
    value = flags.share(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above 0 (every fleet holds 0 %)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.cheapest_fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=[*TRACES, "agentic"], default="mooncake-conversation")
    parser.add_argument("--load", type=flags.load, default=1.0)
    parser.add_argument("--limit", type=flags.positive_int, default=600)
    parser.add_argument("--skip", type=flags.non_negative_int, default=0,
                        help="requests of the trace skipped before the ones replayed (a later window of it; traces "
                        "only, not the agentic workload)")
    parser.add_argument("--target", type=_target, default=0.99, help="SLO attainment to hold, above 0 and at most 1")
    parser.add_argument("--ttft-slo", type=flags.slo_seconds, default=5.0)
    parser.add_argument("--tpot-slo", type=flags.slo_seconds, default=0.1)
    parser.add_argument("--timing-error", type=flags.timing_error, default=0.3, help="in [0, 1)")
    parser.add_argument("--seeds", type=flags.seeds, default=(0,),
                        help="seeds of the timing error, comma-separated or ranges (400-402)")
    parser.add_argument("--policies", type=flags.policies, default=("baton", *BASELINES, "sglang"))
    parser.add_argument("--traces", default="")
    parser.add_argument("--jobs", type=flags.positive_int, default=2)
    parser.add_argument("--out", default="results/cheapest")
    return parser


def args_for(options: argparse.Namespace, fleet: str) -> argparse.Namespace:
    """The simulator's options for one run of the search on fleet."""
    argv = ["--workload", options.workload, "--fleet", fleet, "--loads", f"{options.load:g}",
            "--limit", str(options.limit), "--skip", str(options.skip), "--ttft-slo", str(options.ttft_slo),
            "--tpot-slo", str(options.tpot_slo), "--timing-error", str(options.timing_error)]
    return parse_args(argv + (["--traces", options.traces] if options.traces else []))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.workload == "agentic" and options.skip:
        parser.error(f"argument --skip: {options.skip}: the agentic workload is generated, not read from a trace; "
                     "it has no requests to skip")
    check_trace(parser.error, args_for(options, FAMILIES[0].fleet(1)))
    flags.check_out(parser.error, options.out)
    policies, seeds = options.policies, options.seeds

    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}  # (policy, fleet): one summary per seed
    # One binary search per (policy, family), advanced in lock step so each round's runs go in parallel.
    bounds = {(p, f.name): [1, f.max_k + 1] for p in policies for f in FAMILIES}  # [lo, hi): hi passes
    families = {f.name: f for f in FAMILIES}
    with worker_pool(options.jobs) as pool:
        while open_ := [key for key, (lo, hi) in bounds.items() if lo < hi]:
            probes = {key: (bounds[key][0] + bounds[key][1]) // 2 for key in open_}
            jobs = [(key, families[key[1]].fleet(k)) for key, k in probes.items()]
            todo = sorted({(key[0], fleet) for key, fleet in jobs if (key[0], fleet) not in runs})
            summaries = list(pool.map(_run, [(args_for(options, f), p, seed) for p, f in todo for seed in seeds]))
            for i, (policy, fleet) in enumerate(todo):
                runs[(policy, fleet)] = summaries[i * len(seeds):(i + 1) * len(seeds)]
            for key, fleet in jobs:
                k = probes[key]
                if _mean(runs[(key[0], fleet)], "slo_attainment") >= options.target:
                    bounds[key][1] = k
                else:
                    bounds[key][0] = k + 1
    wall_s = time.perf_counter() - started

    replayed = (f"requests {options.skip:,}-{options.skip + options.limit:,}" if options.skip
                else f"first {options.limit} requests")
    lines = [f"Cheapest fleet holding {options.target:.0%} SLO attainment (TTFT {options.ttft_slo:g} s, TPOT "
             f"{options.tpot_slo * 1000:.0f} ms): {options.workload}, {replayed} at "
             f"{options.load:g}x, ±{options.timing_error:.0%} timing error (seeds {flags.seeds_text(seeds)}; "
             f"attainment and costs their means); {len(runs) * len(seeds)} runs in {wall_s / 60:.0f} min.", "",
             "| policy | " + " | ".join(f.name for f in FAMILIES)
             + " | cheapest | $/h | SLO attainment | whole-fleet $ per success | busy-time $ per success |",
             "|---|" + "---|" * len(FAMILIES) + "---|---:|---:|---:|---:|"]
    best: dict[str, tuple[float, str]] = {}
    for policy in policies:
        cells = []
        for family in FAMILIES:
            k = bounds[(policy, family.name)][0]
            if k > family.max_k:
                cells.append("none")
                continue
            fleet = family.fleet(k)
            cells.append(fleet)
            if policy not in best or price_per_hour(fleet) < best[policy][0]:
                best[policy] = (price_per_hour(fleet), fleet)
        price, fleet = best.get(policy, (0.0, "none"))
        if fleet == "none":
            lines.append(f"| {policy} | " + " | ".join(cells) + " | none | | | | |")
            continue
        held = runs[(policy, fleet)]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {fleet} | {price:.2f} | "
                     f"{_mean(held, 'slo_attainment'):.1%} | {_mean(held, 'cost_per_successful_task'):.5f} | "
                     f"{_mean(held, 'busy_cost_per_successful_task'):.5f} |")
    text = "\n".join(lines) + "\n"
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(results_json({f"{p}@{f}": dict(zip(map(str, seeds), s, strict=True))
                                                    for (p, f), s in runs.items()}))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
