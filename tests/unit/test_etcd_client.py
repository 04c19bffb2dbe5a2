"""Which failures move an etcd client to the next member, and how far (no etcd needed: channels connect lazily)."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from services.common.etcd_client import moves_on
from services.common.etcd_session import connect


async def test_calls_failing_together_on_one_member_move_the_client_once() -> None:
    client = connect("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    try:
        await client.connect()
        failing_channel = client._channel_number
        client._failed(failing_channel, grpc.StatusCode.UNAVAILABLE, "connection refused")
        client._failed(failing_channel, grpc.StatusCode.DEADLINE_EXCEEDED, "a second call on the same channel")
        await client.connect()
        assert client.endpoint == "127.0.0.1:2"  # not past the second member to the third

        client._failed(client._channel_number, grpc.StatusCode.DEADLINE_EXCEEDED, "frozen")
        await client.connect()
        client._failed(client._channel_number, grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader")
        assert client.endpoint == "127.0.0.1:1"  # round again to the first
    finally:
        await client.close()


async def test_a_refusal_of_the_call_itself_does_not_move_the_client() -> None:
    client = connect("127.0.0.1:1,127.0.0.1:2")
    try:
        await client.connect()
        for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                     grpc.StatusCode.CANCELLED, grpc.StatusCode.OUT_OF_RANGE):
            client._failed(client._channel_number, code, "the call's own fault")
        assert client.endpoint == "127.0.0.1:1"
    finally:
        await client.close()


async def test_a_client_of_one_member_stays_with_it() -> None:
    client = connect("127.0.0.1:1")
    try:
        await client.connect()
        assert client.channel is not None
        channel = client.channel
        client._failed(client._channel_number, grpc.StatusCode.UNAVAILABLE, "down")
        assert client.endpoint == "127.0.0.1:1" and client.channel is channel  # gRPC reconnects it when back
    finally:
        await client.close()


async def test_what_every_member_says_while_etcd_elects_a_leader_does_not_move_the_client() -> None:
    """Moving on these sent clients off healthy members during a raft election, as likely onto the dead one
    (helper-178); a member without a leader, a gone one and a frozen one are left."""
    assert not moves_on(grpc.StatusCode.UNAVAILABLE, "etcdserver: leader changed")
    assert not moves_on(grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out, possibly due to previous leader "
                                                     "failure")
    assert moves_on(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader")
    assert moves_on(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: Connection refused")
    assert moves_on(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert not moves_on(grpc.StatusCode.NOT_FOUND, "requested lease not found")


async def test_a_move_passes_over_a_member_a_call_failed_on_lately() -> None:
    client = connect("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    try:
        await client.connect()
        client._failed_at["127.0.0.1:2"] = asyncio.get_running_loop().time()  # as if a call on it had just failed
        client._failed(client._channel_number, grpc.StatusCode.UNAVAILABLE, "connection refused")
        assert client.endpoint == "127.0.0.1:3"
    finally:
        await client.close()


class _KeepAliveStub:
    """Stands in for etcd's Lease service: records each keep-alive's timeout and answers it."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def LeaseKeepAlive(self, requests: object, timeout: float | None = None, metadata: object = None):  # noqa: N802
        self.timeouts.append(timeout)

        async def replies():
            yield types.SimpleNamespace(TTL=3)

        return replies()


@pytest.mark.parametrize(("endpoints", "expected_s"), [("127.0.0.1:1,127.0.0.1:2", 0.75), ("127.0.0.1:1", 2.0)])
async def test_a_keep_alive_with_another_member_to_move_to_waits_a_quarter_of_the_ttl(
        endpoints: str, expected_s: float) -> None:
    """Sent a third of a 3 s TTL after the last, to a member that froze, a keep-alive that waited the client's 2 s
    failed as the lease ran out, too late to move to another member (helper-178). Alone, a member is waited for as
    long as before: there is nowhere to move."""
    client = connect(endpoints)
    try:
        await client.connect()
        stub = _KeepAliveStub()
        client.leasestub = stub
        assert (await client.refresh_lease(7, ttl_s=3)).TTL == 3
        assert stub.timeouts == [expected_s]
    finally:
        await client.close()
