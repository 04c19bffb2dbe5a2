"""How the local cluster starts its processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from baton.cluster import ManagedProcess


def test_a_service_leads_its_own_process_group_in_the_callers_session(tmp_path: Path) -> None:
    """Its own group, so it and what it starts stop together; the caller's session, since where the
    kernel shares CPU time by session (autogroup), a vllm node in a session of its own kept the router
    and the client off the CPU for seconds on two cores."""
    # Waits for a signal: stop() ends it (no sleep, and it cannot outlive the test).
    child = ManagedProcess("child", [sys.executable, "-c", "import signal; signal.pause()"], tmp_path / "child.log")
    child.start()
    try:
        assert os.getpgid(child.pid) == child.pid
        assert os.getsid(child.pid) == os.getsid(0)
    finally:
        assert child.stop(timeout_s=10) is not None
    assert not child.is_running()
