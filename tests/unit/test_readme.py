"""The README's configuration table names every flag each service accepts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.kvindex.config import KVIndexConfig
from services.node_agent.config import NodeAgentConfig
from services.router.config import RouterConfig
from services.scheduler.config import SchedulerConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("config", [RouterConfig, SchedulerConfig, KVIndexConfig, NodeAgentConfig])
def test_every_flag_is_documented(config: type) -> None:
    flags = [f"`--{field.name.replace('_', '-')}`" for field in dataclasses.fields(config)]
    assert [flag for flag in flags if flag not in README] == []
