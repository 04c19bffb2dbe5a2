"""Which failures move an etcd client to the next member, and how far (no etcd needed: channels connect lazily)."""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from services.common.etcd_session import connect


async def test_calls_failing_together_on_one_member_move_the_client_once() -> None:
    async with connect("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") as client:
        failing_channel = client._channel_number
        client._failed(failing_channel, grpc.StatusCode.UNAVAILABLE, "connection refused")
        client._failed(failing_channel, grpc.StatusCode.DEADLINE_EXCEEDED, "a second call on the same channel")
        await client.connect()
        assert client.endpoint == "127.0.0.1:2"  # not past the second member to the third

        client._failed(client._channel_number, grpc.StatusCode.DEADLINE_EXCEEDED, "frozen")
        await client.connect()
        client._failed(client._channel_number, grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader")
        assert client.endpoint == "127.0.0.1:1"  # round again to the first


@pytest.mark.parametrize(("code", "details"), [
    # What every member says while etcd elects a raft leader: moving on it sent clients off healthy members, as
    # likely onto the dead one (helper-178).
    (grpc.StatusCode.UNAVAILABLE, "etcdserver: leader changed"),
    (grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out, possibly due to previous leader failure"),
    # The call's own fault.
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided"),
    (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: requested lease not found"),
    (grpc.StatusCode.CANCELLED, "cancelled by its caller"),
    (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted"),
])
async def test_a_failure_that_is_not_the_members_does_not_move_the_client(code: grpc.StatusCode, details: str) -> None:
    async with connect("127.0.0.1:1,127.0.0.1:2") as client:
        client._failed(client._channel_number, code, details)
        assert client.endpoint == "127.0.0.1:1"


async def test_a_client_of_one_member_stays_with_it() -> None:
    async with connect("127.0.0.1:1") as client:
        channel = client.channel
        assert channel is not None
        client._failed(client._channel_number, grpc.StatusCode.UNAVAILABLE, "down")
        assert client.endpoint == "127.0.0.1:1" and client.channel is channel  # gRPC reconnects it when back


async def test_a_move_passes_over_a_member_a_call_failed_on_lately() -> None:
    async with connect("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3") as client:
        client._failed_at["127.0.0.1:2"] = asyncio.get_running_loop().time()  # as if a call on it had just failed
        client._failed(client._channel_number, grpc.StatusCode.UNAVAILABLE, "connection refused")
        assert client.endpoint == "127.0.0.1:3"


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
    async with connect(endpoints) as client:
        stub = _KeepAliveStub()
        client.leasestub = stub
        assert (await client.refresh_lease(7, ttl_s=3)).TTL == 3
        assert stub.timeouts == [expected_s]
