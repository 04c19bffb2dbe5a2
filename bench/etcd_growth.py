"""etcd's database under the scheduler leader's hand-over state, rewritten as the leader does, with and without the
auto-compaction `baton up` and the compose cluster run etcd with (baton/cluster.py ETCD_COMPACTION).

Each run starts its own etcd on free loopback ports, puts a --state-kb value to /baton/scheduler/state --writes
times in --rounds rounds, and between rounds waits --pause-s (longer than the compaction period given) and prints
the database's size. Uncompacted, etcd keeps every revision: the size grows by the value's size per write, to the
2 GB quota past which etcd refuses every write.

    python -m bench.etcd_growth             # about 1 min on a 2-core machine
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
_SHORT_COMPACTION = (*ETCD_COMPACTION[:-1], "5s")


async def grow(workdir: Path, compaction: tuple[str, ...], value: bytes, writes: int, rounds: int,
               pause_s: float) -> list[float]:
    """The database's size in MB after each round of writes."""
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
                sizes.append((await client.status()).db_size / 1e6)
        return sizes
    finally:
        etcd.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-kb", type=positive_int, default=20, help="size of the state written")
    parser.add_argument("--writes", type=positive_int, default=2000, help="writes per round (a leader: one a second)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--pause-s", type=float, default=12.0, help="wait after each round (over 5 s: a compaction)")
    args = parser.parse_args()
    value = os.urandom(args.state_kb * 512).hex().encode()
    for name, compaction in (("uncompacted", ()), ("compacted every 5 s", _SHORT_COMPACTION)):
        with tempfile.TemporaryDirectory() as workdir:
            sizes = asyncio.run(grow(Path(workdir), compaction, value, args.writes, args.rounds, args.pause_s))
        print(f"{name:>20}: database after each {args.writes} writes of {args.state_kb} KB: "
              + ", ".join(f"{size:.1f} MB" for size in sizes))


if __name__ == "__main__":
    main()
