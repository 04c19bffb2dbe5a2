"""The `baton` command as a user runs it: up with two routers, generate, status, then Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.conftest import wait_until
from tests.processes import is_alive

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


def command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def test_up_generate_status_and_stop(tmp_path: Path) -> None:
    # Its own state directory: clusters found there are this test's alone.
    env = {**os.environ, "BATON_STATE_DIR": str(tmp_path / "state")}
    up = subprocess.Popen(
        [BATON, "up", "--name", "lab", "--routers", "2", "--nodes", "2", "--gpus", "h100,l4", "--router-port", "0",
         "--http-port", "0", "--speed", "20", "--workdir", str(tmp_path / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    services: set[int] = set()
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in up.stdout], daemon=True).start()  # type: ignore[union-attr]

    def baton(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([BATON, *argv], capture_output=True, text=True, timeout=30, env=env)

    state = tmp_path / "state" / "lab.json"
    try:
        deadline = time.monotonic() + 60
        output = []
        while not any("Ctrl-C stops the cluster" in line for line in output):
            output.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        routers = json.loads(state.read_text())["routers"]
        assert len(set(routers)) == 2
        assert any(line.startswith(f"Baton is up: routers {', '.join(routers)}  (cluster 'lab'")
                   for line in output), output
        assert any("OpenAI-compatible HTTP API: http://127.0.0.1:" in line for line in output), output
        services = children_of(up.pid)
        assert len(services) == 7  # etcd, kvindex, scheduler, two routers, two node agents

        # The one running cluster is found unnamed; --json is one protobuf JSON object per chunk.
        generated = baton("generate", "Hello there", "--max-tokens", "12", "--json")
        assert generated.returncode == 0, generated.stderr
        chunks = [json.loads(line) for line in generated.stdout.splitlines()]
        assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        text = "".join(chunk.get("text", "") for chunk in chunks)

        # --stop reaches the engine: greedy output is deterministic, so it ends at the stop text.
        stop = text[6:8]
        stopped = baton("generate", "Hello there", "--max-tokens", "12", "--stop", stop, "--cluster", "lab")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == text[:text.index(stop) + len(stop)]
        assert "stop;" in stopped.stderr

        status = baton("status", "--state", str(state))  # --state after the subcommand
        assert status.returncode == 0, status.stderr
        assert "2 nodes" in status.stdout and "scheduler leader: scheduler-0" in status.stdout
        rows = {line.split()[0]: line.split()[1] for line in status.stdout.splitlines() if line.startswith("node-")}
        assert rows == {"node-0": "h100", "node-1": "l4"}

        def shows_step_time() -> bool:
            """A node that served the generates shows its latest decode step time (seen ages are whole ms),
            once its load report has reached the leader."""
            lines = baton("status").stdout.splitlines()
            return any(re.search(r" \d+\.\dms ", line) for line in lines if line.startswith("node-"))

        wait_until(shows_step_time, 20, "baton status to show a node's latest decode step time")
        assert "recent placements (policy baton)" in status.stdout  # the generates above
        assert "admission queue: 0 waiting" in status.stdout  # nothing is queued at an idle leader

        bad = baton("generate", "x", "--model", "nope")
        assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr

        # With the first router gone, generate fails over to the second.
        [router_0] = [pid for pid in services if "--instance-id=router-0" in command_line(pid)]
        os.kill(router_0, signal.SIGKILL)
        survived = baton("generate", "Hello there", "--max-tokens", "4")
        assert survived.returncode == 0, survived.stderr
        assert "completion 4" in survived.stderr
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    assert not [pid for pid in services if is_alive(pid)]
    assert not state.exists()
    assert os.path.isdir(tmp_path / "work")


def test_a_closed_terminal_stops_the_cluster(tmp_path: Path) -> None:
    # SIGHUP (the terminal `baton up` ran in was closed) stops it as Ctrl-C does: before, it died at once and
    # left etcd and every service running, each in its own process group.
    env = {**os.environ, "BATON_STATE_DIR": str(tmp_path / "state")}
    up = subprocess.Popen([BATON, "up", "--nodes", "1", "--router-port", "0", "--http-port", "-1", "--speed", "0",
                           "--workdir", str(tmp_path / "work")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    services: set[int] = set()
    try:
        assert up.stdout is not None
        for line in up.stdout:  # bounded by the module's timeout
            if "Ctrl-C stops the cluster" in line:
                break
        services = children_of(up.pid)
        assert len(services) == 5  # etcd, kvindex, scheduler, router, node agent
        up.send_signal(signal.SIGHUP)
        assert up.wait(60) == 0
        assert not [pid for pid in services if is_alive(pid)]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(60)
        for pid in services:  # what it left running when the feature is broken: this test's own, by pid
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
