from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class ProfileSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROFILE_SOURCE_UNSPECIFIED: _ClassVar[ProfileSource]
    PROFILE_SOURCE_CONFIGURED: _ClassVar[ProfileSource]
    PROFILE_SOURCE_CALIBRATED: _ClassVar[ProfileSource]
    PROFILE_SOURCE_ONLINE: _ClassVar[ProfileSource]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_COLD: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_WARM: _ClassVar[ModelState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
PROFILE_SOURCE_UNSPECIFIED: ProfileSource
PROFILE_SOURCE_CONFIGURED: ProfileSource
PROFILE_SOURCE_CALIBRATED: ProfileSource
PROFILE_SOURCE_ONLINE: ProfileSource
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_COLD: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_WARM: ModelState

class RequestContext(_message.Message):
    __slots__ = ("tenant", "priority", "ttft_budget_ms", "tpot_budget_ms", "deadline_ms", "workflow_id", "step", "total_steps")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    priority: int
    ttft_budget_ms: int
    tpot_budget_ms: int
    deadline_ms: int
    workflow_id: str
    step: int
    total_steps: int
    def __init__(self, tenant: _Optional[str] = ..., priority: _Optional[int] = ..., ttft_budget_ms: _Optional[int] = ..., tpot_budget_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., workflow_id: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "max_tokens", "stop", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "num_migrations", "recomputed_tokens", "gpu_ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    num_migrations: int
    recomputed_tokens: int
    gpu_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_migrations: _Optional[int] = ..., recomputed_tokens: _Optional[int] = ..., gpu_ms: _Optional[float] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "max_context_tokens", "tokenizer", "vocab_size", "is_warm", "state", "weights_bytes", "load_time_s", "kv_blocks", "profile")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_WARM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_context_tokens: int
    tokenizer: str
    vocab_size: int
    is_warm: bool
    state: ModelState
    weights_bytes: int
    load_time_s: float
    kv_blocks: int
    profile: EngineProfile
    def __init__(self, name: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., tokenizer: _Optional[str] = ..., vocab_size: _Optional[int] = ..., is_warm: _Optional[bool] = ..., state: _Optional[_Union[ModelState, str]] = ..., weights_bytes: _Optional[int] = ..., load_time_s: _Optional[float] = ..., kv_blocks: _Optional[int] = ..., profile: _Optional[_Union[EngineProfile, _Mapping]] = ...) -> None: ...

class EngineProfile(_message.Message):
    __slots__ = ("a_ms", "b_ms_per_tok", "c_ms_per_tok2", "prefill_floor_ms", "d_ms", "e_ms_per_seq", "f_ms_per_ctx_tok", "max_num_batched_tokens", "kv_block_size", "num_kv_blocks", "source", "num_samples", "max_num_seqs")
    A_MS_FIELD_NUMBER: _ClassVar[int]
    B_MS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    C_MS_PER_TOK2_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FLOOR_MS_FIELD_NUMBER: _ClassVar[int]
    D_MS_FIELD_NUMBER: _ClassVar[int]
    E_MS_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    F_MS_PER_CTX_TOK_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    a_ms: float
    b_ms_per_tok: float
    c_ms_per_tok2: float
    prefill_floor_ms: float
    d_ms: float
    e_ms_per_seq: float
    f_ms_per_ctx_tok: float
    max_num_batched_tokens: int
    kv_block_size: int
    num_kv_blocks: int
    source: ProfileSource
    num_samples: int
    max_num_seqs: int
    def __init__(self, a_ms: _Optional[float] = ..., b_ms_per_tok: _Optional[float] = ..., c_ms_per_tok2: _Optional[float] = ..., prefill_floor_ms: _Optional[float] = ..., d_ms: _Optional[float] = ..., e_ms_per_seq: _Optional[float] = ..., f_ms_per_ctx_tok: _Optional[float] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., source: _Optional[_Union[ProfileSource, str]] = ..., num_samples: _Optional[int] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "gpu", "hbm_bytes", "region", "price_per_hour", "models", "kv_block_size", "engine", "draining")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    HBM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    gpu: str
    hbm_bytes: int
    region: str
    price_per_hour: float
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    kv_block_size: int
    engine: str
    draining: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., gpu: _Optional[str] = ..., hbm_bytes: _Optional[int] = ..., region: _Optional[str] = ..., price_per_hour: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., kv_block_size: _Optional[int] = ..., engine: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("node_id", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "active_decode_blocks", "pending_prefill_tokens", "reported_at_ms", "num_received", "recent_decode_step_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RECENT_DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    active_decode_blocks: int
    pending_prefill_tokens: int
    reported_at_ms: int
    num_received: int
    recent_decode_step_ms: float
    def __init__(self, node_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., active_decode_blocks: _Optional[int] = ..., pending_prefill_tokens: _Optional[int] = ..., reported_at_ms: _Optional[int] = ..., num_received: _Optional[int] = ..., recent_decode_step_ms: _Optional[float] = ...) -> None: ...
