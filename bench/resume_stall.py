"""Resume stall: from the last token before a node dies to the first token after, by context length.

Two h100 nodes in real time (sim engine, speed 1). Each trial streams a completion through the
router, SIGKILLs the serving node after some tokens, and times the gap the client sees. "cached":
both nodes were warmed with the prompt first, so the survivor re-prefills only the generated
tokens; "cold": the survivor has nothing cached and re-prefills the whole context.
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

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc
from bench.report import machine_line, positive_int, write_section
from services.common.block_hash import block_hashes

SECTION = "## Resume stall (issue 3)"
MODEL = "sim-llama-3.1-8b"


def prompt_tokens(trial: str, num_tokens: int) -> list[int]:
    """A prompt of num_tokens byte tokens whose first block is unique to the trial."""
    text = f"{trial:<15} " + "all work and no play makes a long context " * (num_tokens // 40 + 1)
    return list(text.encode()[:num_tokens])


async def warm(cluster: LocalCluster, prompt: list[int]) -> None:
    """Prefill prompt on every node, straight to the node agents, and wait until the kvindex knows."""
    for node in cluster.nodes:
        async with grpc.aio.insecure_channel(node.address) as channel:
            request = node_agent_pb2.NodeGenerateRequest(
                request_id=f"warm-{node.name}-{time.monotonic_ns()}", model=MODEL, prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True))
            async for _ in node_agent_pb2_grpc.NodeAgentStub(channel).Generate(request, timeout=120):
                pass
    assert cluster.kvindex is not None
    hashes = block_hashes(prompt)
    async with grpc.aio.insecure_channel(cluster.kvindex.address) as channel:
        stub = kvindex_pb2_grpc.KVIndexStub(channel)
        deadline = time.monotonic() + 30
        while True:
            reply = await stub.QueryOverlap(kvindex_pb2.OverlapRequest(model=MODEL, block_hashes=hashes))
            if sorted(reply.matched_blocks.values()) == [len(hashes)] * len(cluster.nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("kvindex never saw the warmed prompt on every node")
            await asyncio.sleep(0.05)


async def trial(cluster: LocalCluster, prompt: list[int], kill_after: int, max_tokens: int) -> tuple[float, int]:
    """Stall in ms the client saw across the kill, and the tokens the new node recomputed."""
    assert cluster.router is not None
    last_before = first_after = None
    victim = ""
    recomputed = 0
    async with BatonClient(cluster.router.address) as client:
        received = 0
        async for chunk in client.generate(MODEL, prompt_token_ids=prompt, max_tokens=max_tokens,
                                           ignore_eos=True, timeout_s=300):
            now = time.perf_counter()
            received += len(chunk.token_ids)
            if not victim and received >= kill_after:
                victim = chunk.node_id
                last_before = now
                next(p for p in cluster.nodes if p.name == victim).signal(signal.SIGKILL)
            elif victim and chunk.node_id != victim and chunk.token_ids and first_after is None:
                first_after = now
            if chunk.finish_reason:
                recomputed = chunk.usage.recomputed_tokens
                if chunk.usage.num_migrations != 1:
                    raise RuntimeError(f"expected one migration, saw {chunk.usage.num_migrations}")
    if last_before is None or first_after is None:
        raise RuntimeError("the stream did not move to another node")
    cluster.restart(next(p for p in cluster.nodes if p.name == victim))
    cluster.wait_nodes_visible(len(cluster.nodes), 30)
    return (first_after - last_before) * 1000, recomputed


async def measure(cluster: LocalCluster, args: argparse.Namespace) -> list[tuple[int, str, list[float], int]]:
    rows = []
    for context in args.contexts:
        for cached in (False, True):
            stalls, recomputed = [], 0
            for i in range(args.trials):
                prompt = prompt_tokens(f"{context}-{cached}-{i}-{time.monotonic_ns()}", context)
                if cached:
                    await warm(cluster, prompt)
                stall, recomputed = await trial(cluster, prompt, args.kill_after, args.max_tokens)
                stalls.append(stall)
                print(f"context {context} {'cached' if cached else 'cold'} trial {i}: stall {stall:.0f} ms, "
                      f"{recomputed} tokens recomputed", flush=True)
            rows.append((context, "survivor caches the prompt" if cached else "survivor cold", stalls, recomputed))
    return rows


def table(rows: list[tuple[int, str, list[float], int]]) -> str:
    lines = ["| context (tokens) | survivor | stall median (ms) | stall max (ms) | tokens recomputed |",
             "|---:|---|---:|---:|---:|"]
    for context, case, stalls, recomputed in rows:
        lines.append(f"| {context} | {case} | {statistics.median(stalls):.0f} | {max(stalls):.0f} | {recomputed} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--trials", type=positive_int, default=3)
    parser.add_argument("--kill-after", type=positive_int, default=32, help="tokens received before the kill")
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m bench.resume_stall " + " ".join(sys.argv[1:] if argv is None else argv)
    cluster = LocalCluster(ClusterSpec(num_nodes=2, model=MODEL, speed=1.0, lease_ttl_s=2, log_level="WARNING"))
    try:
        cluster.start()
        rows = asyncio.run(measure(cluster, args))
    finally:
        cluster.stop()
    print(table(rows))
    if args.out is not None:
        write_section(args.out, SECTION, f"""{SECTION}

Command: `{command.strip()}`

{machine_line()}
Two h100 nodes serving `{MODEL}` in real time (sim engine, `speed=1`, timing from ../shared/perf), one router;
{args.trials} trials per row. Each trial streams `max_tokens={args.max_tokens}` through the router and SIGKILLs
the serving node once {args.kill_after} tokens have arrived; the stall is the gap the client sees between the
last token before the kill and the first token from the new node. "survivor caches the prompt": both nodes
were warmed with the prompt first, so the new node re-prefills only the generated tokens; "survivor cold":
it re-prefills the whole context. Tokens recomputed are the new node's prefilled tokens (context minus its
cache hit) of the last trial.

{table(rows)}
""")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
