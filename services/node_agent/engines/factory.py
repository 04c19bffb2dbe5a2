"""Build the engine a node agent hosts, and the NodeInfo it registers."""

from __future__ import annotations

from baton.v1 import common_pb2
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.base import Engine
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.engine import SimEngine
from services.node_agent.engines.sim.models import GPU_SPECS, get_model, kv_capacity_blocks
from services.node_agent.engines.sim.timing import load_coefficients


def build_engine(config: NodeAgentConfig) -> tuple[Engine, common_pb2.NodeInfo]:
    """The configured engine and this node's registration."""
    if config.engine != "sim":
        raise SystemExit("--engine vllm: not available in this build (needs a GPU and vllm); use --engine sim")
    if config.gpu not in GPU_SPECS:
        raise SystemExit(f"--gpu: unknown GPU {config.gpu!r}; known: {', '.join(sorted(GPU_SPECS))}")
    gpu = GPU_SPECS[config.gpu]
    try:
        model = get_model(config.model)
        timing = load_coefficients(config.gpu, model.perf_model)
    except KeyError as exc:
        raise SystemExit(f"--model/--gpu: {exc.args[0]}") from None
    hbm_bytes = int(config.hbm_gb * 1e9) if config.hbm_gb > 0 else gpu.hbm_bytes
    num_blocks = config.kv_blocks or kv_capacity_blocks(hbm_bytes, model)
    if num_blocks <= 0:
        raise SystemExit(f"--hbm-gb: {hbm_bytes / 1e9:.0f} GB leaves no room for KV cache of {model.name}")
    core = SimEngineCore(
        model,
        timing,
        num_kv_blocks=num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    engine = SimEngine(core, model.name, config.speed)
    node_info = common_pb2.NodeInfo(
        node_id=config.node_id,
        address=config.listen,
        gpu=config.gpu,
        hbm_bytes=hbm_bytes,
        region=config.region,
        price_per_hour=config.price_per_hour or gpu.price_per_hour,
        models=[
            common_pb2.ModelInfo(
                name=model.name,
                max_context_tokens=model.max_context_tokens,
                tokenizer=engine.tokenizer,
                vocab_size=model.vocab_size,
                is_warm=True,
            )
        ],
        kv_block_size=engine.kv_block_size,
        engine="sim",
    )
    return engine, node_info
