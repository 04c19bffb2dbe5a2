"""Scheduler leader failover: from SIGKILL of the leader to the first placement by its successor.

Three scheduler replicas with the default 3 s lease. A prober sends Place to every live replica
every few milliseconds; the time from the kill to the first Place a new leader accepts is the
failover time. After each trial the killed replica restarts as a standby.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from pathlib import Path

import grpc

from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess
from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from bench.report import machine_line, positive_int, write_section

SECTION = "## Scheduler leader failover (issue 4)"
PROBE_INTERVAL_S = 0.005


async def first_placement_after(survivors: list[ManagedProcess], model: str, timeout_s: float) -> str:
    """Probe every survivor until one places; the name of the one that did."""
    channels = {p.name: grpc.aio.insecure_channel(p.address) for p in survivors}
    request = scheduler_pb2.PlaceRequest(request_id="failover-probe", model=model, num_prompt_tokens=1, max_tokens=1)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, channel in channels.items():
                try:
                    await scheduler_pb2_grpc.SchedulerStub(channel).Place(request, timeout=0.5)
                    return name
                except grpc.aio.AioRpcError:
                    pass  # FAILED_PRECONDITION from a standby until the election is decided
            await asyncio.sleep(PROBE_INTERVAL_S)
        raise RuntimeError(f"no new leader placed within {timeout_s} s")
    finally:
        for channel in channels.values():
            await channel.close()


def trial(cluster: LocalCluster) -> tuple[float, str, str]:
    """Kill the leader; seconds until a successor placed, and who was killed and who took over."""
    leader_id = cluster.cluster_state().leader_id
    leader = next(p for p in cluster.schedulers if p.name == leader_id)
    survivors = [p for p in cluster.schedulers if p is not leader]
    leader.signal(signal.SIGKILL)
    killed_at = time.perf_counter()
    successor = asyncio.run(first_placement_after(survivors, cluster.spec.model, 30))
    elapsed = time.perf_counter() - killed_at
    cluster.restart(leader)
    return elapsed, leader_id, successor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=positive_int, default=10)
    parser.add_argument("--lease-ttl-s", type=positive_int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    command = "python -m bench.leader_failover " + " ".join(sys.argv[1:] if argv is None else argv)
    cluster = LocalCluster(ClusterSpec(num_nodes=1, num_schedulers=3, speed=0.0, lease_ttl_s=args.lease_ttl_s,
                                       log_level="WARNING"))
    times = []
    try:
        cluster.start()
        for i in range(args.trials):
            elapsed, killed, successor = trial(cluster)
            times.append(elapsed)
            print(f"trial {i}: killed {killed}, {successor} placed after {elapsed * 1000:.0f} ms", flush=True)
            cluster.wait_nodes_visible(1, 30)
    finally:
        cluster.stop()
    median, worst = statistics.median(times) * 1000, max(times) * 1000
    table = ("| trials | lease TTL | failover median (ms) | failover max (ms) |\n|---:|---:|---:|---:|\n"
             f"| {len(times)} | {args.lease_ttl_s} s | {median:.0f} | {worst:.0f} |")
    print(table)
    if args.out is not None:
        write_section(args.out, SECTION, f"""{SECTION}

Command: `{command.strip()}`

{machine_line()}
Three scheduler replicas, lease TTL {args.lease_ttl_s} s. Each trial SIGKILLs the leader and probes every
surviving replica with Place every {PROBE_INTERVAL_S * 1000:.0f} ms; the failover time runs from the kill to
the first placement a new leader accepts. The killed replica then restarts as a standby.

{table}

A killed leader cannot resign, so its election key stays until etcd expires its lease: the failover time
is the lease TTL (counted from the leader's last keep-alive, sent every TTL/3) plus etcd's expiry check and
the watch that wakes the next candidate. A leader that shuts down cleanly resigns, and its successor takes
over at once.
""")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
