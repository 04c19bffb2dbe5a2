"""The mesh's own overhead: the same streams through the router and straight from the node agent, sim timing off."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import common_pb2, node_agent_pb2, node_agent_pb2_grpc, router_pb2, router_pb2_grpc
from bench.report import machine_line, positive_int, write_section

SECTION = "## Mesh overhead (issue 2)"
NUM_WARMUP = 20
CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Stream:
    """One finished stream, timed from the call."""

    ttft_s: float
    duration_s: float
    num_tokens: int


StreamFn = Callable[[int], Awaitable[Stream]]


def prompt_for(tag: str, number: int, num_tokens: int) -> str:
    """An ASCII prompt of exactly num_tokens bytes whose first block is unique to (tag, number)."""
    head = f"{tag}{number:07d} "
    filler = "the quick brown fox jumps over the lazy dog " * (num_tokens // 44 + 1)
    return (head + filler)[:num_tokens]


async def timed(chunks: AsyncIterator[tuple[int, ...]], started: float, max_tokens: int) -> Stream:
    """Time to the first chunk with tokens, and to the end, of one stream of token-id chunks."""
    ttft = -1.0
    num_tokens = 0
    async for token_ids in chunks:
        if token_ids and ttft < 0:
            ttft = time.perf_counter() - started
        num_tokens += len(token_ids)
    duration = time.perf_counter() - started
    if num_tokens != max_tokens:
        raise RuntimeError(f"stream returned {num_tokens} tokens, expected max_tokens={max_tokens}")
    return Stream(ttft, duration, num_tokens)


def direct_path(stub: node_agent_pb2_grpc.NodeAgentStub, model: str, args: argparse.Namespace) -> StreamFn:
    """Path A: NodeAgent.Generate on the node itself."""

    async def run(number: int) -> Stream:
        prompt = list(prompt_for("a", number, args.prompt_tokens).encode())
        sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        request = node_agent_pb2.NodeGenerateRequest(request_id=f"bench-a-{number}", model=model,
                                                     prompt_token_ids=prompt, sampling=sampling)
        started = time.perf_counter()
        call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
        return await timed((tuple(c.token_ids) async for c in call), started, args.max_tokens)

    return run


def router_path(stub: router_pb2_grpc.RouterStub, model: str, args: argparse.Namespace) -> StreamFn:
    """Path B: Router.Generate, which places the request and relays the node's stream."""

    async def run(number: int) -> Stream:
        request = router_pb2.GenerateRequest(request_id=f"bench-b-{number}", model=model, ignore_eos=True,
                                             prompt=prompt_for("b", number, args.prompt_tokens),
                                             max_tokens=args.max_tokens)
        started = time.perf_counter()
        call = stub.Generate(request, timeout=CALL_TIMEOUT_S)
        return await timed((tuple(c.token_ids) async for c in call), started, args.max_tokens)

    return run


async def concurrent_round(path: StreamFn, first: int, concurrency: int) -> float:
    """Aggregate tokens/s of `concurrency` streams started together, over the wall time of all of them."""
    started = time.perf_counter()
    streams = await asyncio.gather(*(path(first + i) for i in range(concurrency)))
    return sum(s.num_tokens for s in streams) / (time.perf_counter() - started)


async def measure(cluster: LocalCluster, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Warm-up, then interleaved sequential streams, then interleaved concurrent rounds, per path."""
    assert cluster.router is not None
    model = cluster.spec.model
    async with grpc.aio.insecure_channel(cluster.nodes[0].address) as node_channel, \
            grpc.aio.insecure_channel(cluster.router.address) as router_channel:
        paths = {
            "direct": direct_path(node_agent_pb2_grpc.NodeAgentStub(node_channel), model, args),
            "router": router_path(router_pb2_grpc.RouterStub(router_channel), model, args),
        }
        sequential: dict[str, list[Stream]] = {name: [] for name in paths}
        for number in range(NUM_WARMUP + args.requests):
            for name, path in paths.items():  # A, B, A, B: both see the same machine state
                stream = await path(number)
                if number >= NUM_WARMUP:
                    sequential[name].append(stream)
        number = NUM_WARMUP + args.requests
        aggregate: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, path in paths.items():
                aggregate[name].append(await concurrent_round(path, number, args.concurrency))
            number += args.concurrency
    results: dict[str, dict[str, float]] = {}
    for name, streams in sequential.items():
        ttfts = statistics.quantiles([s.ttft_s * 1000 for s in streams], n=100, method="inclusive")
        rates = [s.num_tokens / s.duration_s for s in streams]
        results[name] = {"ttft_p50": ttfts[49], "ttft_p99": ttfts[98], "rate_p50": statistics.median(rates),
                         "aggregate": statistics.fmean(aggregate[name])}
    return results


def table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    """The results as a markdown table: each metric for both paths and their difference or ratio."""
    direct, router = results["direct"], results["router"]
    added, ratio = (lambda d, r: f"{r - d:+.2f} ms"), (lambda d, r: f"{r / d:.2f}x")
    rows = [
        ("TTFT p50 (ms)", "ttft_p50", "{:.2f}", added),
        ("TTFT p99 (ms)", "ttft_p99", "{:.2f}", added),
        ("tokens/s per stream, p50", "rate_p50", "{:.0f}", ratio),
        (f"aggregate tokens/s, {args.concurrency} concurrent streams", "aggregate", "{:.0f}", ratio),
    ]
    lines = ["| metric | direct (node agent) | through router | router vs direct |", "|---|---:|---:|---:|"]
    for label, key, fmt, compare in rows:
        lines.append(f"| {label} | {fmt.format(direct[key])} | {fmt.format(router[key])} | "
                     f"{compare(direct[key], router[key])} |")
    return "\n".join(lines)


def section(results: dict[str, dict[str, float]], args: argparse.Namespace, command: str) -> str:
    """The docs/benchmarks.md section: command, machine, date, table and what the numbers say."""
    direct, router = results["direct"], results["router"]
    num_cpus = len(os.sched_getaffinity(0))
    return f"""{SECTION}

Command: `{command}`

{machine_line()}
One node, sim engine with `speed=0` (no modelled GPU time), {args.prompt_tokens}-token prompts, \
`max_tokens={args.max_tokens}`, `ignore_eos`; {NUM_WARMUP} warm-up requests per path, then {args.requests} \
sequential streams per path and {args.rounds} rounds of {args.concurrency} concurrent streams per path, \
interleaved direct/router. Every prompt is distinct, so neither path gets prefix-cache hits.

{table(results, args)}

With the engine's timing off, the differences are the mesh's own cost: the router's validation and \
tokenization, its Place call to the scheduler (which in turn asks the kvindex for cached prefixes) before \
the first token can be asked for, and a second gRPC hop that re-encodes every chunk. \
The router adds {router["ttft_p50"] - direct["ttft_p50"]:.2f} ms to TTFT at p50 and \
{router["ttft_p99"] - direct["ttft_p99"]:.2f} ms at p99. One router process relayed \
{router["aggregate"]:.0f} tokens/s across {args.concurrency} concurrent streams, \
{router["aggregate"] / direct["aggregate"]:.0%} of what the node agent streamed directly. \
The client, router, node agent, scheduler, kvindex and etcd all share this {num_cpus}-CPU machine, so these \
numbers include CPU contention between them; a router on cores of its own would likely relay more.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=positive_int, default=200, help="sequential streams per path")
    parser.add_argument("--concurrency", type=positive_int, default=32, help="concurrent streams per round")
    parser.add_argument("--rounds", type=positive_int, default=10, help="concurrent rounds per path")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="completion tokens per stream")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt tokens per stream")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write the section into")
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error(f"--requests: at least 2 are needed for percentiles, got {args.requests}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Start a one-node cluster with sim timing off, measure both paths, report, stop the cluster."""
    args = parse_args(argv)
    command = "python -m bench.mesh_overhead " + " ".join(sys.argv[1:] if argv is None else argv)
    cluster = LocalCluster(ClusterSpec(num_nodes=1, speed=0.0, log_level="WARNING"))
    try:
        cluster.start()
        results = asyncio.run(measure(cluster, args))
    finally:
        cluster.stop()
    print(table(results, args))
    if args.out is not None:
        write_section(args.out, SECTION, section(results, args, command.strip()))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
