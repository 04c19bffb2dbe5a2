from baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_OUTCOME_UNSPECIFIED: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_SUCCEEDED: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_LATE: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_FAILED: _ClassVar[RequestOutcome]
    REQUEST_OUTCOME_CANCELLED: _ClassVar[RequestOutcome]
REQUEST_OUTCOME_UNSPECIFIED: RequestOutcome
REQUEST_OUTCOME_SUCCEEDED: RequestOutcome
REQUEST_OUTCOME_LATE: RequestOutcome
REQUEST_OUTCOME_FAILED: RequestOutcome
REQUEST_OUTCOME_CANCELLED: RequestOutcome

class LiveRequests(_message.Message):
    __slots__ = ("router_id", "request_ids", "workflow_ids", "tenants", "prompt_digests", "router_incarnation")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    workflow_ids: _containers.RepeatedScalarFieldContainer[str]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    prompt_digests: _containers.RepeatedScalarFieldContainer[int]
    router_incarnation: int
    def __init__(self, router_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., workflow_ids: _Optional[_Iterable[str]] = ..., tenants: _Optional[_Iterable[str]] = ..., prompt_digests: _Optional[_Iterable[int]] = ..., router_incarnation: _Optional[int] = ...) -> None: ...

class LiveRequestsAck(_message.Message):
    __slots__ = ("num_held", "lease_ms")
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    num_held: int
    lease_ms: int
    def __init__(self, num_held: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("request_id", "context", "ttft_ms", "outcome", "gpu_ms_by_node", "model", "num_output_tokens", "price_per_hour_by_node", "another_stream_live", "router_id")
    class GpuMsByNodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PricePerHourByNodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    GPU_MS_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    ANOTHER_STREAM_LIVE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context: _common_pb2.RequestContext
    ttft_ms: int
    outcome: RequestOutcome
    gpu_ms_by_node: _containers.ScalarMap[str, float]
    model: str
    num_output_tokens: int
    price_per_hour_by_node: _containers.ScalarMap[str, float]
    another_stream_live: bool
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., context: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., ttft_ms: _Optional[int] = ..., outcome: _Optional[_Union[RequestOutcome, str]] = ..., gpu_ms_by_node: _Optional[_Mapping[str, float]] = ..., model: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., price_per_hour_by_node: _Optional[_Mapping[str, float]] = ..., another_stream_live: _Optional[bool] = ..., router_id: _Optional[str] = ...) -> None: ...

class TaskStats(_message.Message):
    __slots__ = ("tasks_succeeded", "tasks_failed", "tasks_open", "ended_cost_usd", "cost_per_successful_task_usd", "model_load_cost_usd", "fleet_cost_usd", "fleet_cost_per_successful_task_usd")
    TASKS_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    TASKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    TASKS_OPEN_FIELD_NUMBER: _ClassVar[int]
    ENDED_COST_USD_FIELD_NUMBER: _ClassVar[int]
    COST_PER_SUCCESSFUL_TASK_USD_FIELD_NUMBER: _ClassVar[int]
    MODEL_LOAD_COST_USD_FIELD_NUMBER: _ClassVar[int]
    FLEET_COST_USD_FIELD_NUMBER: _ClassVar[int]
    FLEET_COST_PER_SUCCESSFUL_TASK_USD_FIELD_NUMBER: _ClassVar[int]
    tasks_succeeded: int
    tasks_failed: int
    tasks_open: int
    ended_cost_usd: float
    cost_per_successful_task_usd: float
    model_load_cost_usd: float
    fleet_cost_usd: float
    fleet_cost_per_successful_task_usd: float
    def __init__(self, tasks_succeeded: _Optional[int] = ..., tasks_failed: _Optional[int] = ..., tasks_open: _Optional[int] = ..., ended_cost_usd: _Optional[float] = ..., cost_per_successful_task_usd: _Optional[float] = ..., model_load_cost_usd: _Optional[float] = ..., fleet_cost_usd: _Optional[float] = ..., fleet_cost_per_successful_task_usd: _Optional[float] = ...) -> None: ...

class ModelAction(_message.Message):
    __slots__ = ("node_id", "model", "kind", "reason", "at_ms", "result")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: str
    kind: str
    reason: str
    at_ms: int
    result: str
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., at_ms: _Optional[int] = ..., result: _Optional[str] = ...) -> None: ...

class FinishedAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRecentDecisionsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class RecentDecisions(_message.Message):
    __slots__ = ("policy", "decisions")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    decisions: _containers.RepeatedCompositeFieldContainer[PlacementDecision]
    def __init__(self, policy: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[PlacementDecision, _Mapping]]] = ...) -> None: ...

class PlacementDecision(_message.Message):
    __slots__ = ("request_id", "node_id", "score", "context", "decided_at_ms", "candidates", "model", "leader_revision", "fallback", "retry_cause", "excluded_node_ids", "waited_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEADER_REVISION_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    RETRY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    WAITED_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    node_id: str
    score: float
    context: _common_pb2.RequestContext
    decided_at_ms: int
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateTerms]
    model: str
    leader_revision: int
    fallback: str
    retry_cause: str
    excluded_node_ids: _containers.RepeatedScalarFieldContainer[str]
    waited_ms: int
    def __init__(self, request_id: _Optional[str] = ..., node_id: _Optional[str] = ..., score: _Optional[float] = ..., context: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., decided_at_ms: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[CandidateTerms, _Mapping]]] = ..., model: _Optional[str] = ..., leader_revision: _Optional[int] = ..., fallback: _Optional[str] = ..., retry_cause: _Optional[str] = ..., excluded_node_ids: _Optional[_Iterable[str]] = ..., waited_ms: _Optional[int] = ...) -> None: ...

class CandidateTerms(_message.Message):
    __slots__ = ("node_id", "gpu", "cached_tokens", "predicted_ttft_ms", "predicted_tpot_ms", "cost", "success", "workflow_spent", "has_kv_room", "score", "warm", "load_ms", "kv_free_blocks", "at_risk", "model")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_SPENT_FIELD_NUMBER: _ClassVar[int]
    HAS_KV_ROOM_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AT_RISK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gpu: str
    cached_tokens: int
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    cost: float
    success: float
    workflow_spent: float
    has_kv_room: bool
    score: float
    warm: bool
    load_ms: float
    kv_free_blocks: int
    at_risk: float
    model: str
    def __init__(self, node_id: _Optional[str] = ..., gpu: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., cost: _Optional[float] = ..., success: _Optional[float] = ..., workflow_spent: _Optional[float] = ..., has_kv_room: _Optional[bool] = ..., score: _Optional[float] = ..., warm: _Optional[bool] = ..., load_ms: _Optional[float] = ..., kv_free_blocks: _Optional[int] = ..., at_risk: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "model", "num_prompt_tokens", "block_hashes", "max_tokens", "context", "exclude_node_ids", "retry_cause", "alternative_models", "resumed", "router_id", "prompt_digest", "router_incarnation", "num_generated_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    RETRY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_MODELS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ROUTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    num_prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    context: _common_pb2.RequestContext
    exclude_node_ids: _containers.RepeatedScalarFieldContainer[str]
    retry_cause: str
    alternative_models: _containers.RepeatedScalarFieldContainer[str]
    resumed: bool
    router_id: str
    prompt_digest: int
    router_incarnation: int
    num_generated_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., context: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., exclude_node_ids: _Optional[_Iterable[str]] = ..., retry_cause: _Optional[str] = ..., alternative_models: _Optional[_Iterable[str]] = ..., resumed: _Optional[bool] = ..., router_id: _Optional[str] = ..., prompt_digest: _Optional[int] = ..., router_incarnation: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("node_id", "address", "matched_blocks", "cost", "model")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    matched_blocks: int
    cost: float
    model: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., cost: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class ReportLoadAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("info", "load", "load_age_ms", "reserved_for_model")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FOR_MODEL_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.NodeInfo
    load: _common_pb2.NodeLoad
    load_age_ms: int
    reserved_for_model: str
    def __init__(self, info: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.NodeLoad, _Mapping]] = ..., load_age_ms: _Optional[int] = ..., reserved_for_model: _Optional[str] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("scheduler_id", "nodes", "leader_id", "leader_address", "tasks", "model_actions", "leading_revision", "queued_by_tenant")
    class QueuedByTenantEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    LEADING_REVISION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BY_TENANT_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeState]
    leader_id: str
    leader_address: str
    tasks: TaskStats
    model_actions: _containers.RepeatedCompositeFieldContainer[ModelAction]
    leading_revision: int
    queued_by_tenant: _containers.ScalarMap[str, int]
    def __init__(self, scheduler_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeState, _Mapping]]] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., tasks: _Optional[_Union[TaskStats, _Mapping]] = ..., model_actions: _Optional[_Iterable[_Union[ModelAction, _Mapping]]] = ..., leading_revision: _Optional[int] = ..., queued_by_tenant: _Optional[_Mapping[str, int]] = ...) -> None: ...
