"""Explored, not a policy: would moving a long answer onto a GPU that has just gone idle shorten the drain?

A fleet paid until its last request ends pays for the last long answer's decode, and that answer decodes
slower beside other work. Baton's resume path can move a running generation to another node (its context
prefilled again there), so a scheduler could move a long answer off a shared GPU whenever another GPU of
the fleet goes idle. This measures what such moves give with knowledge no live scheduler has: the mover
reads each running request's **true** remaining length (the rest of its rule is a choice, not a bound on
every mover).

When a node finishes a step with nothing left to run (and nothing waits for admission), the mover looks at the
decoding requests on the other nodes of its model that run two requests or more: of those with at least
--min-remaining true tokens left whose decode time saved (remaining tokens × the step they run now, less the
step they would run alone there, as the registered profiles predict) exceeds the prefill of their context
there, it moves the one with the most tokens left, when its node next ends a step (no token is lost), at most
once. Everything else is the simulator's own run of Baton's policy.

    python -m bench.tail_moves --setting "Azure code, mixed, 2x, requests 1,200-1,800" --seeds 180,181,182

prints, per seed, the drain and the whole-fleet cost per successful task with and without the moves, and the
change's mean with its 95 % interval over the seeds (docs/explored/tail-moves.md has the figures).
"""

from __future__ import annotations

import argparse
import sys

from bench.last_requests import find_setting
from bench.sim_matrix import _args, build_parser
from simulator.metrics import Slo, summarize
from simulator.report import build_workload, mean_ci, simulate
from simulator.simulation import Simulation


class TailMoves(Simulation):
    """The simulator, with a mover that knows every request's true remaining length (no live scheduler does)."""

    def __init__(self, *args, min_remaining: int = 300, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._min_remaining = min_remaining
        self._moves: dict[str, str] = {}  # request id -> the idle node it moves to
        self._moved: set[str] = set()

    @property
    def num_moves(self) -> int:
        return len(self._moved)

    def _step_ms(self, node, num_seqs: int, num_context_tokens: int) -> float:
        return self._profile(node.config.gpu, node.model).timing.decode_step_ms(num_seqs, num_context_tokens)

    def _step_done(self, node, result) -> None:
        super()._step_done(node, result)
        idle = (node.is_alive and node.core is not None and not node.core.has_unfinished_requests()
                and not node.flights and not node.waiting_for_load)
        if not idle or self._held:
            return
        # A request that ended, or whose node died, before its move frees the idle node it was moving to.
        self._moves = {request_id: target for request_id, target in self._moves.items()
                       if any(request_id in n.flights for n in self._nodes.values() if n.is_alive)}
        if node.config.node_id in self._moves.values():
            return
        best: tuple[int, str] | None = None
        for other in self._nodes.values():
            if other is node or not other.is_alive or other.model != node.model or len(other.flights) < 2:
                continue
            context = sum(len(g.context) for g in other.flights.values())
            step_there = self._step_ms(other, len(other.flights), context)
            for request_id, generation in other.flights.items():
                record = self._records[request_id]
                if request_id in self._moves or request_id in self._moved or record.first_token_s is None:
                    continue
                remaining = generation.num_remaining  # where the engine stops: the true length, within max_tokens
                alone_here = self._step_ms(node, 1, len(generation.context))
                refill = self._profile(node.config.gpu, node.model).timing.prefill_ms([len(generation.context)])
                if (remaining >= self._min_remaining and remaining * (step_there - alone_here) > refill
                        and (best is None or remaining > best[0])):
                    best = (remaining, request_id)
        if best is not None:
            self._moves[best[1]] = node.config.node_id

    def _kick(self, node) -> None:
        if not node.is_stepping and node.is_alive and node.core is not None:
            for request_id in [r for r in self._moves if r in node.flights]:
                target = self._nodes[self._moves.pop(request_id)]
                if not target.is_alive or target.core is None or target.model != node.model:
                    continue
                generation = node.flights.pop(request_id)
                node.core.abort_request(request_id)
                record = self._records[request_id]
                record.end_attempt()  # the attempt's GPU time is paid, as a migration's is
                record.node_id = target.config.node_id
                self._moved.add(request_id)
                self._start_on(target, generation, record, tuple(generation.context_block_hashes()))
        super()._kick(node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tail_moves", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", required=True, help="as bench.last_requests takes it")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--policy", default="baton")
    parser.add_argument("--min-remaining", type=int, default=300,
                        help="true tokens left below which a request is not moved")
    own, rest = parser.parse_known_args(argv)
    options = build_parser().parse_args(rest)
    setting = find_setting(own.setting, options)
    if setting is None:
        print(f"--setting: no setting named {own.setting!r} (bench.last_requests --help lists the forms)",
              file=sys.stderr)
        return 2
    args = _args(setting, options)
    workload = build_workload(args, setting.load)
    slo = Slo(args.ttft_slo, args.tpot_slo)
    changes = []
    for seed in (int(s) for s in own.seeds.split(",")):
        plain = summarize(simulate(args, own.policy, workload, seed), workload, slo)
        movers: list[TailMoves] = []

        def mover(*a, **k) -> TailMoves:
            movers.append(TailMoves(*a, min_remaining=own.min_remaining, **k))
            return movers[-1]

        moved = summarize(simulate(args, own.policy, workload, seed, simulation=mover), workload, slo)
        change = 100.0 * (moved.cost_per_successful_task / plain.cost_per_successful_task - 1.0)
        changes.append(change)
        print(f"seed {seed}: drain {plain.drain_s:.2f} s, with moves {moved.drain_s:.2f} s ({movers[0].num_moves} "
              f"moves); successes {plain.num_tasks_ok} / {moved.num_tasks_ok}; whole fleet per success "
              f"{change:+.2f} %", flush=True)
    mean, half = mean_ci(changes)
    print(f"{own.policy} with moves against without, whole fleet per success: {mean:+.3f} ± {half:.3f} % "
          f"over {len(changes)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
