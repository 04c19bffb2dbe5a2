"""Scheduler gRPC service: protobuf <-> the cluster view and placement policy."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation

from baton.protocol import LEADER_KEY
from baton.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common import etcd_keys
from services.common.auth import TenantKeys
from services.common.change_signal import ChangeSignal, wait_or_timeout
from services.common.config import MAX_PRICE_PER_HOUR
from services.common.directory import ChannelPool, ServiceDirectory
from services.common.errors import (
    BatonError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
    abort,
    shown,
)
from services.common.etcd_session import Membership, PrefixView
from services.common.failure_cause import RETRY_CAUSES
from services.common.load import load_from_proto, load_to_proto
from services.common.node_registration import parse_node_info
from services.common.profile_proto import profile_from_proto, profile_problem
from services.common.request_context import context_fields, context_of
from services.common.server import ServingNames
from services.common.telemetry import Telemetry
from services.common.tenant_directory import TenantDirectory
from services.common.timeouts import usable_s, within
from services.scheduler.admission import Admission, TenantLimits
from services.scheduler.config import SchedulerConfig, parse_tenant_limits
from services.scheduler.fleet import ClusterView, NodeSpec
from services.scheduler.gate import AdmissionGate
from services.scheduler.leadership import LeaderRole
from services.scheduler.model_loader import ModelLoader
from services.scheduler.model_planner import ModelAction, ModelPlanner
from services.scheduler.placement import (
    DeadlineOutOfReach,
    LeftOutOfReach,
    PlaceAsk,
    Placer,
    Plan,
    Unmeetable,
    ticket_of,
)
from services.scheduler.policies import Decision, PlacementRequest, make_policy
from services.scheduler.retry_budget import RetryBudget
from services.scheduler.tasks import TaskLedger, json_str_bytes, request_task, workflow_task
from services.scheduler.validation import check_finished, check_live_requests, check_load, check_place

log = logging.getLogger(__name__)

_DECISIONS_KEPT = 200
_WORKFLOWS_HANDED_OVER = 10_000
# The tasks ended lately that a leader hands over (a late or repeated notice of one, a router's after a leader
# change, must not open it again at the successor): those ended within this many seconds, as long as a router
# tries to deliver a notice (services/router/relay.py _NOTICE_WITHIN_S).
_ENDED_HANDED_OVER_S = 30.0
# The workflows placed last whose spend a leader hands over though their task is not open yet (their first step runs).
_NEW_WORKFLOWS_HANDED_OVER = 1_000
# The admission state a leader hands over, in bytes at most (half for slots, about 85 of 36-character ids): the state
# is one etcd value, rewritten every second, and etcd keeps thousands of past writes in memory (helper-133).
_ADMISSION_STATE_BYTES = 16 * 1024
# The hand-over state's open tasks and workflows' spend, about, in bytes of JSON, and the digests of ended tasks, by
# count (19 bytes each): 10,000 of each with 257-character ids made 5.7 MB, past etcd's 1.5 MiB for a request, and
# every write was refused. Well under it: the whole state is at most about 270 KB, and etcd keeps up to about 10,000
# past writes in memory (docs/etcd.md).
_OPEN_TASKS_STATE_BYTES = 128 * 1024
_WORKFLOW_SPEND_STATE_BYTES = 64 * 1024
_ENDED_DIGESTS_HANDED_OVER = 3_000
# A successor adds the whole fleet's cost from where its predecessor stopped counting to its own takeover,
# at the fleet's price then, up to this long: a longer gap is a control plane restarted on an old etcd,
# not a failover, and is left out (logged).
_MAX_FLEET_GAP_S = 600.0
_SUCCEEDED = scheduler_pb2.REQUEST_OUTCOME_SUCCEEDED
_LATE = scheduler_pb2.REQUEST_OUTCOME_LATE
_CANCELLED = scheduler_pb2.REQUEST_OUTCOME_CANCELLED
# How long a Place without a deadline is held while the leader's lease is unconfirmed.
_UNCONFIRMED_HOLD_S = 30.0
# A node that reported within this long is taken as alive when a placement excludes it (nodes report load every
# 250 ms by default: four reports missed).
_REPORTING_S = 1.0
# How long a kvindex replica that failed an overlap query is asked after the others.
_KVINDEX_AVOID_S = 5.0
# While every kvindex replica has failed lately, how often one is asked again (each placement in between is made
# without cache information, at once).
_KVINDEX_PROBE_S = 1.0
# Hedged overlap queries (a second replica asked while the first is slow) as retries are budgeted: at most a tenth
# of the queries over 10 s, beyond 10 in each 10 s. Where every replica is slow, hedging each query doubled the
# load on replicas that were slow already (helper-162).
_HEDGE_RATIO = 0.1
_HEDGE_MIN_PER_S = 1.0
# How many cold nodes one placement may see fail to load its model before it is refused.
_MAX_FAILED_LOADS = 2
# Of what is left of it, what a wait for an unconfirmed lease leaves for etcd to show a successor (a quarter
# at most).
_SUCCESSOR_WINDOW_S = 0.5
# Bounds of the observed TTFT / budget histogram: around 1, where a budget is met or missed (the SDK's default
# bounds, 0, 5, 10, 25, ..., put every ratio below 5 in one bucket).
TTFT_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


def place_ask(request: scheduler_pb2.PlaceRequest) -> PlaceAsk:
    """The Place request, checked (validation.check_place), as the pure core's ask."""
    return PlaceAsk(
        request=PlacementRequest(
            request_id=request.request_id,
            model=request.model,
            num_prompt_tokens=request.num_prompt_tokens,
            num_prompt_blocks=len(request.block_hashes),
            max_tokens=request.max_tokens,
            block_hashes=tuple(request.block_hashes),
            **context_fields(request.context),
        ),
        alternative_models=tuple(request.alternative_models),
        exclude=frozenset(request.exclude_node_ids),
        retry_cause=request.retry_cause,
        resumed=request.resumed,
        num_generated_tokens=request.num_generated_tokens,
        router_id=request.router_id,
        prompt_digest=request.prompt_digest,
    )


def _price(price_per_hour: float) -> float:
    """A registration's or a notice's price as the ledger counts it: one not finite, below 0 or above
    MAX_PRICE_PER_HOUR (a node agent checks its own flag; a registration from elsewhere may not) counts as nothing,
    not as a ledger poisoned for good."""
    return price_per_hour if 0 <= price_per_hour <= MAX_PRICE_PER_HOUR else 0.0


def node_spec(info: common_pb2.NodeInfo) -> NodeSpec:
    profiles = {m.name: p for m in info.models if (p := profile_from_proto(m)) is not None}
    # A step's token budget is the warm model's engine's (chunked prefill); 2048 until it registers one.
    warm = [profiles[m.name] for m in info.models if m.is_warm and m.name in profiles]
    return NodeSpec(
        node_id=info.node_id,
        address=info.address,
        gpu=info.gpu,
        price_per_hour=_price(info.price_per_hour),
        warm_models=frozenset(m.name for m in info.models if m.is_warm),
        kv_block_size=info.kv_block_size or 16,
        cold_models=frozenset(m.name for m in info.models if not m.is_warm),
        loading_models=frozenset(m.name for m in info.models if m.state == common_pb2.MODEL_STATE_LOADING),
        load_time_s={m.name: m.load_time_s for m in info.models},
        region=info.region,
        kv_blocks={m.name: m.kv_blocks for m in info.models},
        engine=info.engine,
        profiles=profiles,
        context_tokens={m.name: m.max_context_tokens for m in info.models},
        **({"max_num_batched_tokens": warm[0].max_num_batched_tokens} if warm else {}),
    )


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    service_names = ("baton.v1.Scheduler",)

    def __init__(self, config: SchedulerConfig, telemetry: Telemetry,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        # The whole fleet's cost is counted up to this time (clock's; None: not yet), and up to this wall-clock
        # time, which a successor compares with its own across hosts.
        self._wall_clock = wall_clock
        self._fleet_counted_at: float | None = None
        self._fleet_counted_unix = wall_clock()
        # A lapsed registration (etcd froze, or the node died) keeps a node only while it reports load
        # within a keep-alive interval; the view holds it for one TTL (docs/etcd.md).
        self._cluster = ClusterView(load_timeout_s=config.load_timeout_s, lapsed_silence_s=config.lease_ttl_s / 3)
        self._policy = make_policy(config.policy, config.prefill_load_scale, config.slo_ttft_ms, config.slo_tpot_ms)
        self._retry_budget = RetryBudget(config.retry_ratio, config.retry_min_per_s)
        self._decisions: deque[scheduler_pb2.PlacementDecision] = deque(maxlen=_DECISIONS_KEPT)
        self._ttft_ratio = telemetry.meter.create_histogram(
            "baton.scheduler.observed_ttft_ratio", description="clients' time to first token over their budget",
            explicit_bucket_boundaries_advisory=TTFT_RATIO_BUCKETS)
        self._admission = Admission(max_queued=config.max_queued, limits=parse_tenant_limits(config.tenant_limits),
                                    lease_s=config.admission_lease_s, is_registered=self._router_registered)
        self._gate = AdmissionGate(self._admission, self._is_saturated, telemetry.meter, clock,
                                   config.max_tenant_labels, lambda: self._role.is_leader)
        self._node_infos: dict[str, common_pb2.NodeInfo] = {}
        # (node, model, why) of the registered profiles that cannot be used, as last logged.
        self._unusable_profiles: set[tuple[str, str, str]] = set()
        # Nodes draining out of the fleet (SIGTERM), and the last load each reported with when (the clock's): no
        # candidates, but running their streams and paid for, so GetClusterState shows them (it left them out while
        # their streams ran on, helper-158).
        self._draining_infos: dict[str, common_pb2.NodeInfo] = {}
        self._draining_loads: dict[str, tuple[common_pb2.NodeLoad, float]] = {}
        # Nodes draining out of the fleet: no new work, but paid for until they leave.
        self._draining_price_per_hour = 0.0
        self._member = Membership(config.etcd, config.lease_ttl_s, config.etcd_credentials())
        self._nodes = PrefixView(self._member.client, etcd_keys.NODES, self._on_nodes_changed,
                                 grace_s=config.lease_ttl_s)
        # Set once the nodes have been read from etcd: before then a leader knows no model.
        self._nodes_read = asyncio.Event()
        # Tenant records (`baton tenants`): their limits feed admission; with --auth, their keys guard
        # what this scheduler tells about tenants.
        self._tenants = TenantDirectory(self._member.client, self._on_tenants_changed)
        self._kvindexes = ServiceDirectory(self._member.client, "kvindex", telemetry, grace_s=config.lease_ttl_s)
        # When each kvindex replica last failed an overlap query (this scheduler's clock).
        self._kvindex_failed_at: dict[str, float] = {}
        # When a replica that had failed lately was last asked again (this scheduler's clock).
        self._kvindex_probed_at = -math.inf
        self._hedges = RetryBudget(_HEDGE_RATIO, _HEDGE_MIN_PER_S)
        self._attempts = itertools.count(1)  # numbers this replica's Place calls
        # The routers registered: one gone holds no stream of a request id (its node streams ended with it).
        self._routers = PrefixView(self._member.client, etcd_keys.service_prefix("router"))
        # This process's mark on the hand-over states it writes (its instance id may outlive it, in a restart).
        self._incarnation = uuid.uuid4().hex
        # On gRPC health, "baton.v1.Scheduler" serves on the leader only: a standby answers Place only to name the
        # leader. "" says the process is up, on every replica.
        self.health = ServingNames(not_serving=self.service_names)
        self._role = LeaderRole(self._member.client, config.instance_id, config.address, config.lease_ttl_s,
                                self._hand_over_state, self._take_over_state,
                                on_leading=lambda leading: self.health.set(self.service_names[0], leading))
        self._placements = telemetry.meter.create_counter(
            "baton.scheduler.placements", description="placement decisions, by outcome"
        )
        self._planner = ModelPlanner(idle_swap_s=config.model_swap_idle_s, idle_unload_s=config.model_idle_unload_s)
        self._node_channels = ChannelPool(telemetry)
        self._loader = ModelLoader(self._node_channels, config.model_load_timeout_s, self._charge_load)
        self._tasks = TaskLedger(timeout_s=config.task_timeout_s)
        self._placer = Placer(self._cluster, self._policy, self._retry_budget, self._planner)
        # Price per hour of every node seen, kept after it leaves (its requests' ends come later).
        self._prices: dict[str, float] = {}
        self._nodes_changed = ChangeSignal()
        meter = telemetry.meter
        meter.create_observable_gauge("baton.scheduler.cost_per_successful_task", [self._observe_kpi], unit="USD",
                                      description="cost of the whole fleet (accounting=fleet, the headline) or of busy "
                                      "GPU time (accounting=busy, the floor) over the tasks that succeeded")
        meter.create_observable_gauge("baton.scheduler.tasks", [self._observe_tasks],
                                      description="tasks ended, by outcome, and open")
        # Always reported: which replica leads, and a standby's /metrics is not empty (its target_info too).
        meter.create_observable_gauge("baton.scheduler.is_leader",
                                      [lambda options: [Observation(1 if self._role.is_leader else 0)]],
                                      description="1 on the replica that leads, 0 on a standby")

    def register(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self, server)

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        config = self._config
        return [
            *self._member.hold_service("scheduler", config.instance_id, config.address),
            *self._role.loops(),
            self._gate.run(),
            self._plan_models(),
            self._nodes.run(),
            self._kvindexes.run(),
            self._routers.run(),
            self._tenants.run(),
        ]

    def _router_registered(self, router_id: str) -> bool:
        """Whether router_id is registered in etcd (so, until this scheduler has read who is: yes)."""
        return not self._routers.synced.is_set() or etcd_keys.service_key("router", router_id) in self._routers.items

    def _on_tenants_changed(self, keys: TenantKeys) -> None:
        limits = parse_tenant_limits(self._config.tenant_limits)
        for name, record in keys.records.items():
            limits[name] = TenantLimits(weight=record.weight, max_concurrency=record.max_concurrency,
                                        tokens_per_minute=record.tokens_per_minute)
        self._admission.set_limits(limits)
        self._gate.limits_changed()

    async def _caller_tenant(self, context: grpc.aio.ServicerContext, needs_admin: bool) -> str | None:
        """With --auth, the tenant whose key made this call (None: an administrator); PermissionDenied when
        needs_admin and it is not one. Without --auth, None: everything is shown."""
        if not self._config.auth:
            return None
        await self._tenants.ready(self._config.lease_ttl_s)
        record = self._tenants.tenant_from_metadata(context.invocation_metadata())
        if record.is_admin:
            return None
        if needs_admin:
            raise PermissionDenied(f"tenant {record.tenant!r}: the cluster state is for administrators "
                                   "(`baton tenants add NAME --admin`)")
        return record.tenant

    def _hand_over_state(self) -> dict[str, Any]:
        """What a successor needs that it cannot rebuild from etcd and node reports."""
        now = self._clock()
        return {
            "leader": self._config.instance_id,
            "incarnation": self._incarnation,
            "retry_budget": {"requests": self._retry_budget.num_requests(now),
                             "retries": self._retry_budget.num_retries(now)},
            "workflow_spent": self._workflows_handed_over(),
            "tasks": self._tasks.to_state(_WORKFLOWS_HANDED_OVER, now, _ENDED_HANDED_OVER_S, _OPEN_TASKS_STATE_BYTES,
                                          _ENDED_DIGESTS_HANDED_OVER),
            "fleet": {"counted_until_unix": self._fleet_counted_unix, "price_per_hour": self.fleet_price_per_hour()},
            "model_demand_age_s": self._planner.demand_state(now),
            "admission": {**self._admission.to_state(now, _ADMISSION_STATE_BYTES), "written_unix": self._wall_clock()},
        }

    def _workflows_handed_over(self) -> dict[str, float]:
        """The GPU spend of the workflows whose task is open, and of the last to be placed whose task has not ended
        (a first step still running opens none): those a step may yet come to. Not every recent one's: a workflow
        whose task ended has no step to come, and with them the state grew with the traffic (helper-134, 135)."""
        spent = self._policy.workflow_state()
        recent = list(spent)[-_NEW_WORKFLOWS_HANDED_OVER:]
        handed = {w: s for w, s in spent.items() if self._tasks.is_open(workflow_task(w))}
        handed.update((w, spent[w]) for w in recent if not self._tasks.has_ended(workflow_task(w)))
        kept, size = [], 0
        for workflow, amount in reversed(list(handed.items())[-_WORKFLOWS_HANDED_OVER:]):  # newest first, as fit
            size += json_str_bytes(workflow) + 28  # its key, its spend (a float's repr) and the separators
            if size > _WORKFLOW_SPEND_STATE_BYTES:
                break
            kept.append((workflow, amount))
        return dict(reversed(kept))

    def _take_over_state(self, state: dict[str, Any]) -> None:
        if state.get("incarnation") == self._incarnation:
            # Elected again (an etcd freeze ended every lease, its own too) with no other leader's state written
            # since its own: what it holds is newer than what it wrote (the endings it was told of after its last
            # write), so it keeps that. Restored, those endings were lost. The fleet was paid while it did not lead.
            self._count_leaderless_gap({"counted_until_unix": self._fleet_counted_unix,
                                        "price_per_hour": self.fleet_price_per_hour()})
            log.info("leading again on its own state (no other leader wrote one since)")
            return
        # Read whole before any is applied: a record that is not a state leaves them as they were (helper-183).
        budget = state["retry_budget"]
        requests, retries = int(budget["requests"]), int(budget["retries"])
        workflow_spent = {k: float(v) for k, v in state.get("workflow_spent", {}).items()}
        demand = {k: float(v) for k, v in state.get("model_demand_age_s", {}).items()}
        self._retry_budget.restore(requests, retries, self._clock())
        self._policy.restore_workflow_state(workflow_spent)
        self._planner.restore_demand(demand, self._clock())
        if "admission" in state:
            self._take_over_admission(state["admission"])
        if "tasks" in state:
            self._tasks.restore(state["tasks"], self._clock())
            self._count_leaderless_gap(state.get("fleet"))
        log.info("took over from %s: %s, %d workflows", state.get("leader"), budget,
                 len(state.get("workflow_spent", {})))

    def _take_over_admission(self, state: dict[str, Any]) -> None:
        """The predecessor's admission slots and tenants' tokens of the minute (Admission.restore); then this
        replica's own queue is held to them, as to lowered limits."""
        written = state.get("written_unix")
        gap_s = self._wall_clock() - float(written) if isinstance(written, int | float) else None
        try:
            taken = self._admission.restore(state, self._clock(), gap_s)
        except ValueError as exc:
            log.warning("not taking over the predecessor's admission state: %s", exc)
            return
        if gap_s is None or gap_s > self._admission.lease_s:
            log.warning("took over no admission slots: the predecessor's state was written %s ago, more than a lease "
                        "(%.0f s)", "an unknown time" if gap_s is None else f"{gap_s:.0f} s", self._admission.lease_s)
        elif taken:
            log.info("took over %d admission slots", taken)
        if state.get("left_out"):
            log.warning("the predecessor's admission state left out %s slots or tenants' token windows (over its %d "
                        "bytes): their routers' live reports give the slots back", state["left_out"],
                        _ADMISSION_STATE_BYTES)
        self._gate.limits_changed()

    def _on_nodes_changed(self, items: dict[str, bytes]) -> None:
        specs, infos, lapsed, draining_price, draining = [], {}, set(), 0.0, {}
        unusable = set()
        for key, value in items.items():
            info = parse_node_info(key, value)
            if info is None:
                continue
            for m in info.models:  # said once a registration, not again at every change of another node's
                if m.HasField("profile") and (problem := profile_problem(m.profile)):
                    unusable.add(entry := (info.node_id, m.name, problem))
                    if entry not in self._unusable_profiles:
                        log.warning("node %s registered a profile for %s that cannot be used (%s): placed as a node "
                                    "without one", shown(info.node_id), shown(m.name), problem)
            if info.draining:  # leaving cleanly: its streams finish, nothing new goes there; still paid for
                # Its streams' GPU time is charged at its price.
                price = self._prices[info.node_id] = _price(info.price_per_hour)
                if key not in self._nodes.lapsed:  # a draining node reports no load: lapsed, it is taken for gone
                    draining_price += price
                    draining[info.node_id] = info
                continue
            infos[info.node_id] = info
            specs.append(node_spec(info))
            if key in self._nodes.lapsed:
                lapsed.add(info.node_id)
        self._node_infos = infos
        self._unusable_profiles = unusable
        self._draining_price_per_hour = draining_price
        self._draining_infos = draining
        self._draining_loads = {n: load for n, load in self._draining_loads.items() if n in draining}
        self._cluster.set_nodes(specs, self._clock(), frozenset(lapsed))
        self._prices.update((spec.node_id, spec.price_per_hour) for spec in specs)
        self._gate.capacity_changed()  # a model may have turned warm
        self._nodes_read.set()
        self._nodes_changed.notify()

    def _max_context_tokens(self, model: str) -> int | None:
        """model's context as the nodes listing it register it (the longest, should they differ: what some router
        may have checked a request against); None when no node lists it."""
        return max((m.max_context_tokens for info in self._node_infos.values() for m in info.models
                    if m.name == model), default=None)

    def fleet_price_per_hour(self) -> float:
        """What the operator pays an hour for the GPUs the fleet lists (`GetClusterState`, `baton status`), busy or
        idle, and for those draining out of it. A node whose registration lapsed and that has gone silent is gone,
        though etcd's grace for its key has not ended (priced through that grace, a dead node was paid for about
        twice its lease)."""
        now = self._clock()
        listed = (s for s in self._cluster.nodes() if self._cluster.is_listed(s, now))
        return sum(s.spec.price_per_hour for s in listed) + self._draining_price_per_hour

    async def before_stop(self) -> None:
        await self._role.resign()
        await self._member.leave()

    async def close(self) -> None:
        await self._kvindexes.close()
        await self._node_channels.close()
        await self._member.close()

    async def _overlap(self, model: str, block_hashes: Sequence[int]) -> dict[str, int] | None:
        """Cached leading blocks per node, from any kvindex replica, within --kvindex-timeout-s in all; None when none
        answered in time (the request is placed without cache information, and its decision says so)."""
        if not block_hashes:
            return {}
        # A match is a run of leading blocks: a longer prompt's is cut short there, not refused by the kvindex.
        request = kvindex_pb2.OverlapRequest(model=model, block_hashes=block_hashes[:self._config.max_overlap_blocks])
        now = self._clock()
        addresses = self._kvindexes.addresses()
        for gone in self._kvindex_failed_at.keys() - set(addresses):  # (replicas come and go on fresh ports)
            del self._kvindex_failed_at[gone]
        # A replica that failed lately is asked last: a frozen one cost every placement --kvindex-timeout-s for as
        # long as it stayed registered (helper-129). While every one has, the one that failed longest ago is asked
        # again, at most once a _KVINDEX_PROBE_S; the placements in between are made without cache information.
        lately = {a for a in addresses if self._kvindex_failed_at.get(a, -math.inf) > now - _KVINDEX_AVOID_S}
        order = sorted(addresses, key=lambda a: a in lately)
        if lately and lately == set(addresses):
            if now - self._kvindex_probed_at < _KVINDEX_PROBE_S:
                return None
            order = [min(addresses, key=lambda a: self._kvindex_failed_at[a])]
            self._kvindex_probed_at = now
        # The timeout is the query's, not each replica's: two frozen replicas cost every placement twice it for as
        # long as they stayed registered (helper-160). The next replica is asked when the one asked failed, and too
        # (hedged) when it has not answered within a fifth of the timeout and the hedge budget allows: the first
        # answer wins.
        self._hedges.record_request(now)
        loop = asyncio.get_running_loop()
        end = loop.time() + self._config.kvindex_timeout_s
        hedge_s = self._config.kvindex_timeout_s / 5
        asking: dict[asyncio.Task[kvindex_pb2.OverlapResponse], str] = {}
        try:
            while (order or asking) and (remaining := end - loop.time()) > 0:
                if order and (not asking or self._hedges.try_retry(self._clock())):
                    address = order.pop(0)
                    stub = kvindex_pb2_grpc.KVIndexStub(self._kvindexes.channel(address))
                    asking[asyncio.ensure_future(stub.QueryOverlap(request, timeout=remaining))] = address
                done, _ = await asyncio.wait(asking, timeout=min(hedge_s, remaining) if order else remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                answer: kvindex_pb2.OverlapResponse | None = None
                for task in done:  # every one read, so that none's failure goes unretrieved
                    address = asking.pop(task)
                    try:
                        reply = task.result()
                    except grpc.aio.AioRpcError as exc:
                        self._kvindex_failed_at[address] = self._clock()
                        log.warning("kvindex %s overlap query failed: %s", address, exc.code().name)
                        continue
                    self._kvindex_failed_at.pop(address, None)
                    answer = answer or reply
                if answer is not None:
                    for slow in asking.values():  # outrun by a later one: asked after the others for a while
                        self._kvindex_failed_at[slow] = self._clock()
                    return dict(answer.matched_blocks)
            for address in asking.values():  # asked, and no answer within the query's time
                self._kvindex_failed_at[address] = self._clock()
                log.warning("kvindex %s overlap query failed: no answer within %g s", address,
                            self._config.kvindex_timeout_s)
        finally:
            for task in asking:
                task.cancel()
        return None

    async def Place(
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        plan: Plan | None = None
        is_placed = admitted = False
        called_at = self._clock()
        trace.get_current_span().set_attribute("baton.request_id", request.request_id)
        attempt = next(self._attempts)  # which call admitted it, if one later call of its id shares its slot
        failed_loads: set[str] = set()  # cold nodes that failed to load its model
        # The metric's label: a cause check_place refuses is counted as one "unknown", not under its own value.
        retry = request.retry_cause if not request.retry_cause or request.retry_cause in RETRY_CAUSES else "unknown"
        try:
            check_place(request, self._max_context_tokens(request.model), self._config.max_id_len)
            if await self._wait_for_nodes(context.time_remaining()):
                # Checked again: the model's context, which a request is held to, came with the nodes.
                check_place(request, self._max_context_tokens(request.model), self._config.max_id_len)
            ask = place_ask(request)
            await self._role.wait_if_taking_over(self._config.lease_ttl_s)
            await self._wait_for_election(context.time_remaining())
            await self._confirm_leadership(context)
            self._gate.router_seen(request.router_id, request.router_incarnation)
            changing = self._loader.changing_nodes
            while True:
                plan = self._placer.start(ask, self._clock(), changing, self._admission.limits_refusal)
                if plan.limits_refusal is not None:
                    # No node has its model warm, and its tenant's limits refuse it: refused now, as the gate would
                    # after a wait for a load it did not ask for (a 503 then, helper-139).
                    raise self._gate.refuse(ticket_of(ask, plan.started_at, attempt), plan.limits_refusal)
                waited_s = 0.0
                if not plan.has_candidates and not plan.is_retry:
                    # The models are only on busy nodes' disks: the planner makes room; wait for it.
                    waited_s = await self._wait_for_candidates(plan, context.time_remaining())
                if not plan.has_candidates:
                    raise self._placer.no_candidates(plan, waited_s)
                answers = {m: await self._overlap(m, request.block_hashes)
                           for m, nodes in plan.candidates.items() if nodes}
                overlaps = {m: answer or {} for m, answer in answers.items()}
                # Placed without cache information, the decision says so: its zeros looked like the kvindex's own
                # answer, a repeated conversation moving between nodes for no reason shown (helper-160).
                blind = "" if None not in answers.values() else (
                    "no kvindex is registered: placed without cache information" if not self._kvindexes.addresses()
                    else f"no kvindex answered within {self._config.kvindex_timeout_s:g} s (or every one failed "
                    "lately): placed without cache information")
                options = self._placer.options(plan, overlaps.__getitem__)
                admission = self._placer.ticket(plan, options, self._clock(), attempt,
                                                cache_known=None not in answers.values())
                waited = False
                if admission is not None:
                    waited = await self._gate.enter(*admission)
                    admitted = True
                # Leadership is checked last, with no await between the check and the decision.
                while not (revision := self._role.leading_revision()):
                    await self._confirm_leadership(context)
                    waited = True
                if waited:
                    # It waited: place it on the fleet as it is now, with no await from here on.
                    options = self._placer.after_queueing(plan, options, self._clock(), changing)
                placed = self._placer.decide(options, self._clock())
                decision, model = placed.decision, placed.request.model
                self._record_decision(placed.request, decision, revision,
                                      "; ".join(n for n in (plan.unpredicted, blind) if n), ask,
                                      self._clock() - called_at)
                if placed.is_cold:
                    try:
                        await self._load_for(request, decision, model, context.time_remaining())
                    except _LoadFailed as failure:
                        # The node could not load it (it died mid-load, say): the request ran nowhere, so it is
                        # placed again without that node while its call has time. Refused, its client's retries
                        # went back to the dead node, a candidate until its lease ended (helper-126).
                        if len(failed_loads) >= _MAX_FAILED_LOADS:
                            raise
                        log.warning("request %s: %s; placing it again without that node", request.request_id,
                                    failure)
                        failed_loads.add(failure.node_id)
                        ask = dataclasses.replace(ask, exclude=ask.exclude | {failure.node_id})
                        continue
                self._gate.placed(request.request_id)
                is_placed = True
                break
        except BatonError as error:
            self._placements.add(1, {"outcome": error.code.name, "retry": retry})
            # Budgets refused by the placement core, before the gate or after its queue: counted as the gate's are.
            if isinstance(error, Unmeetable):
                self._gate.refused(f"{error.field} no node could meet", request.context.priority)
            elif isinstance(error, (DeadlineOutOfReach, LeftOutOfReach)) and not request.retry_cause:
                # (A move ended so was admitted once already: not a refusal of admission's.)
                self._gate.refused("deadline cannot be met", request.context.priority)
            await abort(context, error)
        finally:
            if plan is not None and not is_placed:  # refused, failed or cancelled once the budget was charged
                self._placer.abandon(plan)
            if admitted and not is_placed:
                # It never ran (its model's load failed, its caller went away, leadership was lost): its slot is
                # freed and its tokens given back, as far as this call holds them (Admission.end). (A cold node's
                # failed load kept the slot for the next try, helper-131.)
                self._gate.finished(request.request_id, holder=request.router_id, ran=False, attempt=attempt)
        self._placements.add(1, {"outcome": "OK", "retry": retry})
        log.debug("placed %s on %s (cost %.1f, %d cached blocks)", request.request_id, decision.node_id,
                  decision.cost, decision.matched_blocks)
        return scheduler_pb2.Placement(
            node_id=decision.node_id,
            address=decision.address,
            matched_blocks=decision.matched_blocks,
            cost=decision.cost,
            model=model,
        )

    async def _load_for(self, request: scheduler_pb2.PlaceRequest, decision: Decision, model: str,
                        remaining_s: float | None) -> None:
        """A cold node serves nothing until warm: load model there and wait for it, within the request's time.
        _LoadFailed if the node could not load it (Place tries another); Unavailable if it takes longer."""
        # Its answer must reach the router within the call: after it, the router took the leader for lost.
        usable = usable_s(remaining_s)
        try:
            await within(self._loader.ensure_warm(decision.node_id, decision.address, model,
                                                  f"placed {request.request_id} there"), usable)
        except TimeoutError:
            raise Unavailable(f"loading {model} on node {decision.node_id} takes longer than the request's "
                              f"{remaining_s:.1f} s left; the load goes on") from None
        except Unavailable as exc:
            # Its caller places it again elsewhere, on the slot it holds (released and admitted again, it was charged
            # twice, and another request of its tenant could take the slot meanwhile, helper-131).
            raise _LoadFailed(str(exc), decision.node_id) from None

    async def _wait_for_candidates(self, plan: Plan, time_remaining: float | None) -> float:
        """Until a node has plan's first model warm or loading, within the request's time (less what the refusal
        needs to reach its caller: waited to the end, the caller saw its own timeout and took this leader for lost,
        waiting --leader-wait-s more for another, helper-126) and the load timeout; at once if no live node even has
        it on disk. The seconds it waited."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        usable = usable_s(time_remaining)
        deadline = began + min(math.inf if usable is None else usable, self._config.model_load_timeout_s)
        model = plan.models[0]
        while not plan.has_candidates:
            now = self._clock()
            live = [s for s in self._cluster.nodes() if self._cluster.is_live(s, now)]
            if not any(model in s.spec.cold_models for s in live):
                break
            # Warm where the request will not go (its router avoids those nodes) and still reporting: the planner
            # loads for demand the warm nodes cannot take, not for this, so waiting held it to its deadline, and its
            # router had no time left to ask again without its exclusions. One that went silent may have died: its
            # lease ends, and the planner loads the model elsewhere for the request, as before.
            if any(model in s.spec.warm_models and s.spec.node_id in plan.ask.exclude
                   and s.reported_at is not None and now - s.reported_at <= _REPORTING_S for s in live):
                break
            # Woken by a change of the fleet, and each _REPORTING_S (load reports do not signal it): an excluded warm
            # node that reports again is found so.
            changed = self._nodes_changed.since_now()
            left_s = deadline - loop.time()
            if left_s <= 0:
                break
            await wait_or_timeout(changed, min(left_s, _REPORTING_S))
            self._placer.refresh(plan, self._clock(), self._loader.changing_nodes)
        return loop.time() - began

    async def _plan_models(self) -> None:
        """While leading: load models short of warm capacity, unload idle ones; end silent tasks; count the
        whole fleet's cost."""
        self._fleet_counted_at = self._clock()
        while True:
            await asyncio.sleep(self._config.model_plan_interval_s)
            now = self._clock()
            if not self._role.is_leader:
                self._planner.release()  # a successor plans afresh; on return, so does this one
                self._fleet_counted_at = now  # the leader counts this interval
                continue
            # Only while leading: no live report touches a standby's tasks, and one elected again keeps its own ledger.
            self._tasks.expire(now)
            self._count_fleet_time()
            reserved = self._planner.reservations()
            actions = self._planner.plan(self._cluster, now, self._loader.busy_nodes(), self._loader.loading_models())
            for node_id, model in self._planner.reservations().items() - reserved.items():
                log.info("node %s reserved to be swapped to %s: it gets nothing new until its requests end", node_id,
                         model)
            for node_id, model in reserved.items() - self._planner.reservations().items():
                log.info("node %s no longer reserved for %s", node_id, model)
            by_node: dict[str, list[ModelAction]] = {}
            for action in actions:
                by_node.setdefault(action.node_id, []).append(action)
            for node_id, node_actions in by_node.items():
                status = self._cluster.get(node_id)
                if status is not None:
                    self._loader.start(status.spec.address, node_actions)

    def _count_fleet_time(self) -> None:
        """The whole fleet's cost since it was last counted, at its price now (the leader, each interval)."""
        now = self._clock()
        if self._fleet_counted_at is not None:
            self._tasks.add_fleet_time(max(0.0, now - self._fleet_counted_at), self.fleet_price_per_hour())
        self._fleet_counted_at, self._fleet_counted_unix = now, self._wall_clock()

    def _count_leaderless_gap(self, fleet: dict[str, float] | None) -> None:
        """On takeover: the fleet was paid while no leader counted it, from where the predecessor stopped (its
        wall clock) to now, at the price it last saw; from now on this leader counts."""
        self._fleet_counted_at, self._fleet_counted_unix = self._clock(), self._wall_clock()
        if not fleet:  # a state written before the gap was handed over
            return
        gap_s = self._fleet_counted_unix - float(fleet["counted_until_unix"])
        if 0.0 <= gap_s <= _MAX_FLEET_GAP_S:
            self._tasks.add_fleet_time(gap_s, float(fleet["price_per_hour"]))
        else:
            log.warning("not counting the fleet's cost for a %.0f s gap since the last leader counted it", gap_s)

    def _is_saturated(self) -> bool:
        """From live signals: queue depth and KV use reported by every node (llm-d's saturation).

        Observed TTFT against budgets is recorded (baton.scheduler.observed_ttft_ratio) but does not
        halt dispatch: in the simulator that cut goodput at 3x load from 7.0 to 4.5 requests/s.
        """
        return self._placer.is_saturated(self._clock())

    async def Finished(
        self, request: scheduler_pb2.FinishedRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.FinishedAck:
        try:
            check_finished(request, self._max_context_tokens(request.model), self._config.max_id_len)
        except BatonError as error:
            await abort(context, error)
        await self._role.wait_if_taking_over(self._config.lease_ttl_s)  # not to be overwritten by the hand-over
        # A standby's ledger is replaced when it takes over, so the notice would be lost there: as for Place, wait
        # out an election under way or a late keep-alive (within the call's time), then refuse, naming the leader.
        await self._wait_for_election(context.time_remaining())
        try:
            await self._confirm_leadership(context)
        except BatonError as error:
            await abort(context, error)
        self._gate.finished(request.request_id, request.another_stream_live, request.router_id)
        ctx = request.context
        if request.ttft_ms and ctx.ttft_budget_ms:
            self._ttft_ratio.record(request.ttft_ms / ctx.ttft_budget_ms)
        if request.outcome in (_SUCCEEDED, _LATE) and request.model:  # ran to its end: a length to learn
            self._placer.observe_finished(request.model, request.num_output_tokens)
        if request.outcome:
            # At the price this leader saw the node registered with, else at the router's (a node that left before
            # this leader began), else at nothing.
            cost = sum(ms / 3_600_000 * self._prices.get(node, _price(request.price_per_hour_by_node.get(node, 0.0)))
                       for node, ms in request.gpu_ms_by_node.items() if math.isfinite(ms) and ms > 0)
            task = (workflow_task(ctx.workflow_id), ctx.step, ctx.total_steps) if ctx.workflow_id \
                else (request_task(request.request_id), 1, 1)
            # Answered late (its client has the answer; not while another stream of its id runs, which may yet
            # succeed): a task whose every step is answered has failed at once.
            self._tasks.record(*task, cost, request.outcome == _SUCCEEDED, self._clock(),
                               answered=request.outcome == _LATE and not request.another_stream_live,
                               cancelled=request.outcome == _CANCELLED)
        return scheduler_pb2.FinishedAck()

    async def ReportLiveRequests(
        self, request: scheduler_pb2.LiveRequests, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LiveRequestsAck:
        try:
            check_live_requests(request, self._config.max_live_ids, self._config.max_id_len)
        except BatonError as error:
            await abort(context, error)
        await self._role.wait_if_taking_over(self._config.lease_ttl_s)
        if not self._role.has_taken_over():
            # etcd showed this replica the leader to the router before its own campaign returned (its predecessor's
            # key had just gone): dropped then, the report gave no slot to the requests running with none here, and
            # their tenant went past its limit until the next report (helper-136: five more, in 1 of 19 failovers).
            # Nor while it restores its predecessor's state, which would replace the slots the report gave
            # (helper-137). A standby's stray report waits as long, within the call.
            remaining_s = usable_s(context.time_remaining())
            await wait_or_timeout(self._role.elected, self._config.lease_ttl_s if remaining_s is None
                                  else min(self._config.lease_ttl_s, remaining_s))
        num_held = 0
        if self._role.is_leader:
            self._gate.router_seen(request.router_id, request.router_incarnation)
            num_held = self._gate.renew(request.request_ids, request.router_id, request.tenants,
                                        request.prompt_digests)
            # A long step (or a retry of a lone request, whose task is its id) does not time its task out.
            self._tasks.touch([*map(workflow_task, request.workflow_ids), *map(request_task, request.request_ids)],
                              self._clock())
        return scheduler_pb2.LiveRequestsAck(num_held=num_held,
                                             lease_ms=int(self._config.admission_lease_s * 1000))

    def _charge_load(self, node_id: str, model: str) -> None:
        """A model load the leader ordered: its modelled GPU time, at the node's price, is paid for."""
        status = self._cluster.get(node_id)
        if status is not None:
            seconds = status.spec.load_time_s.get(model, 0.0)
            self._tasks.add_overhead(seconds / 3600 * status.spec.price_per_hour)

    def _task_stats(self) -> scheduler_pb2.TaskStats:
        stats = self._tasks.stats()
        return scheduler_pb2.TaskStats(tasks_succeeded=stats.succeeded, tasks_failed=stats.failed,
                                       tasks_open=stats.open, ended_cost_usd=stats.ended_cost_usd,
                                       cost_per_successful_task_usd=stats.cost_per_successful_task,
                                       model_load_cost_usd=stats.overhead_usd, fleet_cost_usd=stats.fleet_cost_usd,
                                       fleet_cost_per_successful_task_usd=stats.fleet_cost_per_successful_task)

    def _observe_kpi(self, options: CallbackOptions) -> list[Observation]:
        if not self._role.is_leader or not self._tasks.succeeded:
            return []
        stats = self._tasks.stats()
        return [Observation(stats.fleet_cost_per_successful_task, {"accounting": "fleet"}),
                Observation(stats.cost_per_successful_task, {"accounting": "busy"})]

    def _observe_tasks(self, options: CallbackOptions) -> list[Observation]:
        if not self._role.is_leader:
            return []
        stats = self._tasks.stats()
        return [Observation(stats.succeeded, {"outcome": "succeeded"}),
                Observation(stats.failed, {"outcome": "failed"}), Observation(stats.open, {"outcome": "open"})]

    async def _confirm_leadership(self, context: grpc.aio.ServicerContext) -> None:
        """Return while this replica leads on a live lease; FailedPrecondition, naming the leader, otherwise.

        A leader whose lease is unconfirmed (a keep-alive late, etcd unreachable) holds the call
        until a refresh confirms it or etcd says it lost, within the caller's time.
        """
        remaining = usable_s(context.time_remaining())
        # Not all of it: if the lease was lost, what is left is for etcd to show the successor the refusal names.
        hold_s = _UNCONFIRMED_HOLD_S if remaining is None else remaining - min(_SUCCESSOR_WINDOW_S, remaining / 4)
        if not await self._role.wait_confirmed(hold_s):
            # Just deposed, this replica's view may still show itself: name the successor once it shows.
            remaining = usable_s(context.time_remaining())
            bound_s = self._config.lease_ttl_s if remaining is None else min(self._config.lease_ttl_s, remaining)
            await self._role.wait_successor_shown(bound_s)
            raise self._not_leader()

    def _record_decision(self, placement: PlacementRequest, decision: Decision, leader_revision: int,
                         note: str = "", ask: PlaceAsk | None = None, waited_s: float = 0.0) -> None:
        """Keep the decision, its per-axis terms and what could not be predicted (note: admission's) for
        GetRecentDecisions and the trace span; for a move (ask's retry cause), why and the nodes it avoided, and how
        long the call waited before it (a move's decision looked like a first placement, and one made after a
        wait for a model's load showed only the fleet at its end, helper-158)."""
        terms = [
            scheduler_pb2.CandidateTerms(
                node_id=t.node_id, gpu=t.gpu, cached_tokens=t.cached_tokens, predicted_ttft_ms=t.ttft_ms,
                predicted_tpot_ms=t.tpot_ms, cost=t.cost, success=t.success, workflow_spent=t.workflow_spent,
                has_kv_room=t.has_kv_room, score=t.score,
                warm=t.warm, load_ms=t.load_ms, kv_free_blocks=t.kv_free_blocks, at_risk=t.at_risk, model=t.model)
            for t in self._policy.last_terms()
        ]
        self._decisions.append(scheduler_pb2.PlacementDecision(
            request_id=placement.request_id, node_id=decision.node_id, score=decision.cost, model=placement.model,
            context=context_of(placement), decided_at_ms=int(time.time() * 1000), candidates=terms,
            leader_revision=leader_revision, fallback="; ".join(n for n in (decision.fallback, note) if n),
            retry_cause=ask.retry_cause if ask is not None else "",
            excluded_node_ids=sorted(ask.exclude) if ask is not None else (), waited_ms=round(waited_s * 1000)))
        span = trace.get_current_span()
        span.set_attribute("baton.placement.node", decision.node_id)
        span.set_attribute("baton.placement.model", placement.model)
        span.set_attribute("baton.placement.score", decision.cost)
        span.set_attribute("baton.placement.cached_blocks", decision.matched_blocks)
        if ask is not None and ask.retry_cause:
            span.set_attribute("baton.placement.retry_cause", ask.retry_cause)
        if decision.fallback:
            span.set_attribute("baton.placement.fallback", decision.fallback)
        several_models = len({t.model for t in terms}) > 1
        for t in terms:
            span.set_attribute(
                f"baton.candidate.{t.node_id}" + (f".{t.model}" if several_models else ""),
                f"gpu={t.gpu} ttft_ms={t.predicted_ttft_ms:.0f} tpot_ms={t.predicted_tpot_ms:.1f} "
                f"cost={t.cost:.6f} success={t.success:.3f} spent={t.workflow_spent:.6f} "
                f"at_risk={t.at_risk:.6f} warm={t.warm} load_ms={t.load_ms:.0f} kv_free={t.kv_free_blocks} "
                f"kv_room={t.has_kv_room} score={t.score:.6f}")

    async def GetRecentDecisions(
        self, request: scheduler_pb2.GetRecentDecisionsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RecentDecisions:
        try:
            tenant = await self._caller_tenant(context, needs_admin=False)
            if request.limit < 0:
                raise InvalidArgument("limit", request.limit, "must be 0 (all kept) or positive")
        except BatonError as error:
            await abort(context, error)
        newest = [d for d in reversed(self._decisions) if tenant is None or d.context.tenant == tenant]
        if request.limit > 0:
            newest = newest[: request.limit]
        if tenant is not None:  # without the candidates' terms and the score: they tell the nodes' load, others' work
            newest = [_without_terms(d) for d in newest]
        return scheduler_pb2.RecentDecisions(policy=self._config.policy, decisions=newest)

    async def _wait_for_election(self, remaining_s: float | None) -> None:
        """While etcd shows no leader at all, wait up to a TTL for this replica to be elected.

        A router sends Place to the replica it saw lead. When a frozen etcd resumes, every election
        lease has lapsed, the leader's too: it steps down and campaigns again, and for that moment no
        leader exists. Refused then, the router would wait for a different leader in vain."""
        if self._role.is_leader or self._role.leader() is not None:
            return
        remaining_s = usable_s(remaining_s)
        wait_s = self._config.lease_ttl_s if remaining_s is None else min(self._config.lease_ttl_s, remaining_s)
        await wait_or_timeout(self._role.elected, wait_s)

    async def _wait_for_nodes(self, remaining_s: float | None) -> bool:
        """Until this replica has read the nodes from etcd, within the call and a TTL; Unavailable after; whether it
        waited. A leader elected before its first listing came refused every model NOT_FOUND, "no registered node has
        it"."""
        if self._nodes_read.is_set() or self._cluster.nodes():  # a view with nodes in it was read
            return False
        remaining_s = usable_s(remaining_s)
        wait_s = self._config.lease_ttl_s if remaining_s is None else min(self._config.lease_ttl_s, remaining_s)
        if not await wait_or_timeout(self._nodes_read, wait_s):
            raise Unavailable(f"{self._config.instance_id} has not read the nodes from etcd within {wait_s:.1f} s "
                              "(is etcd reachable?); retry")
        return True

    def _not_leader(self) -> FailedPrecondition:
        leader = self._role.leader()
        if leader is None:
            return FailedPrecondition(f"{self._config.instance_id} is a standby and no leader is elected yet")
        leader_id, address = leader
        if leader_id == self._config.instance_id:  # etcd's deletion of our key has yet to reach the view
            return FailedPrecondition(f"{self._config.instance_id} does not lead: its election lease ended; "
                                      "no successor is known yet")
        return FailedPrecondition(f"{self._config.instance_id} is a standby; the leader is {leader_id} at {address}",
                                  metadata=((LEADER_KEY, address),))

    async def ReportLoad(
        self, request_iterator: AsyncIterator[common_pb2.NodeLoad], context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportLoadAck:
        async for load in request_iterator:
            try:
                check_load(load)
            except BatonError as error:  # the stream ends; the node's reports before it stand
                log.warning("refused a load report: %s", error)
                await abort(context, error)
            if load.node_id in self._draining_infos:
                self._draining_loads[load.node_id] = (load, self._clock())
                continue
            self._cluster.report_load(load.node_id, load_from_proto(load), self._clock())
            self._gate.capacity_changed()
        return scheduler_pb2.ReportLoadAck()

    async def GetClusterState(
        self, request: scheduler_pb2.GetClusterStateRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ClusterState:
        try:
            await self._caller_tenant(context, needs_admin=True)
        except BatonError as error:
            await abort(context, error)
        now = self._clock()
        state = scheduler_pb2.ClusterState(scheduler_id=self._config.instance_id)
        leader = self._role.leader()
        if leader is not None:
            state.leader_id, state.leader_address = leader
        state.leading_revision = self._role.leading_revision()
        if state.leading_revision:
            state.tasks.CopyFrom(self._task_stats())
            state.model_actions.extend(reversed(self._loader.log))
            state.queued_by_tenant.update(self._admission.queued_by_tenant())
        # A node draining for a swap sat unused with nothing saying why (helper-126).
        reserved = self._planner.reservations() if state.leading_revision else {}
        for status in self._cluster.nodes():
            if not self._cluster.is_listed(status, now):
                continue  # lapsed and silent: gone, though its grace has not ended
            info = self._node_infos.get(status.spec.node_id)
            state.nodes.append(
                scheduler_pb2.NodeState(
                    info=info,
                    load=load_to_proto(status.spec.node_id, status.load),
                    load_age_ms=int((now - status.reported_at) * 1000) if status.reported_at is not None else -1,
                    reserved_for_model=reserved.get(status.spec.node_id, ""),
                )
            )
        for node_id, info in sorted(self._draining_infos.items()):  # info.draining says so
            load, reported_at = self._draining_loads.get(node_id, (common_pb2.NodeLoad(node_id=node_id), None))
            state.nodes.append(scheduler_pb2.NodeState(
                info=info, load=load, load_age_ms=int((now - reported_at) * 1000) if reported_at is not None else -1))
        return state


def _without_terms(decision: scheduler_pb2.PlacementDecision) -> scheduler_pb2.PlacementDecision:
    """decision as a tenant sees it: where its request went and why in words, not the nodes' figures (a tenant read
    another's load in the free KV blocks and predicted TTFTs of its own decisions, helper-164)."""
    seen = scheduler_pb2.PlacementDecision()
    seen.CopyFrom(decision)
    seen.ClearField("candidates")
    seen.ClearField("score")
    return seen


class _LoadFailed(Unavailable):
    """A cold node chosen for a request did not load its model (it failed, or was busy with another)."""

    def __init__(self, message: str, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id

