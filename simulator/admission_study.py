"""`baton sim-admission`: goodput and SLO attainment per priority band against offered load, for
Baton's admission, plain FIFO (no admission) and GIE-style flow control, in the simulator."""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from services.scheduler.policies import make_policy
from simulator.cluster import ADMISSIONS, RunResult, Simulation, fleet
from simulator.metrics import Slo
from simulator.workload import assign_classes, load_mooncake

NAMES = {"none": "FIFO (no admission)", "gie": "GIE flow control", "baton": "Baton admission"}


def per_band(result: RunResult, slo: Slo) -> dict[int, tuple[int, int]]:
    """(requests meeting the SLO, requests) by priority band."""
    bands: dict[int, list[int]] = {}
    for record in result.records:
        met, total = bands.setdefault(record.request.priority, [0, 0])
        bands[record.request.priority] = [met + int(slo.is_met(record)), total + 1]
    return {band: (met, total) for band, (met, total) in bands.items()}


def run_one(job: tuple[argparse.Namespace, str, float]) -> tuple[str, float, dict]:
    args, admission, load = job
    workload = assign_classes(load_mooncake(Path(args.traces) / "conversation_trace.jsonl", speedup=load,
                                            limit=args.limit))
    slo = Slo(args.ttft_slo, args.tpot_slo)
    result = Simulation(fleet(args.fleet), make_policy(args.policy), model=args.model, admission=admission,
                        ttft_budget_ms=int(args.ttft_slo * 1000)).run(workload)
    bands = per_band(result, slo)
    met = sum(m for m, _ in bands.values())
    refused = sum(1 for r in result.records if r.failed)
    return admission, load, {"goodput_rps": met / result.makespan_s, "met": met, "total": len(result.records),
                             "refused": refused, "bands": {str(b): v for b, v in sorted(bands.items())}}


def _share(bands: dict[str, tuple[int, int]], band: str) -> str:
    met, total = bands.get(band, (0, 0))
    return f"{met / total:.0%}" if total else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton sim-admission", description=__doc__)
    parser.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"))
    parser.add_argument("--fleet", default="4xh100")
    parser.add_argument("--model", default="sim-llama-3.1-8b")
    parser.add_argument("--policy", default="dynamo")
    parser.add_argument("--loads", default="0.5,1,2,3", help="trace speed-ups")
    parser.add_argument("--limit", type=int, default=3000)
    parser.add_argument("--ttft-slo", type=float, default=5.0)
    parser.add_argument("--tpot-slo", type=float, default=0.1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="results/admission")
    args = parser.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    jobs = [(args, admission, load) for load in loads for admission in ADMISSIONS]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(run_one, jobs))
    lines = ["| load | admission | goodput (req/s) | SLO met, band 1 | band 0 | band -1 | refused at once |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for admission, load, r in rows:
        shares = [_share(r["bands"], band) for band in ("1", "0", "-1")]
        lines.append(f"| {load:g}x | {NAMES[admission]} | {r['goodput_rps']:.3f} | {' | '.join(shares)} "
                     f"| {r['refused']} |")
    table = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": [
        {"admission": a, "load": load, **r} for a, load, r in rows]}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
