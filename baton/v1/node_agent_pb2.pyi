from baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_PHASE_UNSPECIFIED: _ClassVar[RequestPhase]
    REQUEST_PHASE_QUEUED: _ClassVar[RequestPhase]
    REQUEST_PHASE_PREFILLING: _ClassVar[RequestPhase]
    REQUEST_PHASE_DECODING: _ClassVar[RequestPhase]
REQUEST_PHASE_UNSPECIFIED: RequestPhase
REQUEST_PHASE_QUEUED: RequestPhase
REQUEST_PHASE_PREFILLING: RequestPhase
REQUEST_PHASE_DECODING: RequestPhase

class LoadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model", "waited_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    waited_s: float
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., waited_s: _Optional[float] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class NodeGenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "num_resumed_tokens", "cache_salt", "resent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    num_resumed_tokens: int
    cache_salt: str
    resent: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_resumed_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., resent: _Optional[bool] = ...) -> None: ...

class NodeGenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "index", "finish_reason", "usage", "node_id", "checkpoint", "started", "progress")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    node_id: str
    checkpoint: Checkpoint
    started: StreamStarted
    progress: RequestProgress
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., node_id: _Optional[str] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., started: _Optional[_Union[StreamStarted, _Mapping]] = ..., progress: _Optional[_Union[RequestProgress, _Mapping]] = ...) -> None: ...

class RequestProgress(_message.Message):
    __slots__ = ("phase", "num_ahead", "num_computed_tokens", "num_prompt_tokens")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NUM_AHEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    phase: RequestPhase
    num_ahead: int
    num_computed_tokens: int
    num_prompt_tokens: int
    def __init__(self, phase: _Optional[_Union[RequestPhase, str]] = ..., num_ahead: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("num_context_tokens", "num_completion_tokens", "seed", "exact", "gpu_ms", "num_cached_tokens")
    NUM_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    GPU_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_context_tokens: int
    num_completion_tokens: int
    seed: int
    exact: bool
    gpu_ms: float
    num_cached_tokens: int
    def __init__(self, num_context_tokens: _Optional[int] = ..., num_completion_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., exact: _Optional[bool] = ..., gpu_ms: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class StreamStarted(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "expected_step_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    expected_step_ms: float
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., expected_step_ms: _Optional[float] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVSnapshot(_message.Message):
    __slots__ = ("node_id", "model", "seq", "block_hashes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    model: str
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., model: _Optional[str] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...
