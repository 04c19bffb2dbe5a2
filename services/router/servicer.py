"""Router gRPC service: validate, place, stream from the node agent, relay to the client."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.metrics import Observation

from baton.protocol import DEFAULT_TENANT, LIVE_IDS_PER_REPORT
from baton.v1 import (
    common_pb2,
    node_agent_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common import etcd_keys
from services.common.auth import TenantRecord, joined_authorization
from services.common.coalesce import coalesce
from services.common.deadline import until
from services.common.directory import ChannelPool, LeaderDirectory
from services.common.errors import AlreadyExists, BatonError, DeadlineExceeded, ResourceExhausted, Unavailable, abort
from services.common.etcd_session import Membership, PrefixView
from services.common.gone_from_listing import GoneFromListing
from services.common.server import ServingNames
from services.common.telemetry import Telemetry
from services.common.tenant_directory import TenantDirectory
from services.common.timeouts import usable_s, within
from services.common.tls import server_ssl_context
from services.router.catalogue import models_from_registrations, registrations
from services.router.config import RouterConfig
from services.router.generation import Generation
from services.router.http_api import HttpApi
from services.router.node_stream import NodeLiveness
from services.router.relay import Ending, HeldEndings, Relay
from services.router.request_scope import cluster_request_id, name_as_client
from services.router.stop_text import StopText
from services.router.tokenizer import TOKENIZERS
from services.router.validation import ModelEntry, check_fields, validate

log = logging.getLogger(__name__)

# How long a router that stops waits for the streams its server cut to end (their cleanup tells the leader).
_CLOSE_STREAMS_S = 5.0


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

    def __init__(self, config: RouterConfig, telemetry: Telemetry, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock  # when models left the listing (GONE_MODEL_MEMORY_S)
        # On gRPC health, baton.v1.Router serves once the nodes have been read from etcd (nodes_read).
        self.health = ServingNames(not_serving=self.service_names)
        self._rng = random.Random()
        self._models: dict[str, ModelEntry] = {}
        # The models no node serves now that some node served lately: a request for one is told to retry (or an
        # alternative serves it), not that the cluster never served it.
        self._gone_models: GoneFromListing[ModelEntry] = GoneFromListing()
        # Set once the nodes have been read from etcd: before then every model would be "not served" (NOT_FOUND,
        # which a client does not retry) on a router that had just started.
        self._nodes_read = asyncio.Event()
        self._member = Membership(config.etcd, config.lease_ttl_s, config.etcd_credentials())
        # A node whose lease lapsed stays for a TTL: an etcd freeze expires every lease at once.
        self._nodes = PrefixView(self._member.client, etcd_keys.NODES, self._on_nodes_changed,
                                 grace_s=config.lease_ttl_s)
        # With --auth: every call names its tenant by API key (services/common/auth.py).
        self._tenants = TenantDirectory(self._member.client) if config.auth else None
        self._leader = LeaderDirectory(self._member.client, etcd_keys.SCHEDULER_ELECTION, telemetry)
        self._node_channels = ChannelPool(telemetry)
        self._liveness = NodeLiveness()
        # Each node's registration (GPU generation, price), by node id, kept after a node leaves: its last tokens
        # may come later, and a leader that never saw it prices its GPU time from the Finished notice.
        self._node_infos: dict[str, common_pb2.NodeInfo] = {}
        self._relay = Relay(config, self._leader, self._node_channels, self._liveness, telemetry.meter,
                            self._node_infos.get)
        # Requests this router serves now (an id twice if a client sent it twice), reported to the leader.
        self._live: Counter[str] = Counter()
        # The workflow of each live request that is a step of one.
        self._live_workflows: dict[str, str] = {}
        # The tenant of each live request as the leader counts it, and its generation (once placed, the reports
        # name its tenant: a leader with no slot for it gives it one).
        self._live_tenants: dict[str, tuple[str, Generation]] = {}
        # Streams begun and not yet settled (valid or not), and an event set whenever that count reaches 0.
        self._open_streams = 0
        self._streams_ended = asyncio.Event()
        self._requests = telemetry.meter.create_counter(
            "baton.router.requests", description="Generate requests, by final status"
        )
        self._rate_limited = telemetry.meter.create_counter(
            "baton.router.rate_limited", description="requests refused: over their connection's request rate"
        )
        self._relayed_tokens = telemetry.meter.create_counter(
            "baton.router.relayed_tokens", description="completion tokens relayed to clients"
        )
        # Observed at every collection, so a router's /metrics has its target_info and this from the start, not only
        # after its first request.
        telemetry.meter.create_observable_gauge(
            "baton.router.open_streams", [lambda _: [Observation(self._open_streams)]],
            description="Generate streams (gRPC and HTTP) begun and not yet ended")
        # One bucket per client connection, gRPC and HTTP alike (None: --max-requests-per-connection-per-s 0).
        self._connection_rates = config.connection_rates()
        # HTTPS with the certificate the gRPC port serves (--tls-cert), else plaintext HTTP.
        self._http = (HttpApi(self, config.http_listen, config.input_limits, self.check_connection_rate,
                              ssl_context=server_ssl_context(config.tls),
                              tracer=telemetry.tracer_provider.get_tracer("baton.router.http"),
                              meter=telemetry.meter, read_timeout_s=config.http_read_timeout_s)
                      if config.http_listen else None)

    def register(self, server: grpc.aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(self, server)

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        config = self._config
        return [
            *self._member.hold_service("router", config.instance_id, config.address),
            self._nodes.run(),
            self._leader.run(),
            self._report_live(),
            *([self._tenants.run()] if self._tenants is not None else []),
        ]

    async def _report_live(self) -> None:
        """Tell the leader, every --live-report-interval-s and as soon as etcd shows a new one, which requests this
        router still serves: their admission slots stay held. Best effort: a slot missed for the leader's lease is
        freed."""
        interval_s = self._config.live_report_interval_s
        reported_to = self._leader.leader()
        while True:
            # At once, too, when etcd shows a new leader: one that took over holding no slot for a request a node
            # runs gives it one from this report, and a request of its tenant admitted before then went past the
            # tenant's limit (helper-135: 1 of 40, 0.2 s after the successor led).
            await self._leader.wait_for_other(reported_to, interval_s)
            reported_to = self._leader.leader()
            address = self._leader.address()
            if address is None or not self._live:
                continue
            stub = scheduler_pb2_grpc.SchedulerStub(self._leader.channel(address))
            live = list(self._live)
            for start in range(0, len(live), LIVE_IDS_PER_REPORT):
                ids = live[start:start + LIVE_IDS_PER_REPORT]
                workflows = sorted({self._live_workflows[i] for i in ids if i in self._live_workflows})
                placed = [self._placed(i) for i in ids]
                report = scheduler_pb2.LiveRequests(
                    router_id=self._config.instance_id, router_incarnation=self._relay.incarnation,
                    request_ids=ids, workflow_ids=workflows,
                    tenants=[run[0] if run else "" for run in placed],
                    prompt_digests=[run[1].prompt_digest if run else 0 for run in placed])
                try:
                    await stub.ReportLiveRequests(report, timeout=interval_s)
                except grpc.aio.AioRpcError as exc:
                    log.debug("live-request report to %s failed: %s", address, exc.code().name)
                    break

    def _placed(self, request_id: str) -> tuple[str, Generation] | None:
        """The tenant and generation of request_id once a node has taken it (a live report names its tenant and
        prompt then), else None."""
        live = self._live_tenants.get(request_id)
        return live if live is not None and live[1].placed else None

    def _on_nodes_changed(self, items: dict[str, bytes]) -> None:
        self._models = models_from_registrations(items, self._nodes.lapsed)
        self._gone_models.update(self._models, self._clock())
        self._node_infos.update(registrations(items))
        self._liveness.update({key.removeprefix(etcd_keys.NODES) for key in items})
        self._nodes_read.set()
        self.health.set(self.service_names[0], True)

    def _wait_s(self, time_remaining: Callable[[], float | None]) -> float:
        """How long a wait for etcd's view may take of a call: --leader-wait-s, within the call's time less what its
        refusal needs to reach the caller before its deadline (which would otherwise say only that it passed)."""
        remaining_s = usable_s(time_remaining())
        return self._config.leader_wait_s if remaining_s is None else min(remaining_s, self._config.leader_wait_s)

    def has_read_nodes(self) -> bool:
        """Whether this router has read the cluster's nodes from etcd (what nodes_read waits for)."""
        return self._nodes_read.is_set()

    async def nodes_read(self, time_remaining: Callable[[], float | None] = lambda: None) -> None:
        """Return once this router has read the cluster's nodes from etcd, waiting for that within _wait_s;
        Unavailable after. A router that had just started answered every model NOT_FOUND, "not served by this
        cluster (served: none)", for as long as its first listing took (a CI run under load)."""
        if self._nodes_read.is_set():
            return
        timeout_s = self._wait_s(time_remaining)
        try:
            await within(self._nodes_read.wait(), timeout_s)
        except TimeoutError:
            raise Unavailable(f"this router has not read the cluster's nodes from etcd (is etcd reachable?) within "
                              f"{timeout_s:.1f} s; retry") from None

    async def open_http(self) -> bool:
        """Serve the OpenAI-compatible HTTP API when --http-listen asks for it; False when its
        address cannot be bound. Called before the gRPC server starts, so a router reported
        SERVING serves HTTP too."""
        if self._http is None:
            return True
        return await self._http.start()

    async def before_stop(self) -> None:
        if self._http is not None:
            self._http.stop_accepting()
        await self._member.leave()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        # The leader hears how the last streams ended before its channel closes: those the server cut as it stopped
        # end over the next turns of the loop, and their notices go out then.
        await self._streams_closed(_CLOSE_STREAMS_S)
        await self._relay.close()
        await self._leader.close()
        await self._node_channels.close()
        await self._member.close()

    async def _streams_closed(self, timeout_s: float) -> None:
        """Until every stream begun has settled, or timeout_s has passed (logged)."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._open_streams:
                    self._streams_ended.clear()
                    await self._streams_ended.wait()
        except TimeoutError:
            log.warning("closing with %d streams still open after %.0f s: their Finished notices are not sent",
                        self._open_streams, timeout_s)

    def served_models(self) -> list[router_pb2.ServedModel]:
        """The models the cluster serves now, by name."""
        return [
            router_pb2.ServedModel(
                name=m.name,
                max_context_tokens=m.max_context_tokens,
                tokenizer=m.tokenizer,
                num_warm_nodes=m.num_warm_nodes,
            )
            for _, m in sorted(self._models.items())
        ]

    def check_connection_rate(self, connection: str) -> None:
        """Count one request against connection's rate (a TCP connection, as its front end names it);
        ResourceExhausted naming the limits and when to retry if it is over them."""
        if self._connection_rates is None:
            return
        wait_s = self._connection_rates.acquire(connection, asyncio.get_running_loop().time())
        if wait_s > 0:
            self._rate_limited.add(1)
            config = self._config
            raise ResourceExhausted(
                f"connection {connection}: more requests than --max-requests-per-connection-per-s="
                f"{config.max_requests_per_connection_per_s:g} after a burst of --connection-request-burst="
                f"{config.connection_request_burst}", retry_after_ms=max(1, math.ceil(wait_s * 1000)))

    async def authorize(self, authorization: str | None,
                        time_remaining: Callable[[], float | None] = lambda: None) -> TenantRecord | None:
        """With --auth, the tenant record of the caller's `authorization: Bearer <key>` (gRPC metadata or HTTP
        header); Unauthenticated without a valid key. Without --auth, None (anyone may call)."""
        if self._tenants is None:
            return None
        await self._tenants.ready(self._wait_s(time_remaining))
        return self._tenants.tenant_from_authorization(authorization)

    async def _authenticate(self, request: router_pb2.GenerateRequest, authorization: str | None,
                            time_remaining: Callable[[], float | None] = lambda: None) -> str:
        """With --auth, the caller's tenant replaces the request's own, and its prefix-cache namespace is
        returned; Unauthenticated without a valid key, PermissionDenied for a priority above the tenant's
        max_priority. Without --auth, the shared namespace ("")."""
        if self._tenants is None:
            self._name_span(request)
            return ""
        await self._tenants.ready(self._wait_s(time_remaining))
        record = self._tenants.tenant_from_authorization(authorization)
        request.tenant = record.tenant
        self._name_span(request)
        record.check_priority(request.priority)  # as the key decides the tenant, its record bounds the priority
        return record.cache_salt

    def _name_span(self, request: router_pb2.GenerateRequest) -> None:
        """The request's span names the id it asks for, as generate names it once valid, so that a request refused
        before that (a field out of range, a priority above its tenant's) is found in the traces by it
        (helper-197); not an id that validation will refuse."""
        request_id = request.request_id
        if 0 < len(request_id) <= self._config.max_id_len and request_id.isprintable() \
                and request_id == request_id.strip():
            trace.get_current_span().set_attribute(
                "baton.request_id", request_id if self._tenants is None
                else cluster_request_id(request.tenant, request_id))

    async def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        try:
            self.check_connection_rate(context.peer())
            await self.authorize(_authorization(context), context.time_remaining)
            await self.nodes_read(context.time_remaining)
        except BatonError as error:
            await abort(context, error)
        return router_pb2.ListModelsResponse(models=self.served_models())

    @property
    def models(self) -> dict[str, ModelEntry]:
        """What validation knows of each served model, by name."""
        return self._models

    def gone_model(self, name: str) -> ModelEntry | None:
        """name's entry if some node served it lately and none does now (GONE_MODEL_MEMORY_S)."""
        return self._gone_models.get(name, self._clock())

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        try:
            # First, before any work: a connection over its rate costs the router as little as can be.
            self.check_connection_rate(context.peer())
            async with aclosing(self.generate(request, context.time_remaining, _authorization(context))) as replies:
                async for reply in replies:
                    yield reply
        except BatonError as error:
            await abort(context, error)

    async def generate(
        self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
        authorization: str | None = None,
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        """The request's stream, for every front end (gRPC, HTTP): validated, placed, relayed and
        resumed on node failures; BatonError, naming what was wrong, when it cannot be served."""
        outcome = ""  # the status it ended with; none: OK once its last reply went out, else its client went away
        live_id: str | None = None
        # How the generation ended, told the leader once this stream knows whether its last reply went out.
        # ABORTED comes from a node whose stream a resume of this request, through another router, took over;
        # ALREADY_EXISTS from one that runs this id already, for a stream of it through this router or another.
        span = trace.get_current_span()  # the request's: gRPC's Generate, or the HTTP request's
        held = HeldEndings(lambda ending: self._tell_finished(
            ending, outcome in (grpc.StatusCode.ABORTED.name, grpc.StatusCode.ALREADY_EXISTS.name), span))
        delivered = False
        # The request as the cluster knows it (with --auth, in its tenant's namespace) and as the client does.
        cluster_id = client_id = request.request_id
        self._open_streams += 1
        try:
            cache_salt = await self._authenticate(request, authorization, time_remaining)
            if not self.has_read_nodes():  # bad input is refused at once, not after the wait for the served models
                check_fields(request, self._config.input_limits)
            await self.nodes_read(time_remaining)
            valid = validate(request, self._models, self._config.default_max_tokens, self._rng,
                             self._config.input_limits, self.gone_model)
            client_id = cluster_id = valid.request_id
            if self._tenants is not None:  # request.tenant is the key's: another tenant cannot reach this id
                cluster_id = cluster_request_id(request.tenant, client_id)
                if request.workflow_id:  # nor its workflow's task, whose steps and spend the scheduler keeps
                    request.workflow_id = cluster_request_id(request.tenant, request.workflow_id)
            # A request's trace is found by its id (no span carried it, helper-158): the cluster's, as the leader's
            # and the nodes' spans name it.
            span.set_attribute("baton.request_id", cluster_id)
            tokenizer = TOKENIZERS[valid.model.tokenizer]
            generation = Generation(
                request_id=cluster_id,
                model=valid.model.name,
                prompt_token_ids=valid.prompt_token_ids,
                sampling=valid.sampling,
                generated=list(valid.resume_token_ids),
                alternative_models=valid.alternative_models,
                cache_salt=cache_salt,
                resent=request.HasField("resume"),
                # Only a request with stop strings has its tokens decoded one by one.
                stop_text=(StopText(request.stop, tokenizer.decoder(), valid.resume_token_ids)
                           if request.stop else None),
            )
            if self._live.get(cluster_id) and not generation.resent:
                # (The leader refuses one whose id another router runs; this router's own it knows best: the claim
                # the leader has of it may be a stream that just ended, its Finished notice under way.)
                raise AlreadyExists(f"request_id={client_id!r}: is already running, through this router; a new "
                                    "request needs another request_id (a gRPC client takes the stream over by "
                                    "sending it with `resume`)")
            decoder = tokenizer.decoder()
            # A resumed stream's text continues where the client's left off, mid-character or not.
            decoder.decode(valid.resume_token_ids)
            is_first = True
            live_id = generation.request_id
            self._live[live_id] += 1
            if request.workflow_id:
                self._live_workflows[live_id] = request.workflow_id
            current = self._live_tenants.get(live_id)
            if current is None or not current[1].placed:
                # Not over a stream of the id a node runs: a resend refused for another prompt blanked that stream's
                # tenant and prompt in every report while it ran (helper-143).
                self._live_tenants[live_id] = (request.tenant or DEFAULT_TENANT, generation)
            # A stream that passes its end-to-end deadline ends there: the tokens sent so far stay sent.
            deadline_at = (asyncio.get_running_loop().time() + request.deadline_ms / 1000
                           if request.deadline_ms else None)
            # The relay is cut off at the deadline, and what it generated before then still goes out, then the error:
            # cut off after the merging below, the tokens waiting out the stream interval were dropped (the client
            # had 57 of the 64 the error named, helper-125). Once the finishing chunk came, the deadline is met,
            # however slow its client is to take it. (Not "the tokens sent so far stand": an HTTP client that asked
            # for a whole answer was sent none.)
            passed = until(self._relay.stream(generation, request, time_remaining, deadline_at, held), deadline_at,
                           lambda: DeadlineExceeded(
                               f"deadline_ms={request.deadline_ms}: passed after {len(generation.generated)} "
                               f"generated tokens of request {client_id}{_waiting_for_leader(generation)}"),
                           last=lambda chunk: bool(chunk.finish_reason))
            # Tokens that come faster than one message per stream interval, or while the client is
            # behind, go out merged; a migration never shares a message (node_id names one node). Closed at once,
            # whoever stops reading (a client gone): the relay stops its node stream.
            chunks = coalesce(passed, merge_chunks, min_interval_s=self._config.stream_interval_s,
                              max_pending=self._config.max_pending_chunks, key=lambda chunk: chunk.node_id)
            async with aclosing(chunks) as relayed:
                async for chunk in relayed:
                    self._relayed_tokens.add(len(chunk.token_ids), {"model": generation.model})
                    text = decoder.decode(list(chunk.token_ids), final=bool(chunk.finish_reason))
                    if generation.stop_text is not None:  # the text ends with the stop, though its token may go on
                        text = generation.stop_text.clip(text)
                    reply = router_pb2.GenerateChunk(
                        request_id=client_id,
                        token_ids=chunk.token_ids,
                        text=text,
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
                    # Resumed: its front end took the last reply on (a gRPC write completed), the client did not
                    # go away before it.
                    delivered = delivered or bool(chunk.finish_reason)
        except BatonError as error:
            outcome = error.code.name
            name_as_client(error, cluster_id, client_id)
            raise
        except Exception:
            outcome = grpc.StatusCode.UNKNOWN.name  # a bug: what gRPC tells the client of an unexpected exception
            raise
        finally:
            if live_id is not None:
                self._live[live_id] -= 1
                if self._live[live_id] <= 0:
                    del self._live[live_id]
                    self._live_workflows.pop(live_id, None)
                    self._live_tenants.pop(live_id, None)
            # The relay has ended, unless this stream was cancelled again while it closed: then its ending is told
            # when it comes.
            held.settle(delivered)
            # Without a status of its own, a stream whose last reply never went out was left by its client (a
            # cancelled call, a closed HTTP connection).
            self._requests.add(1, {"status": outcome or ("OK" if delivered else grpc.StatusCode.CANCELLED.name)})
            self._open_streams -= 1
            if not self._open_streams:
                self._streams_ended.set()

    def _tell_finished(self, ending: Ending, other_stream_elsewhere: bool, span: trace.Span) -> None:
        """Tell the leader how a stream ended, and whether another of its request id still runs: here, or elsewhere
        as a node said (a resume took this one's place there, it was already running there, or it runs there in a
        stream this one could not take over). Their admission slot is one: released now, a refused duplicate, or a
        frozen router waking, freed the slot of the stream still running. The request's span is told too."""
        ending.traced(span)
        ending.another_stream_live = (other_stream_elsewhere or bool(ending.generation.refusals)
                                      or self._live.get(ending.generation.request_id, 0) > 0)
        self._relay.tell_finished(ending)


def _waiting_for_leader(generation: Generation) -> str:
    """Why a deadline passed, when the placement was waiting for a scheduler leader then (a control-plane outage,
    not a slow node); "" otherwise."""
    since = generation.leader_wait_since
    if since is None:
        return ""
    waited_s = asyncio.get_running_loop().time() - since
    return f", its placement waiting {waited_s:.1f} s for a scheduler leader that answers"


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's `authorization` metadata (the API key, with --auth), if any; several entries joined."""
    return joined_authorization(context.invocation_metadata())
