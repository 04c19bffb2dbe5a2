"""Why a router gave up a node's stream of a request: the cause of a move, sent as Place's retry_cause."""

from __future__ import annotations

import enum


class FailureCause(enum.Enum):
    """Why a node stream was given up, and so why the generation moved."""

    CONNECT_FAILED = "connect_failed"  # the stream broke before the node sent anything
    STREAM_BROKEN = "stream_broken"  # the stream broke or ended without a finish
    STALLED = "stalled"  # no token or heartbeat within the stall deadline
    LEASE_EXPIRED = "lease_expired"  # the node's etcd registration went away
    DRAINED = "drained"  # the node is shutting down (SIGTERM) and handed the stream on as its grace ended


# What a Place's retry_cause may be besides "" (a first placement): the scheduler labels a metric with it.
RETRY_CAUSES = frozenset(cause.value for cause in FailureCause)
