"""Router gRPC service: validate, place, stream from the node agent, relay to the client."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any

import grpc

from baton.v1 import (
    node_agent_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common import etcd_keys
from services.common.coalesce import coalesce
from services.common.deadline import until
from services.common.directory import ChannelPool, LeaderDirectory
from services.common.errors import BatonError, DeadlineExceeded, abort
from services.common.etcd_session import Membership, PrefixView
from services.common.telemetry import Telemetry
from services.router.catalogue import models_from_registrations
from services.router.config import RouterConfig
from services.router.generation import Generation
from services.router.node_stream import NodeLiveness
from services.router.relay import Relay
from services.router.tokenizer import TOKENIZERS
from services.router.validation import ModelEntry, validate

log = logging.getLogger(__name__)

# Request ids per ReportLiveRequests call (well under gRPC's 4 MiB message limit at 128 characters each).
_LIVE_IDS_PER_REPORT = 10_000


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
        self._rng = random.Random()
        self._models: dict[str, ModelEntry] = {}
        self._member = Membership(config.etcd, config.lease_ttl_s)
        # A node whose lease lapsed stays for a TTL: an etcd freeze expires every lease at once.
        self._nodes = PrefixView(self._member.client, etcd_keys.NODES, self._on_nodes_changed,
                                 grace_s=config.lease_ttl_s)
        self._leader = LeaderDirectory(self._member.client, etcd_keys.SCHEDULER_ELECTION, telemetry)
        self._node_channels = ChannelPool(telemetry)
        self._liveness = NodeLiveness()
        self._relay = Relay(config, self._leader, self._node_channels, self._liveness, telemetry.meter)
        # Requests this router serves now (an id twice if a client sent it twice), reported to the leader.
        self._live: Counter[str] = Counter()
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
            *self._member.hold_service("router", config.instance_id, config.address),
            self._nodes.run(),
            self._leader.run(),
            self._report_live(),
        ]

    async def _report_live(self) -> None:
        """Tell the leader, every --live-report-interval-s, which requests this router still serves:
        their admission slots stay held. Best effort: a slot missed for the leader's lease is freed."""
        interval_s = self._config.live_report_interval_s
        while True:
            await asyncio.sleep(interval_s)
            address = self._leader.address()
            if address is None or not self._live:
                continue
            stub = scheduler_pb2_grpc.SchedulerStub(self._leader.channel(address))
            live = list(self._live)
            for start in range(0, len(live), _LIVE_IDS_PER_REPORT):
                report = scheduler_pb2.LiveRequests(router_id=self._config.instance_id,
                                                    request_ids=live[start:start + _LIVE_IDS_PER_REPORT])
                try:
                    await stub.ReportLiveRequests(report, timeout=interval_s)
                except grpc.aio.AioRpcError as exc:
                    log.debug("live-request report to %s failed: %s", address, exc.code().name)
                    break

    def _on_nodes_changed(self, items: dict[str, bytes]) -> None:
        self._models = models_from_registrations(items, self._nodes.lapsed)
        self._liveness.update({key.removeprefix(etcd_keys.NODES) for key in items})

    async def before_stop(self) -> None:
        await self._member.leave()

    async def close(self) -> None:
        await self._leader.close()
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
        live_id: str | None = None
        try:
            valid = validate(request, self._models, self._config.default_max_tokens, self._rng,
                             self._config.input_limits)
            generation = Generation(
                request_id=valid.request_id,
                model=valid.model.name,
                prompt_token_ids=valid.prompt_token_ids,
                sampling=valid.sampling,
                generated=list(valid.resume_token_ids),
                alternative_models=valid.alternative_models,
            )
            decoder = TOKENIZERS[valid.model.tokenizer].decoder()
            # A resumed stream's text continues where the client's left off, mid-character or not.
            decoder.decode(valid.resume_token_ids)
            is_first = True
            live_id = generation.request_id
            self._live[live_id] += 1
            # Tokens that come faster than one message per stream interval, or while the client is
            # behind, go out merged; a migration never shares a message (node_id names one node).
            chunks = coalesce(self._relay.stream(generation, request, context.time_remaining), merge_chunks,
                              min_interval_s=self._config.stream_interval_s,
                              max_pending=self._config.max_pending_chunks, key=lambda chunk: chunk.node_id)
            # A stream that passes its end-to-end deadline ends there: the tokens sent so far stay sent.
            deadline_at = (asyncio.get_running_loop().time() + request.deadline_ms / 1000
                           if request.deadline_ms else None)
            async for chunk in until(chunks, deadline_at, lambda: DeadlineExceeded(
                    f"deadline_ms={request.deadline_ms}: passed after {len(generation.generated)} generated "
                    f"tokens of request {generation.request_id}; the tokens sent so far stand")):
                self._relayed_tokens.add(len(chunk.token_ids), {"model": generation.model})
                reply = router_pb2.GenerateChunk(
                    request_id=generation.request_id,
                    token_ids=chunk.token_ids,
                    text=decoder.decode(list(chunk.token_ids)),
                    index=chunk.index,
                    node_id=chunk.node_id,
                    finish_reason=chunk.finish_reason,
                    inexact=not generation.is_exact,
                    model=generation.model,
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
            if live_id is not None:
                self._live[live_id] -= 1
                if self._live[live_id] <= 0:
                    del self._live[live_id]
            self._requests.add(1, {"status": outcome})
