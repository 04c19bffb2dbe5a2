"""What the compose file gives Baton's services, checked without Docker."""

from __future__ import annotations

import re
from pathlib import Path

from baton.cluster import ROUTER_STOP_S

COMPOSE = Path(__file__).parents[2] / "deploy/compose/docker-compose.yml"


def test_every_baton_service_has_longer_to_stop_than_a_router_takes_to_drain() -> None:
    """Docker's default, 10 s, equal to the router's grace, SIGKILLed a router stopped with a stream in flight: exit
    137, its streams' Finished notices unsent (helper-175). The live check is tests/compose; whether the router or
    Docker's SIGKILL comes first at 10 s is a race, so this holds the setting itself."""
    baton = COMPOSE.read_text().split("x-baton: &baton\n", 1)[1].split("\nx-", 1)[0]  # the anchor every service uses
    [seconds] = re.findall(r"^  stop_grace_period: (\d+)s$", baton, re.MULTILINE)
    assert int(seconds) > ROUTER_STOP_S
    # The vLLM override's node, which does not take the anchor (helper-177).
    vllm = (COMPOSE.parent / "docker-compose.vllm-cpu.yml").read_text().split("\n  node-vllm-cpu:\n", 1)[1]
    [seconds] = re.findall(r"^    stop_grace_period: (\d+)s$", vllm.split("\n\n", 1)[0], re.MULTILINE)
    assert int(seconds) > ROUTER_STOP_S
