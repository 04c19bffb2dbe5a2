"""Catalogue of simulated models and GPUs, and the KV capacity they leave."""

from __future__ import annotations

from dataclasses import dataclass

# Byte-level vocabulary: ids 0..255 are bytes, 256 is end-of-sequence.
BYTE_VOCAB_SIZE = 257
EOS_TOKEN_ID = 256

# vLLM's default gpu_memory_utilization, and the activation/CUDA-graph reserve
# the perf README measured on top of the weights.
_GPU_MEMORY_UTILIZATION = 0.9
_RUNTIME_RESERVE_BYTES = 2.4 * 2**30


@dataclass(frozen=True)
class SimModelSpec:
    """A model the simulated engine can serve."""

    name: str
    # The "model" column of coefficients.csv whose timing this model uses.
    perf_model: str
    weights_bytes: float
    kv_bytes_per_token: int
    max_context_tokens: int
    vocab_size: int = BYTE_VOCAB_SIZE
    eos_token_id: int = EOS_TOKEN_ID


@dataclass(frozen=True)
class GpuSpec:
    """A GPU generation: memory and a default price (price is configuration)."""

    name: str
    hbm_bytes: int
    price_per_hour: float


SIM_MODELS: dict[str, SimModelSpec] = {
    spec.name: spec
    for spec in (
        SimModelSpec(
            name="sim-llama-3-8b",
            perf_model="Meta-Llama-3-8B",
            weights_bytes=16.1e9,
            kv_bytes_per_token=131072,
            max_context_tokens=8192,
        ),
        # Llama-3.1-8B: Llama-3-8B's shapes and timing with a 128k context, for long-context work.
        SimModelSpec(
            name="sim-llama-3.1-8b",
            perf_model="Meta-Llama-3-8B",
            weights_bytes=16.1e9,
            kv_bytes_per_token=131072,
            max_context_tokens=131072,
        ),
        SimModelSpec(
            name="sim-llama-2-7b",
            perf_model="Llama-2-7b-hf",
            weights_bytes=13.5e9,
            kv_bytes_per_token=524288,
            max_context_tokens=4096,
        ),
    )
}

GPU_SPECS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("h100", 80 * 10**9, 4.25),
        GpuSpec("a100", 80 * 10**9, 2.21),
        GpuSpec("h200", 141 * 10**9, 6.0),
        GpuSpec("a40", 48 * 10**9, 1.28),
        GpuSpec("a10g", 24 * 10**9, 1.01),
        GpuSpec("l4", 24 * 10**9, 0.80),
    )
}


def get_model(name: str) -> SimModelSpec:
    """The simulated model called name; KeyError naming the known ones otherwise."""
    try:
        return SIM_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown simulated model {name!r}; known: {', '.join(sorted(SIM_MODELS))}") from None


# Cold start (shared/perf/README.md): reading weights is storage bound (12.7 GiB in 25 s from
# disk: 0.55 GB/s), and engine start-up adds compilation and CUDA-graph capture (4-8 s cached
# plus about 17 s). An 8B model: 16.1 GB / 0.55 GB/s + 20 s = 49 s, inside the 45-90 s reported.
DISK_BYTES_PER_S = 0.55e9
ENGINE_START_S = 20.0


def load_time_s(model: SimModelSpec, disk_bytes_per_s: float = DISK_BYTES_PER_S,
                engine_start_s: float = ENGINE_START_S) -> float:
    """Time to make model warm on a GPU from local disk: read the weights, then start the engine."""
    return model.weights_bytes / disk_bytes_per_s + engine_start_s


def kv_capacity_blocks(gpu_hbm_bytes: float, model: SimModelSpec, block_size: int = 16) -> int:
    """KV blocks that fit beside the weights: (HBM·0.9 − weights − 2.4 GiB) ÷ bytes per block."""
    free_bytes = gpu_hbm_bytes * _GPU_MEMORY_UTILIZATION - model.weights_bytes - _RUNTIME_RESERVE_BYTES
    return max(0, int(free_bytes // (model.kv_bytes_per_token * block_size)))
