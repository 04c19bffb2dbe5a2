"""Router gRPC service: validate, place, stream from the node agent, relay to the client."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc

from baton.v1 import (
    node_agent_pb2,
    node_agent_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common import etcd_keys
from services.common.block_hash import block_hashes
from services.common.coalesce import coalesce
from services.common.directory import ChannelPool, ServiceDirectory
from services.common.errors import BatonError, Unavailable, abort, from_rpc_error
from services.common.etcd_session import Membership, PrefixView
from services.common.telemetry import Telemetry
from services.router.catalogue import models_from_registrations
from services.router.config import RouterConfig
from services.router.tokenizer import TOKENIZERS
from services.router.validation import ModelEntry, ValidRequest, validate

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
        self._requests = telemetry.meter.create_counter(
            "baton.router.requests", description="Generate requests, by final status"
        )
        self._relayed_tokens = telemetry.meter.create_counter(
            "baton.router.relayed_tokens", description="completion tokens relayed to clients"
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
            remaining_s = context.time_remaining()
            placement = await self._place(valid, request, remaining_s)
            decoder = TOKENIZERS[valid.model.tokenizer].decoder()
            node_stream = self._stream_from_node(valid, placement, context.time_remaining())
            async for chunk in coalesce(node_stream, merge_chunks):
                self._relayed_tokens.add(len(chunk.token_ids), {"model": valid.model.name})
                reply = router_pb2.GenerateChunk(
                    request_id=valid.request_id,
                    token_ids=chunk.token_ids,
                    text=decoder.decode(list(chunk.token_ids)),
                    index=chunk.index,
                    node_id=chunk.node_id,
                    finish_reason=chunk.finish_reason,
                )
                if chunk.HasField("usage"):
                    reply.usage.CopyFrom(chunk.usage)
                yield reply
        except BatonError as error:
            outcome = error.code.name
            await abort(context, error)
        finally:
            self._requests.add(1, {"status": outcome})

    async def _place(
        self, valid: ValidRequest, request: router_pb2.GenerateRequest, remaining_s: float | None
    ) -> scheduler_pb2.Placement:
        """A node for the request, within the placement timeout and the client's own deadline."""
        timeout_s = self._config.placement_timeout_s
        if remaining_s is not None:
            timeout_s = min(timeout_s, remaining_s)
        place = scheduler_pb2.PlaceRequest(
            request_id=valid.request_id,
            model=valid.model.name,
            num_prompt_tokens=len(valid.prompt_token_ids),
            block_hashes=block_hashes(valid.prompt_token_ids),
            max_tokens=valid.sampling.max_tokens,
            tenant=request.tenant,
            priority=request.priority,
            ttft_budget_ms=request.ttft_budget_ms,
            deadline_ms=request.deadline_ms,
            workflow_id=request.workflow_id,
            step=request.step,
            total_steps=request.total_steps,
        )
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

    async def _stream_from_node(
        self, valid: ValidRequest, placement: scheduler_pb2.Placement, remaining_s: float | None
    ) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
        """The node's chunks; the node's stream ends when the client's deadline does."""
        stub = node_agent_pb2_grpc.NodeAgentStub(self._node_channels.get(placement.address))
        call = stub.Generate(
            node_agent_pb2.NodeGenerateRequest(
                request_id=valid.request_id,
                model=valid.model.name,
                prompt_token_ids=valid.prompt_token_ids,
                sampling=valid.sampling,
            ),
            timeout=remaining_s,
        )
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                raise Unavailable(
                    f"node {placement.node_id} at {placement.address} failed mid-stream: {exc.details()}"
                ) from None
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()
