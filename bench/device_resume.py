"""Kill-resume on real vLLM engines: two vllm node agents in a local mesh, one killed mid-stream.

    python -m bench.device_resume --model-dir DIR --out OUT_DIR [--node-arg=--kv-cache-bytes=...]

A greedy stream runs uninterrupted first (the reference), then again with the serving node
SIGKILLed after --kill-after tokens; the router resumes it on the other node from its checkpoint.
Reported: whether the stream completed, how many tokens match the reference, the client's stall
across the kill, and the router's metrics (TTFT and inter-token histograms, migrations) scraped
from its /metrics. Exits 1 when the stream did not complete or did not move to the other node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster


async def stream(router: str, model: str, prompt: list[int], max_tokens: int,
                 on_tokens: Any = None) -> tuple[list[int], list[str], list[float]]:
    """(tokens, serving node ids in order, arrival time of each chunk with tokens)."""
    tokens: list[int] = []
    nodes: list[str] = []
    arrivals: list[float] = []
    async with BatonClient(router) as client:
        async for chunk in client.generate(model, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                           timeout_s=300):
            if chunk.token_ids:
                arrivals.append(time.perf_counter())
                tokens += chunk.token_ids
            if chunk.node_id and chunk.node_id not in nodes:
                nodes.append(chunk.node_id)
            if on_tokens is not None:
                on_tokens(chunk, tokens)
    return tokens, nodes, arrivals


def router_metrics(cluster: LocalCluster) -> dict[str, float]:
    """The router's baton_* samples summed over their labels, by sample name."""
    assert cluster.router is not None
    with urllib.request.urlopen(f"http://{cluster.router.metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("baton_router_") and (line.split("{")[0].endswith(("_count", "_sum", "_total"))):
            name = line.split("{")[0].split(" ")[0]
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def kill_resume(cluster: LocalCluster, model: str, prompt: list[int], max_tokens: int,
                      kill_after: int) -> dict[str, Any]:
    assert cluster.router is not None
    router = cluster.router.address
    reference, reference_nodes, _ = await stream(router, model, prompt, max_tokens)
    killed: list[str] = []

    def kill_when_due(chunk: Any, tokens: list[int]) -> None:
        if not killed and len(tokens) >= kill_after and chunk.node_id:
            process = next(p for p in cluster.nodes if p.name == chunk.node_id)
            process.signal(signal.SIGKILL)
            killed.append(process.name)

    tokens, nodes, arrivals = await stream(router, model, prompt, max_tokens, kill_when_due)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    matched = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b),
                   min(len(tokens), len(reference)))
    return {
        "max_tokens": max_tokens, "kill_after": kill_after, "reference_nodes": reference_nodes,
        "killed": killed, "nodes": nodes, "num_tokens": len(tokens),
        "completed": len(tokens) == max_tokens, "moved": len(nodes) == 2 and nodes[0] in killed,
        "tokens_matching_reference": matched, "identical_to_reference": tokens == reference,
        "longest_gap_ms": max(gaps) * 1000 if gaps else 0.0,
        "median_gap_ms": sorted(gaps)[len(gaps) // 2] * 1000 if gaps else 0.0,
        "router_metrics": router_metrics(cluster),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kill-after", type=int, default=64, help="tokens received before the kill")
    parser.add_argument("--gpu", default="h200", help="the nodes' GPU generation (their metrics label)")
    parser.add_argument("--node-arg", action="append", default=[], help="one more node agent flag (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="cluster start-up limit")
    parser.add_argument("--out", type=Path, required=True, help="folder for device_resume.json")
    parser.add_argument("--workdir", type=Path, default=None, help="where the cluster's logs and etcd data go "
                        "(kept; default: a temporary folder, removed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = json.loads((args.model_dir / "config.json").read_text())
    model = args.model_dir.resolve().name
    # Ids 2.. (0 and 1 are BOS and EOS), deterministic, within the model's vocabulary.
    prompt = [(7 * i + 3) % (config["vocab_size"] - 2) + 2 for i in range(args.prompt_tokens)]
    spec = ClusterSpec(num_nodes=2, gpus=(args.gpu, args.gpu), engine="vllm", model=model,
                       model_dir=str(args.model_dir.resolve()), metrics=True, node_args=tuple(args.node_arg),
                       router_args=("--stall-floor-s=2",), log_level="WARNING")
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(spec, args.workdir)
    started = time.monotonic()
    try:
        cluster.start(timeout_s=args.timeout_s)
        start_s = time.monotonic() - started
        result = asyncio.run(kill_resume(cluster, model, prompt, args.max_tokens, args.kill_after))
    finally:
        cluster.stop()
    result["cluster_start_s"] = start_s
    (args.out / "device_resume.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["completed"] and result["moved"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
