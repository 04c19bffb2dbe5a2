"""The size of the scheduler leader's hand-over state (written to etcd every second) after --minutes of --rate
single-step workflows and --lone-rate lone requests a second, the task ledger and the policy's workflow spend fed as
Finished and Place feed them.
etcd's memory grows with the size of what is rewritten (`python -m bench.etcd_growth`), so the state should not grow
with the traffic.

    python -m bench.handover_state_size      # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json

from bench.report import positive_int
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerService
from services.scheduler.tasks import request_task, workflow_task


async def state_bytes(rate: int, lone_rate: int, minutes: int) -> int:
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
        return len(json.dumps(service._hand_over_state()))
    finally:
        await service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=positive_int, default=6, help="single-step workflows a second")
    parser.add_argument("--lone-rate", type=int, default=100, help="lone requests a second")
    parser.add_argument("--minutes", type=positive_int, default=30)
    args = parser.parse_args()
    size = asyncio.run(state_bytes(args.rate, args.lone_rate, args.minutes))
    print(f"hand-over state after {args.minutes} min of {args.rate} single-step workflows and {args.lone_rate} lone "
          f"requests a second: {size} bytes")


if __name__ == "__main__":
    main()
