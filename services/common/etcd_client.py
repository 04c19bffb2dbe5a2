"""The etcd client every Baton process uses: aetcd's, over one or several members of an etcd cluster, plaintext or TLS.

aetcd 1.0.0 (pinned in pyproject.toml) dials one host:port over a plaintext channel. A service given only the member
that then died lost etcd for as long as that member stayed down, though the cluster's other members kept its quorum:
its lease lapsed, it left the fleet, a leader lost its election (helper-175). Given several
endpoints (`--etcd a:2379,b:2379,c:2379`), a client talks to one member at a time and moves to the next when a call to
it fails for want of that member:

- UNAVAILABLE: the member is gone (refused, reset) or has no raft leader (calls carry etcd's `hasleader` metadata, so a
  member cut off from the quorum refuses them, and ends the watches open on it, rather than serve a stale view);
- DEADLINE_EXCEEDED: the member or its host is frozen (every call has the client's timeout; a watch has none, but a
  process's lease is refreshed every third of its TTL, and that call times out).

Moving ends the old member's watches as a clean end of stream, which every watcher in Baton answers with a fresh
listing and watch (on the next member), and closes the old channel once its calls have had their timeout to end.
The lease, the keys and the election's records are the cluster's, not a member's: they live on through the move.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import aetcd
import grpc
from aetcd import rpc, rtypes, watcher

from services.common.reconnect import RECONNECT_OPTIONS
from services.common.timeouts import within

log = logging.getLogger(__name__)

# The codes that say the member a call went to cannot serve it, where another member may.
_MEMBER_FAILED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# etcd's own UNAVAILABLE refusals begin so. Only "no leader" is the member's alone: "leader changed" and "request
# timed out, possibly due to previous leader failure" come from every member while the cluster elects a leader, and
# moving on them sent clients off healthy members, as likely onto the dead one (helper-178).
_ETCD_REFUSAL = "etcdserver: "
_NO_LEADER = "etcdserver: no leader"
# A member a call failed on is passed over while others have not failed for this long.
_PASS_OVER_S = 10.0
# etcd refuses a call that carries this while it has no raft leader, and ends a watch that carries it once it loses
# its leader (etcd's clientv3 WithRequireLeader).
_REQUIRE_LEADER = (("hasleader", "true"),)


def split_endpoints(value: str) -> tuple[str, ...]:
    """The comma-separated host:port endpoints of --etcd, each stripped of spaces."""
    return tuple(part.strip() for part in value.split(","))


class EtcdClient(aetcd.Client):
    """aetcd.Client over one or several etcd members' endpoints; a TLS channel when credentials are given.

    connect() is aetcd 1.0.0's own, with the channel built here (plaintext or TLS, with the failover interceptor) and
    without username/password authentication, which Baton does not use.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        host, _, port = endpoints[0].rpartition(":")
        super().__init__(host=host, port=int(port), timeout=timeout_s, options=dict(RECONNECT_OPTIONS))
        self.endpoints = tuple(endpoints)
        self._at = 0
        self._credentials = credentials
        # Counts the channels built: a failure moves on only from the channel it happened on, so that the calls
        # that fail together on a dead member move the client once, not once each.
        self._channel_number = 0
        self._failed_at: dict[str, float] = {}  # endpoint: when a call on it last failed (loop time)
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    @property
    def endpoint(self) -> str:
        """The member this client talks to now."""
        return self.endpoints[self._at]

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await within(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self._channel_number += 1
            interceptors = _Failover(self._failed, self._channel_number).interceptors()
            options = list(self._options.items())
            if self._credentials is not None:
                self.channel = grpc.aio.secure_channel(self.endpoint, self._credentials, options=options,
                                                       interceptors=interceptors)
            else:
                self.channel = grpc.aio.insecure_channel(self.endpoint, options=options, interceptors=interceptors)
            self.metadata = _REQUIRE_LEADER
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False

    def _failed(self, channel_number: int, code: grpc.StatusCode, details: str | None) -> None:
        """A call on channel channel_number failed with code: move to another member, once per channel."""
        if (len(self.endpoints) == 1 or not _moves_on(code, details) or channel_number != self._channel_number
                or not self._connected.is_set()):
            return  # one member: gRPC reconnects its channel when it is back
        failed = self.endpoint
        now = asyncio.get_running_loop().time()
        self._failed_at[failed] = now
        self._at = self._next_member(now)
        log.warning("etcd member %s failed a call (%s: %s); moving to %s", failed, code.name, details, self.endpoint)
        old_channel, old_watcher = self.channel, self._watcher
        self._init_channel_attrs()
        self._connected.clear()  # the next call connects to self.endpoint
        task = asyncio.get_running_loop().create_task(self._close_old(old_channel, old_watcher))
        self._closing[task] = old_channel
        task.add_done_callback(lambda done: self._closing.pop(done, None))

    def _next_member(self, now: float) -> int:
        """The next member round the list that no call failed on lately; the next one if every other did."""
        count = len(self.endpoints)
        for step in range(1, count):
            at = (self._at + step) % count
            if now - self._failed_at.get(self.endpoints[at], -math.inf) >= _PASS_OVER_S:
                return at
        return (self._at + 1) % count

    async def _close_old(self, channel: grpc.aio.Channel, old_watcher: watcher.Watcher | None) -> None:
        """End the old member's watches, as a clean end of stream, and close its channel once every other call
        on it has had its timeout to end: a call cut by the channel's closing raised CancelledError in its
        caller's task, which no etcd loop of Baton takes for an etcd failure."""
        try:
            if old_watcher is not None:
                await old_watcher.shutdown()
            await channel.close(grace=(self._timeout or 0) + 1.0)
        except Exception as exc:  # noqa: BLE001 - the old member's channel is being dropped either way
            log.debug("closing the channel to a failed etcd member: %s", exc)

    async def close(self) -> None:
        await super().close()
        for task, channel in list(self._closing.items()):  # the client is done: no call of it is left to end
            task.cancel()
            await channel.close()

    @aetcd.client._handle_errors
    @aetcd.client._ensure_connected
    async def refresh_lease(self, lease_id: int, ttl_s: float | None = None) -> Any:
        """One keep-alive of lease_id: etcd's reply (TTL 0: the lease is gone), or None. With ttl_s, and other
        members to move to, it waits a quarter of ttl_s at most, not the client's timeout: a keep-alive sent a third
        of the TTL after the last one, to a member that froze, failed only as the lease ran out (helper-178)."""
        timeout_s = self._timeout
        if ttl_s is not None and len(self.endpoints) > 1:
            timeout_s = min(timeout_s or ttl_s, ttl_s / 4)
        async for reply in self.leasestub.LeaseKeepAlive([rpc.LeaseKeepAliveRequest(ID=lease_id)],
                                                          timeout=timeout_s, metadata=self.metadata):
            return reply
        return None

    @aetcd.client._handle_errors
    async def watch(self, key: bytes, **options: Any) -> rtypes.Watch:
        """aetcd's watch (options as its), whose cancel goes to the watcher that made the watch. aetcd's looked the
        client's watcher up when called: after a move it raised AttributeError (there was none yet, and the
        scheduler's campaign failed and gave up its place: helper-178), or cancelled a watch of the next member's
        stream that had the same id."""
        await self.connect()
        own = self._watcher
        assert own is not None
        events: asyncio.Queue[Any] = asyncio.Queue()
        callback = await own.add_callback(key, events.put, **options)
        ended = asyncio.Event()

        @aetcd.client._handle_errors
        async def iterate() -> AsyncIterator[Any]:
            while not ended.is_set():
                event = await events.get()
                if event is None:  # cancelled, or the watcher shut down (a move, a close)
                    ended.set()
                elif isinstance(event, Exception):
                    ended.set()
                    raise event
                else:
                    yield event

        async def cancel() -> None:
            ended.set()
            events.put_nowait(None)
            await own.cancel(callback.watch_id)

        return rtypes.Watch(iterate, cancel, callback.watch_id)


def _moves_on(code: grpc.StatusCode, details: str | None) -> bool:
    """Whether a call that failed with code and details says its member cannot serve where another may."""
    if code not in _MEMBER_FAILED:
        return False
    text = details or ""
    return not text.startswith(_ETCD_REFUSAL) or text.startswith(_NO_LEADER)


class _Failover:
    """Tells the client of each call on one channel that failed (etcd's API has unary and stream-stream calls only).
    One interceptor object per kind of call: grpc.aio files an interceptor under the first kind it implements only,
    so one that implemented both saw no stream (a member frozen while a lease keep-alive was the only call to it was
    never left: the compose test's paused member)."""

    def __init__(self, failed: Callable[[int, grpc.StatusCode, str | None], None], channel_number: int) -> None:
        self._failed = failed
        self._channel_number = channel_number

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [_UnaryFailover(self), _StreamFailover(self)]

    def saw(self, error: grpc.aio.AioRpcError) -> None:
        self._failed(self._channel_number, error.code(), error.details())


class _UnaryFailover(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, failover: _Failover) -> None:
        self._failover = failover

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        call = await continuation(client_call_details, request)
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            self._failover.saw(exc)
        return call  # awaited again by the caller: the same response or error


class _StreamFailover(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, failover: _Failover) -> None:
        self._failover = failover

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> AsyncIterator[Any]:
        call = await continuation(client_call_details, request_iterator)
        return self._watched(call)

    async def _watched(self, call: Any) -> AsyncIterator[Any]:
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            self._failover.saw(exc)
            raise
