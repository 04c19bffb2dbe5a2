"""The Docker engine and the images, once per run for every compose project the tests bring up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.compose.deployment import COMPOSE_DIR, IMAGE_ENV, LOCAL_BASES, ROOT, Images, Stopwatch
from tests.compose.engine import compose_command, docker_engine, run


@pytest.fixture(scope="session")
def compose_images() -> Iterator[Images]:
    """dockerd answering (installed and started here when absent, stopped here by pid), the local base
    images and Baton's image built; timings to .cache/test/compose/timings.txt at the end."""
    logs = ROOT / ".cache" / "test" / "compose"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "compose.log"
    log.write_text("")
    clock = Stopwatch()
    with docker_engine(log):
        clock.lap("docker")
        run([str(COMPOSE_DIR / "local" / "build-bases.sh")], log, timeout_s=420, env=LOCAL_BASES)
        clock.lap("base images")
        run([*compose_command(), "-f", str(COMPOSE_DIR / "docker-compose.yml"), "-p", "batontest", "build"], log,
            timeout_s=420, env=IMAGE_ENV)
        clock.lap("build")
        yield Images(log, clock)
    clock.lap("docker stop")
    print("\n" + clock.report())
    (logs / "timings.txt").write_text(clock.report() + "\n")
