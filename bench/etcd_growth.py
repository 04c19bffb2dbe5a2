"""etcd's database and memory under the scheduler leader's hand-over state, rewritten as the leader does: with
etcd's defaults, and with the flags `baton up` and the compose cluster run it with (baton/cluster.py ETCD_COMPACTION:
compaction every minute, here every 5 s so that a short run shows it; a snapshot every 5,000 writes).

Each run starts its own etcd on free loopback ports, puts a --state-kb value to /baton/scheduler/state --writes
times in --rounds rounds, and after each round waits --pause-s (longer than the compaction period) and prints the
database's size and etcd's resident memory. Uncompacted, etcd keeps every revision: the database grows by the value's
size per write, to the 2 GB quota past which etcd refuses every write. etcd keeps its raft log in memory up to its
next snapshot (100,000 writes by default), and 5,000 entries past it.

    python -m bench.etcd_growth             # about 2 min on a 2-core machine
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import aetcd

from baton.cluster import ETCD_COMPACTION, ManagedProcess, etcd_binary, free_port, wait_etcd_healthy
from bench.report import positive_int
from services.common import etcd_keys

# Compaction every few seconds, so that a short run shows what a minute's period does to a long one.
_SHORT_COMPACTION = tuple("5s" if flag == "1m" else flag for flag in ETCD_COMPACTION)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


async def grow(workdir: Path, compaction: tuple[str, ...], value: bytes, writes: int, rounds: int,
               pause_s: float) -> list[tuple[float, float]]:
    """The database's size and etcd's resident memory, in MB, after each round of writes."""
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    etcd = ManagedProcess(name="etcd", args=[
        etcd_binary(), "--name", "growth", "--data-dir", str(workdir / "etcd"),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"growth={peer_url}", "--log-level", "error", *compaction,
    ], log_path=workdir / "etcd.log", address=f"127.0.0.1:{client_port}")
    etcd.start()
    try:
        wait_etcd_healthy(etcd, 30.0)
        sizes = []
        async with aetcd.Client(host="127.0.0.1", port=client_port) as client:
            for _ in range(rounds):
                for _ in range(writes):
                    await client.put(etcd_keys.SCHEDULER_STATE.encode(), value)
                await asyncio.sleep(pause_s)
                assert etcd.proc is not None
                sizes.append(((await client.status()).db_size / 1e6, _rss_mb(etcd.proc.pid)))
        return sizes
    finally:
        etcd.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-kb", type=positive_int, default=20, help="size of the state written")
    parser.add_argument("--writes", type=positive_int, default=4000, help="writes per round (a leader: one a second)")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--pause-s", type=float, default=6.0, help="wait after each round (over 5 s: a compaction)")
    args = parser.parse_args()
    value = os.urandom(args.state_kb * 512).hex().encode()
    print(f"after each {args.writes} writes of {args.state_kb} KB: database MB / etcd's resident memory MB")
    for name, flags in (("etcd's defaults", ()), ("Baton's flags", _SHORT_COMPACTION)):
        with tempfile.TemporaryDirectory() as workdir:
            sizes = asyncio.run(grow(Path(workdir), flags, value, args.writes, args.rounds, args.pause_s))
        print(f"{name:>16}: " + ", ".join(f"{size:.0f} / {rss:.0f}" for size, rss in sizes))


if __name__ == "__main__":
    main()
