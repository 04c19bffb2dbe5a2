"""`baton up` says when one of its processes exits while the cluster runs (only a missing row in `baton status`
showed a killed node, helper-110)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from baton.cli import report_exits
from baton.cluster import ManagedProcess


def test_each_process_that_exits_is_reported_once_with_how_and_its_log(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    killed = ManagedProcess("node-1", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                            tmp_path / "node-1.log")
    failed = ManagedProcess("router-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "router-0.log")
    running = ManagedProcess("node-0", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "node-0.log")
    for process in (killed, failed, running):
        process.start()
    try:
        for process in (killed, failed):
            assert process.proc is not None
            process.proc.wait()
        exited: set[str] = set()
        report_exits([killed, failed, running], exited)
        report_exits([killed, failed, running], exited)
        lines = capsys.readouterr().out.splitlines()
    finally:
        running.stop(timeout_s=5)
    assert lines == [f"node-1 (pid {killed.pid}) exited (killed by SIGKILL); its log: {tmp_path / 'node-1.log'}",
                     f"router-0 (pid {failed.pid}) exited (exit code 3); its log: {tmp_path / 'router-0.log'}"]
