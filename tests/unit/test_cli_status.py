"""`baton status` says why the cost per successful task is missing, instead of leaving it out."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from baton.cli import main
from baton.state_files import ClusterRecord, record_path, write_record
from baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc


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


class _Frozen(_Standby):
    """A replica that takes the call and answers nothing until released (a frozen host, as long as the test needs;
    bounded for a broken run)."""

    def __init__(self) -> None:
        super().__init__("scheduler-1", "")
        self.started, self.released = threading.Event(), threading.Event()
        self.context: grpc.ServicerContext | None = None

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        self.context = context
        self.started.set()
        self.released.wait(10)
        return super().GetClusterState(request, context)


class _Answering(_Standby):
    """A replica that answers at once, noting whether the frozen one's caller still waited for it then."""

    def __init__(self, frozen: _Frozen) -> None:
        super().__init__("", "")
        self.frozen = frozen
        self.frozen_still_asked: bool | None = None

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        assert self.frozen.started.wait(10) and self.frozen.context is not None
        self.frozen_still_asked = self.frozen.context.is_active()
        self.frozen.released.set()
        return super().GetClusterState(request, context)


def test_status_asks_every_replica_at_once_so_a_frozen_first_one_does_not_hold_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Asked in turn, the frozen first replica held every call for its 3 s timeout: its caller had given up on it
    # before the next replica was asked.
    frozen = _Frozen()
    answering = _Answering(frozen)
    with _serve(frozen) as first, _serve(answering) as second:
        path = record_path(tmp_path, "lab")
        write_record(path, ClusterRecord(name="lab", path=path, pid=os.getpid(), routers=("127.0.0.1:1",),
                                         schedulers=(first, second)))
        assert main(["status", "--state-dir", str(tmp_path)]) == 0
    assert answering.frozen_still_asked is True
    assert "scheduler leader:" in capsys.readouterr().out  # whichever answered first


class _Hostile(_Standby):
    """A leader whose state holds a client's strings with terminal escapes in them (kept from before they were
    refused)."""

    def __init__(self) -> None:
        super().__init__("scheduler-1", "")

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.ClusterState(scheduler_id="scheduler-1", leader_id="scheduler-1", leading_revision=7,
                                          queued_by_tenant={"t\x1b[2J": 1})

    def GetRecentDecisions(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.RecentDecisions(policy="baton", decisions=[
            scheduler_pb2.PlacementDecision(request_id="r\x1b[2J\nx", node_id="n1", fallback="f\x1b[0m")])


def test_status_shows_a_clients_control_characters_escaped_never_raw(capsys: pytest.CaptureFixture[str]) -> None:
    with _serve(_Hostile()) as address:
        assert main(["status", "--scheduler", address]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "('t\\x1b[2J' 1)" in out and "'r\\x1b[2J\\nx'" in out and "fallback: 'f\\x1b[0m'" in out


class _Draining(_Standby):
    """A leader with a node reserved for a model swap."""

    def __init__(self) -> None:
        super().__init__("scheduler-1", "")

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        node = scheduler_pb2.NodeState(reserved_for_model="sim-llama-2-7b", load_age_ms=5)
        node.info.node_id = "node-2"
        return scheduler_pb2.ClusterState(scheduler_id="scheduler-1", leader_id="scheduler-1", leading_revision=7,
                                          nodes=[node])

    def GetRecentDecisions(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.RecentDecisions(policy="baton")


def test_status_says_which_node_drains_for_a_model_swap(capsys: pytest.CaptureFixture[str]) -> None:
    with _serve(_Draining()) as address:
        assert main(["status", "--scheduler", address]) == 0
    assert ("draining: reserved to be swapped to sim-llama-2-7b once its requests end (placement sends it nothing "
            "new)") in capsys.readouterr().out


class _ShuttingDown(_Standby):
    """A leader whose fleet has a node shutting down, four streams still running there."""

    def __init__(self) -> None:
        super().__init__("scheduler-1", "")

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.ClusterState(scheduler_id="scheduler-1", leader_id="scheduler-1", nodes=[
            scheduler_pb2.NodeState(info=common_pb2.NodeInfo(node_id="n0", gpu="h100")),
            scheduler_pb2.NodeState(info=common_pb2.NodeInfo(node_id="n1", gpu="h100", draining=True),
                                    load=common_pb2.NodeLoad(node_id="n1", num_running=4), load_age_ms=40)])


def test_status_shows_a_draining_node_and_says_it_is_draining(capsys: pytest.CaptureFixture[str]) -> None:
    with _serve(_ShuttingDown()) as address:
        assert main(["status", "--scheduler", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 nodes (1 draining)" in lines[0]
    row = next(i for i, line in enumerate(lines) if line.startswith("n1 "))
    assert lines[row].split()[4] == "4"  # its running streams (no address, no model: the columns after)
    assert lines[row + 1].split()[0] == "draining:"


class _Moved(_Standby):
    """A leader whose last decision placed a move, after a wait."""

    def __init__(self) -> None:
        super().__init__("scheduler-1", "")

    def GetRecentDecisions(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.RecentDecisions(policy="baton", decisions=[scheduler_pb2.PlacementDecision(
            request_id="alice/p12-b10", node_id="n1", retry_cause="drained", excluded_node_ids=["n0"], waited_ms=5670,
            candidates=[scheduler_pb2.CandidateTerms(node_id="n1", cached_tokens=2992, warm=True)])])


def test_status_says_a_decision_was_a_move_and_how_long_it_waited(capsys: pytest.CaptureFixture[str]) -> None:
    with _serve(_Moved()) as address:
        assert main(["status", "--scheduler", address]) == 0
    out = capsys.readouterr().out
    assert "alice/p12-b10 -> n1" in out and "cached 2992" in out  # cut to 12 characters, and no cache (helper-160)
    assert "a move (drained), avoiding n0" in out
    assert "decided after 5.7 s waiting (admission queue, a model's load, or leadership)" in out


class _Terms(_Standby):
    """A replica that led at revision 46, and now leads again at 143 (or, leading 0, does not lead now)."""

    def __init__(self, leading: int) -> None:
        super().__init__("scheduler-1", "")
        self.leading = leading

    def GetClusterState(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.ClusterState(scheduler_id="scheduler-1", leader_id="scheduler-1",
                                          leading_revision=self.leading)

    def GetRecentDecisions(self, request, context):  # noqa: N802 - the generated servicer's name
        return scheduler_pb2.RecentDecisions(policy="baton", decisions=[
            scheduler_pb2.PlacementDecision(request_id=rid, node_id="n1", leader_revision=revision)
            for rid, revision in (("b-1", 143), ("b-0", 143), ("a-2", 46))])


def test_status_says_whose_placements_it_shows_and_where_an_earlier_term_begins(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each replica keeps the placements it made in every term it led. Shown as the latest, a standby's old list hid
    the leader's newest placements, and a leader's list went from its term to an earlier one with the placements of
    the leader between them missing and no sign of it (helper-192)."""
    with _serve(_Terms(leading=143)) as address:
        assert main(["status", "--scheduler", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("recent placements (policy baton), newest first:")
    assert [line.split()[0] for line in lines[start + 1:]] == ["b-1", "b-0", "(as", "a-2"]
    assert lines[start + 3] == ("  (as leader at revision 46, an earlier term: other leaders' placements since are "
                                "not here)")
    with _serve(_Terms(leading=0)) as address:
        assert main(["status", "--scheduler", address]) == 0
    out = capsys.readouterr().out
    assert ("recent placements of scheduler-1, which does not lead on a confirmed lease now: those it made when it "
            "led, perhaps not the leader's latest (policy baton), newest first:\n"
            "  (as leader at revision 143)\n") in out
    # The term after it older: said to be an earlier one, with what is missing between.
    assert "(as leader at revision 46, an earlier term: other leaders' placements since are not here)" in out
