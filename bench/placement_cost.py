"""CPU time of one placement through the pure placement core (start, options, admission's ticket, decide) under
Baton's policy, on fleets of 8, 32 and 64 nodes: with admission's predictions computed once per candidate
(BatonPolicy.remembering, as the scheduler runs) and, in the same run, computed at each of admission's three
passes (as before), alternating, so both are measured on the machine as it is then.

    .venv/bin/python -m bench.placement_cost
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

from services.common.load import Load
from services.node_agent.engines.sim.models import SIM_MODELS
from services.node_agent.engines.sim.profile import configured_profile
from services.scheduler.fleet import ClusterView, NodeSpec
from services.scheduler.model_planner import ModelPlanner
from services.scheduler.placement import PlaceAsk, Placer
from services.scheduler.policies import PlacementRequest, make_policy
from services.scheduler.policies.baton import BatonPolicy
from services.scheduler.retry_budget import RetryBudget

MODEL = "sim-llama-3.1-8b"
GPUS = ("h100", "a100", "l4")


def _placer(num_nodes: int) -> Placer:
    """A mixed fleet, each node with a load of its own."""
    specs = [NodeSpec(node_id=f"n{i}", address=f"n{i}:1", gpu=GPUS[i % 3], price_per_hour=1.0,
                      warm_models=frozenset({MODEL}),
                      profiles={MODEL: configured_profile(GPUS[i % 3], SIM_MODELS[MODEL], 25_000)})
             for i in range(num_nodes)]
    view = ClusterView(load_timeout_s=1e9)
    view.set_nodes(specs)
    for i, spec in enumerate(specs):
        view.report_load(spec.node_id, Load(kv_blocks_total=10_000, kv_blocks_used=100 * (i % 7),
                                            num_running=i % 5, num_waiting=i % 2), 0.0)
    return Placer(view, make_policy("baton"), RetryBudget(ratio=0.2, min_retries_per_s=5.0), ModelPlanner())


def _ms_per_placement(placer: Placer, first: int, count: int) -> float:
    started = time.process_time()
    for r in range(first, first + count):
        request = PlacementRequest(request_id=f"r{r}", model=MODEL, num_prompt_tokens=800, num_prompt_blocks=50,
                                   max_tokens=256, block_hashes=tuple(range(r, r + 50)), deadline_ms=60_000)
        plan = placer.start(PlaceAsk(request), 1.0)
        options = placer.options(plan, lambda _: {})
        placer.ticket(plan, options, 1.0)
        placer.decide(options, 1.0)
    return (time.process_time() - started) / count * 1000


@contextlib.contextmanager
def _forgetting(self: BatonPolicy) -> Iterator[None]:
    yield  # each pass computes its predictions again, as before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two ways")
    parser.add_argument("--placements", type=int, default=200, help="placements a round, each way")
    options = parser.parse_args(argv)
    remembering = BatonPolicy.remembering
    print("| nodes | ms a placement, each prediction once | ms, three times (before) | ratio |")
    print("|---|---|---|---|")
    for num_nodes in (8, 32, 64):
        once, thrice = [], []
        for round_ in range(options.rounds):
            for way, times in ((remembering, once), (_forgetting, thrice)):
                BatonPolicy.remembering = way  # type: ignore[method-assign]
                try:
                    times.append(_ms_per_placement(_placer(num_nodes), round_ * options.placements,
                                                   options.placements))
                finally:
                    BatonPolicy.remembering = remembering  # type: ignore[method-assign]
        a, b = statistics.median(once), statistics.median(thrice)
        print(f"| {num_nodes} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
