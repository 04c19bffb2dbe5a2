"""Router gRPC service: validate, place, stream from the node agent, relay to the client."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc

from baton.v1 import (
    common_pb2,
    node_agent_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common import etcd_keys
from services.common.coalesce import coalesce
from services.common.directory import ChannelPool, ServiceDirectory
from services.common.errors import BatonError, Unavailable, abort, from_rpc_error
from services.common.etcd_session import Membership, PrefixView
from services.common.telemetry import Telemetry
from services.router.catalogue import models_from_registrations
from services.router.config import RouterConfig
from services.router.generation import FailureCause, Generation, NodeFailure
from services.router.node_stream import NodeLiveness, watched_stream
from services.router.tokenizer import TOKENIZERS
from services.router.validation import ModelEntry, validate

log = logging.getLogger(__name__)


def merge_chunks(chunks: list[node_agent_pb2.NodeGenerateChunk]) -> node_agent_pb2.NodeGenerateChunk:
    """Several node chunks as one: their tokens in order, the first index, the last status."""
    if len(chunks) == 1:
        return chunks[0]
    merged = node_agent_pb2.NodeGenerateChunk()
    merged.CopyFrom(chunks[-1])
    merged.index = chunks[0].index
    del merged.token_ids[:]
    for chunk in chunks:
        merged.token_ids.extend(chunk.token_ids)
    return merged


class RouterService(router_pb2_grpc.RouterServicer):
    service_names = ("baton.v1.Router",)

    def __init__(self, config: RouterConfig, telemetry: Telemetry) -> None:
        self._config = config
        self._telemetry = telemetry
        self._rng = random.Random()
        self._models: dict[str, ModelEntry] = {}
        self._member = Membership(config.etcd, config.lease_ttl_s)
        self._nodes = PrefixView(self._member.client, etcd_keys.NODES, self._on_nodes_changed)
        self._schedulers = ServiceDirectory(self._member.client, "scheduler", telemetry)
        self._node_channels = ChannelPool(telemetry)
        self._liveness = NodeLiveness()
        # Nodes that failed a stream lately, avoided by every placement until the time given.
        self._suspects: dict[str, float] = {}
        self._requests = telemetry.meter.create_counter(
            "baton.router.requests", description="Generate requests, by final status"
        )
        self._relayed_tokens = telemetry.meter.create_counter(
            "baton.router.relayed_tokens", description="completion tokens relayed to clients"
        )
        self._migrations = telemetry.meter.create_counter(
            "baton.router.migrations", description="generations moved to another node, by cause"
        )
        self._resume_stall = telemetry.meter.create_histogram(
            "baton.router.resume_stall", unit="ms",
            description="from the last token before a node failure to the first token after",
        )
        self._recomputed = telemetry.meter.create_counter(
            "baton.router.recomputed_tokens", description="context tokens prefilled again on resume"
        )

    def register(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self, server)

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        config = self._config
        return [
            *self._member.hold_service("router", config.instance_id, config.listen),
            self._nodes.run(),
            self._schedulers.run(),
        ]

    def _on_nodes_changed(self, items: dict[str, bytes]) -> None:
        self._models = models_from_registrations(items)
        self._liveness.update({key.removeprefix(etcd_keys.NODES) for key in items})

    async def before_stop(self) -> None:
        await self._member.leave()

    async def close(self) -> None:
        await self._schedulers.close()
        await self._node_channels.close()
        await self._member.close()

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(
            models=[
                router_pb2.ServedModel(
                    name=m.name,
                    max_context_tokens=m.max_context_tokens,
                    tokenizer=m.tokenizer,
                    num_warm_nodes=m.num_warm_nodes,
                )
                for _, m in sorted(self._models.items())
            ]
        )

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        outcome = "OK"
        try:
            valid = validate(request, self._models, self._config.default_max_tokens, self._rng)
            generation = Generation(
                request_id=valid.request_id,
                model=valid.model.name,
                prompt_token_ids=valid.prompt_token_ids,
                sampling=valid.sampling,
                generated=list(valid.resume_token_ids),
            )
            decoder = TOKENIZERS[valid.model.tokenizer].decoder()
            # A resumed stream's text continues where the client's left off, mid-character or not.
            decoder.decode(valid.resume_token_ids)
            is_first = True
            chunks = coalesce(self._relay(generation, request, context), merge_chunks)
            async for chunk in chunks:
                self._relayed_tokens.add(len(chunk.token_ids), {"model": generation.model})
                reply = router_pb2.GenerateChunk(
                    request_id=generation.request_id,
                    token_ids=chunk.token_ids,
                    text=decoder.decode(list(chunk.token_ids)),
                    index=chunk.index,
                    node_id=chunk.node_id,
                    finish_reason=chunk.finish_reason,
                    inexact=not generation.is_exact,
                )
                if is_first and generation.sampling.HasField("seed"):
                    reply.seed = generation.sampling.seed
                is_first = False
                if chunk.finish_reason:
                    reply.usage.CopyFrom(generation.usage(chunk.usage))
                yield reply
        except BatonError as error:
            outcome = error.code.name
            await abort(context, error)
        finally:
            self._requests.add(1, {"status": outcome})

    async def _relay(
        self, generation: Generation, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
        """The generation's chunks, indexed from its start, moving to another node when one fails."""
        loop = asyncio.get_running_loop()
        if generation.num_remaining == 0:  # a resumed request that already has every token
            yield node_agent_pb2.NodeGenerateChunk(index=len(generation.generated),
                                                   finish_reason=common_pb2.FINISH_REASON_LENGTH)
            return
        retry_cause = ""
        last_token_at: float | None = None
        failed_at: float | None = None
        while True:
            placement = await self._place(generation, request, retry_cause, context.time_remaining())
            base = len(generation.generated)
            node_chunks = watched_stream(
                self._node_channels.get(placement.address), placement.node_id, generation.node_request(),
                self._liveness, self._config.stall_floor_s, context.time_remaining(),
            )
            try:
                async for chunk in node_chunks:
                    if chunk.index != len(generation.generated) - base:
                        raise NodeFailure(placement.node_id, FailureCause.STREAM_BROKEN,
                                          f"chunk index {chunk.index}, expected {len(generation.generated) - base}")
                    generation.generated.extend(chunk.token_ids)
                    if base and not chunk.checkpoint.exact:
                        generation.is_exact = False
                    if chunk.token_ids:
                        last_token_at = loop.time()
                        if failed_at is not None:
                            self._resume_stall.record((last_token_at - failed_at) * 1000)
                            failed_at = None
                    if chunk.finish_reason and retry_cause:
                        recomputed = chunk.usage.prompt_tokens - chunk.usage.cached_tokens
                        generation.recomputed_tokens += recomputed
                        self._recomputed.add(recomputed, {"model": generation.model})
                    chunk.index += base
                    yield chunk
                    if chunk.finish_reason:
                        return
            except NodeFailure as failure:
                log.warning("request %s: %s after %d tokens; resuming elsewhere", generation.request_id,
                            failure, len(generation.generated))
                self._migrations.add(1, {"cause": failure.cause.value})
                self._suspects[failure.node_id] = loop.time() + self._config.suspect_s
                generation.record_failure(failure, self._config.max_migrations)
                retry_cause = failure.cause.value
                if failed_at is None:
                    failed_at = last_token_at if last_token_at is not None else loop.time()

    async def _place(
        self, generation: Generation, request: router_pb2.GenerateRequest, retry_cause: str,
        remaining_s: float | None,
    ) -> scheduler_pb2.Placement:
        """A node for the generation's next attempt, avoiding nodes that failed recently."""
        now = asyncio.get_running_loop().time()
        self._suspects = {node: until for node, until in self._suspects.items() if until > now}
        place = scheduler_pb2.PlaceRequest(
            request_id=generation.request_id,
            model=generation.model,
            num_prompt_tokens=len(generation.context),
            block_hashes=generation.context_block_hashes(),
            max_tokens=generation.num_remaining,
            tenant=request.tenant,
            priority=request.priority,
            ttft_budget_ms=request.ttft_budget_ms,
            deadline_ms=request.deadline_ms,
            workflow_id=request.workflow_id,
            step=request.step,
            total_steps=request.total_steps,
            exclude_node_ids=sorted(set(generation.excluded_nodes()) | set(self._suspects)),
            retry_cause=retry_cause,
        )
        try:
            return await self._call_scheduler(place, remaining_s)
        except BatonError as error:
            if error.code == grpc.StatusCode.UNAVAILABLE and self._suspects:
                # Every node this router avoids may be all there is; try them again.
                del place.exclude_node_ids[:]
                place.exclude_node_ids.extend(generation.excluded_nodes())
                return await self._call_scheduler(place, remaining_s)
            if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_cause:
                raise Unavailable(f"request {generation.request_id} cannot move after {retry_cause}: "
                                  f"{error}") from None
            raise

    async def _call_scheduler(
        self, place: scheduler_pb2.PlaceRequest, remaining_s: float | None
    ) -> scheduler_pb2.Placement:
        """Place on the first scheduler that answers, within the placement timeout and the client's deadline."""
        timeout_s = self._config.placement_timeout_s
        if remaining_s is not None:
            timeout_s = min(timeout_s, remaining_s)
        addresses = self._schedulers.addresses() or await self._schedulers.wait_any(timeout_s)
        last_error: BatonError = Unavailable("no scheduler answered")
        for address in addresses:
            stub = scheduler_pb2_grpc.SchedulerStub(self._schedulers.channel(address))
            try:
                return await stub.Place(place, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise from_rpc_error(exc) from None
                last_error = from_rpc_error(exc)
        raise last_error
