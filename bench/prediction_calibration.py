"""How well Baton's predictions at placement follow what its requests then get, in the simulator.

For every placement of one run it keeps the chosen node's predicted TTFT and TPOT, then compares
them with the TTFT and mean TPOT the request got (requests of more than 20 tokens for TPOT): the
correlation over the run's placements, and the mean ratio of predicted to actual. The simulator's
engines run off the profile the scheduler reads by the seed's timing error, so the ratio carries
that error; the correlation says whether a prediction ranks placements the way they turned out.

    python -m bench.prediction_calibration --fleet 8xh100 --load 2 --seed 2
"""

from __future__ import annotations

import argparse
import statistics
import sys

from services.scheduler.policies import Option, make_policy
from services.scheduler.policies.base import Decision
from simulator.report import build_workload, parse_args
from simulator.simulation import Simulation, fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prediction_calibration", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="mooncake-conversation")
    parser.add_argument("--fleet", default="8xh100")
    parser.add_argument("--load", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traces", default="")
    options = parser.parse_args(argv)
    argv_sim = ["--workload", options.workload, "--fleet", options.fleet, "--limit", str(options.limit)]
    args = parse_args(argv_sim + (["--traces", options.traces] if options.traces else []))
    policy = make_policy("baton")
    predicted: dict[str, tuple[float, float]] = {}
    choose_among = policy.choose_among

    def noting(options_: list[Option], now: float) -> tuple[int, Decision]:
        index, decision = choose_among(options_, now)
        terms = next(t for t in policy.last_terms() if t.node_id == decision.node_id)
        predicted[options_[index].request.request_id] = (terms.ttft_ms / 1000, terms.tpot_ms / 1000)
        return index, decision

    policy.choose_among = noting  # type: ignore[method-assign]
    result = Simulation(fleet(options.fleet), policy, model=args.model, ttft_budget_ms=int(args.ttft_slo * 1000),
                        tpot_budget_ms=int(args.tpot_slo * 1000), max_tokens=args.max_tokens,
                        timing_error=args.timing_error, seed=options.seed).run(build_workload(args, options.load))
    ttft, tpot = [], []
    for record in result.records:
        guess = predicted.get(record.request.request_id)
        if guess is None or record.first_token_s is None or record.finish_s is None:
            continue
        ttft.append((guess[0], record.first_token_s - record.arrival_s))
        if record.num_generated > 20:
            tpot.append((guess[1], (record.finish_s - record.first_token_s) / (record.num_generated - 1)))
    print(f"{options.workload}, {options.fleet} at {options.load:g}x, seed {options.seed}: "
          f"{len(ttft)} placements, {len(tpot)} with more than 20 tokens")
    print("| prediction | correlation with what the request got | mean predicted / actual |")
    print("|---|---:|---:|")
    for name, pairs in (("TTFT", ttft), ("TPOT", tpot)):
        guesses, actual = [p for p, _ in pairs], [a for _, a in pairs]
        ratio = statistics.fmean(p / a for p, a in pairs if a > 0)
        print(f"| {name} | {statistics.correlation(guesses, actual):.3f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
