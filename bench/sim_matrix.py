"""The held-out evaluation: Baton's policy against the baselines on settings it was not tuned on.

Each setting (workload × fleet × load × SLO) is replayed under every policy, over several seeds of
the timing-model error (each GPU generation runs ±e off the model the scheduler reads), with
max_tokens the scheduler sees instead of true output lengths. For each setting it reports, per
policy, SLO attainment and cost per successful task two ways — the whole fleet until the last
request ends (the headline) and busy GPU time (the floor) — with 95 % intervals over the seeds, and a
verdict line: Baton against the best baseline on each.

    python -m bench.sim_matrix --out results/matrix            # the matrix in docs/evaluation.md
    python -m bench.sim_matrix --tuning --seeds 10,11,12,13,14,15,16,17,18,19 --out results/tuning
                                                               # the windows Baton's parameters are chosen on
    python -m bench.sim_matrix --windows 8 --seeds 0,1,2 --only "8xH100, 1x" --out results/windows
                                                               # a setting over other windows of its trace

A seed draws the timing error only: every seed of a setting replays the same requests, so where one
long answer decides how long the fleet runs, it decides it in every seed. `--windows N` replays each
chosen setting over N further windows of its trace instead (none sharing a request with the matrix's
or the tuning windows), and pools them: Baton's change against each baseline, seed-averaged within a
window, with its interval over the windows, on the whole fleet and on the busy-time floor.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from simulator import flags
from simulator.report import TRACES, check_trace, mean_ci, merge_seeds, parse_args, run_one
from simulator.simulation import ADMISSIONS
from simulator.study import results_json, run_all
from simulator.workload import trace_length

# SGLang's cache-aware policy and plain least-loaded trail these on every setting tried
# (`baton sim` runs them all); the matrix keeps the strongest baselines to stay within a CI-sized budget.
BASELINES = ("weighted_least_loaded", "llm_d", "llm_d_precise", "dynamo")


@dataclass(frozen=True)
class Setting:
    name: str
    workload: str
    fleet: str
    load: float
    ttft_s: float = 5.0
    tpot_s: float = 0.1
    # Agent tasks for the agentic workload (five requests each); None: --limit requests.
    limit: int | None = None
    # Tasks that set their own budgets (`baton sim --slo-mix`); ttft_s/tpot_s are then only the default.
    slo_mix: str = ""
    # Requests of the trace skipped before the window replayed (the tuning windows; the matrix: 0).
    skip: int = 0


MIXED = "4xh100,4xa100,4xl4"
SETTINGS = (
    Setting("Mooncake conversation, mixed, 1x", "mooncake-conversation", MIXED, 1.0),
    Setting("Mooncake synthetic, mixed, 1x", "mooncake-synthetic", MIXED, 1.0),
    Setting("Azure conversation, mixed, 1x", "azure-conv", MIXED, 1.0),
    Setting("Azure conversation, mixed, 3x", "azure-conv", MIXED, 3.0),
    Setting("Azure code, mixed, 2x", "azure-code", MIXED, 2.0),
    Setting("Agentic (5 steps), mixed, 2 tasks/s", "agentic", MIXED, 2.0, limit=200),
    Setting("Mooncake conversation, 8xH100, 1x", "mooncake-conversation", "8xh100", 1.0),
    Setting("Mooncake conversation, 8xH100, 2x", "mooncake-conversation", "8xh100", 2.0),
    Setting("Mooncake conversation, 8xH100, 1x, TPOT 30 ms", "mooncake-conversation", "8xh100", 1.0, tpot_s=0.03),
    Setting("Mooncake conversation, 2xH100+8xL4, 1x", "mooncake-conversation", "2xh100,8xl4", 1.0),
    Setting("SLO mix: Mooncake conversation, mixed, 1x, 30 % of tasks TTFT 1 s / TPOT 30 ms, 70 % TTFT 30 s / "
            "TPOT 200 ms", "mooncake-conversation", MIXED, 1.0, slo_mix="0.3:1:0.03,0.7:30:0.2"),
) + tuple(
    Setting(f"SLO sweep: Mooncake conversation, mixed, 1x, TTFT {t:g} s, TPOT {p * 1000:.0f} ms",
            "mooncake-conversation", MIXED, 1.0, ttft_s=t, tpot_s=p)
    for t in (1.0, 5.0) for p in (0.03, 0.05, 0.1) if (t, p) != (5.0, 0.1)
)


# The matrix replays each trace's first REQUESTS requests and a tuning window as many from its skip (the
# default --limit); windows of another size still keep clear of those.
REQUESTS = 600


def window_of(setting: Setting, skip: int, size: int) -> Setting:
    """The setting replayed over `size` requests of its trace from request `skip`, named for them."""
    return replace(setting, name=f"{setting.name}, requests {skip:,}-{skip + size:,}", skip=skip)


# Where Baton's parameters are chosen: windows of the same traces with no request in common with the
# matrix's (its first 600), on the matrix's fleets and loads (docs/evaluation.md, "What was tuned on what").
_SLO_MIX = "0.3:1:0.03,0.7:30:0.2"
_TUNED = (
    Setting("Mooncake conversation, 8xH100, 1x", "mooncake-conversation", "8xh100", 1.0),
    Setting("Mooncake conversation, 8xH100, 2x", "mooncake-conversation", "8xh100", 2.0),
    Setting("Mooncake conversation, 8xH100, 1x, TPOT 30 ms", "mooncake-conversation", "8xh100", 1.0, tpot_s=0.03),
    Setting("Mooncake conversation, mixed, 1x", "mooncake-conversation", MIXED, 1.0),
    Setting("Mooncake conversation, mixed, 3x", "mooncake-conversation", MIXED, 3.0),
    Setting("Mooncake conversation, 2xH100+8xL4, 1x", "mooncake-conversation", "2xh100,8xl4", 1.0),
    Setting("SLO mix: Mooncake conversation, mixed, 1x", "mooncake-conversation", MIXED, 1.0, slo_mix=_SLO_MIX),
    Setting("Azure conversation, mixed, 1x", "azure-conv", MIXED, 1.0),
    Setting("Azure conversation, mixed, 3x", "azure-conv", MIXED, 3.0),
    Setting("Azure code, mixed, 2x", "azure-code", MIXED, 2.0),
)


def tuning_windows(size: int = REQUESTS) -> tuple[Setting, ...]:
    """The tuning windows of `size` requests each (--limit), named for the requests they replay."""
    return tuple(window_of(setting, skip, size) for skip in (3000, 6000) for setting in _TUNED) + tuple(
        # the synthetic trace has 3,993 requests
        window_of(Setting("Mooncake synthetic, mixed, 1x", "mooncake-synthetic", MIXED, 1.0), skip, size)
        for skip in (1500, 3000)
    )


TUNING = tuning_windows()


def _args(setting: Setting, options: argparse.Namespace) -> argparse.Namespace:
    argv = ["--workload", setting.workload, "--fleet", setting.fleet, "--loads", f"{setting.load:g}",
            "--ttft-slo", str(setting.ttft_s), "--tpot-slo", str(setting.tpot_s),
            "--timing-error", str(options.timing_error), "--max-tokens", str(options.max_tokens),
            "--admission", options.admission]
    if setting.slo_mix:
        argv += ["--slo-mix", setting.slo_mix]
    if setting.skip:
        argv += ["--skip", str(setting.skip)]
    limit = setting.limit or options.limit
    if limit:
        argv += ["--limit", str(limit)]
    if options.traces:
        argv += ["--traces", options.traces]
    return parse_args(argv)


def setup_of(setting: Setting, options: argparse.Namespace) -> dict:
    """What a setting's runs replay and how, all but the policy and the seeds: the options that change a run, and
    the setting's own fields (bench.adoption_rule compares two sides' setups)."""
    setup = {key: getattr(options, key) for key in ("limit", "timing_error", "max_tokens", "admission", "tuning")}
    setup.update({key: value for key, value in asdict(setting).items() if key not in ("name", "limit")})
    setup["agent_tasks"] = setting.limit
    if setting.limit is not None:  # the agentic setting replays its own tasks, whatever --limit says
        del setup["limit"]
    return setup


def _num_requests(setting: Setting, options: argparse.Namespace) -> int:
    """The number of requests in setting's trace."""
    return trace_length(Path(_args(setting, options).traces) / TRACES[setting.workload])


def held_out_windows(setting: Setting, options: argparse.Namespace, count: int) -> list[Setting]:
    """The first `count` windows of options.limit requests of setting's trace that share no request with
    the matrix's (the first) or with a tuning window of that trace; fewer where the trace ends."""
    size = options.limit
    seen = max(size, REQUESTS)
    used = [(0, seen)] + [(t.skip, t.skip + seen) for t in TUNING if t.workload == setting.workload]
    num_requests = _num_requests(setting, options)
    windows: list[Setting] = []
    skip = seen
    while len(windows) < count:
        if not any(skip < end and start < skip + size for start, end in used):
            if skip + size > num_requests:
                break  # the trace ends inside it
            windows.append(window_of(setting, skip, size))
        skip += size
    return windows


CHEAPEST = "the cheapest in each window"


def _has_figure(run: dict, key: str) -> bool:
    """Whether a run has the figure: a run with no success has no cost per success (inf; null in results.json)."""
    return run[key] is not None and math.isfinite(run[key]) and run[key] > 0


def pooled_change(per_window: list[dict[str, list[dict]]], mine: str, theirs: str,
                  key: str = "cost_per_successful_task") -> tuple[list[float], list[float]]:
    """Per window, the change of `mine` against `theirs` (or against the cheapest of the other policies in that
    window by `key`, theirs=CHEAPEST), each seed paired with the same seed and averaged over them: the cost per
    successful task `key` (whole fleet unless told) in %, and SLO attainment in points. Windows where a run had no
    success are left out."""
    costs, slos = [], []
    for runs in per_window:
        other = theirs if theirs != CHEAPEST else min((p for p in runs if p != mine),
                                                      key=lambda p: sum(r[key] for r in runs[p]))
        pairs = list(zip(runs[mine], runs[other], strict=True))
        if not all(_has_figure(m, key) and _has_figure(t, key) for m, t in pairs):
            continue
        costs.append(sum((m[key] / t[key] - 1) * 100 for m, t in pairs) / len(pairs))
        slos.append(sum((m["slo_attainment"] - t["slo_attainment"]) * 100 for m, t in pairs) / len(pairs))
    return costs, slos


def pooled_verdict(per_window: list[dict[str, list[dict]]]) -> list[str]:
    """Two tables over the windows. Baton against each baseline and against the cheapest in each window:
    the mean of the per-window changes (pooled_change) with its 95 % interval over the windows, and the
    windows where Baton was cheaper; beside them the busy-time floor the same way (against the cheapest by
    busy time in each window, which may be another policy). Then the same statistic for every policy, against
    the cheapest of the others in each window: the cheapest of several policies is cheaper than any one of
    them partly by chance, and this shows how far each policy is from it."""
    policies = list(per_window[0])

    def row(name: str, costs: list[float], slos: list[float] | None = None,
            busy: list[float] | None = None) -> str:
        cost, ci = mean_ci(costs)
        cells = [name, f"{cost:+.2f} ± {ci:.2f} %", f"{sum(c < 0 for c in costs)} of {len(costs)}"]
        if slos is not None:
            slo, slo_ci = mean_ci(slos)
            cells.append(f"{slo:+.2f} ± {slo_ci:.2f} pt")
        if busy is not None:
            floor, floor_ci = mean_ci(busy)  # a window without a busy figure has no whole-fleet one either
            cells.append(f"{floor:+.1f} ± {floor_ci:.1f} %, {sum(c < 0 for c in busy)} of {len(busy)}")
        return "| " + " | ".join(cells) + " |"

    lines = ["| baseline | whole-fleet cost per successful task | Baton cheaper in | SLO attainment "
             "| busy-time floor (Baton cheaper in) |",
             "|---|---:|---:|---:|---:|"]
    for theirs in [p for p in policies if p != "baton"] + [CHEAPEST]:
        costs, slos = pooled_change(per_window, "baton", theirs)
        if costs:
            busy, _ = pooled_change(per_window, "baton", theirs, key="busy_cost_per_successful_task")
            lines.append(row(theirs, costs, slos, busy))
    lines += ["", "Each policy against the cheapest of the others in each window:", "",
              "| policy | whole-fleet cost per successful task | cheaper in |", "|---|---:|---:|"]
    for mine in policies:
        costs, _ = pooled_change(per_window, mine, CHEAPEST)
        if costs:
            lines.append(row(mine, costs))
    return lines


def verdict(rows: dict[str, dict], per_seed: dict[str, list[dict]] | None = None) -> str:
    """Baton against the best baseline by SLO attainment and by each cost; with the runs of each seed,
    also the whole-fleet difference seed by seed (paired: a seed is the same trace and timing error
    for every policy) with its 95 % interval and the seeds where Baton was cheaper."""
    baton = rows["baton"]
    others = {p: s for p, s in rows.items() if p != "baton"}
    best_slo = max(others, key=lambda p: others[p]["slo_attainment"])
    best_fleet = min(others, key=lambda p: others[p]["cost_per_successful_task"])
    best_busy = min(others, key=lambda p: others[p]["busy_cost_per_successful_task"])

    def change(mine: float, theirs: float) -> str:
        return f"{(mine / theirs - 1) * 100:+.1f} %" if theirs else "n/a"

    slo_gap = (baton["slo_attainment"] - others[best_slo]["slo_attainment"]) * 100
    line = (f"SLO {slo_gap:+.1f} pt vs {best_slo}; whole-fleet cost "
            f"{change(baton['cost_per_successful_task'], others[best_fleet]['cost_per_successful_task'])} "
            f"vs {best_fleet}; busy-time floor "
            f"{change(baton['busy_cost_per_successful_task'], others[best_busy]['busy_cost_per_successful_task'])} "
            f"vs {best_busy}")
    if per_seed and len(per_seed["baton"]) > 1:
        paired = paired_change(per_seed["baton"], per_seed[best_fleet], "cost_per_successful_task")
        if paired:
            mean, ci, cheaper = paired
            line += (f"; seed by seed against {best_fleet}: {mean:+.2f} ± {ci:.2f} % whole fleet, "
                     f"cheaper in {cheaper} of {len(per_seed['baton'])} seeds")
    return line


def paired_changes(mine: list[dict], theirs: list[dict], key: str) -> list[float] | None:
    """Seed by seed, (mine / theirs - 1) in %; None when a seed has no figure (no successes)."""
    if not all(_has_figure(m, key) and _has_figure(t, key) for m, t in zip(mine, theirs, strict=True)):
        return None
    return [(m[key] / t[key] - 1) * 100 for m, t in zip(mine, theirs, strict=True)]


def paired_change(mine: list[dict], theirs: list[dict], key: str) -> tuple[float, float, int] | None:
    """Seed by seed, (mine / theirs - 1) in %: its mean, the half-width of its 95 % interval, and the
    number of seeds where mine was lower. None when a seed has no figure (no successes)."""
    changes = paired_changes(mine, theirs, key)
    if changes is None:
        return None
    mean, ci = mean_ci(changes)
    return mean, ci, sum(change < 0 for change in changes)


def _cell(s: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    ci = s.get(f"{key}_ci", 0.0) * scale
    value = f"{s[key] * scale:{fmt}}"
    return f"{value} ± {ci:{fmt}}" if ci else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_matrix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=flags.positive_int, default=REQUESTS,
                        help="first N requests of each trace (or of each tuning window)")
    parser.add_argument("--seeds", type=flags.seeds, default=(0, 1),
                        help="seeds of the timing-model error draw, comma-separated or ranges (10-19)")
    parser.add_argument("--sweep-seeds", type=flags.seeds, default=(0,), help="seeds for the SLO-sweep settings")
    parser.add_argument("--timing-error", type=flags.timing_error, default=0.3, help="in [0, 1)")
    parser.add_argument("--max-tokens", type=flags.positive_int, default=2048)
    parser.add_argument("--policies", type=flags.policies, default=("baton", *BASELINES))
    parser.add_argument("--only", default="", help="run only the settings whose name contains this")
    parser.add_argument("--tuning", action="store_true",
                        help="the tuning windows instead of the matrix (choose parameters there: --seeds 10-19)")
    parser.add_argument("--windows", type=flags.non_negative_int, default=0,
                        help="replay each chosen setting over this many other windows of its trace, and pool them")
    parser.add_argument("--traces", default="")
    parser.add_argument("--admission", choices=ADMISSIONS, default="none",
                        help="the leader's admission for every policy: none (placed at once; the tables' setting) or "
                        "baton (the scheduler's gate, as a live cluster runs each policy)")
    parser.add_argument("--jobs", type=flags.positive_int, default=2)
    parser.add_argument("--out", default="results/matrix")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    policies = options.policies
    candidates = tuning_windows(options.limit) if options.tuning else SETTINGS
    settings = [s for s in candidates if options.only in s.name]
    if not settings:
        parser.error(f"argument --only: no {'tuning window' if options.tuning else 'setting'} has {options.only!r} "
                     f"in its name; they are: {'; '.join(s.name for s in candidates)}")
    for setting in settings:
        check_trace(parser.error, _args(setting, options))
    pools: dict[str, list[str]] = {}
    unwindowed: list[str] = []
    if options.windows:  # each trace setting's windows in its place (agent tasks are generated: no windows)
        if options.tuning:
            parser.error("--windows replays windows of --limit requests of the matrix's settings, "
                         "not of the tuning windows")
        chosen, settings = settings, []
        for setting in chosen:
            windows = held_out_windows(setting, options, options.windows) if setting.limit is None else []
            if windows:
                pools[setting.name] = [w.name for w in windows]
                settings += windows
            else:
                unwindowed.append(setting.name)
    flags.check_out(parser.error, options.out)  # last: made before a later refusal, it was left empty (helper-163)

    def seeds_of(setting: Setting) -> list[int]:
        return list(options.sweep_seeds if setting.name.startswith("SLO sweep") else options.seeds)

    jobs = [(_args(s, options), p, s.load, seed) for s in settings for p in policies for seed in seeds_of(s)]
    started = time.perf_counter()
    outcomes = run_all(run_one, jobs, options.jobs)
    wall_s = time.perf_counter() - started
    lines = [f"{'Tuning windows' if options.tuning else 'Matrix'}: policies over seeds "
             f"{flags.seeds_text(options.seeds)} (SLO sweep: {flags.seeds_text(options.sweep_seeds)}) of "
             f"±{options.timing_error:.0%} timing-model error per GPU "
             f"generation; the scheduler sees max_tokens={options.max_tokens}, never true output lengths; "
             f"{options.limit} requests (agentic: tasks) of each trace, "
             f"{'from the window named' if options.tuning or options.windows else 'the first'}. "
             f"Cost per successful task in $ "
             f"(whole fleet until the last request ends, and busy GPU time); ± is a 95 % interval over the seeds; "
             f"drain: seconds the fleet ran after the last arrival. "
             f"{len(jobs)} runs in {wall_s / 60:.0f} min.", ""]
    merged: dict[str, dict[str, dict]] = {}
    seeds_run: dict[str, dict[str, list[dict]]] = {}
    runs_of = iter(outcomes)
    for setting in settings:
        rows, per_seed = {}, {}
        for policy in policies:
            per_seed[policy] = [summary for _, _, _, summary, _, _ in (next(runs_of) for _ in seeds_of(setting))]
            rows[policy] = merge_seeds(per_seed[policy])
        merged[setting.name], seeds_run[setting.name] = rows, per_seed
        budgets = "each task's own budgets" if setting.slo_mix else (
            f"TTFT {setting.ttft_s:g} s, TPOT {setting.tpot_s * 1000:.0f} ms")
        lines += [f"### {setting.name} ({budgets})", "",
                  "| policy | SLO attainment (%) | whole fleet ($) | busy-time floor ($) | TTFT p50 / p99 (s) "
                  "| drain (s) |",
                  "|---|---:|---:|---:|---|---:|"]
        for policy, s in rows.items():
            lines.append(f"| {policy} | {_cell(s, 'slo_attainment', '.1f', 100)} "
                         f"| {_cell(s, 'cost_per_successful_task', '.5f')} "
                         f"| {_cell(s, 'busy_cost_per_successful_task', '.5f')} "
                         f"| {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} | {s['drain_s']:.2f} |")
        if "baton" in rows and len(rows) > 1:
            lines += ["", f"Baton: {verdict(rows, per_seed)}.", ""]
    for name, windows in pools.items():
        if "baton" not in policies or len(policies) < 2:
            continue
        lines += [f"### {name}, over {len(windows)} windows", "",
                  "Baton's change against each baseline: per window, the mean over the seeds; then the mean "
                  "and its 95 % interval over the windows.", "", *pooled_verdict([seeds_run[w] for w in windows]),
                  ""]
    if unwindowed:
        lines += ["Not replayed over windows (agent tasks are generated, not read from a trace; or the trace has "
                  "no other window): " + "; ".join(unwindowed) + ".", ""]
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    setups = {setting.name: setup_of(setting, options) for setting in settings}
    (out / "results.json").write_text(results_json({"options": vars(options), "settings": merged, "setups": setups,
                                                    "per_seed": seeds_run}))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
