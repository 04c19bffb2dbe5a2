from baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "stop", "request_id", "tenant", "priority", "ttft_budget_ms", "deadline_ms", "workflow_id", "step", "total_steps", "ignore_eos", "resume", "alternative_models", "tpot_budget_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_MODELS_FIELD_NUMBER: _ClassVar[int]
    TPOT_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: PromptTokens
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    tenant: str
    priority: int
    ttft_budget_ms: int
    deadline_ms: int
    workflow_id: str
    step: int
    total_steps: int
    ignore_eos: bool
    resume: Resume
    alternative_models: _containers.RepeatedScalarFieldContainer[str]
    tpot_budget_ms: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[PromptTokens, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., ttft_budget_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., workflow_id: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., alternative_models: _Optional[_Iterable[str]] = ..., tpot_budget_ms: _Optional[int] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("token_ids", "elapsed_ms", "first_token_ms", "last_token_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    elapsed_ms: int
    first_token_ms: int
    last_token_ms: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., elapsed_ms: _Optional[int] = ..., first_token_ms: _Optional[int] = ..., last_token_ms: _Optional[int] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "index", "node_id", "finish_reason", "usage", "seed", "inexact", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INEXACT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    node_id: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    seed: int
    inexact: bool
    model: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., node_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., seed: _Optional[int] = ..., inexact: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    def __init__(self, models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ...) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("name", "max_context_tokens", "tokenizer", "num_warm_nodes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_WARM_NODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_context_tokens: int
    tokenizer: str
    num_warm_nodes: int
    def __init__(self, name: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., tokenizer: _Optional[str] = ..., num_warm_nodes: _Optional[int] = ...) -> None: ...
