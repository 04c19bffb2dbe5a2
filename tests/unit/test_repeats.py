"""A failure repeating at every retry is logged at its first and then once in a while, with its count."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from baton.v1 import kvindex_pb2
from services.common import etcd_session
from services.common.etcd_session import PrefixView
from services.common.repeats import REPEAT_LOG_EVERY_S, Repeats
from services.node_agent import kv_publisher


def test_a_run_of_failures_is_logged_at_its_first_then_every_so_often_with_its_count_and_its_end_once(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    repeats = Repeats(logging.getLogger("test.repeats"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.repeats"):
        for _ in range(10):  # one a second
            repeats.failed("watch on %s failed", "/a")
            now[0] += 1.0
        now[0] = REPEAT_LOG_EVERY_S
        repeats.failed("watch on %s failed", "/a")
        repeats.failed("watch on %s failed", "/a")
        repeats.failed("watch on %s refused", "/a")  # another failure: said at once (helper-177)
        repeats.succeeded("watch on %s again", "/a")
        repeats.succeeded("watch on %s again", "/a")  # no run to end
        repeats.failed("watch on %s failed", "/a")  # a new run: said at once
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "watch on /a failed"),
        ("WARNING", "watch on /a failed (after 9 more like the last logged)"),
        ("WARNING", "watch on /a refused (after 1 more like the last logged)"),
        ("INFO", "watch on /a again"),
        ("WARNING", "watch on /a failed"),
    ]


async def test_a_view_that_cannot_reach_etcd_logs_once_not_at_every_retry(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A service that never reached etcd logged "etcd watch … failed; keeping last view" 4 to 5 times a second,
    though it had no view (helper-175)."""
    monkeypatch.setattr(etcd_session, "_RETRY_S", 0.0)
    tries = 0

    class _Down:
        async def get_prefix(self, prefix: bytes) -> None:
            nonlocal tries
            tries += 1
            if tries == 50:
                raise asyncio.CancelledError
            raise ConnectionError("etcd unreachable")

    view = PrefixView(_Down(), "/baton/nodes/")  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger=etcd_session.__name__), pytest.raises(asyncio.CancelledError):
        await view.run()
    assert [r.getMessage() for r in caplog.records] == [
        "etcd watch on /baton/nodes/ failed (etcd unreachable); no view yet"]


async def test_a_kvindex_that_takes_the_first_batch_and_refuses_the_stream_is_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A kvindex that has not seen the node in etcd yet refuses its stream after the first batch: at every retry (2 a
    second) the node logged the stream as up again and broken again (helper-177)."""
    monkeypatch.setattr(kv_publisher, "_RETRY_S", 0.0)
    refused = asyncio.Event()
    tries = 0

    class _Log:
        async def stream(self) -> AsyncIterator[kvindex_pb2.KVEventBatch]:
            yield kvindex_pb2.KVEventBatch()
            await asyncio.Event().wait()

    class _Refusing:
        def __init__(self, channel: object) -> None:
            pass

        async def Publish(self, batches: AsyncIterator[kvindex_pb2.KVEventBatch]) -> None:  # noqa: N802 - gRPC's name
            nonlocal tries
            await anext(batches)  # taken, and then the stream is refused
            tries += 1
            if tries == 20:
                refused.set()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="node n1 is not registered in etcd")

    class _Kvindexes:
        kind = "kvindex"

        def addresses(self) -> list[str]:
            return ["kvindex-1:1"]

        def channel(self, address: str) -> None:
            return None

        async def wait_changed(self, addresses: object) -> None:
            await asyncio.Event().wait()

    monkeypatch.setattr(kv_publisher.kvindex_pb2_grpc, "KVIndexStub", _Refusing)
    with caplog.at_level(logging.INFO, logger=kv_publisher.__name__):
        publishing = asyncio.create_task(kv_publisher.publish(_Log(), _Kvindexes()))  # type: ignore[arg-type]
        await refused.wait()
        publishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await publishing
    assert [r.getMessage() for r in caplog.records] == [
        "publishing kv events to kvindex kvindex-1:1",
        "kv event stream to kvindex-1:1 broke: UNAVAILABLE: node n1 is not registered in etcd"]
