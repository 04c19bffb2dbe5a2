"""A Baton service never shares a port: a second one on a port in use exits with a clear message."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
import pytest
from opentelemetry import context

from services.common.server import ServingNames, serve, setup_logging
from services.common.telemetry import Telemetry

pytestmark = pytest.mark.timeout(20)


class _Idle:
    service_names = ("baton.v1.Idle",)
    closed = False

    def __init__(self) -> None:
        self.health = ServingNames()

    def register(self, server: grpc.aio.Server) -> None:
        pass

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        return []

    async def before_stop(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


async def test_a_second_service_on_a_port_in_use_exits_instead_of_sharing_it(caplog: pytest.LogCaptureFixture) -> None:
    first = grpc.aio.server(options=[("grpc.so_reuseport", 1)])  # as gRPC does by default
    port = first.add_insecure_port("127.0.0.1:0")
    await first.start()
    second = _Idle()
    try:
        with caplog.at_level(logging.ERROR):
            code = await asyncio.wait_for(serve(second, f"127.0.0.1:{port}", Telemetry("idle/test", "none")), 10)
    finally:
        await first.stop(0)
    assert code == 2
    assert second.closed
    assert f"cannot bind 127.0.0.1:{port}: the address is in use" in caplog.text


def test_a_span_context_detached_in_another_task_is_not_logged_as_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """A streaming call's span ends in the task that closes the stream; OpenTelemetry logged that as an ERROR with a
    traceback on every cancelled stream (a live probe found them in every node's log). Other errors still show."""
    setup_logging("INFO")
    token = context.attach(context.set_value("key", 1))
    contextvars.Context().run(context.detach, token)  # as the closing task does
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    logging.getLogger("opentelemetry.context").error("Failed to detach context")  # not the known case: kept
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
