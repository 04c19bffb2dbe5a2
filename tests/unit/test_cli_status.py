"""`baton status` says why the cost per successful task is missing, instead of leaving it out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from baton.cli import main
from baton.v1 import scheduler_pb2, scheduler_pb2_grpc


class _Standby(scheduler_pb2_grpc.SchedulerServicer):
    """A replica that knows of a leader it names (leader_address, possibly unreachable), or of none."""

    def __init__(self, leader_id: str, leader_address: str) -> None:
        self.leader_id, self.leader_address = leader_id, leader_address

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.ClusterState(scheduler_id="scheduler-1", leader_id=self.leader_id,
                                          leader_address=self.leader_address)


@contextlib.contextmanager
def _serve(servicer: scheduler_pb2_grpc.SchedulerServicer) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.mark.parametrize(("leader_id", "leader_address", "why"), [
    ("", "", "tasks: not shown: no leader is elected"),
    ("scheduler-0", "127.0.0.1:1", "tasks: not shown: the leader at 127.0.0.1:1 did not answer (UNAVAILABLE)"),
])
def test_status_says_why_it_shows_no_tasks(capsys: pytest.CaptureFixture[str], leader_id: str, leader_address: str,
                                           why: str) -> None:
    with _serve(_Standby(leader_id, leader_address)) as address:
        assert main(["status", "--scheduler", address]) == 0
    assert why in capsys.readouterr().out.splitlines()
