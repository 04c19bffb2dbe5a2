"""StallWatch with an injected clock: a silent node is stalled, a busy one is not."""

from __future__ import annotations

from collections.abc import Callable

from baton.v1 import node_agent_pb2
from services.router.stall import BUSY_PATIENCE, NodeActivity, StallWatch

NODE = "node-a"
FLOOR_S = 1.0
Chunk = node_agent_pb2.NodeGenerateChunk


def _queued(num_ahead: int) -> Chunk:
    """A heartbeat saying the request waits in the node's queue."""
    return Chunk(progress=node_agent_pb2.RequestProgress(phase=node_agent_pb2.REQUEST_PHASE_QUEUED,
                                                         num_ahead=num_ahead))


def _started() -> Chunk:
    chunk = _queued(40)
    chunk.started.CopyFrom(node_agent_pb2.StreamStarted(heartbeat_interval_ms=100, expected_step_ms=20.0))
    return chunk


def _watch(activity: NodeActivity, now: float = 0.0) -> StallWatch:
    activity.open(NODE)
    return StallWatch(NODE, FLOOR_S, activity, now)


def _first_stall(watch: StallWatch, until: float, step: float = 0.05,
                 each_step: Callable[[float], None] | None = None) -> tuple[float, str] | None:
    """The first time, checking every step seconds up to until, the watch says stalled."""
    now = 0.0
    while now <= until:
        if each_step is not None:
            each_step(now)
        why, _ = watch.check(now)
        if why is not None:
            return now, why
        now = round(now + step, 6)
    return None


def test_a_queued_request_with_heartbeats_is_never_stalled() -> None:
    watch = _watch(NodeActivity())
    watch.heard(_started(), 0.0)
    assert _first_stall(watch, 30.0, each_step=lambda now: watch.heard(_queued(int(40 - now)), now)) is None


def test_a_node_silent_on_every_stream_is_stalled_at_the_deadline_saying_what_it_announced() -> None:
    watch = _watch(NodeActivity())
    watch.heard(_started(), 0.0)
    stall = _first_stall(watch, 30.0)
    assert stall is not None
    at, why = stall
    assert at == FLOOR_S  # max(floor, 3 heartbeats, 10 steps) = the 1 s floor
    assert "nor on any other from the node" in why and "queued, 40 ahead" in why


def test_a_stream_waiting_for_its_first_word_on_a_busy_node_is_not_stalled_at_the_floor() -> None:
    """Issue 15.5: in a burst, a stream the node has not answered yet while it answers others
    was declared stalled after the 1 s floor; it is given BUSY_PATIENCE deadlines."""
    activity = NodeActivity()
    silent = _watch(activity)
    busy = _watch(activity)

    def other_stream_flows(now: float) -> None:
        busy.heard(Chunk(token_ids=[97]), now)

    stall = _first_stall(silent, 30.0, each_step=other_stream_flows)
    assert stall is not None
    at, why = stall
    assert at == BUSY_PATIENCE * FLOOR_S
    assert "while the node answered others" in why and "the node announced nothing" in why


def test_when_the_whole_node_goes_quiet_the_waiting_stream_is_stalled_one_deadline_later() -> None:
    activity = NodeActivity()
    silent = _watch(activity)
    busy = _watch(activity)

    def others_until_3s(now: float) -> None:
        if now <= 3.0:
            busy.heard(Chunk(token_ids=[97]), now)

    stall = _first_stall(silent, 30.0, each_step=others_until_3s)
    assert stall is not None and stall[0] == 3.0 + FLOOR_S
    assert "nor on any other from the node" in stall[1]


def test_no_clock_runs_while_the_reader_is_not_listening() -> None:
    watch = _watch(NodeActivity())
    watch.heard(Chunk(token_ids=[97]), 0.0)
    watch.stop_listening()
    assert watch.check(50.0)[0] is None
    watch.listen(50.0)
    assert watch.check(50.0 + FLOOR_S - 0.01)[0] is None
    assert watch.check(50.0 + FLOOR_S)[0] is not None


def test_a_node_forgets_its_last_word_once_no_stream_is_open() -> None:
    activity = NodeActivity()
    activity.open(NODE)
    activity.heard(NODE, 5.0)
    activity.close(NODE)
    assert activity.last_heard(NODE) is None


def test_silence_the_router_could_not_hear_is_not_the_nodes_once_until_heard_again() -> None:
    """A router frozen 30 s (SIGSTOP, a paused VM) checks 29 s late: the node sent all along, its chunks wait unread
    behind the check, and every stream of the router counted as stalled and moved. Counted from the late check, the
    node has a deadline to be heard; a second late check with nothing heard between finds a dead node."""
    watch = _watch(NodeActivity())
    watch.heard(_started(), 0.0)
    assert watch.check(30.0, late_s=29.0) == (None, FLOOR_S)
    watch.heard(_queued(3), 30.01)  # what the node sent while the router slept
    assert watch.check(31.0, late_s=0.0)[0] is None
    assert watch.check(60.0, late_s=28.0)[0] is None  # frozen again: heard since, so forgiven again
    why, _ = watch.check(90.0, late_s=29.0)  # and again, nothing heard: a router starved for good finds it dead
    assert why is not None and "nor on any other from the node" in why
    # A check on time is judged as before: nothing heard for a deadline is stalled.
    punctual = _watch(NodeActivity())
    punctual.heard(_started(), 0.0)
    assert punctual.check(FLOOR_S, late_s=FLOOR_S / 2 - 0.01)[0] is not None
