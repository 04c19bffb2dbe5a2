"""NodeAgent gRPC service: protobuf <-> the engine; etcd registration, KV events and load reports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from google.protobuf import json_format

from baton.v1 import common_pb2, node_agent_pb2, node_agent_pb2_grpc
from services.common import etcd_keys
from services.common.directory import ServiceDirectory
from services.common.errors import Aborted, AlreadyExists, BatonError, Drained, InvalidArgument, StreamHeld, abort
from services.common.etcd_session import Membership
from services.common.sampling_checks import check_node_sampling
from services.common.server import ServingNames, serve_once
from services.common.telemetry import Telemetry
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.base import Engine, EngineInputError
from services.node_agent.engines.factory import model_info, node_info
from services.node_agent.engines.types import EngineRequest, FinishReason, RequestOutput, RequestPhase, SamplingParams
from services.node_agent.kv_publisher import KvEventLog, publish
from services.node_agent.load_metrics import LoadGauges
from services.node_agent.load_reporter import load_message, report_load
from services.node_agent.model_host import ModelHost

log = logging.getLogger(__name__)

# How long before a SIGTERM's grace ends (at most half of it) the streams still running are handed on: time for
# their routers to hear it before the server's stop cuts the calls.
HAND_ON_MARGIN_S = 1.0

PHASES = {
    RequestPhase.QUEUED: node_agent_pb2.REQUEST_PHASE_QUEUED,
    RequestPhase.PREFILLING: node_agent_pb2.REQUEST_PHASE_PREFILLING,
    RequestPhase.DECODING: node_agent_pb2.REQUEST_PHASE_DECODING,
}

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(sampling: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(tuple(seq.token_ids) for seq in sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )


@dataclass
class _Serving:
    """A Generate stream this node serves: what it was asked, and whether a resume of it has taken its place."""

    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str
    superseded: asyncio.Event = field(default_factory=asyncio.Event)

    def refusal(self, request: node_agent_pb2.NodeGenerateRequest, vocab_size: int) -> str | None:
        """Why request cannot take this stream's place; None when it resumes this stream as the engine will surely
        take it: its prompt is this one's plus tokens in the vocabulary (or this one's, sent again before a token
        came), it resumes part of that prompt, asks for at least one token and no more than this one had left (so it
        fits the context and the KV room this one held), under the same cache salt."""
        prompt = request.prompt_token_ids
        max_tokens = request.sampling.max_tokens
        if tuple(prompt[:len(self.prompt)]) != self.prompt:
            return "its prompt does not begin with that stream's"
        if not all(0 <= t < vocab_size for t in prompt[len(self.prompt):]):
            return f"its prompt's tokens past that stream's are not all in the vocabulary [0, {vocab_size})"
        if not 0 <= request.num_resumed_tokens < len(prompt):
            return (f"num_resumed_tokens={request.num_resumed_tokens} is not 0 or more and below its prompt's length "
                    f"{len(prompt)}")
        if max_tokens < 1:
            return f"sampling.max_tokens={max_tokens} asks for no token"
        if len(prompt) + max_tokens > len(self.prompt) + self.max_tokens:
            return (f"sampling.max_tokens={max_tokens} takes it to {len(prompt) + max_tokens} tokens, past the "
                    f"{len(self.prompt) + self.max_tokens} that stream could reach")
        if request.cache_salt != self.cache_salt:
            return "its cache salt (its tenant's prefix-cache namespace) is not that stream's"
        return None

    def is_another_request(self, request: node_agent_pb2.NodeGenerateRequest) -> bool:
        """Whether request, a resume of this stream's id, cannot be this request resumed at all: its prompt and this
        stream's differ before either ends (a client's resume has this stream's prompt and tokens it generated, or
        fewer of them when this stream is a later attempt), or it has another cache salt."""
        shared = min(len(request.prompt_token_ids), len(self.prompt))
        return (tuple(request.prompt_token_ids[:shared]) != self.prompt[:shared]
                or request.cache_salt != self.cache_salt)


class NodeAgentService(node_agent_pb2_grpc.NodeAgentServicer):
    service_names = ("baton.v1.NodeAgent",)

    def __init__(self, config: NodeAgentConfig, host: ModelHost, telemetry: Telemetry) -> None:
        self._config = config
        # baton.v1.NodeAgent serves once the node is registered in etcd (a container that never reached etcd showed
        # healthy, helper-175); through a later outage it serves on. "" says the process is up.
        self.health = ServingNames(not_serving=self.service_names)
        self._host = host
        self._member = Membership(config.etcd, config.lease_ttl_s, config.etcd_credentials())
        # Replicas whose lease lapsed are kept a TTL: an etcd freeze must not cut load or KV streams.
        self._schedulers = ServiceDirectory(self._member.client, "scheduler", telemetry, grace_s=config.lease_ttl_s)
        self._kvindexes = ServiceDirectory(self._member.client, "kvindex", telemetry, grace_s=config.lease_ttl_s)
        self._kv_log = KvEventLog(config.node_id, host)
        # Per request id, the stream serving it now.
        self._serving: dict[str, _Serving] = {}
        self._draining = False  # shutting down (SIGTERM): no candidate
        # Set a moment before a SIGTERM's grace ends: the streams still running are handed on (Drained).
        self._handing_on = asyncio.Event()
        self._hand_on_timer: asyncio.TimerHandle | None = None
        self._tokens = telemetry.meter.create_counter(
            "baton.node.generated_tokens", description="tokens generated on this node"
        )
        self._load_gauges = LoadGauges(host, telemetry.meter, {"node": config.node_id, "gpu": config.gpu})

    def register(self, server: grpc.aio.Server) -> None:
        node_agent_pb2_grpc.add_NodeAgentServicer_to_server(self, server)

    def _registration(self) -> bytes:
        info = node_info(self._config, self._host)
        # Once draining, always: a model that turned warm during the grace re-registered it as a candidate
        # (helper-162).
        info.draining = self._draining
        return json_format.MessageToJson(info, indent=None).encode()

    async def _keep_registration_current(self) -> None:
        """Rewrite the etcd registration whenever a model turns warm, loading or cold."""
        changed = self._host.models_changed.since_now()
        while True:
            await changed.wait()
            changed = self._host.models_changed.since_now()  # before the put: a change during it is not lost
            await self._member.update(etcd_keys.node_key(self._config.node_id), self._registration())

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        return [
            self._host.run(),
            *self._member.hold(etcd_keys.node_key(self._config.node_id), self._registration()),
            serve_once(self.health, self.service_names[0], self._member.registered),
            self._keep_registration_current(),
            self._schedulers.run(),
            self._kvindexes.run(),
            self._kv_log.follow(),
            publish(self._kv_log, self._kvindexes),
            report_load(self._config.node_id, self._host, self._schedulers,
                        self._config.load_report_interval_s),
            self._load_gauges.follow(self._config.load_report_interval_s),
        ]

    async def before_stop(self) -> None:
        # Leave the candidate set, but stay registered: streams already running finish during the
        # grace period, and a router must not take the node's leaving for its death and move them.
        self._draining = True
        await self._member.update(etcd_keys.node_key(self._config.node_id), self._registration())
        # Those still running a moment before the grace ends are handed on, for their routers to move them as a
        # drain: cut by the server's stop, each was counted a crash ("stream_broken", helper-158).
        grace_s = self._config.shutdown_grace_s
        self._hand_on_timer = asyncio.get_running_loop().call_later(
            max(0.0, grace_s - min(HAND_ON_MARGIN_S, grace_s / 2)), self._handing_on.set)

    async def close(self) -> None:
        if self._hand_on_timer is not None:
            self._hand_on_timer.cancel()
        await self._member.leave()  # drained (or out of grace): the registration goes at once
        await self._schedulers.close()
        await self._kvindexes.close()
        await self._member.close()

    async def Generate(
        self, request: node_agent_pb2.NodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
        try:
            engine = self._host.engine_for(request.model)
        except BatonError as error:
            await abort(context, error)
        request_id = request.request_id
        trace.get_current_span().set_attribute("baton.request_id", request_id)
        try:
            check_node_sampling(request.sampling, self._host.local(request.model).vocab_size)
            self._make_way(request, engine)
        except BatonError as error:
            engine.refused_before_admission()  # received all the same, as the engine counts those it refuses
            await abort(context, error)
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            sampling=sampling_from_proto(request.sampling),
            num_resumed_tokens=request.num_resumed_tokens,
            cache_salt=request.cache_salt,
        )
        try:
            outputs = engine.generate(engine_request, self._config.heartbeat_interval_s)
        except EngineInputError as exc:
            await abort(context, InvalidArgument(exc.field, exc.value, exc.reason))
        serving = self._serving[request_id] = _Serving(tuple(request.prompt_token_ids), request.sampling.max_tokens,
                                                       request.cache_salt)
        superseded = serving.superseded
        try:
            exact = engine.resumes_exactly(engine_request.sampling)
            yield self._chunk(request, 0,
                              started=node_agent_pb2.StreamStarted(
                                  heartbeat_interval_ms=int(self._config.heartbeat_interval_s * 1000),
                                  expected_step_ms=engine.expected_step_ms()),
                              progress=self._progress(engine, request.request_id))
            index = 0
            handed_on = False
            async for output in outputs:
                if superseded.is_set():
                    break
                # Handed on once the output that came after the grace's end neared is sent: one that finishes the
                # stream finishes it here (it was dropped, and another node asked to redo its token, helper-162).
                grace_ending = self._handing_on.is_set()
                if output is None:  # heartbeat: the router learns the request is queued or prefilling, not lost
                    if grace_ending:
                        handed_on = True
                        break
                    yield self._chunk(request, index, progress=self._progress(engine, request.request_id))
                    continue
                chunk = self._chunk(request, index, token_ids=output.new_token_ids,
                                    finish_reason=FINISH_REASONS[output.finish_reason])
                index += len(output.new_token_ids)
                chunk.checkpoint.CopyFrom(self._checkpoint(request, index, exact, output))
                self._tokens.add(len(output.new_token_ids), {"model": request.model})
                if output.finish_reason is not None:
                    chunk.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=output.num_prompt_tokens,
                            cached_tokens=output.num_cached_tokens,
                            completion_tokens=output.num_completion_tokens,
                            gpu_ms=output.gpu_ms,
                        )
                    )
                yield chunk
                if output.finish_reason is None and grace_ending:
                    handed_on = True
                    break
            if superseded.is_set():  # not a node failure: its router must not move it
                await abort(context, Aborted(f"request {request_id}: a resume of it took this stream's place on node "
                                             f"{self._config.node_id}"))
            if handed_on:
                # (Its router's message names the request, the node and the tokens it had.)
                await abort(context, Drained(f"shutting down, its grace of {self._config.shutdown_grace_s:g} s "
                                             "ending; another node goes on with the stream", self._config.node_id))
        except EngineInputError as exc:  # an engine that checks part of its input as it runs (vLLM)
            await abort(context, InvalidArgument(exc.field, exc.value, exc.reason))
        finally:
            if self._serving.get(request_id) is serving:
                del self._serving[request_id]
            # The client went away or the stream broke: the engine must not go on for nobody. Closing the stream
            # ends this request only (not one of the same id admitted since, closed late as it may be).
            await outputs.aclose()

    def _make_way(self, request: node_agent_pb2.NodeGenerateRequest, engine: Engine) -> None:
        """End the stream of request's id this node still runs, when request resumes it (its router froze, or lost
        its client, who sent it again through another router: the newer stream has the client, and the old one ends
        ABORTED). Only a resume the engine will take as surely as it took that stream, or a refused one would end it
        too; another is StreamHeld (its router places it on another node, not taking this one for failed), a fresh
        request, or a "resume" that cannot be this request at all, AlreadyExists (said as such, so its router tells
        the leader the id's other stream holds their one admission slot)."""
        request_id = request.request_id
        earlier = self._serving.get(request_id)
        if earlier is None or engine.progress(request_id) is None:
            return
        if not (request.num_resumed_tokens or request.resent):
            raise AlreadyExists(f"request_id={request_id!r}: is already running on node {self._config.node_id}")
        if earlier.is_another_request(request):
            # Placed elsewhere, it ran beside that stream on their one admission slot: a tenant at its concurrency
            # limit ran a stream per node under one id with an empty `resume` (helper-114).
            raise AlreadyExists(f"request_id={request_id!r}: is already running on node {self._config.node_id}, "
                                f"as another request: {earlier.refusal(request, engine.vocab_size)} (a resume "
                                "continues the running stream's prompt, under its cache salt)")
        if (why := earlier.refusal(request, engine.vocab_size)) is not None:
            raise StreamHeld(f"request_id={request_id!r}: an earlier stream of it still runs on node "
                             f"{self._config.node_id}, which this resume cannot take over: {why}",
                             self._config.node_id)
        log.info("request %s: resumed here while its earlier stream still ran; ending that one", request_id)
        earlier.superseded.set()
        engine.abort(request_id)

    def _chunk(self, request: node_agent_pb2.NodeGenerateRequest, index: int,
               **fields: Any) -> node_agent_pb2.NodeGenerateChunk:
        return node_agent_pb2.NodeGenerateChunk(
            request_id=request.request_id, index=index, node_id=self._config.node_id, **fields
        )

    @staticmethod
    def _progress(engine: Engine, request_id: str) -> node_agent_pb2.RequestProgress | None:
        progress = engine.progress(request_id)
        if progress is None:
            return None
        return node_agent_pb2.RequestProgress(
            phase=PHASES[progress.phase], num_ahead=progress.num_ahead,
            num_computed_tokens=progress.num_computed_tokens, num_prompt_tokens=progress.num_prompt_tokens)

    @staticmethod
    def _checkpoint(request: node_agent_pb2.NodeGenerateRequest, num_generated: int, exact: bool,
                    output: RequestOutput) -> node_agent_pb2.Checkpoint:
        checkpoint = node_agent_pb2.Checkpoint(
            num_context_tokens=len(request.prompt_token_ids) + num_generated,
            num_completion_tokens=num_generated,
            exact=exact,
            gpu_ms=output.gpu_ms,
            num_cached_tokens=output.num_cached_tokens,
        )
        if request.sampling.HasField("seed"):
            checkpoint.seed = request.sampling.seed
        return checkpoint

    async def GetLoad(
        self, request: node_agent_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.NodeLoad:
        return load_message(self._config.node_id, self._host)

    async def GetKVSnapshot(
        self, request: node_agent_pb2.GetKVSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> node_agent_pb2.KVSnapshot:
        return self._kv_log.snapshot()

    async def LoadModel(
        self, request: node_agent_pb2.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> node_agent_pb2.LoadModelResponse:
        try:
            waited_s = await self._host.load_model(request.model)
        except BatonError as error:
            await abort(context, error)
        return node_agent_pb2.LoadModelResponse(model=self._model_info(request.model), waited_s=waited_s)

    async def UnloadModel(
        self, request: node_agent_pb2.UnloadModelRequest, context: grpc.aio.ServicerContext
    ) -> node_agent_pb2.UnloadModelResponse:
        try:
            self._host.unload_model(request.model)
        except BatonError as error:
            await abort(context, error)
        return node_agent_pb2.UnloadModelResponse(model=self._model_info(request.model))

    def _model_info(self, model: str) -> common_pb2.ModelInfo:
        return model_info(self._host.local(model), self._host.state[model], self._host.profile(model))
