"""The `baton` command as a user runs it: up, generate, status, then Ctrl-C."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BATON = str(Path(sys.executable).parent / "baton")


def children_of(pid: int) -> set[int]:
    """Pids whose parent is pid, read from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_generate_status_and_stop(tmp_path: Path) -> None:
    state = tmp_path / "cluster.json"
    up = subprocess.Popen(
        [BATON, "--state", str(state), "up", "--nodes", "2", "--gpus", "h100,l4", "--router-port", "0",
         "--http-port", "0", "--speed", "20", "--workdir", str(tmp_path / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    services: set[int] = set()
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in up.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 60
        output = []
        while not any("Ctrl-C stops the cluster" in line for line in output):
            output.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        assert any(line.startswith("Baton is up: router 127.0.0.1:") for line in output), output
        assert any("OpenAI-compatible HTTP API: http://127.0.0.1:" in line for line in output), output
        services = children_of(up.pid)
        assert len(services) == 6  # etcd, kvindex, scheduler, router, two node agents

        generated = subprocess.run([BATON, "--state", str(state), "generate", "Hello there", "--max-tokens", "12"],
                                   capture_output=True, text=True, timeout=30)
        assert generated.returncode == 0, generated.stderr
        assert len(generated.stdout.strip()) > 0
        assert "completion 12" in generated.stderr

        status = subprocess.run([BATON, "--state", str(state), "status"], capture_output=True, text=True,
                                timeout=30)
        assert status.returncode == 0, status.stderr
        assert "2 nodes" in status.stdout and "scheduler leader: scheduler-0" in status.stdout
        rows = {line.split()[0]: line.split()[1] for line in status.stdout.splitlines() if line.startswith("node-")}
        assert rows == {"node-0": "h100", "node-1": "l4"}
        assert "recent placements (policy baton)" in status.stdout  # the generate above

        bad = subprocess.run([BATON, "--state", str(state), "generate", "x", "--model", "nope"],
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    assert not [pid for pid in services if is_alive(pid)]
    assert not state.exists()
    assert os.path.isdir(tmp_path / "work")
