"""Whether a change to Baton's policy passes the adoption rules of the tuning windows (docs/evaluation.md).

    python -m bench.sim_matrix --tuning --seeds 10-19 --policies baton --out results/tuning-current
    (change the policy)
    python -m bench.sim_matrix --tuning --seeds 10-19 --policies baton --out results/tuning-variant
    python -m bench.adoption_rule --variant results/tuning-variant --current results/tuning-current \\
        [--baselines results/tuning-baselines [more directories ...]]

Each side may name several result directories (e.g. seeds 10-19 and 20-29); their seeds are joined, and
the variant's and the current policy's runs are paired seed by seed (the same seeds on both sides, or it
refuses). --baselines: runs of the other policies on the same window-settings, any seeds (their means are
used); several directories each add their window-settings (one named in two: the later directory's). Runs
that replayed a window-setting otherwise than the other side's (another --limit, --timing-error, --max-tokens,
--admission, fleet, load, SLO or window) are refused, naming what differs: only the policy may.

Rule 1 (the fifth round's): the whole-fleet cost per successful task at least 0.1 % lower on average over
the window-settings; no more SLO misses in all; no window-setting more than 2 % dearer; dearer than the best
baseline on no more window-settings.

Rule 2 (written down after finding that two overloaded window-settings swing by tens of percent from seed
to seed, deciding rule 1's worst window, much of its mean and of its misses; applied over seeds 10-29,
twenty seeds, not ten): the mean as in rule 1; no
window-setting dearer with a seed-paired 95 % interval clear of zero; the SLO misses of each seed (summed over
the window-settings), paired by seed, not higher with a 95 % interval clear of zero; the baselines as in rule 1.

Rule 3 (written down after a variant failed rule 2 on its mean alone, +0.08 %, while four overloaded
window-settings moved by -31 to +36 % from seed to seed; applied to seeds 30-39, run for no policy before):
no worse anywhere, better somewhere. No window-setting dearer with a seed-paired 95 % interval clear of zero;
at least one cheaper with its interval clear of zero; the misses and the baselines as in rule 2. The mean
over the window-settings is reported but not judged: the overloaded ones' noise is most of it.

Rule 4 (written down on 2026-12-01 at 21:20 UTC and revised at 21:28 after a review, both before any tuning
run of seeds 40 and above; for the next variant): no window-setting dearer by more than `MARGIN` (0.05 %) with
its seed-paired interval clear of zero; at least one cheaper by more than `MARGIN` with its interval clear of
zero; the mean change over the window-settings other than the four overloaded ones (`OVERLOADED`: the
conversation trace on the mixed fleet at 3x and on 2 H100 + 8 L4, both windows, whose ten-seed intervals run
+-1 to +-21 %) not above zero; the misses and the baselines as in rule 2. A loss or gain smaller than the
margin is below what the policy's own decisions could be said to cause; the overloaded window-settings are
left out of the mean only (their noise decides it), and a clear loss there still counts. A variant never run
before is judged on seeds 40-59; one already run on earlier seeds over all its seeds, those included: ten
seeds did not see a 0.15 % loss that more seeds did (this session's variant passes the rule on each of seeds
10-19, 20-29 and 30-39 and on 10-29, and fails it over 20-39, over 10-19 with 30-39, and over 10-39).
Tuning seeds 40-59 have since judged three variants (one passed and was adopted: the sixth round's, in
docs/evaluation.md), seeds 60-79 a fourth (it failed), seeds 80-99 a fifth (it failed), seeds 100-119 a sixth and
seeds 120-139 a seventh (both failed), seeds 140-159 and 160-179 an eighth (it failed rule 4, then rule 5; see
docs/evaluation.md, the tenth round), seeds 180-199 the same variant once more, by the eleventh round's rule (rule 5 (a)
on them, and part (b) judged across seeds rather than windows: `bench.burst_holdout --across seeds`), which it passed
and was adopted; seeds 200-219 the twelfth round's variant (rule 5 (a) there, which it failed: docs/evaluation.md,
the twelfth round); seeds 220-239 the thirteenth round's variant (rule 5 (a) there, which it failed on one
window-setting, and rule 4 on seeds 60-79 of six target window-settings, which it passed: docs/evaluation.md, the
thirteenth round); seeds 240-259 the fourteenth round's variant (rule 5 (a) there, which it failed on four
window-settings, and rule 4 on seeds 80-99 of the same six target window-settings, which it passed:
docs/evaluation.md, the fourteenth round); seeds 260-279 the fifteenth round's variant (rule 5 (a) there, which it
passed, and rule 4 on seeds 100-119 of the six target window-settings, which it failed on one: docs/evaluation.md,
the fifteenth round); seeds 280-299 the sixteenth round's variant (rule 5 (a) there, which it failed on two
window-settings, and rule 4 on seeds 120-139 of the six target window-settings, which it passed: docs/evaluation.md,
the sixteenth round); seeds 300-319 the seventeenth round's variant (rule 5 (a) there, which it failed on one
window-setting, and rule 4 on seeds 140-159 of the six target window-settings, which it passed: docs/evaluation.md,
the seventeenth round); seeds 320-339 the eighteenth round's variant (rule 5 (a) there, which it passed, and rule
4 on seeds 160-179 of the six target window-settings, which it failed: docs/evaluation.md, the eighteenth round); seeds
340-359 the nineteenth round's variant (rule 5 (a) there, which it failed on two window-settings and on the count
dearer than the best baseline, and rule 4 on seeds 180-199 of the six target window-settings, which it passed:
docs/evaluation.md, the nineteenth round); seeds 360-379 the twentieth round's variant, aimed at a defect and not at
the target (rule 5 (a) there, which it passed, and fewer SLO misses on the cheap fleet's three windows over
the same seeds, which it failed: docs/evaluation.md, the twentieth round); seeds 380-399 the twenty-first round's
variant (rule 5 (a) there, which it failed on one window-setting, and rule 4 on seeds 200-219 of the six target
window-settings, which it failed on the count dearer than the best baseline: docs/evaluation.md, the twenty-first
round); the next variant is judged on seeds 420-439 (and, where the target is unmet, on seeds 220-239; seeds 400-402
ran the held-out windows of the matrix, not the tuning windows), the current policy run on them too.

Rule 5 (for a variant aimed at a failure the tuning windows do not contain, such as TPOT misses when a burst of
prompts lands on a node; written after the tenth round's variant failed rule 4, docs/evaluation.md says how that
weighs): (a) no harm on the tuning windows, `Verdict.no_harm`, reported with --rule 5: rule 4 without its gain,
and the mean over the window-settings not overloaded not above `MARGIN` rather than zero, so that the drift of a
few changed runs does not decide; and (b) a gain where the failure lives, on a hold-out the variant was not built on
(`bench.burst_holdout`, now used up): fewer SLO misses with an interval clear of zero, at a whole-fleet cost no
more than `MARGIN` dearer. Which rule judges a variant is written down with the variant, before its runs.
--rule 5 judges only runs of the tuning windows (`bench.sim_matrix --tuning`), and refuses others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.sim_matrix import paired_changes
from simulator.report import mean_ci

KEY = "cost_per_successful_task"
POLICY = "baton"
# Rule 4: the window-settings whose cost swings by tens of percent from seed to seed (their names begin so),
# left out of its mean, and the least change, in %, that counts as a loss or a gain.
OVERLOADED = ("Mooncake conversation, mixed, 3x,", "Mooncake conversation, 2xH100+8xL4,")
MARGIN = 0.05


@dataclass(frozen=True)
class Verdict:
    per_setting: dict[str, tuple[float, float]]  # each window-setting's mean change (%) and its 95 % half-width
    misses: tuple[int, int]  # variant's and current policy's SLO misses, all seeds and window-settings
    misses_per_seed: tuple[float, float]  # the paired difference per seed: mean, 95 % half-width
    behind_best: tuple[int, int] | None  # window-settings dearer than the best baseline: variant, current

    @property
    def mean_change(self) -> float:
        """The mean over the window-settings of their mean changes, in %."""
        return sum(m for m, _ in self.per_setting.values()) / len(self.per_setting)

    @property
    def worst(self) -> tuple[str, float]:
        """The window-setting with the largest mean change, and that change."""
        name, (mean, _) = max(self.per_setting.items(), key=lambda item: item[1][0])
        return name, mean

    @property
    def dearer(self) -> list[tuple[str, float, float]]:
        """The window-settings dearer with an interval clear of zero: name, mean change, half-width."""
        return [(name, m, h) for name, (m, h) in self.per_setting.items() if m - h > 0]

    @property
    def cheaper(self) -> list[tuple[str, float, float]]:
        return [(name, m, h) for name, (m, h) in self.per_setting.items() if m + h < 0]

    @property
    def steady(self) -> list[float]:
        """The mean changes of the window-settings that are not overloaded (rule 4's mean)."""
        return [m for name, (m, _) in self.per_setting.items() if not name.startswith(OVERLOADED)]

    @property
    def rule_1(self) -> bool:
        return (self.mean_change <= -0.1 and self.misses[0] <= self.misses[1] and self.worst[1] <= 2.0
                and self._baselines_hold())

    @property
    def rule_2(self) -> bool:
        return self.mean_change <= -0.1 and not self.dearer and self._misses_hold() and self._baselines_hold()

    @property
    def rule_3(self) -> bool:
        return bool(self.cheaper) and not self.dearer and self._misses_hold() and self._baselines_hold()

    @property
    def rule_4(self) -> bool:
        steady = self.steady
        return (bool(steady) and self._no_clear_harm() and sum(steady) <= 0
                and any(m + h < 0 and m < -MARGIN for m, h in self.per_setting.values()))

    @property
    def no_harm(self) -> bool:
        """Rule 5's part (a): rule 4 without its gain, the steady mean bounded by MARGIN instead of zero."""
        steady = self.steady
        return bool(steady) and self._no_clear_harm() and sum(steady) / len(steady) <= MARGIN

    def _no_clear_harm(self) -> bool:
        """Rules 4 and 5: no window-setting dearer by more than MARGIN with its interval clear of zero, the
        misses and the baselines held."""
        clear_loss = any(m - h > 0 and m > MARGIN for m, h in self.per_setting.values())
        return not clear_loss and self._misses_hold() and self._baselines_hold()

    def _misses_hold(self) -> bool:
        """No more SLO misses per seed with the paired interval clear of zero."""
        mean, half = self.misses_per_seed
        return mean - half <= 0

    def _baselines_hold(self) -> bool:
        return self.behind_best is None or self.behind_best[0] <= self.behind_best[1]


# What bench.sim_matrix recorded of a run's setup before it wrote each window-setting's (its "setups").
_OPTIONS_SETUP = ("limit", "timing_error", "max_tokens", "admission", "tuning")


def read_results(directory: Path) -> dict:
    """A directory's results.json as bench.sim_matrix writes it; ValueError saying why otherwise."""
    path = directory / "results.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no results.json; expected a directory bench.sim_matrix --out wrote")
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not (isinstance(result, dict) and isinstance(result.get("options"), dict) and "seeds" in result["options"]
            and isinstance(result.get("per_seed"), dict)):
        raise ValueError(f"{path}: not bench.sim_matrix's results (it has no options and per_seed); "
                         "another bench's output?")
    return result


def _seeds(options: dict) -> list[int]:
    """The seeds a results file ran: a list, or text as --seeds took it before the flag was parsed."""
    seeds = options["seeds"]
    return [int(s) for s in (seeds if isinstance(seeds, list) else str(seeds).split(","))]


def load(directories: list[Path]) -> tuple[list[int], dict[str, list[dict]]]:
    """The seeds, and per window-setting the policy's runs in the seeds' order, of result directories."""
    seeds: list[int] = []
    runs: dict[str, list[dict]] = {}
    for directory in directories:
        result = read_results(directory)
        seeds += _seeds(result["options"])
        for setting, policies in result["per_seed"].items():
            if POLICY not in policies:
                raise ValueError(f"{directory}: no runs of {POLICY} on {setting!r} (only {', '.join(policies)})")
            runs.setdefault(setting, []).extend(policies[POLICY])
    return seeds, runs


def differences(first: dict, second: dict) -> list[str]:
    """What two setups both record and differ in: 'limit 100 against 200'."""
    return [f"{key} {first[key]!r} against {second[key]!r}" for key in first if key in second
            and first[key] != second[key]]


def check_same_setups(sides: list[tuple[str, list[Path]]]) -> None:
    """ValueError where two directories (flag and paths) ran with other options, or ran a window-setting otherwise
    (bench.sim_matrix's "setups"; a file written before them gives its options): only the policy and the seeds may
    differ."""
    first: tuple[str, Path, dict] | None = None
    settings: dict[str, tuple[str, Path, dict]] = {}
    for flag, directories in sides:
        for directory in directories:
            result = read_results(directory)
            options = {key: result["options"][key] for key in _OPTIONS_SETUP if key in result["options"]}
            if first is None:
                first = (flag, directory, options)
            elif changed := differences(first[2], options):
                raise ValueError(f"{first[0]} {first[1]} and {flag} {directory} ran with other options: "
                                 f"{'; '.join(changed)}; only the policy may differ")
            for setting in result["per_seed"]:
                setup = result.get("setups", {}).get(setting, options)
                if setting in settings and (changed := differences(settings[setting][2], setup)):
                    other_flag, other, _ = settings[setting]
                    raise ValueError(f"{other_flag} {other} and {flag} {directory} ran {setting!r} otherwise: "
                                     f"{'; '.join(changed)}; only the policy may differ")
                settings.setdefault(setting, (flag, directory, setup))


def slo_misses(run: dict) -> int:
    return round((1 - run["slo_attainment"]) * run["num_requests"])


def judge(variant: dict[str, list[dict]], current: dict[str, list[dict]],
          baselines: dict[str, dict[str, list[dict]]] | None = None) -> Verdict:
    """The rules' figures: variant's runs against current's, paired by position (by seed)."""
    if set(variant) != set(current):
        raise ValueError(f"the two sides ran other window-settings: {sorted(set(variant) ^ set(current))}")
    if not current:
        raise ValueError("no window-settings to judge")
    num_seeds = len(next(iter(current.values())))
    for setting in current:
        if not len(variant[setting]) == len(current[setting]) == num_seeds:
            raise ValueError(f"{setting!r} has {len(variant[setting])} runs of the variant and "
                             f"{len(current[setting])} of the current policy, the first window-setting {num_seeds}: "
                             "the rules pair every window-setting's runs seed by seed (a matrix run with --sweep-seeds "
                             "other than --seeds: judge its SLO sweep apart, run with --only \"SLO sweep\")")
    per_setting: dict[str, tuple[float, float]] = {}
    per_seed = [0] * num_seeds
    for setting, runs in current.items():
        for i, (v, c) in enumerate(zip(variant[setting], runs, strict=True)):
            per_seed[i] += slo_misses(v) - slo_misses(c)
        paired = paired_changes(variant[setting], runs, KEY)
        if paired is None:  # a run with no success has no cost per success
            continue
        per_setting[setting] = mean_ci(paired)
    if not per_setting:
        raise ValueError("no window-setting had a success in every seed on both sides: no cost per success to compare")
    misses = (sum(slo_misses(r) for runs in variant.values() for r in runs),
              sum(slo_misses(r) for runs in current.values() for r in runs))
    behind_best = None
    if baselines is not None:
        behind_best = (0, 0)
        for setting in current:
            others = {p: runs for p, runs in baselines.get(setting, {}).items() if p != POLICY and runs}
            if not others:
                raise ValueError(f"the baselines have no runs of another policy on {setting!r}")
            best = min(_mean(runs) for runs in others.values())
            behind_best = (behind_best[0] + (_mean(variant[setting]) > best),
                           behind_best[1] + (_mean(current[setting]) > best))
    return Verdict(per_setting, misses, mean_ci(per_seed), behind_best)


def _mean(runs: list[dict]) -> float:
    """The runs' mean cost per successful task; a run with none has no figure (null in results.json): infinite."""
    return sum(math.inf if r[KEY] is None else r[KEY] for r in runs) / len(runs)


def report(verdict: Verdict, rule_5: bool = False) -> list[str]:
    """The figures and the verdicts of rules 1-4; rule 5's part (a) only when asked (a variant's rule is chosen
    before its runs, not read off the report)."""
    v = verdict
    lines = [f"whole-fleet cost per successful task, mean change over the window-settings: {v.mean_change:+.2f} %",
             f"worst window-setting: {v.worst[1]:+.2f} % ({v.worst[0]})",
             f"SLO misses: {v.misses[0]:,} against {v.misses[1]:,}; per seed {v.misses_per_seed[0]:+.1f} "
             f"± {v.misses_per_seed[1]:.1f}"]
    for label, entries in (("dearer", v.dearer), ("cheaper", v.cheaper)):
        listed = "; ".join(f"{name} {mean:+.2f} ± {half:.2f} %" for name, mean, half in entries) or "none"
        lines.append(f"{label} with a 95 % interval clear of zero: {listed}")
    steady = v.steady
    if steady:
        lines.append(f"mean change over the {len(steady)} window-settings not overloaded: "
                     f"{sum(steady) / len(steady):+.3f} %")
    if v.behind_best is not None:
        lines.append(f"dearer than the best baseline on {v.behind_best[0]} window-settings, "
                     f"the current policy on {v.behind_best[1]}")
    lines.append("; ".join(f"rule {n}: {'passes' if ok else 'fails'}"
                           for n, ok in ((1, v.rule_1), (2, v.rule_2), (3, v.rule_3), (4, v.rule_4))))
    if rule_5:
        verdict_5 = "passes" if v.no_harm else "fails"
        lines.append(f"rule 5 (a), no harm: {verdict_5} (part (b): python -m bench.burst_holdout)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adoption_rule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", nargs="+", type=Path, required=True)
    parser.add_argument("--current", nargs="+", type=Path, required=True)
    parser.add_argument("--baselines", nargs="+", type=Path,
                        help="runs of the other policies, any seeds; several directories each add their "
                             "window-settings (one in two: the later's)")
    parser.add_argument("--rule", type=int, choices=(4, 5), default=4,
                        help="the rule written down for the variant: 5 adds rule 5's part (a) to the report")
    options = parser.parse_args(argv)
    try:
        sides = [("--current", options.current), ("--variant", options.variant)]
        check_same_setups(sides + ([("--baselines", options.baselines)] if options.baselines else []))
        if options.rule == 5:
            for directory in options.variant + options.current:
                if read_results(directory)["options"].get("tuning") is not True:
                    parser.error(f"--rule 5: {directory} was not run with bench.sim_matrix --tuning; rule 5 (a) "
                                 "judges no harm on the tuning windows")
        variant_seeds, variant = load(options.variant)
        current_seeds, current = load(options.current)
        if variant_seeds != current_seeds:
            parser.error(f"--variant ran seeds {variant_seeds}, --current {current_seeds}: they must be the same")
        baselines = None
        if options.baselines:
            baselines = {}
            for directory in options.baselines:
                baselines.update(read_results(directory)["per_seed"])
        verdict = judge(variant, current, baselines)
    except ValueError as error:
        parser.error(str(error))
    print("\n".join(report(verdict, rule_5=options.rule == 5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
