"""`baton sim-admission`: goodput and SLO attainment per priority band against offered load, for
Baton's admission, plain FIFO (no admission) and GIE-style flow control, in the simulator."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.scheduler.policies import make_policy
from simulator import flags
from simulator.metrics import Slo, met_by, summarize
from simulator.simulation import ADMISSIONS, Simulation, fleet
from simulator.study import run_all, study_parser, write_results
from simulator.workload import assign_classes, load_mooncake

TRACE = "conversation_trace.jsonl"
NAMES = {"none": "FIFO (no admission)", "gie": "GIE flow control", "baton": "Baton admission"}


def run_one(job: tuple[argparse.Namespace, str, float]) -> tuple[str, float, dict]:
    args, admission, load = job
    workload = assign_classes(load_mooncake(Path(args.traces) / TRACE, speedup=load, limit=args.limit))
    slo = Slo(args.ttft_slo, args.tpot_slo)
    result = Simulation(fleet(args.fleet), make_policy(args.policy), model=args.model, admission=admission,
                        ttft_budget_ms=int(args.ttft_slo * 1000), tpot_budget_ms=int(args.tpot_slo * 1000),
                        timing_error=args.timing_error, seed=args.seed).run(workload)
    bands = met_by(result, slo, lambda record: record.request.priority)
    met = sum(m for m, _ in bands.values())
    refused = sum(1 for r in result.records if r.failed.startswith(("refused", "shed")))
    summary = summarize(result, workload, slo)
    # (A run in which nothing ran has no makespan: a 0 ms TTFT budget refused everything, helper-161.)
    goodput = met / result.makespan_s if result.makespan_s > 0 else 0.0
    return admission, load, {"goodput_rps": goodput, "met": met, "total": len(result.records),
                             "refused": refused, "bands": bands,
                             "cost_per_successful_task": summary.cost_per_successful_task,
                             "busy_cost_per_successful_task": summary.busy_cost_per_successful_task}


def _share(bands: dict[str, tuple[int, int]], band: str) -> str:
    met, total = bands.get(band, (0, 0))
    return f"{met / total:.0%}" if total else "-"


def main(argv: list[str] | None = None) -> int:
    parser = study_parser("baton sim-admission", __doc__, fleet="4xh100", policy="dynamo", loads="0.5,1,2,3",
                          limit=3000, out="results/admission")
    parser.add_argument("--model", type=flags.sim_model, default="sim-llama-3.1-8b")
    args = parser.parse_args(argv)
    flags.check_trace(parser.error, args.traces, TRACE)
    flags.check_out(parser.error, args.out)
    loads = args.loads
    rows = run_all(run_one, [(args, admission, load) for load in loads for admission in ADMISSIONS], args.jobs)
    lines = ["| load | admission | goodput (req/s) | SLO met, band 1 | band 0 | band -1 | refused or shed "
             "| cost per successful task, whole fleet / busy ($) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for admission, load, r in rows:
        shares = [_share(r["bands"], band) for band in ("1", "0", "-1")]
        lines.append(f"| {load:g}x | {NAMES[admission]} | {r['goodput_rps']:.3f} | {' | '.join(shares)} "
                     f"| {r['refused']} | {r['cost_per_successful_task']:.5f} / "
                     f"{r['busy_cost_per_successful_task']:.5f} |")
    write_results(args.out, "\n".join(lines), {"args": vars(args), "runs": [
        {"admission": a, "load": load, **r} for a, load, r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
