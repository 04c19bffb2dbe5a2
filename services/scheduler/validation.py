"""What the scheduler checks of a Place, Finished or live-request report before any work, naming the field. Pure.

The router checks what clients send, but any gRPC caller may call the scheduler, and a request's fields
do more than describe it: its prompt blocks count as load on the node it is placed on (a placement that
claims 100,000 blocks made a node look 42 s slow to every request for seconds after), and a size no
node can hold waits for one until the caller's deadline. So what the router would never send is refused
at once with INVALID_ARGUMENT.
"""

from __future__ import annotations

from baton.protocol import MAX_ALTERNATIVE_MODELS
from baton.v1 import common_pb2, scheduler_pb2
from services.common.block_hash import DEFAULT_BLOCK_SIZE
from services.common.config import MAX_INSTANCE_ID_LEN, MAX_NODES_OF_A_REQUEST
from services.common.errors import InvalidArgument, shown
from services.common.failure_cause import RETRY_CAUSES
from services.common.request_context import check_context

# Tokens (prompt + max_tokens) a request for a model no registered node lists may ask for: no model has a
# context this long, and such a request is refused anyway, but by the fleet (no node has it) after a wait.
MAX_TOKENS_OF_AN_UNKNOWN_MODEL = 1 << 24


def check_place(request: scheduler_pb2.PlaceRequest, max_context_tokens: int | None, max_id_len: int) -> None:
    """Refuse a Place whose fields no router sends, naming the first such field and its value.

    max_context_tokens: the model's context as its nodes register it (None: no node lists the model).
    max_id_len: the routers' --max-id-len; a request or workflow id may be scoped by its tenant
    ("<tenant>/<id>", with --auth), so those may be twice as long and one more.
    """
    if not request.model:
        raise InvalidArgument("model", request.model, "must name a model")
    _check_ids(request, max_id_len)
    # It labels the placements metric: a value of the caller's choosing would grow that metric without bound.
    if request.retry_cause and request.retry_cause not in RETRY_CAUSES:
        raise InvalidArgument("retry_cause", request.retry_cause,
                              f"not a cause of a move ({', '.join(sorted(RETRY_CAUSES))}; empty for a first placement)")
    # Each is looked up in the fleet at every placement (one no registered node has is passed over).
    if len(request.alternative_models) > MAX_ALTERNATIVE_MODELS:
        raise InvalidArgument("alternative_models", f"{len(request.alternative_models)} models",
                              f"at most {MAX_ALTERNATIVE_MODELS}")
    if request.num_prompt_tokens <= 0:
        raise InvalidArgument("num_prompt_tokens", request.num_prompt_tokens, "must be positive")
    if request.max_tokens <= 0:
        raise InvalidArgument("max_tokens", request.max_tokens, "must be positive")
    context, whose = (max_context_tokens, "the context window of " + request.model) if max_context_tokens \
        else (MAX_TOKENS_OF_AN_UNKNOWN_MODEL, "what any model's context holds")
    if request.num_prompt_tokens >= context:
        raise InvalidArgument("num_prompt_tokens", request.num_prompt_tokens, f"does not fit {whose} ({context})")
    if request.num_prompt_tokens + request.max_tokens > context:
        raise InvalidArgument("max_tokens", request.max_tokens,
                              f"num_prompt_tokens ({request.num_prompt_tokens}) + max_tokens exceeds {whose} "
                              f"({context})")
    if not 0 <= request.num_generated_tokens < request.num_prompt_tokens:
        raise InvalidArgument("num_generated_tokens", request.num_generated_tokens,
                              f"must be 0 or more and less than num_prompt_tokens ({request.num_prompt_tokens}), "
                              "of which they are a part")
    # One key per full block of the prompt, as the router computes them (services/common/block_hash.py).
    num_blocks = request.num_prompt_tokens // DEFAULT_BLOCK_SIZE
    if len(request.block_hashes) > num_blocks:
        raise InvalidArgument("block_hashes", f"{len(request.block_hashes)} hashes",
                              f"more than the {num_blocks} full blocks of {DEFAULT_BLOCK_SIZE} tokens in "
                              f"num_prompt_tokens={request.num_prompt_tokens}")
    check_context(request.context)


# The most GPU time one request's notice may charge to a node: 1e308 ms made the cost per successful task infinite
# for good (helper-179). (A notice's price is counted as nothing past MAX_PRICE_PER_HOUR: servicer._price.)
MAX_GPU_MS = 7 * 24 * 3_600_000


def _check_ids(request: scheduler_pb2.PlaceRequest | scheduler_pb2.FinishedRequest, max_id_len: int) -> None:
    """A request or workflow id may be scoped by its tenant ("<tenant>/<id>", with --auth), so those may be twice
    --max-id-len and one more."""
    scoped = 2 * max_id_len + 1
    for field, value, limit in (("request_id", request.request_id, scoped), ("tenant", request.context.tenant,
                                max_id_len), ("workflow_id", request.context.workflow_id, scoped),
                                ("router_id", request.router_id, MAX_INSTANCE_ID_LEN)):
        if len(value) > limit:
            raise InvalidArgument(field, value, f"{len(value)} characters, longer than {limit}")


def check_finished(request: scheduler_pb2.FinishedRequest, max_context_tokens: int | None, max_id_len: int) -> None:
    """Refuse a Finished notice that would skew the ledger or the policy, naming the first such field and its value.

    A node it names may be one this leader never saw (it left before this leader began): its GPU time is charged
    at the notice's price, so an unknown node is taken as it is, but named as a node agent's --node-id may be.
    router_id keys the admission slot's holders. Its ids and workflow are held as a Place's are: 150 notices with 3 MB
    ids took a leader from 71 MB to 992 MB for good, and a step past its total_steps opened a task no step could end
    (helper-196).
    """
    _check_ids(request, max_id_len)
    check_context(request.context)
    for field, nodes in (("gpu_ms_by_node", request.gpu_ms_by_node),
                         ("price_per_hour_by_node", request.price_per_hour_by_node)):
        if len(nodes) > MAX_NODES_OF_A_REQUEST:
            raise InvalidArgument(field, f"{len(nodes)} nodes", f"more than the {MAX_NODES_OF_A_REQUEST} one request "
                                  "may run on")
        for node in nodes:
            if len(node) > MAX_INSTANCE_ID_LEN:
                raise InvalidArgument(f"{field} key", node, f"{len(node)} characters, longer than "
                                      f"{MAX_INSTANCE_ID_LEN} (a node agent's --node-id)")
    if request.outcome not in scheduler_pb2.RequestOutcome.values():
        raise InvalidArgument("outcome", request.outcome, "not a RequestOutcome (0 to "
                              f"{max(scheduler_pb2.RequestOutcome.values())})")
    for node, ms in request.gpu_ms_by_node.items():
        if not 0 <= ms <= MAX_GPU_MS:  # (NaN fails it too)
            raise InvalidArgument(f"gpu_ms_by_node[{node!r}]", ms, f"must be 0 to {MAX_GPU_MS} (a week)")
    if request.ttft_ms < 0:
        raise InvalidArgument("ttft_ms", request.ttft_ms, "must not be negative (0: no first token)")
    # The policy learns how long outputs run from this count: one past the context would skew every estimate after.
    if request.num_output_tokens < 0 or max_context_tokens and request.num_output_tokens > max_context_tokens:
        raise InvalidArgument("num_output_tokens", request.num_output_tokens,
                              f"must be 0 to {request.model}'s context ({max_context_tokens})" if max_context_tokens
                              else "must not be negative")


# The largest count a load report may hold (KV blocks, prompt tokens, requests): far beyond any engine's, and small
# enough that the placement's sums of them stay exact and within int64 (kv_blocks_used=-2**63 made every Place fail
# UNKNOWN on the overflow, helper-181). A decode step's reported time: at most an hour.
MAX_LOAD_COUNT = 1 << 48
MAX_STEP_MS = 3_600_000.0


def check_load(load: common_pb2.NodeLoad) -> None:
    """Refuse a load report no engine makes (a count below 0 or past MAX_LOAD_COUNT, a step time not finite or
    past MAX_STEP_MS), naming its node, the field and its value."""
    for field in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "active_decode_blocks",
                  "pending_prefill_tokens", *(("num_received",) if load.HasField("num_received") else ())):
        value = getattr(load, field)
        if not 0 <= value <= MAX_LOAD_COUNT:
            raise InvalidArgument(f"{field} (node {shown(load.node_id)})", value, f"must be 0 to {MAX_LOAD_COUNT}")
    if not 0 <= load.recent_decode_step_ms <= MAX_STEP_MS:  # (NaN fails it too)
        raise InvalidArgument(f"recent_decode_step_ms (node {shown(load.node_id)})", load.recent_decode_step_ms,
                              f"must be 0 to {MAX_STEP_MS:.0f} ms")


def check_live_requests(request: scheduler_pb2.LiveRequests, max_live_ids: int, max_id_len: int) -> None:
    """Refuse a live-request report longer than a router sends (work on every id, on every report), naming the
    list and its length; tenants or prompt digests not one to an id, or a tenant longer than a Place's may be."""
    _check_router_id(request.router_id)
    for field, ids in (("request_ids", request.request_ids), ("workflow_ids", request.workflow_ids)):
        if len(ids) > max_live_ids:
            raise InvalidArgument(field, f"{len(ids)} ids", f"more than --max-live-ids ({max_live_ids}) in one report")
    for field, values in (("tenants", request.tenants), ("prompt_digests", request.prompt_digests)):
        if values and len(values) != len(request.request_ids):
            raise InvalidArgument(field, f"{len(values)} {field.replace('_', ' ')}",
                                  f"one for each of the {len(request.request_ids)} request_ids, or none")
    for i, tenant in enumerate(request.tenants):
        if len(tenant) > max_id_len:
            raise InvalidArgument(f"tenants[{i}]", tenant, f"{len(tenant)} characters, longer than --max-id-len "
                                  f"({max_id_len})")


def _check_router_id(router_id: str) -> None:
    """router_id keys the holders of an admission slot: a router's --instance-id, at most MAX_INSTANCE_ID_LEN."""
    if len(router_id) > MAX_INSTANCE_ID_LEN:
        raise InvalidArgument("router_id", router_id, f"{len(router_id)} characters, longer than {MAX_INSTANCE_ID_LEN} "
                              "(a router's --instance-id)")
