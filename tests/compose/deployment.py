"""A compose project under test (the plaintext cluster or the TLS one), how to reach and inspect it,
and the images every project of the run shares."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from baton.cluster import free_port
from tests.compose.engine import compose_command, run
from tests.integration.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
LOCAL_BASES = {"PY_BASE": "baton-local/python:3.11", "ETCD_IMAGE": "baton-local/etcd:3.5.1"}
# The image every project runs (built once per test run), and how it was built.
IMAGE_ENV = {**LOCAL_BASES, "PIP_NO_INDEX": "1", "BATON_IMAGE": "baton:compose-test"}
NUM_NODES = 4


@dataclass
class Deployment:
    """One compose project and how to reach it."""

    compose: list[str]
    env: dict[str, str]
    routers: list[str]
    log: Path
    # Services that run once and exit (the TLS deployment's `certs`): no health check to wait for.
    one_shot: tuple[str, ...] = ()
    http: list[str] = field(default_factory=list)

    def __call__(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([*self.compose, *args], self.log, timeout_s=timeout_s, env=self.env, check=check)

    def container_ids(self, service: str = "") -> list[str]:
        return self("ps", "-q", *([service] if service else [])).stdout.split()

    def etcdctl(self, *args: str, member: str = "etcd-1") -> str:
        return self("exec", "-T", member, "/usr/local/bin/etcdctl", *args).stdout

    def failover_log(self) -> str:
        """What a failed failover test shows (CI keeps no compose log): the schedulers' and routers' last
        lines, and each etcd member's view of etcd's own leader (a change renews every lease, a dead
        scheduler's too; while there is none, no lease expires)."""
        services = self("logs", "--no-color", "--tail", "40", "scheduler-1", "scheduler-2", "router-1", "router-2",
                        check=False).stdout
        etcd = self("logs", "--no-color", "etcd-1", "etcd-2", "etcd-3", check=False).stdout
        raft = [line for line in etcd.splitlines() if "raft.node" in line and "leader" in line]
        return f"{services}\netcd's leader, as each member saw it:\n" + "\n".join(raft)

    def scheduler_leader(self) -> str:
        """The instance id holding the scheduler election (the lowest create revision leads)."""
        values = self.etcdctl("get", "--prefix", "--sort-by=CREATE", "--order=ASCEND", "--print-value-only",
                              "/baton/election/scheduler/").splitlines()
        return json.loads(values[0])["instance_id"] if values else ""

    def num_registered_nodes(self) -> int:
        return len(self.registered_nodes())

    def registered_nodes(self, member: str = "etcd-1") -> dict[str, int]:
        """The ids of the nodes registered in etcd, as member lists them, and the lease each is held under."""
        output = self.etcdctl("get", "--prefix", "/baton/nodes/", "-w", "json", member=member)
        # (Its own log lines come with it, such as a retry while etcd elected a leader.)
        listing = json.loads(next(line for line in reversed(output.splitlines()) if line.startswith('{"header"')))
        return {base64.b64decode(kv["key"]).decode().removeprefix("/baton/nodes/"): kv.get("lease", 0)
                for kv in listing.get("kvs", [])}

    def are_all_healthy(self, service: str = "") -> bool:
        """Every long-running service's containers are healthy (service's only, when named)."""
        one_shot = {i for name in self.one_shot for i in self.container_ids(name)}
        ids = [i for i in self.container_ids(service) if i not in one_shot]
        states = subprocess.run(
            ["docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}", *ids],
            capture_output=True, text=True, timeout=30).stdout.split()
        return len(states) == len(ids) and all(state == "healthy" for state in states)


class Stopwatch:
    """Wall-clock time of each phase, printed at the end (the issue asks how long the test takes)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.phases: list[tuple[str, float]] = []
        self._mark = self.start

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self._mark))
        self._mark = now

    def report(self) -> str:
        laps = ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in self.phases)
        return f"compose test: {time.monotonic() - self.start:.0f} s in all ({laps})"


@dataclass
class Images:
    """What a module needs to bring a project up: the engine answers, the images are built."""

    log: Path
    clock: Stopwatch


@contextmanager
def brought_up(images: Images, project: str, files: Sequence[str],
               one_shot: tuple[str, ...] = ()) -> Iterator[Deployment]:
    """The project up with the routers' gRPC and HTTP ports published on free ports, every service
    healthy and the nodes in etcd; torn down (containers and volumes) at the end."""
    ports = {name: str(free_port()) for name in ("ROUTER_1_PORT", "ROUTER_2_PORT", "ROUTER_1_HTTP_PORT",
                                                 "ROUTER_2_HTTP_PORT")}
    compose = [*compose_command(), *(arg for name in files for arg in ("-f", str(COMPOSE_DIR / name))), "-p", project]
    deployment = Deployment(compose, {**IMAGE_ENV, **ports}, [f"127.0.0.1:{ports['ROUTER_1_PORT']}",
                                                                f"127.0.0.1:{ports['ROUTER_2_PORT']}"],
                            images.log, one_shot,
                            [f"127.0.0.1:{ports['ROUTER_1_HTTP_PORT']}", f"127.0.0.1:{ports['ROUTER_2_HTTP_PORT']}"])
    deployment("down", "--volumes", "--remove-orphans", "--timeout", "5")  # what a killed run left
    try:
        deployment("up", "-d", timeout_s=300)
        wait_until(deployment.are_all_healthy, 180, f"every container of {project} healthy")
        wait_until(lambda: deployment.num_registered_nodes() == NUM_NODES, 30, f"{NUM_NODES} nodes in etcd")
        images.clock.lap(f"{project} up")
        yield deployment
        images.clock.lap(f"{project} tests")
    finally:
        deployment("logs", "--no-color", "--tail", "200", check=False)
        deployment("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout_s=180)
        images.clock.lap(f"{project} down")
