"""Which failures move an etcd client to the next member, and how far (no etcd needed: channels connect lazily)."""

from __future__ import annotations

import grpc

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
