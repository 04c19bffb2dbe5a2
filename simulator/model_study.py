"""`baton sim-models`: model placement under a shift of demand between two models, in the simulator.

The Azure conversation trace, each task asking for model A or B: B's share of new tasks grows
linearly from --start-share to --end-share over the run (requests longer than B's context always
ask for A). Every node has both models on its disk; --split A,B starts the fleet's first A nodes
with model A warm, the next B with model B, and any left over with none (a placement may load one
there, as on a cold node live). Without --split three quarters of the fleet start with A and the
rest, at least one node, with B (6,2 on the default 8 nodes). `static` keeps the warm models where
they started; `planner` runs the scheduler leader's model planner, which loads a model where demand
outgrows its warm nodes and swaps idle nodes over (loads take the modelled cold-start time, during
which the GPU is billed and serves nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections import Counter
from pathlib import Path

from services.node_agent.engines.sim.models import get_model
from services.scheduler.model_planner import ModelPlanner
from services.scheduler.policies import make_policy
from simulator import flags
from simulator.metrics import Slo, met_by, summarize
from simulator.simulation import Simulation, fleet
from simulator.study import run_all, study_parser, write_results
from simulator.workload import Workload, load_azure

MODES = ("static", "planner")
TRACE = "AzureLLMInferenceTrace_conv.csv"


def default_split(num_nodes: int) -> tuple[int, int]:
    """Nodes starting with A warm and with B: a quarter with B, at least one where the fleet has two."""
    num_b = max(1, num_nodes // 4) if num_nodes > 1 else 0
    return num_nodes - num_b, num_b


def warm_models(num_nodes: int, split: tuple[int, int], model_a: str, model_b: str) -> list[str]:
    """The model each node starts with warm: the first split[0] A, the next split[1] B, the rest none ("")."""
    num_a, num_b = split
    return [model_a if i < num_a else model_b if i < num_a + num_b else "" for i in range(num_nodes)]


def shifted(workload: Workload, model_a: str, model_b: str, start_share: float, end_share: float,
            seed: int = 0) -> Workload:
    """workload with each task asking for model_a or model_b, B's share growing over time."""
    rng = random.Random(seed)
    end_s = max(r.arrival_s for r in workload.requests) or 1.0
    b_context = get_model(model_b).max_context_tokens
    models: dict[str, str] = {}
    for steps in workload.tasks.values():
        first = steps[0]
        share = start_share + (end_share - start_share) * first.arrival_s / end_s
        fits_b = all(r.prompt_len + r.output_len <= b_context for r in steps)
        models[first.task_id] = model_b if fits_b and rng.random() < share else model_a
    requests = [dataclasses.replace(r, model=models[r.task_id]) for r in workload.requests]
    return Workload(name=f"{workload.name}-shift", requests=requests)


def run_one(job: tuple[argparse.Namespace, str, float]) -> tuple[str, float, dict]:
    args, mode, load = job
    model_a, model_b = args.models
    workload = shifted(load_azure(Path(args.traces) / TRACE, speedup=load, limit=args.limit), model_a, model_b,
                       args.start_share, args.end_share)
    nodes = fleet(args.fleet)
    nodes = [dataclasses.replace(n, warm=warm, cold=(model_a, model_b))
             for n, warm in zip(nodes, warm_models(len(nodes), args.split, model_a, model_b), strict=True)]
    planner = ModelPlanner(idle_swap_s=args.swap_idle_s) if mode == "planner" else None
    slo = Slo(args.ttft_slo, args.tpot_slo)
    simulation = Simulation(nodes, make_policy(args.policy), model=model_a, planner=planner,
                            ttft_budget_ms=int(args.ttft_slo * 1000), tpot_budget_ms=int(args.tpot_slo * 1000),
                            timing_error=args.timing_error, seed=args.seed)
    result = simulation.run(workload)
    summary = summarize(result, workload, slo)
    actions = Counter(action.kind for _, action in simulation.model_actions)
    return mode, load, {**dataclasses.asdict(summary), "loads": actions["load"], "unloads": actions["unload"],
                        "by_model": met_by(result, slo, lambda record: record.request.model)}


def table(rows: list[tuple[str, float, dict]]) -> str:
    lines = ["| load | placement | SLO attainment | per model (met/requests) | goodput (req/s) | TTFT p50 / p99 (s) "
             "| GPU-hours busy | cost per successful task, whole fleet / busy ($) | loads / unloads |",
             "|---:|---|---:|---|---:|---|---:|---:|---|"]
    for mode, load, s in rows:
        models = ", ".join(f"{m}: {met}/{total}" for m, (met, total) in s["by_model"].items())
        lines.append(f"| {load:g}x | {mode} | {s['slo_attainment']:.1%} | {models} | {s['goodput_rps']:.2f} "
                     f"| {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} | {s['gpu_hours']:.2f} "
                     f"| {s['cost_per_successful_task']:.5f} / {s['busy_cost_per_successful_task']:.5f} "
                     f"| {s['loads']} / {s['unloads']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser("baton sim-models", __doc__, fleet="8xa100", policy="baton", loads="2,4,6", limit=8000,
                          out="results/models")
    parser.add_argument("--models", type=flags.model_pair, default=("sim-llama-3.1-8b", "sim-llama-2-7b"),
                        help="A,B: two simulated models")
    parser.add_argument("--split", type=flags.split, default=None,
                        help="A,B: nodes starting with A warm, then with B warm, at most the fleet's size (the rest "
                        "start with none); default: three quarters A, the rest (at least one) B")
    parser.add_argument("--start-share", type=flags.share, default=0.1, help="B's share of new tasks at the start")
    parser.add_argument("--end-share", type=flags.share, default=0.9, help="B's share of new tasks at the end")
    parser.add_argument("--swap-idle-s", type=flags.non_negative_seconds, default=10.0,
                        help="a node idle this long may have its model swapped, as the scheduler's --model-swap-idle-s")
    args = parser.parse_args(argv)
    num_nodes = len(fleet(args.fleet))
    if args.split is None:
        args.split = default_split(num_nodes)
    elif sum(args.split) > num_nodes:
        parser.error(f"argument --split: {args.split[0]},{args.split[1]} makes {sum(args.split)} nodes; "
                     f"the fleet {args.fleet} has {num_nodes}")
    flags.check_trace(parser.error, args.traces, TRACE)
    flags.check_out(parser.error, args.out)
    rows = run_all(run_one, [(args, mode, load) for load in args.loads for mode in MODES], args.jobs)
    write_results(args.out, table(rows), {"args": vars(args), "runs": [
        {"mode": m, "load": x, **s} for m, x, s in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
