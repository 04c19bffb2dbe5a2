"""A node's load, as engines measure it and the scheduler weighs it; and its wire form."""

from __future__ import annotations

from dataclasses import dataclass

from baton.v1 import common_pb2


@dataclass(frozen=True)
class Load:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # KV blocks held by requests that have produced their first token.
    active_decode_blocks: int = 0
    # Prompt tokens admitted but not yet prefilled.
    pending_prefill_tokens: int = 0
    # Requests the engine has been handed since it started, refused ones included: the scheduler counts
    # a placement as load the node has not reported until this count shows the request arrived. None:
    # not counted (an agent older than the field), and every report supersedes all placements.
    num_received: int | None = None
    # The mean time of the engine's latest decode steps (about their last second, RecentSteps), the prefill
    # chunks riding in them included: the TPOT a request decoding there now sees. On a node that has
    # stopped decoding, those before it stopped. 0: none yet, or not reported.
    recent_decode_step_ms: float = 0.0


def load_to_proto(node_id: str, load: Load, reported_at_ms: int = 0) -> common_pb2.NodeLoad:
    message = common_pb2.NodeLoad(
        node_id=node_id,
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total,
        active_decode_blocks=load.active_decode_blocks,
        pending_prefill_tokens=load.pending_prefill_tokens,
        reported_at_ms=reported_at_ms,
        recent_decode_step_ms=load.recent_decode_step_ms,
    )
    if load.num_received is not None:
        message.num_received = load.num_received
    return message


def load_from_proto(message: common_pb2.NodeLoad) -> Load:
    return Load(
        num_running=message.num_running,
        num_waiting=message.num_waiting,
        kv_blocks_used=message.kv_blocks_used,
        kv_blocks_total=message.kv_blocks_total,
        active_decode_blocks=message.active_decode_blocks,
        pending_prefill_tokens=message.pending_prefill_tokens,
        num_received=message.num_received if message.HasField("num_received") else None,
        recent_decode_step_ms=message.recent_decode_step_ms,
    )
