"""vLLM's prefill and decode step times on this machine against ../shared/perf's timing model.

    python -m bench.step_times --model-dir DIR --out OUT_DIR

Prefill: one request of n new tokens (prefix caching off, one step: the token budget covers it),
timed from submission to its first token. Decode: B requests of the same context length, timed to
1 token and to 1+K tokens; the difference over K is one decode step of a batch of B. Each point is
the median of its repeats after a warm-up. The model is the fitted row of ../shared/perf
(fitted_coefficients.csv, which the sim engine carries as its coefficients.csv) for this GPU and
Meta-Llama-3-8B; a model of another shape (bench.gpu_model's baton-shape.json) is compared
with that row scaled by its size (a rough guide: weights, KV bytes and attention scale, fixed
overheads do not), and with the row as it is.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_model import REFERENCE_SHAPE, SHAPES, Shape
from bench.report import machine_line

PERF_MODEL = "Meta-Llama-3-8B"


@dataclass(frozen=True)
class Scale:
    """How a shape's step costs compare with the reference shape's, term by term."""

    weights: float  # linear layers: FLOPs per token and bytes of weights read per step
    kv: float  # KV bytes per context token
    attention: float  # prefill attention FLOPs per token pair (layers x hidden)

    @classmethod
    def of(cls, shape: Shape) -> Scale:
        ref = REFERENCE_SHAPE
        return cls(weights=shape.num_body_params / ref.num_body_params,
                   kv=shape.kv_bytes_per_token / ref.kv_bytes_per_token,
                   attention=(shape.num_hidden_layers * shape.hidden_size)
                   / (ref.num_hidden_layers * ref.hidden_size))


UNSCALED = Scale(1.0, 1.0, 1.0)


# ../shared/perf/fitted_coefficients.csv, as the sim engine carries it (a GPU machine has no ../shared).
PERF_CSV = Path(__file__).resolve().parents[1] / "services" / "node_agent" / "engines" / "sim" / "coefficients.csv"


def perf_row(perf_csv: Path, gpu: str, model: str = PERF_MODEL) -> dict[str, float]:
    """The fitted coefficients of (gpu, model, tensor-parallel 1)."""
    with open(perf_csv, newline="") as rows:
        for row in csv.DictReader(rows):
            if row["gpu"] == gpu and row["model"] == model and row["tp"] == "1":
                return {key: float(value) for key, value in row.items()
                        if key not in ("gpu", "model", "tp", "basis") and value}
    raise SystemExit(f"--gpu {gpu}: no row for {model} at tensor-parallel 1 in {perf_csv}")


def modelled_prefill_ms(row: dict[str, float], num_tokens: int, scale: Scale = UNSCALED) -> float:
    """prefill_ms = max(floor, a + b·n) + c·n², terms scaled to the shape."""
    linear = max(row["prefill_floor_ms"], row["a_ms"] + row["b_ms_per_tok"] * num_tokens)
    return linear * scale.weights + row["c_ms_per_tok2"] * num_tokens ** 2 * scale.attention


def modelled_decode_ms(row: dict[str, float], batch: int, context_tokens: int, scale: Scale = UNSCALED) -> float:
    """decode_step_ms = d + e·B + f·C, terms scaled to the shape."""
    return ((row["d_ms"] + row["e_ms_per_seq"] * batch) * scale.weights
            + row["f_ms_per_ctx_tok"] * context_tokens * scale.kv)


def gpu_generation(name: str) -> str:
    """'NVIDIA H200' -> 'h200', as ../shared/perf names GPUs."""
    lowered = name.lower()
    for gpu in ("h200", "h100", "a100", "a40", "a10g", "l4"):
        if gpu in lowered:
            return gpu
    raise SystemExit(f"GPU {name!r}: not one of ../shared/perf's (h200, h100, a100, a40, a10g, l4); pass --gpu")


class Timer:
    """Times generate calls on one vLLM engine with distinct random prompts."""

    def __init__(self, llm: Any, vocab_size: int, seed: int = 0) -> None:
        self._llm = llm
        self._vocab_size = vocab_size
        self._rng = random.Random(seed)

    def _prompts(self, batch: int, num_tokens: int) -> list[dict[str, list[int]]]:
        # Ids 2.. : 0 and 1 are the tokenizer's BOS and EOS.
        return [{"prompt_token_ids": [self._rng.randrange(2, self._vocab_size) for _ in range(num_tokens)]}
                for _ in range(batch)]

    def seconds(self, batch: int, num_tokens: int, max_tokens: int) -> float:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        prompts = self._prompts(batch, num_tokens)
        started = time.perf_counter()
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != [max_tokens] * batch:
            raise RuntimeError(f"expected {max_tokens} tokens from each of {batch} requests, got {got}")
        return elapsed


def measure(timer: Timer, prompt_lens: list[int], batches: list[int], decode_context: int, decode_tokens: int,
            repeats: int) -> dict[str, list[dict[str, float]]]:
    prefill = []
    for n in prompt_lens:
        timer.seconds(1, n, 1)  # warm-up at this size
        samples = [timer.seconds(1, n, 1) * 1000 for _ in range(repeats)]
        prefill.append({"tokens": n, "measured_ms": statistics.median(samples)})
    decode = []
    for batch in batches:
        timer.seconds(batch, decode_context, 1 + decode_tokens)  # warm-up at this batch
        steps = []
        for _ in range(repeats):
            first = timer.seconds(batch, decode_context, 1)
            longer = timer.seconds(batch, decode_context, 1 + decode_tokens)
            steps.append((longer - first) * 1000 / decode_tokens)
        # Mean context per sequence over the timed steps.
        context = batch * (decode_context + 1 + decode_tokens // 2)
        decode.append({"batch": batch, "context_tokens": context, "measured_ms": statistics.median(steps)})
    return {"prefill": prefill, "decode": decode}


def compare(results: dict[str, list[dict[str, float]]], row: dict[str, float], scale: Scale) -> None:
    """Add each point's modelled times (the row as it is, and scaled to the shape) in place."""
    for point in results["prefill"]:
        n = int(point["tokens"])
        point["model_8b_ms"] = modelled_prefill_ms(row, n)
        point["model_scaled_ms"] = modelled_prefill_ms(row, n, scale)
    for point in results["decode"]:
        batch, context = int(point["batch"]), int(point["context_tokens"])
        point["model_8b_ms"] = modelled_decode_ms(row, batch, context)
        point["model_scaled_ms"] = modelled_decode_ms(row, batch, context, scale)


def markdown(results: dict[str, Any]) -> str:
    lines = [f"GPU `{results['device']}` (perf row: {results['gpu']}, {PERF_MODEL}); model shape "
             f"`{results['shape']}` ({results['body_params_b']:.3g}B parameters in its layers); vLLM "
             f"{results['vllm']}, {'eager' if results['eager'] else 'compiled, CUDA graphs'}.",
             machine_line(), "",
             "| step | measured (ms) | model, 8B row (ms) | model scaled to this shape (ms) | measured / scaled |",
             "|---|---:|---:|---:|---:|"]
    for point in results["prefill"]:
        lines.append(f"| prefill {int(point['tokens'])} tokens | {point['measured_ms']:.2f} | "
                     f"{point['model_8b_ms']:.2f} | {point['model_scaled_ms']:.2f} | "
                     f"{point['measured_ms'] / point['model_scaled_ms']:.2f} |")
    for point in results["decode"]:
        lines.append(f"| decode, batch {int(point['batch'])}, {int(point['context_tokens'])} context tokens | "
                     f"{point['measured_ms']:.2f} | {point['model_8b_ms']:.2f} | {point['model_scaled_ms']:.2f} | "
                     f"{point['measured_ms'] / point['model_scaled_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="bench.gpu_model's output")
    parser.add_argument("--perf-csv", type=Path, default=PERF_CSV,
                        help="fitted coefficients (default: the sim engine's copy of ../shared/perf's)")
    parser.add_argument("--gpu", default="", help="perf row's GPU (default: from torch.cuda's device name)")
    parser.add_argument("--prompt-lens", type=int_list, default=[128, 512, 2048, 4096], help="prefill sizes")
    parser.add_argument("--batches", type=int_list, default=[1, 8, 32, 128], help="decode batch sizes")
    parser.add_argument("--decode-context", type=int, default=512, help="prompt tokens of each decoding sequence")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per point")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point (median reported)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (faster start)")
    parser.add_argument("--kv-cache-bytes", type=int, default=0, help="KV cache size (0: vLLM's, from "
                        "--gpu-memory-utilization)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of GPU memory")
    parser.add_argument("--block-size", type=int, default=0, help="tokens per KV block (0: vLLM's default; CPU: 32)")
    parser.add_argument("--out", type=Path, required=True, help="folder for step_times.json and step_times.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import vllm
    from vllm import LLM

    marker = args.model_dir / "baton-shape.json"
    shape_name = json.loads(marker.read_text())["shape"] if marker.exists() else "tiny"
    shape = SHAPES[shape_name]
    config = json.loads((args.model_dir / "config.json").read_text())
    device, gpu = "cpu", args.gpu
    try:
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
            gpu = gpu or gpu_generation(device)
    except ImportError:
        pass
    if not gpu:
        raise SystemExit("no GPU found: pass --gpu to name the perf row to compare with (a dry run)")
    row = perf_row(args.perf_csv, gpu)
    longest = max(args.prompt_lens)
    engine_args: dict[str, Any] = dict(
        model=str(args.model_dir), enable_prefix_caching=False, enforce_eager=args.eager,
        max_model_len=max(longest, args.decode_context + args.decode_tokens + 8) + 8,
        # One step prefills the longest prompt whole, and admits every decoding batch's prompts at once.
        max_num_batched_tokens=max(longest, 2048), max_num_seqs=max(max(args.batches), 8),
        gpu_memory_utilization=args.gpu_memory_utilization)
    if args.kv_cache_bytes:
        engine_args["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.block_size:
        engine_args["block_size"] = args.block_size
    llm = LLM(**engine_args)
    results: dict[str, Any] = measure(Timer(llm, config["vocab_size"]), args.prompt_lens, args.batches,
                                      args.decode_context, args.decode_tokens, args.repeats)
    compare(results, row, Scale.of(shape))
    results.update(device=device, gpu=gpu, shape=shape_name, body_params_b=shape.num_body_params / 1e9,
                   vllm=vllm.__version__, eager=args.eager, perf_row=row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_times.json").write_text(json.dumps(results, indent=2))
    (args.out / "step_times.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
