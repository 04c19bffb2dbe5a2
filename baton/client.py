"""A Python client for Baton's routers, over the generated stubs.

It holds what it has received of each stream, so when the router serving it dies, it sends the
same request to another router with those tokens in `resume`, and the stream continues there:
no token lost, none repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.descriptor import FieldDescriptor

from baton.protocol import AUTHORIZATION_KEY, ORIGIN_KEY, is_baton_status, is_transport_failure
from baton.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.errors import shown
from services.common.reconnect import CLIENT_CONNECT_OPTIONS, CLIENT_KEEPALIVE_OPTIONS, RECONNECT_OPTIONS

# The router a stream fails over to may be one this client could not reach a moment ago (restarting, or
# tried first): its channel is then waiting out a reconnect backoff (about a second at most: the services'
# RECONNECT_OPTIONS), and a call made meanwhile fails at once, as if that router were down too. So a
# failover to a channel in that state first waits for it to connect: this long at most over the whole
# request, never past its deadline. A call to one that did not connect fails as to a down router; with
# every router down, a request fails this much later than it would without the wait.
FAILOVER_CONNECT_S = 3.0
# How the details of a call's error begin when no router it tried answered (each router's failure follows).
EVERY_ROUTER_FAILED = "no router answered"
# New calls go to the routers in turn, passing over one a call found down (a transport failure) for this long, twice
# as long at each failure in a row, at most PASS_OVER_MAX_S; a call it answers ends that. (Each call kept to the
# router the last failover went to: after a rolling restart of the routers every client was on the last one,
# helper-194. Passed over for a fixed time, a frozen router would cost a call its connection wait each time.)
PASS_OVER_S = 5.0
PASS_OVER_MAX_S = 300.0


class FinishReason(enum.IntEnum):
    """Why a stream ended: the wire enum (baton.v1.FinishReason) by name; prints as stop, length, abort."""

    UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED  # not finished (yet)
    STOP = common_pb2.FINISH_REASON_STOP  # a stop sequence or the model's end-of-sequence token
    LENGTH = common_pb2.FINISH_REASON_LENGTH  # max_tokens reached
    ABORT = common_pb2.FINISH_REASON_ABORT  # cancelled before it finished

    def __str__(self) -> str:
        return self.name.lower()


def finish_reason_of(chunk: router_pb2.GenerateChunk) -> FinishReason:
    """The chunk's finish_reason as a FinishReason (UNSPECIFIED on every chunk but the last, or for a
    value newer than this client)."""
    try:
        return FinishReason(chunk.finish_reason)
    except ValueError:
        return FinishReason.UNSPECIFIED


class BatonClient:
    """Streams completions from several routers, each new call to the next in turn, failing over between them
    mid-stream."""

    def __init__(self, addresses: str | Sequence[str], max_failovers: int = 3, *, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """addresses: one router's host:port, several comma-separated (as `baton generate --router` takes them), or
        a sequence of them; api_key: the tenant's key (`baton tenants add`), for routers run with --auth;
        credentials: TLS to the routers (grpc.ssl_channel_credentials with the cluster's CA), plaintext when None;
        clock: what times how long a router found down is passed over."""
        # (A comma-separated string was one address, and its calls failed "Misformatted domain name": helper-176.)
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()] if isinstance(addresses, str) \
            else list(addresses)
        if not self.addresses:
            raise ValueError("BatonClient: at least one router address is needed")
        self.max_failovers = max_failovers
        self._metadata = ((AUTHORIZATION_KEY, f"Bearer {api_key}"),) if api_key else ()
        options = RECONNECT_OPTIONS + CLIENT_KEEPALIVE_OPTIONS + CLIENT_CONNECT_OPTIONS
        self._channels = {address: grpc.aio.secure_channel(address, credentials, options)
                          if credentials is not None else grpc.aio.insecure_channel(address, options)
                          for address in self.addresses}
        self._clock = clock
        self._next = 0  # the router the next call starts at, if no call found it down lately
        # Routers a call found down: when new calls stop passing them over, and how long they were passed over.
        self._passed_over: dict[str, tuple[float, float]] = {}
        self._plaintext = credentials is None

    @property
    def current_address(self) -> str:
        """The router the next call goes to: the next in turn that no call found down lately."""
        return self.addresses[self._first()]

    def _first(self) -> int:
        """The index of the router a new call starts at: the next in turn neither passed over nor failing to connect
        (its channel waiting out a reconnect backoff, where a call fails at once); with none such, the one whose time
        ends first."""
        now = self._clock()
        turn = [(self._next + k) % len(self.addresses) for k in range(len(self.addresses))]
        up = [i for i in turn if self._passed_over.get(self.addresses[i], (0.0, 0.0))[0] <= now
              and self._channels[self.addresses[i]].get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE]
        return up[0] if up else min(turn, key=lambda i: self._passed_over.get(self.addresses[i], (0.0, 0.0))[0])

    def _take_turn(self) -> int:
        """_first, and the call after this one starts at the router after it."""
        index = self._first()
        self._next = (index + 1) % len(self.addresses)
        return index

    def _found_down(self, address: str) -> None:
        """A call found the router down: it is passed over, twice as long as last time if it failed again after its
        last pass-over ended. (Every stream it cut doubled it: a router that died under 8 streams was passed over
        for 5 min, helper-204.)"""
        now = self._clock()
        until, last_s = self._passed_over.get(address, (0.0, 0.0))
        if until > now:
            return  # passed over already: another call that found it down at the same time
        period_s = min(PASS_OVER_MAX_S, 2 * last_s) if last_s else PASS_OVER_S
        self._passed_over[address] = (now + period_s, period_s)

    def _answered(self, address: str) -> None:
        self._passed_over.pop(address, None)

    @staticmethod
    async def _wait_ready(channel: grpc.aio.Channel, wait_s: float) -> float:
        """Wait up to wait_s for channel to connect; the seconds it took."""
        started = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await channel.channel_ready()
        return time.monotonic() - started

    @staticmethod
    def _deadline_left_ms(deadline_ms: int, sent: float, request_id: str, num_received: int) -> int:
        """The part of deadline_ms left since the request was first sent, rounded down to whole ms; none left:
        DEADLINE_EXCEEDED, as a router ends a stream past its deadline."""
        left_ms = deadline_ms - math.ceil((time.monotonic() - sent) * 1000)
        if left_ms <= 0:
            raise _deadline_passed(deadline_ms, request_id, num_received)
        return left_ms

    def _stub(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self._channels[self.current_address])

    async def generate(
        self,
        model: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        timeout_s: float | None = None,
        **fields: object,
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        """Chunks as the routers relay them; other GenerateRequest fields go in **fields (a list field, such as stop
        or alternative_models, also takes one string)."""
        if prompt is not None and prompt_token_ids is not None:  # (the text was dropped without a word: helper-176)
            raise ValueError("prompt and prompt_token_ids: give one of them, not both")
        request = _generate_request(model, fields)
        if prompt is not None:
            try:
                request.prompt = prompt
            except ValueError as exc:  # a lone surrogate (a non-UTF-8 argument, decoded by Python)
                raise ValueError(f"prompt={shown(prompt)}: {exc}") from None
        if prompt_token_ids is not None:
            request.prompt_token_ids.ids.extend(prompt_token_ids)
        if not request.request_id:
            request.request_id = uuid.uuid4().hex  # the same id on every router it may resume on
        sent = time.monotonic()
        deadline = None if timeout_s is None else sent + timeout_s
        # deadline_ms counts from the request's arrival at a router: a resumed stream sends the part left of it,
        # not the whole again (each router counts from its own arrival).
        deadline_ms = request.deadline_ms
        # A caller resuming a stream itself (resume=...) sends the tokens it has and the times of its first send: on
        # a failover they are sent again with those received since, the times still counted from that first send
        # (only those received here were, and the stream went on as if the caller's had never been: helper-182).
        received: list[int] = list(request.resume.token_ids)
        before_ms = request.resume.elapsed_ms
        had_first_token = request.resume.HasField("first_token_ms")
        first_token_at: float | None = None
        last_token_at: float | None = None
        failovers = 0
        # This stream's router: its own, as other streams of the client fail over at the same time.
        index = self._take_turn()
        failed: dict[str, grpc.aio.AioRpcError] = {}  # each router's last transport failure, in the order tried
        connect_budget_s = FAILOVER_CONNECT_S
        while True:
            if received:
                del request.resume.token_ids[:]
                request.resume.token_ids.extend(received)
            if failovers and first_token_at is not None:  # its TTFT was what it was, wherever it resumes
                if not had_first_token:
                    request.resume.first_token_ms = before_ms + int((first_token_at - sent) * 1000)
                assert last_token_at is not None
                request.resume.last_token_ms = before_ms + int((last_token_at - sent) * 1000)
            channel = self._channels[self.addresses[index]]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if failovers and deadline_ms:  # what is left of it; passed while the stream moved: ended, tokens kept
                left_ms = self._deadline_left_ms(deadline_ms, sent, request.request_id, len(received))
                remaining = left_ms / 1000 if remaining is None else min(remaining, left_ms / 1000)
            if failovers and connect_budget_s > 0 and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                connect_budget_s -= await self._wait_ready(
                    channel, connect_budget_s if remaining is None else min(connect_budget_s, remaining))
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if failovers and deadline_ms:  # after any wait for the channel: that time is gone too
                request.deadline_ms = self._deadline_left_ms(deadline_ms, sent, request.request_id, len(received))
            if failovers:  # its TTFT and TPOT are judged from when it was first sent
                request.resume.elapsed_ms = max(before_ms + int((time.monotonic() - sent) * 1000),
                                                request.resume.first_token_ms)
            call = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=remaining, metadata=self._metadata)
            try:
                answered = False
                async for chunk in call:
                    if not answered:
                        answered = True
                        self._answered(self.addresses[index])
                    if chunk.HasField("seed"):
                        request.seed = chunk.seed
                    if chunk.model and chunk.model != request.model:  # an alternative runs it: resume on that one
                        request.model = chunk.model
                        del request.alternative_models[:]
                    if chunk.token_ids:
                        last_token_at = time.monotonic()
                        if first_token_at is None:
                            first_token_at = last_token_at
                    received.extend(chunk.token_ids)
                    yield chunk
                return
            except grpc.aio.AioRpcError as error:
                if not is_transport_failure(error):
                    if is_baton_status(error):  # the router's own answer: it is up
                        self._answered(self.addresses[index])
                    raise
                failed[self.addresses[index]] = error
                self._found_down(self.addresses[index])
                if failovers >= self.max_failovers:
                    raise self._every_router_failed(failed) from None
                failovers += 1
                index = (index + 1) % len(self.addresses)
            finally:
                call.cancel()

    async def complete(self, model: str, prompt: str | None = None, **kwargs: object) -> Completion:
        """The whole completion at once; with resume=, the part after the resumed tokens (from first_index)."""
        resume = kwargs.get("resume")  # a Resume, or its fields as a dict (protobuf takes either)
        result = Completion(first_index=0 if resume is None else len(_generate_request(model, {
            "resume": resume}).resume.token_ids))
        async for chunk in self.generate(model, prompt, **kwargs):
            result.add(chunk)
        return result

    async def list_models(self) -> list[router_pb2.ServedModel]:
        """The models the cluster serves, from the first router that answers, starting at current_address (it
        asked that one only: with the first router down, `baton generate --router A,B` took no model as known and
        sent its default, which B's cluster did not serve; helper-176)."""
        failed: dict[str, grpc.aio.AioRpcError] = {}
        first = self._first()  # (not a turn: `baton generate` then streams from the router that listed the models)
        for tried in range(len(self.addresses)):
            index = (first + tried) % len(self.addresses)
            try:
                reply = await router_pb2_grpc.RouterStub(self._channels[self.addresses[index]]).ListModels(
                    router_pb2.ListModelsRequest(), timeout=5.0, metadata=self._metadata)
            except grpc.aio.AioRpcError as error:
                # A router that let the call's time pass without a status of its own (frozen) is tried no more than
                # one that went away: the listing is a read, safe to ask again elsewhere (helper-177).
                timed_out = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not is_baton_status(error)
                if not (is_transport_failure(error) or timed_out):
                    raise
                failed[self.addresses[index]] = error
                self._found_down(self.addresses[index])
                if tried == len(self.addresses) - 1:
                    raise self._every_router_failed(failed) from None
                continue
            self._answered(self.addresses[index])
            return list(reply.models)
        raise AssertionError("unreachable: the last router's failure is raised")

    def _every_router_failed(self, failed: dict[str, grpc.aio.AioRpcError]) -> grpc.aio.AioRpcError:
        """What a call raises when no router it tried answered: the last failure's code and metadata, its details
        naming each router's failure (it named the last router's only, so the first one's cause was lost:
        helper-176), with a word on TLS where a plaintext client's connection was closed at once (all that a router
        serving TLS says to one: helper-175)."""
        last = list(failed.values())[-1]
        tls_hint = self._plaintext and any("Socket closed" in (error.details() or "") for error in failed.values())
        if len(failed) == 1 and not tls_hint:
            return last
        details = "; ".join(f"{address}: {error.code().name}: {error.details()}" for address, error in failed.items())
        if tls_hint:
            details += (" (a router that serves TLS closes a plaintext connection so; if it does, connect with its CA: "
                        "`credentials=` here, `--tls-ca` for baton generate)")
        return grpc.aio.AioRpcError(last.code(), last.initial_metadata(), last.trailing_metadata(),
                                    details=f"{EVERY_ROUTER_FAILED}: {details}",
                                    debug_error_string=last.debug_error_string())

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def __aenter__(self) -> BatonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# Integer ranges of protobuf's field types, to name a field whose value its type cannot hold.
_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1), FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
}


_REPEATED = frozenset(f.name for f in router_pb2.GenerateRequest.DESCRIPTOR.fields
                      if f.is_repeated)


def _generate_request(model: str, fields: dict[str, object]) -> router_pb2.GenerateRequest:
    """The GenerateRequest of generate()'s arguments; ValueError or TypeError naming the field whose value it cannot
    hold (protobuf's own says only "Value out of range"). What it can hold the router judges."""
    # A list field given one string is that one string (OpenAI's API takes `stop` so): protobuf took it for a list of
    # its characters, and stop="xyz" stopped at any of x, y and z (helper-176).
    fields = {name: [value] if isinstance(value, str) and name in _REPEATED else value
              for name, value in fields.items()}
    try:
        return router_pb2.GenerateRequest(model=model, **fields)
    except (ValueError, TypeError):
        for name, value in {"model": model, **fields}.items():
            try:
                router_pb2.GenerateRequest(**{name: value})
            except (ValueError, TypeError) as own:
                field = router_pb2.GenerateRequest.DESCRIPTOR.fields_by_name.get(name)
                bounds = _RANGES.get(field.type) if field is not None else None
                if bounds is not None and isinstance(value, int) and not bounds[0] <= value <= bounds[1]:
                    raise ValueError(f"{name}={value!r}: out of range [{bounds[0]}, {bounds[1]}]") from None
                # (not type(exc): a UnicodeEncodeError, a lone surrogate's, takes five arguments: helper-182)
                raise (ValueError if isinstance(own, ValueError) else TypeError)(f"{name}={shown(value)}: {own}") \
                    from None
        raise


def _deadline_passed(deadline_ms: int, request_id: str, num_received: int) -> grpc.aio.AioRpcError:
    """The error a router ends a stream with when its deadline_ms passes (the tokens sent so far stand)."""
    details = (f"deadline_ms={deadline_ms}: passed after {num_received} generated tokens of request {request_id}, "
               "while its stream moved to another router; the tokens sent so far stand")
    # Marked as Baton's own status, as a router's is: the request's limit, not the transport failing.
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                grpc.aio.Metadata((ORIGIN_KEY, "baton")), details=details, debug_error_string="")


class Completion:
    """A whole streamed completion, assembled from its chunks: token_ids and text from first_index on (a resumed
    stream's chunks start after the resumed tokens)."""

    def __init__(self, first_index: int = 0) -> None:
        self.first_index = first_index
        self.token_ids: list[int] = []
        self.text = ""
        self.request_id = ""
        self.node_ids: list[str] = []
        # The model that generated it (the request's own or an alternative the scheduler chose).
        self.model = ""
        self.finish_reason = FinishReason.UNSPECIFIED
        self.usage = router_pb2.GenerateChunk().usage
        self.num_chunks = 0
        self.is_exact = True

    def add(self, chunk: router_pb2.GenerateChunk) -> None:
        if chunk.index != self.first_index + len(self.token_ids):
            raise ValueError(f"chunk index {chunk.index} but {len(self.token_ids)} tokens received after index "
                             f"{self.first_index}")
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.num_chunks += 1
        self.is_exact = self.is_exact and not chunk.inexact
        self.model = chunk.model or self.model
        self.request_id = chunk.request_id or self.request_id
        if chunk.node_id and (not self.node_ids or self.node_ids[-1] != chunk.node_id):
            self.node_ids.append(chunk.node_id)
        if chunk.finish_reason:
            self.finish_reason = finish_reason_of(chunk)
            self.usage = chunk.usage
