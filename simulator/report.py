"""`baton sim`: replay a workload on a fleet under every policy and load level; write a table and plots."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from baton.flag_types import DefaultsShown
from services.scheduler.policies import POLICIES, make_policy
from simulator import flags
from simulator.metrics import Slo, summarize, ttft_values
from simulator.simulation import ADMISSIONS, RunResult, Simulation, fleet
from simulator.study import results_json, run_all
from simulator.workload import (
    SloClass,
    Workload,
    agentic_workflows,
    load_azure,
    load_mooncake,
    parse_slo_mix,
    with_slo_mix,
)

TRACES = {
    "mooncake-conversation": "conversation_trace.jsonl",
    "mooncake-synthetic": "synthetic_trace.jsonl",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}
# The agentic workload's tasks when --limit sets none.
AGENT_TASKS = 200


def build_workload(args: argparse.Namespace, load: float) -> Workload:
    """The workload at a load level: trace arrivals sped up by `load` (a closed-loop agent rate scaled)."""
    if args.workload == "agentic":
        num_tasks = AGENT_TASKS if args.limit is None else args.limit
        workload = agentic_workflows(num_tasks=num_tasks, steps=5, system_len=2048, step_len=512,
                                     output_len=256, think_s=2.0, rate_per_s=load)
    else:
        path = Path(args.traces) / TRACES[args.workload]
        loader = load_mooncake if args.workload.startswith("mooncake") else load_azure
        workload = loader(path, speedup=load, prompt_scale=args.prompt_scale, limit=args.limit, skip=args.skip)
    return with_slo_mix(workload, args.slo_mix) if args.slo_mix else workload


def simulate(args: argparse.Namespace, policy: str, workload: Workload, seed: int,
             simulation: Callable[..., Simulation] = Simulation) -> RunResult:
    """One run of workload under policy, as these options set it up (by `simulation`: a subclass that
    explores a mechanism the services lack, `bench.tail_moves`)."""
    return simulation(fleet(args.fleet), make_policy(policy), model=args.model, failures=tuple(args.kill),
                      ttft_budget_ms=int(args.ttft_slo * 1000), tpot_budget_ms=int(args.tpot_slo * 1000),
                      max_tokens=args.max_tokens, timing_error=args.timing_error, seed=seed,
                      admission=args.admission).run(workload)


def run_one(job: tuple[argparse.Namespace, str, float, int]) -> tuple[str, float, int, dict, list[float], float]:
    """One (policy, load, seed) run in its own process: its summary, its TTFTs, and its wall time."""
    args, policy, load, seed = job
    workload = build_workload(args, load)
    started = time.perf_counter()
    result = simulate(args, policy, workload, seed)
    wall_s = time.perf_counter() - started
    summary = summarize(result, workload, Slo(args.ttft_slo, args.tpot_slo))
    return policy, load, seed, asdict(summary), ttft_values(result), wall_s


def mean_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95 % confidence interval (Student's t; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, _T95.get(n - 1, 1.96) * sd / n ** 0.5


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20,
        12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09, 21: 2.08,
        22: 2.07, 23: 2.07, 24: 2.06, 25: 2.06, 26: 2.06, 27: 2.05, 28: 2.05, 29: 2.05}


def merge_seeds(summaries: list[dict]) -> dict:
    """One row from several seeds: each figure's mean, and `<key>_ci` for the headline figures."""
    merged = {k: mean_ci([s[k] for s in summaries])[0] for k in summaries[0]}
    for key in ("slo_attainment", "cost_per_successful_task", "busy_cost_per_successful_task"):
        merged[f"{key}_ci"] = mean_ci([s[key] for s in summaries])[1]
    merged["num_seeds"] = len(summaries)
    return merged


# Written in the table for a figure the run does not have: a percentile of no values, the cost per success of a
# run without one (a bare nan or inf explained nothing).
NO_VALUE = "n/a"
NO_SUCCESS = "no success"


def _pm(value: float, ci: float, fmt: str, missing: str = NO_VALUE) -> str:
    if not math.isfinite(value):
        return missing
    return f"{value:{fmt}}" if not ci else f"{value:{fmt}} ± {ci:{fmt}}"


def _ms(value: float) -> str:
    return _pm(value * 1000, 0.0, ".0f")


def _cost(summary: dict, key: str) -> str:
    return _pm(summary[key], summary.get(f"{key}_ci", 0.0), ".5f", NO_SUCCESS)


def table(rows: list[tuple[str, float, dict]]) -> str:
    header = ("| load | policy | TTFT p50 / p90 / p99 (s) | TPOT p50 / p99 (ms) | SLO attainment | goodput (req/s) "
              "| KV hit rate | GPU-hours busy / fleet | tasks ok | cost per successful task, whole fleet ($) "
              "| busy-time floor ($) | drain (s) |")
    lines = [header, "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for policy, load, s in rows:
        lines.append(
            f"| {load:g}x | {policy} | {' / '.join(_pm(s[f'ttft_{q}'], 0.0, '.2f') for q in ('p50', 'p90', 'p99'))} "
            f"| {_ms(s['tpot_p50'])} / {_ms(s['tpot_p99'])} "
            f"| {_pm(s['slo_attainment'] * 100, s.get('slo_attainment_ci', 0.0) * 100, '.1f')}% "
            f"| {s['goodput_rps']:.2f} | {s['kv_hit_rate']:.1%} | {s['gpu_hours']:.2f} / {s['fleet_gpu_hours']:.2f} "
            f"| {s['num_tasks_ok']:.0f}/{s['num_tasks']:.0f} "
            f"| {_cost(s, 'cost_per_successful_task')} | {_cost(s, 'busy_cost_per_successful_task')} "
            f"| {s['drain_s']:.2f} |")
    figures = [value for _, _, s in rows for value in s.values() if isinstance(value, float)]
    if not all(map(math.isfinite, figures)):
        lines.append(f"\n{NO_VALUE}: in a run (one seed's at least) no request had a first token (for TTFT) or a "
                     f"second (for TPOT). {NO_SUCCESS}: in a run (one seed's at least) no task met its SLO, so "
                     "there is no cost per successful task. results.json has null for each.")
    return "\n".join(lines)


def plot(out: Path, rows: list[tuple[str, float, dict]], ttfts: dict[tuple[str, float], list[float]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    policies = sorted({p for p, _, _ in rows})
    loads = sorted({load for _, load, _ in rows})
    for load in loads:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in policies:
            values = ttfts.get((policy, load), [])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF at {load:g}x load")
        if ax.lines:  # (no request had a first token: an empty plot, without matplotlib's warning)
            ax.legend()
        path = out / f"ttft_cdf_{load:g}x.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    for key, label, name in (("slo_attainment", "SLO attainment", "slo_vs_load.png"),
                             ("cost_per_successful_task", "cost per successful task ($)", "cost_vs_load.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in policies:
            points = sorted((load, s[key]) for p, load, s in rows if p == policy)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
        ax.set_xlabel("load (trace speed-up)")
        ax.set_ylabel(label)
        ax.legend()
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _slo_mix(text: str) -> tuple[SloClass, ...]:
    try:
        return parse_slo_mix(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton sim", description=__doc__, formatter_class=DefaultsShown)
    parser.add_argument("--workload", choices=[*TRACES, "agentic"], default="mooncake-conversation")
    parser.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"),
                        help="folder of the traces (../shared/traces)")
    parser.add_argument("--fleet", type=flags.fleet, default="4xh100,4xa100,4xl4",
                        help="e.g. 16xh100 or 4xh100,4xa100,4xl4")
    parser.add_argument("--model", type=flags.sim_model, default="sim-llama-3.1-8b")
    parser.add_argument("--policies", type=flags.policies, default=tuple(POLICIES),
                        help="comma-separated; default: all")
    parser.add_argument("--loads", type=flags.loads, default=(1.0,),
                        help="comma-separated trace speed-ups, e.g. 0.5,1,2")
    parser.add_argument("--prompt-scale", type=flags.prompt_scale, default=1.0,
                        help="multiply every prompt length (at most 100; a trace's prompt grows in blocks of its own; "
                        "traces only)")
    parser.add_argument("--limit", type=flags.positive_int, default=None,
                        help=f"first N requests (or N agent tasks; default: the whole trace, or {AGENT_TASKS} tasks)")
    parser.add_argument("--skip", type=flags.non_negative_int, default=0,
                        help="start after the trace's first N requests (a window to tune on, disjoint from the "
                        "first); traces only: the agentic workload is generated, and refuses it")
    parser.add_argument("--ttft-slo", type=flags.slo_seconds, default=5.0, help="seconds")
    parser.add_argument("--tpot-slo", type=flags.slo_seconds, default=0.1, help="seconds per output token")
    parser.add_argument("--slo-mix", type=_slo_mix, default=(),
                        help="SHARE:TTFT_S:TPOT_S,...: each task drawn into a class that sets its own budgets "
                        "(its tenant class0, class1, ...), e.g. 0.3:1:0.03,0.7:30:0.2; the shares add up to 1")
    parser.add_argument("--max-tokens", type=flags.positive_int, default=2048,
                        help="what every client asks for; the scheduler never sees a request's true output length")
    parser.add_argument("--timing-error", type=flags.timing_error, default=0.3,
                        help="each GPU generation runs its timing model scaled by a factor drawn from [1-e, 1+e]; "
                        "e in [0, 1)")
    parser.add_argument("--seeds", type=flags.seeds, default=(0,), help="comma-separated seeds of the timing-error "
                        "draw, or ranges (10-19); several give each figure a 95%% confidence interval")
    parser.add_argument("--admission", choices=ADMISSIONS, default="none",
                        help="the leader's admission: none (every request placed at once, nodes queue FIFO), "
                        "baton (the scheduler's own gate, as a live cluster runs every policy) or gie")
    parser.add_argument("--kill", type=flags.kill, action="append", default=[],
                        help="AT_S:NODE_ID, e.g. 600:h100-0 (repeatable); a fleet's nodes are its GPU and their "
                        "place in it: 2xh100,2xl4 has h100-0, h100-1, l4-2, l4-3")
    parser.add_argument("--jobs", type=flags.positive_int, default=os.cpu_count() or 1, help="runs in parallel")
    parser.add_argument("--out", default="results/sim", help="folder for table.md, results.json and plots")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, the flags each checked and those that go together checked together (not the trace)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workload == "agentic" and args.skip:
        parser.error(f"argument --skip: {args.skip}: the agentic workload is generated, not read from a trace; "
                     "it has no requests to skip")
    if args.workload == "agentic" and args.prompt_scale != 1.0:  # (it was ignored there)
        parser.error(f"argument --prompt-scale: {args.prompt_scale:g}: the agentic workload is generated with "
                     "prompts of its own sizes; it has no trace prompts to scale")
    flags.check_kills(parser.error, args.kill, args.fleet)
    return args


def check_trace(refuse: flags.Refuse, args: argparse.Namespace) -> None:
    """The workload's trace is there, reads as one, and holds requests past --skip (agent tasks need none)."""
    if args.workload != "agentic":
        flags.check_trace(refuse, args.traces, TRACES[args.workload], args.skip)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_trace(build_parser().error, args)
    flags.check_out(build_parser().error, args.out)
    policies, loads, seeds = args.policies, args.loads, args.seeds
    jobs = [(args, policy, load, seed) for load in loads for policy in policies for seed in seeds]
    outcomes = run_all(run_one, jobs, args.jobs)
    rows = [(policy, load, merge_seeds([s for p, lo, _, s, _, _ in outcomes if (p, lo) == (policy, load)]))
            for load in loads for policy in policies]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows)
    walls = ", ".join(f"{p}@{load:g}x/{seed} {wall:.0f}s" for p, load, seed, _, _, wall in outcomes)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(results_json(
        {"args": vars(args), "runs": [
            {"policy": p, "load": load, "seed": seed, "summary": s, "wall_s": w}
            for p, load, seed, s, _, w in outcomes]}))
    plots = plot(out, rows, {(p, load): t for p, load, seed, _, t, _ in outcomes if seed == seeds[0]})
    print(text)
    print(f"wall time per run: {walls}")
    print(f"wrote {out / 'table.md'}, {out / 'results.json'} and {len(plots)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
