"""The size of the scheduler leader's hand-over state (written to etcd every second) after --minutes of --rate
single-step workflows and --lone-rate lone requests a second, the task ledger and the policy's workflow spend fed as
Finished and Place feed them; with --refused-rate, that many lone requests a second are refused (for a tenant's
limits, say: each is an open task until --task-timeout-s, 300 s), and the time to build the state is given too
(median of 5).
etcd's memory grows with the size of what is rewritten (`python -m bench.etcd_growth`), so the state should not grow
with the traffic.

    python -m bench.handover_state_size                     # a few seconds
    python -m bench.handover_state_size --refused-rate 50   # an overload: 10,000 refused requests open
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.report import positive_int
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerService
from services.scheduler.tasks import request_task, workflow_task


async def state_bytes(rate: int, lone_rate: int, minutes: int, refused_rate: int = 0) -> tuple[int, float]:
    """The state's size in bytes, and the median time to build it in seconds."""
    now = [0.0]
    service = SchedulerService(SchedulerConfig(), Telemetry("scheduler/bench", "none"), clock=lambda: now[0])
    try:
        for second in range(minutes * 60):
            now[0] = float(second)
            for n in range(rate):
                workflow = f"wf-{second:05d}-{n:03d}-0c5d2b1e-4a7e-4c7e-9f3a"  # as long as a UUID
                service._policy.restore_workflow_state({workflow: 0.0123})
                service._tasks.record(workflow_task(workflow), 1, 1, 0.0123, True, now[0])
            for n in range(lone_rate):
                service._tasks.record(request_task(f"rq-{second:05d}-{n:03d}-0c5d2b1e-4a7e-4c7e"), 1, 1, 0.001, True,
                                      now[0])
            for n in range(refused_rate):
                service._tasks.record(request_task(f"rf-{second:05d}-{n:03d}-0c5d2b1e-4a7e-4c7e"), 1, 1, 0.0, False,
                                      now[0])
            service._tasks.expire(now[0])
        times = []
        for _ in range(5):
            started = time.perf_counter()
            state = json.dumps(service._hand_over_state())
            times.append(time.perf_counter() - started)
        return len(state), statistics.median(times)
    finally:
        await service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=positive_int, default=6, help="single-step workflows a second")
    parser.add_argument("--lone-rate", type=int, default=100, help="lone requests a second")
    parser.add_argument("--minutes", type=positive_int, default=30)
    parser.add_argument("--refused-rate", type=int, default=0, help="lone requests refused a second")
    args = parser.parse_args()
    size, build_s = asyncio.run(state_bytes(args.rate, args.lone_rate, args.minutes, args.refused_rate))
    print(f"hand-over state after {args.minutes} min of {args.rate} single-step workflows, {args.lone_rate} lone "
          f"requests and {args.refused_rate} refused ones a second: {size} bytes, built and encoded in "
          f"{build_s * 1000:.1f} ms")


if __name__ == "__main__":
    main()
