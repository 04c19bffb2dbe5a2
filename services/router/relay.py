"""The router's side of a generation: place it, stream it, and move it when its node fails."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import overload

import grpc
from opentelemetry import trace
from opentelemetry.metrics import Meter

from baton.protocol import LEADER_KEY, ORIGIN_KEY, is_transport_failure
from baton.v1 import common_pb2, node_agent_pb2, router_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.directory import ChannelPool, LeaderDirectory, LeaderRecord
from services.common.errors import (
    BatonError,
    DeadlineExceeded,
    ResourceExhausted,
    StreamHeld,
    Unavailable,
    from_rpc_error,
)
from services.common.failure_cause import FailureCause
from services.common.request_context import context_of
from services.common.slo import Slo, classify
from services.router.config import RouterConfig
from services.router.generation import Generation, NodeFailure, TakeoverRefused
from services.router.latency import StreamLatency
from services.router.node_stream import NodeLiveness, watched_stream
from services.router.stall import NodeActivity

log = logging.getLogger(__name__)


@dataclass
class Ending:
    """How a generation ended, for the leader's Finished notice."""

    generation: Generation
    request: router_pb2.GenerateRequest
    ttft_ms: int
    outcome: scheduler_pb2.RequestOutcome.ValueType
    # Another stream of the same request id still runs when it is told (through this router, or another as its node
    # said): their one admission slot stays held while that stream's router reports it live.
    another_stream_live: bool = False

    def traced(self, span: trace.Span) -> None:
        """On the request's own span (gRPC's Generate, or the HTTP request's), as the leader is told: a trace says how
        it ended and where it ran, where the spans of the calls to nodes it left end UNSET, as a cancelled call's do.
        Not on a span already ended (a stream cancelled again while it closed)."""
        if span.is_recording():
            outcome = scheduler_pb2.RequestOutcome.Name(self.outcome).removeprefix("REQUEST_OUTCOME_").lower()
            span.set_attributes({"baton.outcome": outcome, "baton.tokens": len(self.generation.generated),
                                 "baton.migrations": self.generation.num_migrations})

    def undelivered(self) -> None:
        """Its last reply never reached the client, who went away first: it did not succeed (nor end late)."""
        if self.outcome in (scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED, scheduler_pb2.REQUEST_OUTCOME_LATE):
            self.outcome = scheduler_pb2.REQUEST_OUTCOME_CANCELLED


class HeldEndings:
    """How a stream's generation ended, held until the stream knows whether its last reply reached the client
    (settle), then told the leader. One that comes after (the stream was cancelled again while it closed, and the
    relay ended later, in coalesce's own close) is told at once, undelivered unless the stream had delivered."""

    def __init__(self, tell: Callable[[Ending], None]) -> None:
        self._tell = tell
        self._held: list[Ending] = []
        self._delivered: bool | None = None  # None until settled

    def append(self, ending: Ending) -> None:
        if self._delivered is None:
            self._held.append(ending)
        else:
            self._told(ending)

    def settle(self, delivered: bool) -> None:
        self._delivered = delivered
        held, self._held = self._held, []
        for ending in held:
            self._told(ending)

    def _told(self, ending: Ending) -> None:
        if not self._delivered:
            ending.undelivered()
        self._tell(ending)


class Relay:
    """Streams generations from nodes, resuming each on another node when its node fails."""

    def __init__(self, config: RouterConfig, leader: LeaderDirectory, node_channels: ChannelPool,
                 liveness: NodeLiveness, meter: Meter,
                 registration_of: Callable[[str], common_pb2.NodeInfo | None]) -> None:
        self._config = config
        # This process among those that ran under its --instance-id (PlaceRequest.router_incarnation): one started
        # in the place of one that died frees the slots the dead one held at once, not a lease (15 s) later.
        self.incarnation = secrets.randbits(63) + 1
        # A node's registration (its GPU generation, its price) by id, as this router last saw it; None if never.
        self._registration_of = registration_of
        self._slo = config.slo
        self._leader = leader
        self._node_channels = node_channels
        self._liveness = liveness
        # What this router last heard from each node on any stream: a busy node is not a dead one.
        self._activity = NodeActivity()
        # Nodes that failed a stream lately, avoided by every placement until the time given.
        self._suspects: dict[str, float] = {}
        # Finished notices in flight (kept so they are not collected mid-call, and awaited by close).
        self._notices: set[asyncio.Task[scheduler_pb2.FinishedAck]] = set()
        self._closed = False
        self._migrations = meter.create_counter(
            "baton.router.migrations", description="generations moved to another node, by cause"
        )
        self._resume_stall = meter.create_histogram(
            "baton.router.resume_stall", unit="ms",
            description="from the last token before a node failure to the first token after",
        )
        self._recomputed = meter.create_counter(
            "baton.router.recomputed_tokens", description="context tokens prefilled again on resume"
        )
        self._latency = StreamLatency(meter, config.max_tenant_labels)

    async def stream(
        self, generation: Generation, request: router_pb2.GenerateRequest,
        time_remaining: Callable[[], float | None], deadline_at: float | None, held: HeldEndings,
    ) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
        """The generation's chunks, indexed from its start, moving to another node when one fails. deadline_at:
        when (on the loop's clock) the reader ends the stream at the request's deadline_ms, if it has one. held:
        where its Ending goes, for the caller to tell the leader (tell_finished) once it knows whether the last chunk
        reached its client: this stream ends as soon as its reader takes that chunk."""
        loop = asyncio.get_running_loop()
        # Judged on the client's timeline: a stream it resumes here after its router died was sent resume.elapsed_ms
        # ago and may have had its first token long before (deadline_ms, resent as the part left, counts from here).
        arrived_at = loop.time()
        started_at = arrived_at - request.resume.elapsed_ms / 1000
        num_resumed = len(generation.generated)  # tokens the client had before this stream
        first_token_at: float | None = None
        # The client's last token before it resent the request: what its time per token ends at when no new one comes.
        resumed_last_at: float | None = None
        if request.resume.HasField("first_token_ms"):
            first_token_at = started_at + min(request.resume.first_token_ms, request.resume.elapsed_ms) / 1000
            num_resumed = 0  # its time per token counts every token since that first one
            if request.resume.HasField("last_token_ms"):
                resumed_last_at = min(max(started_at + request.resume.last_token_ms / 1000, first_token_at),
                                      arrived_at)
        outcome = scheduler_pb2.REQUEST_OUTCOME_FAILED
        last_token_at: float | None = None

        def judged(finish_reason: common_pb2.FinishReason.ValueType) -> scheduler_pb2.RequestOutcome.ValueType:
            last_at = last_token_at if last_token_at is not None else resumed_last_at
            return _outcome(finish_reason, request, self._slo, started_at, arrived_at, first_token_at, last_at,
                            len(generation.generated) - num_resumed, loop.time())

        is_task = True  # a lone request refused as bad input is no task, wherever refused (as the router's own)
        try:
            retry_cause: FailureCause | None = None  # why it moves, once a node failed it
            moving: FailureCause | None = None  # a node failure whose move is not yet placed
            # A failed node had the request (said anything on its stream): a move's node then prefills again.
            computed_elsewhere = False
            failed_at: float | None = None
            if generation.stop_text is not None and generation.stop_text.in_resumed:
                # A resumed request whose tokens hold a stop string ended there: no node generates past it.
                outcome = judged(common_pb2.FINISH_REASON_STOP)
                yield node_agent_pb2.NodeGenerateChunk(index=len(generation.generated),
                                                       finish_reason=common_pb2.FINISH_REASON_STOP)
                return
            while True:
                # Its node failed after the last token, before the finish; or a resumed request came with every token
                # (its router died before the finish): it ends here, and the leader hears it ended.
                if generation.num_remaining == 0:
                    outcome = judged(common_pb2.FINISH_REASON_LENGTH)
                    yield _length_finish(generation)
                    return
                try:
                    placement = await self._place(generation, request, retry_cause, time_remaining, deadline_at)
                    generation.placed = True
                except BatonError as error:
                    # Refused as bad input before any node ran it (a move's GPU time is a task's, whatever comes), and
                    # no workflow's step (its workflow failed: unreported, one without total_steps counted as
                    # succeeded); or refused as a duplicate of a stream of its id that runs, or taken over in the
                    # admission queue by its resend (that stream's end is its task's, and their slot is that stream's).
                    ran = bool(generation.failures or generation.refusals or generation.gpu_ms_by_node)
                    is_task = ran or not (error.code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED) or (
                        error.code == grpc.StatusCode.INVALID_ARGUMENT and not request.workflow_id))
                    raise
                if moving is not None:  # counted once a node takes it (a move that found none moved nothing)
                    self._migrations.add(1, {"cause": moving.value})
                    moving = None
                base = len(generation.generated)
                node_chunks = watched_stream(
                    self._node_channels.get(placement.address), placement.node_id,
                    generation.node_request(taking_back=generation.failed_on(placement.node_id)),
                    self._liveness, self._config.stall_floor_s, time_remaining(), self._activity,
                )
                attempt_gpu_ms = 0.0
                attempt_recomputed = 0  # a move's node: the context it prefilled again (as of its last chunk)
                try:
                    async for chunk in node_chunks:
                        if chunk.index != len(generation.generated) - base:
                            raise NodeFailure(placement.node_id, FailureCause.STREAM_BROKEN,
                                              f"chunk index {chunk.index}, expected {len(generation.generated) - base}")
                        # A stop string in the text, however the model tokenized it (the node matches the stop's own
                        # tokens only): the generation ends here, and closing its stream ends it on the node.
                        if generation.stop_text is not None and (
                                num_kept := generation.stop_text.find(chunk.token_ids)) is not None:
                            _end_at_stop(chunk, num_kept)
                        generation.generated.extend(chunk.token_ids)
                        attempt_gpu_ms = chunk.checkpoint.gpu_ms
                        if base and not chunk.checkpoint.exact:
                            generation.is_exact = False
                        if chunk.token_ids:
                            now = loop.time()
                            labels = (self._gpu_of(placement.node_id), request.tenant, generation.model)
                            if first_token_at is None:
                                first_token_at = now
                                self._latency.first_token(now - started_at, *labels)
                            elif failed_at is None and last_token_at is not None:
                                self._latency.next_tokens(now - last_token_at, len(chunk.token_ids), *labels)
                            last_token_at = now
                            if failed_at is not None:
                                self._resume_stall.record((last_token_at - failed_at) * 1000)
                                failed_at = None
                        # A move's node, or a node resuming what the client already has, prefills that again.
                        if (computed_elsewhere or base) and (prefilled := _prefilled(chunk)) is not None:
                            attempt_recomputed = prefilled
                        chunk.index += base
                        if chunk.finish_reason:
                            outcome = judged(chunk.finish_reason)
                            # Charged before the last chunk goes out: its reader totals the usage from it.
                            generation.add_gpu_ms(placement.node_id, attempt_gpu_ms)
                            attempt_gpu_ms = 0.0
                            self._charge_recomputed(generation, attempt_recomputed)
                            attempt_recomputed = 0
                        yield chunk
                        if chunk.finish_reason:
                            return
                except TakeoverRefused as refusal:
                    # The node is well: it runs another stream of this id (a frozen router's, say) that this one
                    # cannot take over. This generation runs elsewhere; no other placement avoids the node, and no
                    # move is counted.
                    log.info("request %s: %s; placing it elsewhere", generation.request_id, refusal)
                    generation.refusals.append(refusal)
                    _trace_event("baton.takeover_refused", refusal.node_id, str(refusal), generation)
                except NodeFailure as failure:
                    if not failure.node_is_well:
                        self._suspects[failure.node_id] = loop.time() + self._config.suspect_s
                    if generation.num_remaining == 0:  # every token arrived: nothing moves, the stream ends
                        log.warning("request %s: %s after its last token; ending it", generation.request_id, failure)
                        continue
                    # A well node (its ping timed out: this router froze) is not avoided: the resume may land there.
                    log.warning("request %s: %s after %d tokens; resuming it%s", generation.request_id, failure,
                                len(generation.generated), "" if failure.node_is_well else " on another node")
                    moving = failure.cause
                    _trace_event("baton.node_failure", failure.node_id, str(failure), generation,
                                 {"baton.cause": failure.cause.value})
                    generation.record_failure(failure, self._config.max_migrations)
                    retry_cause = failure.cause
                    computed_elsewhere = computed_elsewhere or failure.heard
                    if failed_at is None:
                        failed_at = last_token_at if last_token_at is not None else loop.time()
                finally:  # an attempt that failed: what it used and prefilled counts too
                    await node_chunks.aclose()  # at once, not when collected: it ends the node call and its span
                    generation.add_gpu_ms(placement.node_id, attempt_gpu_ms)
                    self._charge_recomputed(generation, attempt_recomputed)
        except (asyncio.CancelledError, GeneratorExit):
            if outcome == scheduler_pb2.REQUEST_OUTCOME_FAILED and not (
                    deadline_at is not None and loop.time() >= deadline_at - _CLOCK_SLACK_S):
                outcome = scheduler_pb2.REQUEST_OUTCOME_CANCELLED  # the client went away (not its deadline)
            raise
        finally:
            # Placed or not (a request refused for the fleet's load or a tenant's limit is a failed task too), the
            # leader learns how it ended; not one it refused as bad input (it took no slot, and the request as sent
            # could never succeed: the router's own refusals of bad input are no tasks either).
            if is_task:
                ttft_ms = int((first_token_at - started_at) * 1000) if first_token_at is not None else 0
                held.append(Ending(generation, request, ttft_ms, outcome))

    def _charge_recomputed(self, generation: Generation, num_tokens: int) -> None:
        if num_tokens:
            generation.recomputed_tokens += num_tokens
            self._recomputed.add(num_tokens, {"model": generation.model})

    def _gpu_of(self, node_id: str) -> str:
        info = self._registration_of(node_id)
        return info.gpu if info is not None else ""

    def tell_finished(self, ending: Ending) -> None:
        """Tell the leader the request ended: its admission slot is released and its task charged. In the
        background, through a failover as a placement is (the leader that etcd shows next, waited for up to
        --leader-wait-s): sent once to a leader that had just been frozen or killed, the notices of requests
        that ended then were lost, and those tasks were never counted."""
        if self._closed:  # its channels are gone: the leader's lease sweep frees the slot
            log.warning("request %s: ended after the router closed; its Finished notice is not sent",
                        ending.generation.request_id)
            return
        generation, request, ttft_ms, outcome = ending.generation, ending.request, ending.ttft_ms, ending.outcome
        notice = scheduler_pb2.FinishedRequest(
            request_id=generation.request_id, context=context_of(request), ttft_ms=ttft_ms, outcome=outcome,
            gpu_ms_by_node=generation.gpu_ms_by_node, model=generation.model,
            num_output_tokens=len(generation.generated),
            price_per_hour_by_node={node: info.price_per_hour for node in generation.gpu_ms_by_node
                                    if (info := self._registration_of(node)) is not None},
            another_stream_live=ending.another_stream_live, router_id=self._config.instance_id)
        task = asyncio.get_running_loop().create_task(self._call_scheduler(notice, _NOTICE_WITHIN_S),
                                                      name=f"Finished notice of {generation.request_id}")
        self._notices.add(task)
        task.add_done_callback(self._finished_notice_done)

    async def close(self) -> None:
        """Wait for the Finished notices under way, at most _CLOSE_NOTICES_S: a router that stops with its last
        streams tells the leader how they ended before its channels close (closed first, the notices were
        cancelled, and those tasks were never counted). Those still unsent then, and any after, are not sent."""
        try:
            async with asyncio.timeout(_CLOSE_NOTICES_S):
                while self._notices:
                    await asyncio.wait(set(self._notices))
        except TimeoutError:
            log.warning("closing with %d Finished notices unsent after %.0f s (no leader answered)",
                        len(self._notices), _CLOSE_NOTICES_S)
            for task in list(self._notices):
                task.cancel()
        self._closed = True

    def _finished_notice_done(self, task: asyncio.Task[scheduler_pb2.FinishedAck]) -> None:
        self._notices.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s was not delivered: %s", task.get_name(), task.exception())

    async def _place(
        self, generation: Generation, request: router_pb2.GenerateRequest, retry_cause: FailureCause | None,
        time_remaining: Callable[[], float | None], deadline_at: float | None = None,
    ) -> scheduler_pb2.Placement:
        """A node for the generation's next attempt, avoiding nodes that failed recently and those that run another
        stream of its id it cannot take over. When none is left, the nodes that failed any stream lately are asked
        again, then those that failed this generation before its last failure: each only when that adds a node
        (asking again for the same set would fail again, and charge again). Two nodes that each stalled for a moment
        ended every moved stream of a two-node cluster, the first live again for seconds, with migrations left
        (helper-154).

        When it is a move (retry_cause set) that cannot happen, Unavailable says which node failed
        how, and why the generation could not move; when no node but those is left, StreamHeld says so. A move asks
        with what is left of the request's deadline (deadline_at, on the loop's clock) as its deadline_ms, as a
        client's resume does: the leader ends one that could not end in it (DEADLINE_EXCEEDED) rather than have a
        survivor prefill it again to miss it.
        """
        place = scheduler_pb2.PlaceRequest(
            request_id=generation.request_id,
            model=generation.model,
            num_prompt_tokens=len(generation.context),
            block_hashes=generation.context_block_hashes(),
            max_tokens=generation.num_remaining,
            context=context_of(request),
            retry_cause=retry_cause.value if retry_cause else "",
            alternative_models=generation.alternative_models,
            resumed=bool(generation.generated) or request.HasField("resume"),
            num_generated_tokens=len(generation.generated),
            router_id=self._config.instance_id,
            router_incarnation=self.incarnation,
            prompt_digest=generation.prompt_digest,
        )
        loop = asyncio.get_running_loop()

        def waiting(since: float | None) -> None:
            generation.leader_wait_since = since
            if since is None and retry_cause and deadline_at is not None:
                # A call goes out: a move's with what is left of the deadline then, through waits for the retry
                # budget and for a leader alike. (Asked with the whole deadline, 16 of 18 streams moved off a dead
                # host were placed, prefilled again on the survivors and ended at their deadline, helper-195; set once
                # a round, a move reached a leader elected seconds later with what was left before, helper-204.)
                place.context.deadline_ms = max(1, math.ceil((deadline_at - loop.time()) * 1000))

        try:
            give_up_at = loop.time() + MOVE_WAIT_S
            while True:
                # (Asked again after a wait, as the nodes' failures are then: suspects lapse, nodes fail.)
                self._suspects = {node: until for node, until in self._suspects.items() if until > loop.time()}
                asks = generation.placement_asks(self._suspects)
                try:
                    placement = await self._ask_in_turn(place, asks, time_remaining, waiting)
                    break
                except ResourceExhausted as error:
                    # A move the cluster's retry budget (or admission) holds back for now: waited out, so that the
                    # generation is not lost (helper-167: 10 of 60 streams of a dead node ended so), within the
                    # client's deadline and MOVE_WAIT_S of this move's first ask.
                    left_s = give_up_at - loop.time()
                    if not retry_cause or error.retry_after_ms / 1000 > left_s:
                        raise
                    wait_s = min(move_wait_s(error.retry_after_ms, random.random()), left_s)
                    remaining = time_remaining()
                    if remaining is not None and wait_s >= remaining:
                        raise DeadlineExceeded(f"request {generation.request_id}: its deadline passes before the "
                                               f"cluster's retry budget lets its move through ({error})") from None
                    log.info("request %s: its move waits %.1f s: %s", generation.request_id, wait_s, error)
                    await asyncio.sleep(wait_s)
        except BatonError as error:
            # (NOT_FOUND for a move: every node that had the model has died or gone from etcd; an outage, not a
            # model the client got wrong.)
            if retry_cause and error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              grpc.StatusCode.NOT_FOUND):
                refused = "".join(f"; {refusal}" for refusal in generation.refusals[-1:])
                raise Unavailable(f"request {generation.request_id}: {generation.failures[-1]}{refused}; could not "
                                  f"move it: {error}") from None
            if generation.refusals and error.code == grpc.StatusCode.UNAVAILABLE:
                # Retryable, and said as the node said it: its client may send it again once that stream ends.
                refusal = generation.refusals[-1]
                raise StreamHeld(f"{refusal.detail}; no other node could take it: {error}",
                                 refusal.node_id) from None
            raise
        generation.settle_model(placement.model)
        return placement

    async def _ask_in_turn(self, place: scheduler_pb2.PlaceRequest, asks: list[set[str]],
                           time_remaining: Callable[[], float | None],
                           waiting: Callable[[float | None], None]) -> scheduler_pb2.Placement:
        """The first placement the leader gives for the asks' node sets, in turn, each asked only when it adds a
        node to the last one refused; the last refusal (no node left) when none gives one."""
        no_node: BatonError | None = None  # the last ask's refusal: no node left
        asked: set[str] = set()
        for exclude in asks:
            if no_node is not None and not asked - exclude:
                continue  # adds no node
            del place.exclude_node_ids[:]
            place.exclude_node_ids.extend(sorted(exclude))
            try:
                return await self._call_scheduler(place, time_remaining(), waiting)
            except BatonError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE or isinstance(error, _NoLeader):
                    raise
                no_node, asked = error, exclude
        assert no_node is not None
        raise no_node

    @overload
    async def _call_scheduler(self, request: scheduler_pb2.PlaceRequest, remaining_s: float | None,
                              on_wait: Callable[[float | None], None] | None = None) -> scheduler_pb2.Placement: ...

    @overload
    async def _call_scheduler(self, request: scheduler_pb2.FinishedRequest, remaining_s: float | None,
                              on_wait: Callable[[float | None], None] | None = None) -> scheduler_pb2.FinishedAck: ...

    async def _call_scheduler(self, request: _LeaderRequest, remaining_s: float | None,
                              on_wait: Callable[[float | None], None] | None = None) -> _LeaderAnswer:
        """Place on the elected scheduler, or tell it a request finished; through a failover, move to the next
        leader and retry there.

        A leader is its election key and revision, not its address. A call in flight is abandoned
        the moment etcd shows another leader (a frozen or cut-off leader is not waited out), and
        when no leader answers, the router waits at most --leader-wait-s for etcd to show a new one
        (on_wait is told, with the time the wait began, while it waits between calls, and None as each call goes
        out: a call a leader holds may be admission queueing as well as a leader that will never answer).
        """
        loop = asyncio.get_running_loop()
        end = math.inf if remaining_s is None else loop.time() + remaining_s

        # Once a leader fails (or none is shown), when the wait for one that answers began, and when it ends.
        wait_end: float | None = None
        wait_began = 0.0

        def wait_s() -> float:
            """The wait left, as a wait between calls begins."""
            nonlocal wait_end, wait_began
            if wait_end is None:
                wait_began = loop.time()
                wait_end = min(wait_began + self._config.leader_wait_s, end)
            if on_wait is not None:
                on_wait(wait_began)
            return max(0.0, wait_end - loop.time())

        def whole_wait_s() -> float:
            """The wait a refusal names: --leader-wait-s, or less when the request's own time ran out first."""
            return 0.0 if wait_end is None else wait_end - wait_began

        backoff_s = 0.025

        async def shown_again(tried: LeaderRecord) -> LeaderRecord | None:
            """After a short backoff, the leader etcd shows: tried still, or one it shows meanwhile;
            None when the wait for a leader is over."""
            nonlocal backoff_s
            backoff_s = min(2 * backoff_s, 1.0)
            other = await self._leader.wait_for_other(tried, min(backoff_s, wait_s()))
            return (other or tried) if other is not None or wait_s() > 0 else None

        leader = self._leader.leader() or await self._leader.wait_for_other(None, wait_s())
        if leader is None:
            raise _NoLeader(f"no scheduler leader is elected: etcd showed none for {whole_wait_s():.1f} s")
        address = leader.address
        num_hints = 0
        timed_out: str | None = None
        while leader is not None:
            # Admission may hold a placement while the fleet is saturated: wait up to the client's deadline.
            timeout_s = self._config.placement_timeout_s if remaining_s is None else max(0.0, end - loop.time())
            tried, at = leader, address
            try:
                if on_wait is not None:
                    on_wait(None)
                return await self._call_at(at, _still_called(tried, at), request, timeout_s)
            except _LeaderReplaced:
                log.log(_log_level(request), "scheduler %s is no longer the elected leader; moving the %s", at,
                        _what(request))
            except grpc.aio.AioRpcError as exc:
                metadata = dict(exc.trailing_metadata() or ())
                hint = metadata.get(LEADER_KEY)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and metadata.get(ORIGIN_KEY) == "baton":
                    # The leader's own answer (a resumed stream that cannot end in what it has left), not this
                    # call timing out: the client hears it as it is.
                    raise from_rpc_error(exc) from None
                if (exc.code() == grpc.StatusCode.FAILED_PRECONDITION and hint and hint != at
                        and num_hints < _MAX_REDIRECTS):
                    address, num_hints = hint, num_hints + 1  # a standby named the leader our view lacks
                    continue
                if not (is_transport_failure(exc) or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                        or exc.code() == grpc.StatusCode.FAILED_PRECONDITION):
                    raise from_rpc_error(exc) from None
                if (exc.code() == grpc.StatusCode.FAILED_PRECONDITION and at == tried.address
                        and self._leader.leader() == tried):
                    # etcd already shows it leading, but it has not taken office yet (its own view lags
                    # etcd's by a watch event): call it again shortly, unless etcd shows another first.
                    if (again := await shown_again(tried)) is not None:
                        leader, address = again, again.address
                        continue
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    timed_out = f"scheduler {at} did not take the {_what(request)} within {timeout_s:.1f} s"
                    if (isinstance(request, scheduler_pb2.PlaceRequest) and at == tried.address
                            and self._leader.leader() == tried):
                        # etcd shows it leading still, its lease kept alive all along: it is alive and held the
                        # placement (admission queueing, a model load), not frozen or dead. Waiting for another
                        # leader only added --leader-wait-s before the refusal, which then blamed the leader
                        # (helper-126, helper-127).
                        raise _NoLeader(f"{timed_out} (admission queueing or a model load); etcd still shows it "
                                        "leading, so no other leader would take it")
                log.log(_log_level(request), "scheduler %s did not take the %s (%s); waiting for a leader", at,
                        _what(request), exc.code().name)
                if is_transport_failure(exc) and at == tried.address:
                    # It may be restarting: call it again once it answers, unless etcd shows another first.
                    leader = await self._leader.wait_other_or_reachable(tried, wait_s())
                    address = leader.address if leader is not None else ""
                    continue
                if (at != tried.address and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                        and self._leader.leader() == tried):
                    # A hint led here: the leader etcd shows answered as a standby whose view still named
                    # the old leader (it had yet to see its own election). Back to it shortly, unless etcd
                    # shows another first; waiting for another would wait out the leader that is.
                    if (again := await shown_again(tried)) is not None:
                        leader, address = again, again.address
                        continue
            leader = await self._leader.wait_for_other(tried, wait_s())
            address = leader.address if leader is not None else ""
        if timed_out is not None:  # a leader that holds a placement that long is queueing it or loading a model
            raise _NoLeader(f"{timed_out} (admission queueing or a model load), and no other leader took over")
        raise _NoLeader(f"no scheduler leader took the {_what(request)} within {whole_wait_s():.1f} s of the first "
                        "one failing")

    async def _call_at(self, address: str, is_current: Callable[[LeaderRecord | None], bool],
                       request: _LeaderRequest, timeout_s: float) -> _LeaderAnswer:
        """Place or tell at address; _LeaderReplaced (the call cancelled) as soon as etcd shows a leader that
        is not is_current."""
        if not is_current(self._leader.leader()):
            raise _LeaderReplaced
        stub = scheduler_pb2_grpc.SchedulerStub(self._leader.channel(address))
        call = (stub.Place(request, timeout=timeout_s) if isinstance(request, scheduler_pb2.PlaceRequest)
                else stub.Finished(request, timeout=timeout_s))

        async def answer() -> _LeaderAnswer:
            return await call

        placed = asyncio.ensure_future(answer())
        replaced = asyncio.ensure_future(self._leader.wait_replaced(is_current))
        try:
            await asyncio.wait({placed, replaced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            replaced.cancel()
            if not placed.done():
                call.cancel()
                placed.cancel()
        if placed.done() and not placed.cancelled():
            return placed.result()
        raise _LeaderReplaced


def _trace_event(name: str, node_id: str, detail: str, generation: Generation,
                 attributes: dict[str, str] | None = None) -> None:
    """An event on the request's span: an attempt on node_id it left, and why (detail, cut to 300 characters)."""
    trace.get_current_span().add_event(name, {"baton.node_id": node_id, "baton.detail": detail[:300],
                                              "baton.tokens": len(generation.generated), **(attributes or {})})


def _still_called(leader: LeaderRecord, address: str) -> Callable[[LeaderRecord | None], bool]:
    """Whether the leader etcd shows is still the one a call went to: that leader, or (after a
    standby's redirect to address) one at that address."""
    return lambda shown: shown == leader or (shown is not None and shown.address == address != leader.address)


class _NoLeader(Unavailable):
    """No scheduler leader answered within the leader wait, or the leader held the call to its end: asking again
    without the suspect nodes would wait that long again."""


class _LeaderReplaced(Exception):
    """etcd shows another leader than the one a placement was sent to."""


# A timer may fire this early on the loop's clock: a stream closed this near its deadline was closed by it.
_CLOCK_SLACK_S = 0.001
# Standby redirects followed per placement (views that disagree must not bounce it forever).
_MAX_REDIRECTS = 3
# The longest a Finished notice is tried (a leader holding its call included; after a leader fails, the wait for
# the next is --leader-wait-s) before it is given up (logged); and how long a router that stops waits for those
# under way.
_NOTICE_WITHIN_S = 30.0
_CLOSE_NOTICES_S = 5.0
# The longest a move waits for the retry budget (or admission) to let it through, from its first ask: a window of
# the budget and then some (docs/resume.md); and the shortest wait between its asks (move_wait_s).
MOVE_WAIT_S = 30.0
MOVE_ASK_EVERY_S = 0.25


def move_wait_s(hint_ms: int, draw: float) -> float:
    """How long a move held back by the retry budget waits before it asks again: the leader's hint, at least
    MOVE_ASK_EVERY_S, and a random share (draw, in [0, 1)) of a tenth of that and MOVE_ASK_EVERY_S. Every move of a
    dead node's streams got the same hint, woke together, and all but one were held back again a millisecond later:
    300 moves asked 11,774 times (helper-168)."""
    base = max(hint_ms / 1000, MOVE_ASK_EVERY_S)
    return base + draw * (base / 10 + MOVE_ASK_EVERY_S)

_LeaderRequest = scheduler_pb2.PlaceRequest | scheduler_pb2.FinishedRequest
_LeaderAnswer = scheduler_pb2.Placement | scheduler_pb2.FinishedAck


def _what(request: _LeaderRequest) -> str:
    return "placement" if isinstance(request, scheduler_pb2.PlaceRequest) else "Finished notice"


def _log_level(request: _LeaderRequest) -> int:
    """A placement's trouble with its leader is a warning; a notice's, retried in the background, is logged
    at debug level (one per request ended in an outage) and as a warning only when given up."""
    return logging.WARNING if isinstance(request, scheduler_pb2.PlaceRequest) else logging.DEBUG


def _prefilled(chunk: node_agent_pb2.NodeGenerateChunk) -> int | None:
    """The prompt tokens (the context, on a move) the chunk's node prefilled, not finding them cached; None from a
    chunk that does not say. A node that does not set its checkpoint's count (an older one) says it in its finish's
    usage only."""
    if chunk.checkpoint.HasField("num_cached_tokens"):
        checkpoint = chunk.checkpoint
        return max(0, checkpoint.num_context_tokens - checkpoint.num_completion_tokens - checkpoint.num_cached_tokens)
    if chunk.finish_reason:
        return max(0, chunk.usage.prompt_tokens - chunk.usage.cached_tokens)
    return None


def _end_at_stop(chunk: node_agent_pb2.NodeGenerateChunk, num_kept: int) -> None:
    """chunk, cut after its first num_kept tokens (the last of them completes a stop string), as the finish the
    node would have sent: its usage as of its checkpoint (GPU time spent on the tokens cut off included)."""
    del chunk.token_ids[num_kept:]
    if not chunk.finish_reason:
        checkpoint = chunk.checkpoint
        chunk.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=checkpoint.num_context_tokens - checkpoint.num_completion_tokens,
            cached_tokens=checkpoint.num_cached_tokens, gpu_ms=checkpoint.gpu_ms))
    chunk.finish_reason = common_pb2.FINISH_REASON_STOP


def _length_finish(generation: Generation) -> node_agent_pb2.NodeGenerateChunk:
    """The last chunk of a generation that has every token max_tokens allows."""
    return node_agent_pb2.NodeGenerateChunk(index=len(generation.generated),
                                            finish_reason=common_pb2.FINISH_REASON_LENGTH)


def _outcome(finish_reason: common_pb2.FinishReason.ValueType, request: router_pb2.GenerateRequest, slo: Slo,
             started_at: float, arrived_at: float, first_token_at: float | None, last_token_at: float | None,
             num_tokens: int, now: float) -> scheduler_pb2.RequestOutcome.ValueType:
    """How a finished request went against its own SLO (the cluster's where it sets none): TTFT from when the
    client first sent it (started_at), deadline_ms from its arrival here (arrived_at), as each was sent."""
    ttft_ms = ((first_token_at if first_token_at is not None else now) - started_at) * 1000
    tpot_ms = None
    if first_token_at is not None and last_token_at is not None and num_tokens > 1:
        tpot_ms = (last_token_at - first_token_at) * 1000 / (num_tokens - 1)
    outcome = classify(slo.for_request(request.ttft_budget_ms, request.tpot_budget_ms, request.deadline_ms),
                       finished=True, cancelled=finish_reason == common_pb2.FINISH_REASON_ABORT, ttft_ms=ttft_ms,
                       tpot_ms=tpot_ms, elapsed_ms=(now - arrived_at) * 1000)
    return int(outcome)
