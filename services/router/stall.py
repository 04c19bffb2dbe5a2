"""When a node stream counts as stalled: silence judged against what the node announced. Pure.

A dead or stopped node sends nothing on any stream; a busy one (a burst queued behind a full
batch, an event loop behind on its writes) is late on some streams but still answers others.
So a stream is stalled when it has been silent for its deadline and so has its node on every
stream this router has with it; a stream silent while its node answers others is given
BUSY_PATIENCE deadlines before it counts as stalled too. Time is passed in.

The router itself may not have run: frozen (SIGSTOP, a paused VM) or starved of CPU, it heard
nothing while the node went on sending, and the check comes late. Silence it could not hear is not
the node's: a check that comes half a deadline or more late counts the silence from then, once until
the stream is heard again (a router starved for good still finds a dead node, one deadline later).
"""

from __future__ import annotations

from baton.v1 import node_agent_pb2

# A stream silent this many deadlines is stalled even while its node answers other streams.
BUSY_PATIENCE = 10


def stall_deadline_s(floor_s: float, started: node_agent_pb2.StreamStarted | None) -> float:
    """How long a node may send nothing on a stream before the stream counts as silent.

    Derived from the pace the node announced: three heartbeat intervals or ten decode steps,
    whichever is longer, and never below floor_s (scheduling noise on a loaded host).
    """
    if started is None:
        return floor_s
    return max(floor_s, 3 * started.heartbeat_interval_ms / 1000, 10 * started.expected_step_ms / 1000)


class NodeActivity:
    """When this router last heard anything from each node, on any of its streams."""

    def __init__(self) -> None:
        self._last_heard: dict[str, float] = {}
        self._num_streams: dict[str, int] = {}

    def open(self, node_id: str) -> None:
        """A stream to node_id begins (its last-heard time is kept while any is open)."""
        self._num_streams[node_id] = self._num_streams.get(node_id, 0) + 1

    def close(self, node_id: str) -> None:
        left = self._num_streams.get(node_id, 0) - 1
        if left > 0:
            self._num_streams[node_id] = left
        else:
            self._num_streams.pop(node_id, None)
            self._last_heard.pop(node_id, None)

    def heard(self, node_id: str, now: float) -> None:
        self._last_heard[node_id] = now

    def last_heard(self, node_id: str) -> float | None:
        return self._last_heard.get(node_id)


def describe_progress(progress: node_agent_pb2.RequestProgress | None) -> str:
    """What the node last said about the request, for messages."""
    if progress is None or progress.phase == node_agent_pb2.REQUEST_PHASE_UNSPECIFIED:
        return "the node announced nothing"
    if progress.phase == node_agent_pb2.REQUEST_PHASE_QUEUED:
        return f"last announced: queued, {progress.num_ahead} ahead"
    if progress.phase == node_agent_pb2.REQUEST_PHASE_PREFILLING:
        return (f"last announced: prefilling, {progress.num_computed_tokens} of {progress.num_prompt_tokens} "
                "prompt tokens computed")
    return "last announced: decoding"


class StallWatch:
    """One node stream's silence: what the node announced, when it was last heard, whether we listen."""

    def __init__(self, node_id: str, floor_s: float, activity: NodeActivity, now: float) -> None:
        self.node_id = node_id
        self.floor_s = floor_s
        self._activity = activity
        self._started: node_agent_pb2.StreamStarted | None = None
        self._progress: node_agent_pb2.RequestProgress | None = None
        self._last_heard = now
        self._is_listening = True
        # A late check forgave the silence before it, and nothing has been heard since.
        self._forgiven = False

    @property
    def deadline_s(self) -> float:
        return stall_deadline_s(self.floor_s, self._started)

    def heard(self, chunk: node_agent_pb2.NodeGenerateChunk, now: float) -> None:
        """A chunk arrived: the stream and its node are alive; keep what it announced."""
        self._last_heard = now
        self._forgiven = False
        self._activity.heard(self.node_id, now)
        if chunk.HasField("started"):
            self._started = chunk.started
        if chunk.HasField("progress"):
            self._progress = chunk.progress
        elif chunk.token_ids:
            self._progress = node_agent_pb2.RequestProgress(phase=node_agent_pb2.REQUEST_PHASE_DECODING)

    def stop_listening(self) -> None:
        """The reader is busy elsewhere (its client is slow): the node cannot be heard, so no clock runs."""
        self._is_listening = False

    def listen(self, now: float) -> None:
        """The reader waits on the node again; silence counts from now."""
        self._is_listening = True
        self._last_heard = now

    def check(self, now: float, late_s: float = 0.0) -> tuple[str | None, float]:
        """(why the stream is stalled, or None; seconds until it is worth checking again). late_s: how long after
        it was due this check runs (the router's own pause)."""
        deadline = self.deadline_s
        if not self._is_listening:
            return None, deadline
        if late_s >= deadline / 2 and not self._forgiven:
            self._forgiven = True
            self._last_heard = now
            return None, deadline
        silent = now - self._last_heard
        if silent < deadline:
            return None, deadline - silent
        node_heard = self._activity.last_heard(self.node_id)
        node_silent = silent if node_heard is None else min(silent, now - node_heard)
        said = describe_progress(self._progress)
        if node_silent >= deadline:
            return (f"nothing for {silent:.2f}s on this stream nor on any other from the node "
                    f"(deadline {deadline:.2f}s; {said})"), deadline
        patience = BUSY_PATIENCE * deadline
        if silent >= patience:
            return (f"nothing for {silent:.2f}s on this stream while the node answered others "
                    f"(busy limit {patience:.2f}s; {said})"), deadline
        return None, min(deadline - node_silent, patience - silent)
