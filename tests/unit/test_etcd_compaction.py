"""The etcd `baton up` starts compacts its history and snapshots often: the leader rewrites its hand-over state every
second; uncompacted, etcd grows to its 2 GB quota and then refuses every write, and its memory grows until a snapshot
(`python -m bench.etcd_growth` measures both)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import cluster
from baton.cluster import ManagedProcess


def test_the_local_etcd_runs_with_auto_compaction(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(ManagedProcess, "start", lambda self: started.append(self.args))
    monkeypatch.setattr(cluster, "wait_etcd_healthy", lambda *args: None)
    cluster.start_etcd(tmp_path)
    args = started[0]
    assert args[args.index("--auto-compaction-mode") + 1] == "periodic"
    assert args[args.index("--auto-compaction-retention") + 1] == "1m"
    assert args[args.index("--snapshot-count") + 1] == "5000"


def test_the_compose_etcd_members_run_with_auto_compaction() -> None:
    compose = (Path(__file__).parents[2] / "deploy/compose/docker-compose.yml").read_text()
    assert "ETCD_AUTO_COMPACTION_MODE: periodic" in compose and "ETCD_AUTO_COMPACTION_RETENTION: 1m" in compose
    assert 'ETCD_SNAPSHOT_COUNT: "5000"' in compose
