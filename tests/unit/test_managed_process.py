"""How the local cluster starts its processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from baton.cluster import ROUTER_STOP_S, ClusterSpec, LocalCluster, ManagedProcess


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


def test_a_router_is_given_the_time_its_shutdown_takes_before_sigkill(tmp_path: Path) -> None:
    """A router stops in up to 20 s (its server's grace, its last streams, their Finished notices); killed at 10 s
    when no leader answered, its notices were lost. Other services keep 10 s."""
    cluster = LocalCluster(ClusterSpec(), tmp_path)
    assert cluster._service("router-0", "services.router", {}).stop_timeout_s == ROUTER_STOP_S >= 20
    assert cluster._service("node-0", "services.node_agent", {}).stop_timeout_s == 10.0


def test_stop_waits_its_stop_timeout_then_kills(tmp_path: Path) -> None:
    """A process that ignores SIGTERM is SIGKILLed once its stop_timeout_s has passed."""
    stubborn = ManagedProcess("stubborn", [sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, "
                                           "signal.SIG_IGN); print('ready', flush=True); signal.pause()"],
                              tmp_path / "stubborn.log", stop_timeout_s=0.2)
    stubborn.start()
    log = tmp_path / "stubborn.log"
    while b"ready" not in log.read_bytes():  # its handler is set (polling the file it writes, not a sleep)
        assert stubborn.is_running()
    assert stubborn.stop() == -9
