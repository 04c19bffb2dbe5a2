"""Rule 5's hold-out (bench.adoption_rule): does a policy change aimed at bursts gain where bursts live?

    python -m bench.burst_holdout --out results/holdout-current          # the policy as it is
    (change the policy)
    python -m bench.burst_holdout --out results/holdout-variant
    python -m bench.burst_holdout --variant results/holdout-variant --current results/holdout-current

Baton alone, over seeds 0, 1 and 2 of the timing error, on windows outside the matrix's and the tuning windows:
the Azure code trace on the mixed fleet at 3x over its 11 such windows less one, the window of
requests 1,800-2,400 left out (the burst the tenth round's variant was built on, at 2x), and the Azure
conversation trace on the mixed fleet at 3x over its first 8 such windows. Not unseen: seven of the Azure code
windows had run at 2x (the "--windows 8" runs) and the Azure conversation ones at 3x (the fifth round), and
since the tenth round both the current policy and that round's variant have run all of them, so a next
variant needs a hold-out of its own. The verdict: per window, the variant's SLO misses less the current
policy's, averaged over the seeds; over the windows, their mean with its 95 % interval must be below zero,
clear of it; and the mean over the windows of the seed-paired change in whole-fleet cost per successful task
must not be above the margin (bench.adoption_rule.MARGIN). With one window of 18 differing, the interval
always holds zero: the hold-out can only judge a change where misses are in several windows, and even then it
cannot pass a gain concentrated in one of them, which widens the interval with it (the tenth round's third look,
--load 5 --trace code: fewer misses in all five windows with any, 85 % of the gain in one, and it failed).

The eleventh round's criterion (--across seeds, written down before its runs: docs/preregistered/eleventh-round.md)
judges across the seeds instead, each its own draw of the GPUs' speeds: per seed, the variant's misses summed over
the windows less the current policy's; their mean over the seeds with its 95 % interval below zero, clear of it; no
window with more misses per seed, paired, clear of zero; and the cost as above. That round ran it on the Azure code
windows at 4x over seeds 3-22 (--load 4 --trace code --seeds 3,...,22), the variant's first runs at that load.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from bench.adoption_rule import KEY, MARGIN, slo_misses
from bench.sim_matrix import SETTINGS, Setting, _args, build_parser, held_out_windows, paired_changes
from simulator.report import mean_ci, run_one
from simulator.study import results_json

SEEDS = (0, 1, 2)
# The burst the tenth round's variant was built on (Azure code at 2x); its requests are left out here.
SEEN_BURST_SKIP = 1800


def windows(options: argparse.Namespace, load: float = 3.0, traces: str = "both") -> list[Setting]:
    """The hold-out's window-settings, in a fixed order (options: bench.sim_matrix's, for --traces); load and
    traces ("both", "code", "conv") give the same windows at another load, or of one trace."""
    by_name = {s.name: s for s in SETTINGS}
    code = replace(by_name["Azure code, mixed, 2x"], name=f"Azure code, mixed, {load:g}x", load=load)
    conv = replace(by_name["Azure conversation, mixed, 3x"], name=f"Azure conversation, mixed, {load:g}x", load=load)
    chosen: list[Setting] = []
    if traces in ("both", "code"):
        chosen += [w for w in held_out_windows(code, options, 20) if w.skip != SEEN_BURST_SKIP]
    if traces in ("both", "conv"):
        chosen += held_out_windows(conv, options, 8)
    return chosen


@dataclass(frozen=True)
class Gain:
    """The variant's misses and cost against the current policy's over the windows: rule 5's part (b), judged
    across the windows, and the eleventh round's, judged across the seeds."""

    misses: tuple[float, float]  # per window, variant's misses less current's (seed mean): their mean, 95 % half-width
    cost_change: float  # mean over the windows of the seed-paired whole-fleet cost change, in %
    num_windows: int
    # Per seed, variant's misses less current's summed over the windows: their mean, 95 % half-width.
    misses_per_seed: tuple[float, float] = (0.0, 0.0)
    # The windows with more misses per seed, paired, with a 95 % interval clear of zero.
    worse_windows: tuple[str, ...] = ()

    @property
    def passes(self) -> bool:
        """Rule 5 (b): fewer misses across the windows, clear of zero, at no dearer a cost."""
        mean, half = self.misses
        return mean + half < 0 and self.cost_change <= MARGIN

    @property
    def passes_across_seeds(self) -> bool:
        """The eleventh round's part (b): fewer misses per seed (each seed's windows summed), clear of zero; no
        window clearly worse; no dearer a cost. A gain in one window counts as fully as one spread over many, and
        the seeds, each its own draw of the GPUs' speeds, are the replicates."""
        mean, half = self.misses_per_seed
        return mean + half < 0 and not self.worse_windows and self.cost_change <= MARGIN


def gain(variant: dict[str, list[dict]], current: dict[str, list[dict]]) -> Gain:
    """Part (b)'s figures on two runs of the same windows and seeds (paired by position)."""
    if set(variant) != set(current):
        raise ValueError(f"the two sides ran other windows: {sorted(set(variant) ^ set(current))}")
    missed, costs, worse = [], [], []
    per_seed = [0] * len(next(iter(current.values())))
    for name, runs in current.items():
        differences = [slo_misses(v) - slo_misses(c) for v, c in zip(variant[name], runs, strict=True)]
        if len(differences) != len(per_seed):
            raise ValueError(f"{name} ran {len(differences)} seeds, the first window {len(per_seed)}")
        per_seed = [total + d for total, d in zip(per_seed, differences, strict=True)]
        mean, half = mean_ci(differences)
        missed.append(mean)
        if mean - half > 0:
            worse.append(name)
        paired = paired_changes(variant[name], runs, KEY)
        if paired is not None:
            costs.append(sum(paired) / len(paired))
    if not costs:
        raise ValueError("no window had a success on both sides: no cost per success to compare")
    return Gain(mean_ci(missed), sum(costs) / len(costs), len(missed), mean_ci(per_seed), tuple(worse))


def run(out: Path, options: argparse.Namespace, load: float, traces: str, seeds: list[int]) -> None:
    per_window: dict[str, list[dict]] = {}
    for window in windows(options, load, traces):
        args = _args(window, options)
        per_window[window.name] = [run_one((args, "baton", window.load, seed))[3] for seed in seeds]
        attained = " / ".join(f"{r['slo_attainment'] * 100:.1f}" for r in per_window[window.name])
        print(f"{window.name}: SLO attainment {attained} %", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(results_json({"seeds": seeds, "per_window": per_window}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.burst_holdout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="run the checked-out Baton on the hold-out and write results here")
    parser.add_argument("--variant", type=Path)
    parser.add_argument("--current", type=Path)
    parser.add_argument("--traces", default="", help="where the trace files are (default: the simulator's)")
    parser.add_argument("--load", type=float, default=3.0, help="the load of both traces' windows (default 3x)")
    parser.add_argument("--trace", choices=("both", "code", "conv"), default="both", help="which trace's windows")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds of the timing error (default 0,1,2)")
    parser.add_argument("--across", choices=("windows", "seeds"), default="windows",
                        help="the criterion written down for the variant: rule 5 (b)'s, across the windows, or the "
                        "eleventh round's, across the seeds")
    options = parser.parse_args(argv)
    if options.load <= 0:
        parser.error(f"--load must be above 0, not {options.load:g}")
    if options.out:
        seeds = [int(seed) for seed in options.seeds.split(",")]
        run(options.out, build_parser().parse_args(["--traces", options.traces] if options.traces else []),
            options.load, options.trace, seeds)
        return 0
    if not (options.variant and options.current):
        parser.error("give --out, or both --variant and --current")
    runs = [json.loads((d / "results.json").read_text()) for d in (options.variant, options.current)]
    if runs[0]["seeds"] != runs[1]["seeds"]:
        parser.error(f"--variant ran seeds {runs[0]['seeds']}, --current {runs[1]['seeds']}: they must be the same")
    g = gain(runs[0]["per_window"], runs[1]["per_window"])
    print(f"SLO misses per window, variant less current: {g.misses[0]:+.2f} ± {g.misses[1]:.2f} "
          f"over {g.num_windows} windows")
    print(f"whole-fleet cost per successful task, mean change over the windows: {g.cost_change:+.3f} %")
    if options.across == "windows":
        print(f"rule 5 (b), a gain on the hold-out: {'passes' if g.passes else 'fails'}")
        return 0
    print(f"SLO misses per seed (its windows summed), variant less current: {g.misses_per_seed[0]:+.2f} "
          f"± {g.misses_per_seed[1]:.2f} over {len(runs[0]['seeds'])} seeds")
    print(f"windows with more misses, clear of zero: {'; '.join(g.worse_windows) or 'none'}")
    print(f"the eleventh round's part (b), a gain across the seeds: {'passes' if g.passes_across_seeds else 'fails'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
