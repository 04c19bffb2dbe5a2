"""A failure repeating at every retry is logged at its first and then once in a while, with its count."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common import etcd_session
from services.common.etcd_session import PrefixView
from services.common.repeats import REPEAT_LOG_EVERY_S, Repeats


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
        repeats.succeeded("watch on %s again", "/a")
        repeats.succeeded("watch on %s again", "/a")  # no run to end
        repeats.failed("watch on %s failed", "/a")  # a new run: said at once
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "watch on /a failed"),
        ("WARNING", "watch on /a failed (9 more failures since the last logged)"),
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
