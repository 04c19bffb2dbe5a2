"""BatonClient fails over to a router that has just come back, not only to one that never went away."""

from __future__ import annotations

import asyncio
import functools
import re
import types
from pathlib import Path

import grpc
import pytest

from baton.client import FAILOVER_CONNECT_S, PASS_OVER_S, BatonClient
from baton.cluster import free_port
from baton.protocol import ORIGIN_KEY, is_transport_failure
from baton.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.errors import InvalidArgument, abort
from services.common.reconnect import SERVER_KEEPALIVE_OPTIONS
from services.common.tls import generate_throwaway_pki


class _Router(router_pb2_grpc.RouterServicer):
    async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
        yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[7, 8, 9], index=0, node_id="n1",
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def _refusing(port: int, attempts: int) -> tuple[asyncio.Server, asyncio.Event]:
    """A listener on port that hangs up on every connection, until `attempts` of them were made: each a
    failed attempt of the client's channel, whose reconnect backoff then grows to its longest."""
    seen = 0
    enough = asyncio.Event()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        writer.close()
        seen += 1
        if seen >= attempts:
            enough.set()

    listener = await asyncio.start_server(hang_up, "127.0.0.1", port)
    return listener, enough


@pytest.mark.asyncio
async def test_a_stream_fails_over_to_a_router_that_restarted_while_its_channel_backs_off() -> None:
    restarted_port = free_port()
    down, restarted = f"127.0.0.1:{free_port()}", f"127.0.0.1:{restarted_port}"
    client = BatonClient([down, restarted], max_failovers=2)
    server = grpc.aio.server()
    listener, enough = await _refusing(restarted_port, attempts=5)
    try:
        # The restarted router was unreachable for a while: the client's channel to it failed to connect
        # again and again, and is waiting out its longest backoff (about a second) when the router comes
        # back and the stream, its first router down, fails over to it.
        assert client.current_address == down
        client._channels[restarted].get_state(try_to_connect=True)  # as an earlier stream's failover would
        await asyncio.wait_for(enough.wait(), 30)
        listener.close()
        await listener.wait_closed()
        router_pb2_grpc.add_RouterServicer_to_server(_Router(), server)
        assert server.add_insecure_port(restarted) == restarted_port
        await server.start()
        completion = await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=3), 30)
        assert completion.token_ids == [7, 8, 9]
        assert client.current_address == restarted
    finally:
        listener.close()
        await client.close()
        await server.stop(None)


@pytest.mark.asyncio
async def test_streams_failing_over_together_each_reach_the_live_router() -> None:
    live_port = free_port()
    down, live = f"127.0.0.1:{free_port()}", f"127.0.0.1:{live_port}"
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(_Router(), server)
    assert server.add_insecure_port(live) == live_port
    await server.start()
    # One failover each: a stream that moved on from the down router must not be sent back to it by
    # another stream's failover.
    client = BatonClient([down, live], max_failovers=1)
    try:
        completions = await asyncio.wait_for(
            asyncio.gather(*(client.complete("m", prompt=f"p{i}", max_tokens=3) for i in range(6))), 30)
        assert [c.token_ids for c in completions] == [[7, 8, 9]] * 6
        assert client.current_address == live
    finally:
        await client.close()
        await server.stop(None)


@pytest.mark.parametrize("timeout_s", [None, 1.0])
async def test_with_every_router_down_a_request_waits_only_for_channels_in_backoff_within_one_budget(
    monkeypatch: pytest.MonkeyPatch, timeout_s: float | None,
) -> None:
    routers = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    client = BatonClient(routers, max_failovers=5)
    waits: list[tuple[str, float]] = []

    async def waited_in_full(channel: grpc.aio.Channel, wait_s: float) -> float:
        waits.append((next(a for a, c in client._channels.items() if c is channel), wait_s))
        return wait_s  # as if the router never came back

    monkeypatch.setattr(BatonClient, "_wait_ready", staticmethod(waited_in_full))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=3, timeout_s=timeout_s), 30)
        assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        # The second and third routers were never tried before (no backoff): called at once. Back at the
        # first, in backoff, it waits: the whole budget, and then no more.
        assert waits[0][0] == routers[0]
        assert sum(wait for _, wait in waits) <= FAILOVER_CONNECT_S
        if timeout_s is None:
            assert waits == [(routers[0], FAILOVER_CONNECT_S)]
        else:  # never past the request's deadline (the stand-in returns at once, so it may be asked again)
            assert all(0 < wait <= timeout_s for _, wait in waits)
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_the_wait_for_a_router_in_backoff_ends_at_the_requests_deadline_ms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every router down: the client waits for a channel in backoff only as long as deadline_ms allows, then
    # ends the request with DEADLINE_EXCEEDED, marked as Baton's own status (it waited the whole 3 s budget).
    clock = [100.0]
    monkeypatch.setattr("baton.client.time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    routers = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    client = BatonClient(routers, max_failovers=5)
    waits: list[float] = []

    async def waited_in_full(channel: grpc.aio.Channel, wait_s: float) -> float:
        waits.append(wait_s)
        clock[0] += wait_s  # as if the router never came back
        return wait_s

    monkeypatch.setattr(BatonClient, "_wait_ready", staticmethod(waited_in_full))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=3, deadline_ms=500), 30)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not is_transport_failure(failed.value)
        assert (ORIGIN_KEY, "baton") in tuple(failed.value.trailing_metadata())
        assert waits == [pytest.approx(0.5)]
    finally:
        await client.close()


# deadline_ms, resume.token_ids, resume.elapsed_ms, first_token_ms and last_token_ms (None when not sent).
Seen = tuple[int, list[int], int, int | None, int | None]


def _as_seen(request: router_pb2.GenerateRequest) -> Seen:
    """What a router is told of a request's past: deadline_ms, the resumed tokens, and the client's timeline."""
    resume = request.resume
    first_token_ms = resume.first_token_ms if resume.HasField("first_token_ms") else None
    last_token_ms = resume.last_token_ms if resume.HasField("last_token_ms") else None
    return request.deadline_ms, list(resume.token_ids), resume.elapsed_ms, first_token_ms, last_token_ms


async def _fail_over_at(monkeypatch: pytest.MonkeyPatch, dies_after_s: float, deadline_ms: int,
                        seen: list[Seen], received: list[int], resume: router_pb2.Resume | None = None) -> None:
    """A stream with deadline_ms whose router dies dies_after_s (on the client's clock) after the request was
    sent, with tokens [7] (at once) and [8] (just before it dies) out, and a router that finishes it with [9].
    seen: each router's _as_seen of the request as it was called; received: the tokens the client got, up to an
    error if one ended it. resume: the caller's own (its tokens come before [7])."""
    clock = [100.0]
    monkeypatch.setattr("baton.client.time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    class Dying(router_pb2_grpc.RouterServicer):
        async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
            seen.append(_as_seen(request))
            at = len(request.resume.token_ids)
            yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[7], index=at, node_id="n1")
            yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[8], index=at + 1, node_id="n1")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router going away")

    class Live(router_pb2_grpc.RouterServicer):
        async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
            seen.append(_as_seen(request))
            yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[9],
                                           index=len(request.resume.token_ids), node_id="n2",
                                           finish_reason=common_pb2.FINISH_REASON_LENGTH)

    servers, addresses = [], []
    for servicer in (Dying(), Live()):
        port, server = free_port(), grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    client = BatonClient(addresses, max_failovers=1)
    try:
        async with asyncio.timeout(30):
            async for chunk in client.generate("m", prompt="hi", max_tokens=3, deadline_ms=deadline_ms,
                                               **({"resume": resume} if resume is not None else {})):
                if not received:  # its router dies this long after the first chunk reached the client
                    clock[0] += dies_after_s
                received.extend(chunk.token_ids)
    finally:
        await client.close()
        for server in servers:
            await server.stop(None)


@pytest.mark.asyncio
async def test_a_resumed_stream_sends_the_part_of_its_deadline_left_not_the_whole_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # deadline_ms counts from the request's arrival at a router. A stream that fails over 3 s into a 4 s
    # deadline must not get a fresh 4 s from the next router (it ran 4.9 s against a real cluster).
    seen: list[Seen] = []
    received: list[int] = []
    await _fail_over_at(monkeypatch, 3.0, 4000, seen, received)
    assert received == [7, 8, 9]
    # Its first token came at once, its last 3 s in; it was sent again then.
    assert seen == [(4000, [], 0, None, None), (1000, [7, 8], 3000, 0, 3000)]


@pytest.mark.asyncio
async def test_a_stream_the_caller_resumed_fails_over_with_the_callers_tokens_and_times_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller resumes a stream itself (its first token 200 ms, its last 400 ms after its first send, 500 ms
    before this call). The failover sent only the tokens received since, and the next router generated the
    caller's part over again: 220 tokens where the run has 200, silently different (helper-182)."""
    seen: list[Seen] = []
    received: list[int] = []
    resume = router_pb2.Resume(token_ids=[1, 2], elapsed_ms=500, first_token_ms=200, last_token_ms=400)
    await _fail_over_at(monkeypatch, 3.0, 0, seen, received, resume)
    assert received == [7, 8, 9]
    assert seen == [(0, [1, 2], 500, 200, 400), (0, [1, 2, 7, 8], 3500, 200, 3500)]


@pytest.mark.asyncio
async def test_a_stream_whose_deadline_passed_before_it_moved_ends_with_deadline_exceeded_its_tokens_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its router died 5 s into a 4 s deadline: no other router is asked; the stream ends as a router ends a
    # stream past its deadline, not refused by admission as a 1 ms request would be.
    seen: list[Seen] = []
    received: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _fail_over_at(monkeypatch, 5.0, 4000, seen, received)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline_ms=4000" in raised.value.details()
    assert received == [7, 8]
    assert seen == [(4000, [], 0, None, None)]


@pytest.mark.parametrize(("fields", "named"), [
    ({"seed": -1}, "seed=-1: out of range [0, 18446744073709551615]"),
    ({"seed": 1 << 64}, "seed=18446744073709551616: out of range"),
    ({"max_tokens": 99999999999}, "max_tokens=99999999999: out of range [-2147483648, 2147483647]"),
    ({"priority": 99999999999}, "priority=99999999999: out of range"),
])
async def test_a_value_the_request_cannot_hold_is_a_value_error_naming_its_field(
        fields: dict[str, int], named: str) -> None:
    client = BatonClient("127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match=re.escape(named)):
            async for _ in client.generate("m", "hi", **fields):
                pass
    finally:
        await client.close()


@pytest.mark.parametrize("value", ["a\ud800", "caf\udce9"])
@pytest.mark.parametrize("field", ["prompt", "model", "stop", "tenant", "request_id", "alternative_models"])
async def test_a_string_that_is_not_utf8_is_a_value_error_naming_its_field(field: str, value: str) -> None:
    """A lone surrogate (a non-UTF-8 argument as Python decodes it) raised `TypeError: function takes exactly 5
    arguments (1 given)`, or protobuf's own error naming no field (helper-182)."""
    client = BatonClient("127.0.0.1:1")
    args = {"model": "m", "prompt": "hi", field: value}
    try:
        with pytest.raises(ValueError, match=rf"^{field}=.*surrogates not allowed"):
            async for _ in client.generate(args.pop("model"), args.pop("prompt"), **args):
                pass
    finally:
        await client.close()


class _ResumingRouter(router_pb2_grpc.RouterServicer):
    async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
        yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[7, 8],
                                       index=len(request.resume.token_ids), node_id="n1",
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("resume", [router_pb2.Resume(token_ids=[1, 2, 3]), {"token_ids": [1, 2, 3]}])
async def test_a_resumed_completion_holds_the_part_after_the_resumed_tokens(resume: object) -> None:
    """complete() with resume= raised `chunk index 3 but 0 tokens received` once the tokens were generated and paid
    for (helper-182), and with the Resume's fields as a dict after the first fix (helper-183)."""
    port, server = free_port(), grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(_ResumingRouter(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with BatonClient(f"127.0.0.1:{port}") as client:
            result = await client.complete("m", "hi", resume=resume)
        assert (result.first_index, result.token_ids) == (3, [7, 8])
    finally:
        await server.stop(None)


class _QuietRouter(router_pb2_grpc.RouterServicer):
    """A router whose stream sends nothing for quiet_s (a long prefill, a wait in the admission queue)."""

    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self.calls = 0

    async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
        self.calls += 1
        await asyncio.sleep(self.quiet_s)  # the modelled quiet stream, not synchronisation
        yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[7], index=0, node_id="n1",
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.mark.asyncio
async def test_a_stream_quiet_for_longer_than_the_keepalive_is_not_taken_for_a_dead_router() -> None:
    """The client pings its router every 2 s while a call is open; a gRPC server with its default options answers
    pings that come more often than every 5 minutes without data with GOAWAY (too_many_pings), which failed a stream
    quiet for 12 s (at about 6 s) and sent it to another router. Baton's servers take them."""
    server = grpc.aio.server(options=list(SERVER_KEEPALIVE_OPTIONS))
    router = _QuietRouter(quiet_s=12.0)
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    client = BatonClient([address, f"127.0.0.1:{free_port()}"], max_failovers=1)
    try:
        completion = await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=1), 30)
        assert completion.token_ids == [7] and router.calls == 1  # (moved, it would have failed: no other router)
    finally:
        await client.close()
        await server.stop(0)


class _Listing(_Router):
    async def ListModels(self, request, context):  # noqa: N802 - the generated servicer's name
        return router_pb2.ListModelsResponse(models=[router_pb2.ServedModel(name="m")])


async def _serving(servicer: router_pb2_grpc.RouterServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_call_behind_a_frozen_first_router_reaches_the_live_one_within_its_deadline() -> None:
    """A connection attempt to a frozen router (its kernel accepts, its gRPC never answers) took gRPC's 20 s default
    to fail: a call with a 10 s timeout ended DEADLINE_EXCEEDED without trying the live second router (helper-176)."""
    frozen = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # accepts, says nothing
    server, live = await _serving(_Router())
    client = BatonClient([f"127.0.0.1:{frozen.sockets[0].getsockname()[1]}", live])
    try:
        completion = await client.complete("m", prompt="hi", max_tokens=3, timeout_s=10)
        assert completion.token_ids == [7, 8, 9] and client.current_address == live
    finally:
        await client.close()
        await server.stop(None)
        frozen.close()


async def test_the_models_listing_fails_over_as_a_stream_does() -> None:
    """It asked the first router only: with that one down, `baton generate --router A,B` took no model as known and
    sent its default, which the cluster did not serve (helper-176)."""
    server, live = await _serving(_Listing())
    frozen = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # accepts, says nothing
    client = BatonClient(f"127.0.0.1:{free_port()}, {live}")  # as `baton generate --router` takes them
    # (Its 5 s ran out before the 6 s connection attempt to a frozen router failed: helper-177.)
    behind_frozen = BatonClient([f"127.0.0.1:{frozen.sockets[0].getsockname()[1]}", live])
    try:
        assert client.addresses[1] == live
        for listing in (client, behind_frozen):
            assert [m.name for m in await listing.list_models()] == ["m"] and listing.current_address == live
    finally:
        await client.close()
        await behind_frozen.close()
        await server.stop(None)
        frozen.close()


async def test_a_list_field_given_one_string_is_that_string_and_a_prompt_is_text_or_ids() -> None:
    """stop="xyz" stopped at any of x, y and z (protobuf took the string for a list of its characters), and a prompt
    given as both text and token ids lost its text without a word (helper-176)."""
    seen: list[router_pb2.GenerateRequest] = []

    class _Seeing(_Router):
        async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
            seen.append(request)
            async for chunk in super().Generate(request, context):
                yield chunk

    server, live = await _serving(_Seeing())
    client = BatonClient(live)
    try:
        await client.complete("m", prompt="hi", stop="xyz", alternative_models="m2")
        assert list(seen[0].stop) == ["xyz"] and list(seen[0].alternative_models) == ["m2"]
        with pytest.raises(ValueError, match="prompt and prompt_token_ids: give one of them"):
            await client.complete("m", prompt="hi", prompt_token_ids=[1, 2])
    finally:
        await client.close()
        await server.stop(None)


async def test_with_every_router_failing_the_error_names_each_and_a_tls_router_is_hinted_at(tmp_path) -> None:
    """A stream or listing that no router answered raised the last router's failure only: a plaintext client whose
    first router serves TLS (it closes the connection, "Socket closed") saw the second's "Connection refused"
    (helper-175, helper-176)."""
    pki = generate_throwaway_pki(tmp_path)
    server = grpc.aio.server()
    tls_port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(Path(pki.service.key).read_bytes(), Path(pki.service.cert).read_bytes())]))
    await server.start()
    tls_router, down = f"127.0.0.1:{tls_port}", f"127.0.0.1:{free_port()}"
    client = BatonClient([tls_router, down], max_failovers=1)
    try:
        for call in (functools.partial(client.complete, "m", prompt="hi", max_tokens=3), client.list_models):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(call(), 30)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            details = failed.value.details() or ""
            assert f"{tls_router}: UNAVAILABLE" in details and "Socket closed" in details, details
            assert f"{down}: UNAVAILABLE" in details, details
            assert "a router that serves TLS closes a plaintext connection" in details
    finally:
        await client.close()
        await server.stop(None)


class _Counted(_Router):
    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
        self.calls += 1
        yield router_pb2.GenerateChunk(request_id=request.request_id, token_ids=[7], index=0, node_id="n1",
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def test_new_calls_go_to_the_routers_in_turn_passing_over_one_found_down_until_its_time_ends() -> None:
    """Each call went to the router the last failover went to, also once the first was back: after a rolling
    restart of the routers every client was on the last one (helper-194)."""
    first, second = _Counted(), _Counted()
    server, a = await _serving(first)
    other, b = await _serving(second)
    now = [0.0]
    client = BatonClient([a, b], max_failovers=1, clock=lambda: now[0])

    async def calls(count: int) -> tuple[int, int]:
        for _ in range(count):
            assert (await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=1), 30)).token_ids == [7]
        return first.calls, second.calls

    try:
        assert await calls(4) == (2, 2)
        await server.stop(None)  # the next call finds it down, and moves on to the second
        assert await calls(3) == (2, 5)
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(first, server)
        assert server.add_insecure_port(a) == int(a.rsplit(":", 1)[1])
        await server.start()
        await asyncio.wait_for(client._channels[a].channel_ready(), 30)  # back, and connected again
        assert await calls(2) == (2, 7)  # passed over still
        now[0] += PASS_OVER_S
        assert await calls(4) == (4, 9)
    finally:
        await client.close()
        await server.stop(None)
        await other.stop(None)


class _Hanging(_Router):
    """Starts each stream and says nothing more until it is stopped."""

    def __init__(self) -> None:
        self.started = 0
        self.all_started = asyncio.Event()

    async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
        self.started += 1
        if self.started == 4:
            self.all_started.set()
        await asyncio.Event().wait()
        yield router_pb2.GenerateChunk()


async def test_a_router_that_died_under_many_streams_is_passed_over_once_not_once_per_stream() -> None:
    """Every stream it cut doubled the time a router was passed over: one that died under 8 streams was passed over
    for 5 minutes after it was back (helper-204)."""
    hanging, second = _Hanging(), _Counted()
    server, a = await _serving(hanging)
    other, b = await _serving(second)
    now = [0.0]
    client = BatonClient([a, b], max_failovers=1, clock=lambda: now[0])
    try:
        streams = [asyncio.ensure_future(client.complete("m", prompt=f"p{i}", max_tokens=1)) for i in range(8)]
        await asyncio.wait_for(hanging.all_started.wait(), 30)  # four on each router, in turn
        await server.stop(None)  # the first dies under its four: they move on to the second
        assert [c.token_ids for c in await asyncio.wait_for(asyncio.gather(*streams), 30)] == [[7]] * 8
        server = grpc.aio.server()
        back = _Counted()
        router_pb2_grpc.add_RouterServicer_to_server(back, server)
        assert server.add_insecure_port(a) == int(a.rsplit(":", 1)[1])
        await server.start()
        await asyncio.wait_for(client._channels[a].channel_ready(), 30)
        now[0] += PASS_OVER_S  # once, not 2^3 times over
        for _ in range(2):
            await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=1), 30)
        assert back.calls == 1
    finally:
        await client.close()
        await server.stop(None)
        await other.stop(None)


class _Refusing(_Router):
    """Answers every call with a status of its own, as a router does to bad input."""

    async def Generate(self, request, context):  # noqa: N802 - the generated servicer's name
        await abort(context, InvalidArgument("max_tokens", request.max_tokens, "refused for the test"))
        yield router_pb2.GenerateChunk()


async def test_a_router_that_answers_with_a_status_of_its_own_is_up_and_a_later_death_is_passed_over_afresh() -> None:
    """Answered with a status, not a chunk, a router kept its pass-over's length, and its next death was passed over
    twice as long (helper-204)."""
    port = free_port()
    a = f"127.0.0.1:{port}"
    other, b = await _serving(_Counted())
    now = [0.0]
    client = BatonClient([a, b], max_failovers=1, clock=lambda: now[0])
    server = grpc.aio.server()
    try:
        await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=1), 30)  # a is down: passed over 5 s
        router_pb2_grpc.add_RouterServicer_to_server(_Refusing(), server)
        assert server.add_insecure_port(a) == port
        await server.start()
        await asyncio.wait_for(client._channels[a].channel_ready(), 30)
        now[0] += PASS_OVER_S

        async def call() -> None:
            await asyncio.wait_for(client.complete("m", prompt="hi", max_tokens=1), 30)

        await call()  # the second's turn
        assert client.current_address == a
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await server.stop(None)  # and dies
        await call()  # the second's turn
        await call()  # the first's: found down, it moves on to the second
        assert client._passed_over[a] == (now[0] + PASS_OVER_S, PASS_OVER_S)  # 5 s afresh, not 10
    finally:
        await client.close()
        await server.stop(None)
        await other.stop(None)
