"""A Docker engine for the compose test: the running one, or dockerd installed and started here (stopped by pid)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.conftest import wait_until

# BuildKit pulls a frontend image and Docker 20.10's compose v1 builds with docker-py: keep the legacy builder.
DOCKER_ENV = {"DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}


def run(args: Sequence[str], log: Path, *, timeout_s: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command, appending its output to log; on failure, fail the test with the output's tail."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(args)}\n")
        out.flush()
        result = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=timeout_s, env={**os.environ, **DOCKER_ENV, **(env or {})})
        out.write(result.stdout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args[:3])} … exited {result.returncode} (log: {log}):\n{result.stdout[-3000:]}")
    return result


def is_engine_up() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0


def install_docker(log: Path) -> None:
    """Debian's docker.io (dockerd 20.10) and docker-compose (v1), when this machine lacks them."""
    if shutil.which("dockerd") and (shutil.which("docker-compose") or has_compose_plugin()):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Docker cannot run here: no dockerd, and installing it needs root and apt-get")
    run(["apt-get", "update", "-qq"], log, timeout_s=300)
    run(["apt-get", "install", "-y", "-qq", "docker.io", "docker-compose"], log, timeout_s=600,
        env={"DEBIAN_FRONTEND": "noninteractive"})


def has_compose_plugin() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "compose", "version"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def compose_command() -> list[str]:
    """`docker compose` (v2) where the plugin is installed, else `docker-compose` (v1, Debian's)."""
    return ["docker", "compose"] if has_compose_plugin() else ["docker-compose"]


@contextmanager
def docker_engine(log: Path) -> Iterator[None]:
    """Yield with a Docker engine answering; one started here is stopped here, by its pid."""
    install_docker(log)
    if is_engine_up():
        yield
        return
    with (log.parent / "dockerd.log").open("a") as out:
        dockerd = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: dockerd.poll() is not None or is_engine_up(), 90, f"dockerd (pid {dockerd.pid}) to answer")
        if dockerd.poll() is not None:
            tail = (log.parent / "dockerd.log").read_text()[-2000:]
            pytest.skip(f"Docker cannot run here: dockerd exited {dockerd.returncode}:\n{tail}")
        yield
    finally:
        if dockerd.poll() is None:
            dockerd.send_signal(signal.SIGTERM)  # dockerd stops its containers and its own containerd
            try:
                dockerd.wait(60)
            except subprocess.TimeoutExpired:
                dockerd.kill()
                dockerd.wait(10)
