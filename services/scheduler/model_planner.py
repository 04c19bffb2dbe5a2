"""Which models to load where, and which to unload: the scheduler's model placement. Pure.

Every round the leader asks for a plan. A model is short of warm capacity when someone asked for
it lately and either no live node has it warm or every node that has it is saturated (llm-d's
saturation: queue depth and KV use). Then, if no load of it is under way, it is loaded on one node
that has it on local disk: a node with a free GPU first, otherwise one whose warm model has been
idle for a while and stays warm elsewhere (or nobody asked for it lately) — that one is unloaded
first. A load under way is not counted as capacity: a cold node serves nothing until warm.

When no node can be given up — a placement that spreads work keeps every node of the other model
busy, so none is ever idle for long — the planner reserves the least loaded node of a model that
stays warm elsewhere and whose other nodes are not saturated: placement sends it nothing new
(`reserved_nodes`), and once its requests have ended it is swapped over. A reservation is
released when the model is no longer short.

A warm model idle for `idle_unload_s` on a node is unloaded when another node keeps it warm, so
idle GPUs are free for the models that need them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.fleet import ClusterView, NodeStatus, saturation


@dataclass(frozen=True)
class ModelAction:
    kind: str  # "load" or "unload"
    node_id: str
    model: str
    reason: str


class ModelPlanner:
    def __init__(self, demand_window_s: float = 60.0, idle_swap_s: float = 10.0, idle_unload_s: float = 0.0,
                 saturation: float = 1.0) -> None:
        self.demand_window_s = demand_window_s
        self.idle_swap_s = idle_swap_s
        self.idle_unload_s = idle_unload_s
        self.saturation = saturation
        self._last_demand: dict[str, float] = {}
        # Nodes draining for a swap: node id → the model it will be given.
        self._reserved: dict[str, str] = {}

    def reserved_nodes(self) -> frozenset[str]:
        """Nodes draining for a swap: placement sends them nothing new."""
        return frozenset(self._reserved)

    def reservations(self) -> dict[str, str]:
        """Node id → the model it drains to be swapped to."""
        return dict(self._reserved)

    def note_demand(self, model: str, now: float) -> None:
        """A request asked for model (placed or not)."""
        self._last_demand[model] = now

    def demand_state(self, now: float) -> dict[str, float]:
        """What a successor leader needs: how long ago each model still wanted was last asked for (clocks differ
        between hosts). Without it a successor took every model for unwanted and swapped out the only warm copy of
        one in use (helper-126)."""
        return {model: now - last for model, last in self._last_demand.items() if self._wanted(model, now)}

    def restore_demand(self, ages_s: dict[str, float], now: float) -> None:
        """A predecessor's demand_state; a later demand noted here already wins."""
        for model, age_s in ages_s.items():
            self._last_demand[model] = max(self._last_demand.get(model, -math.inf), now - age_s)

    def _wanted(self, model: str, now: float) -> bool:
        last = self._last_demand.get(model)
        return last is not None and now - last <= self.demand_window_s

    def release(self) -> None:
        """Forget every reservation (a leader stepping down: its successor plans afresh)."""
        self._reserved.clear()

    def plan(self, view: ClusterView, now: float, busy_nodes: frozenset[str] = frozenset(),
             loading: frozenset[str] = frozenset()) -> list[ModelAction]:
        """Actions for this round. Nodes in busy_nodes have an action under way and are left alone;
        models in loading are being loaded already (as ordered, before etcd shows it)."""
        actions: list[ModelAction] = []
        taken = set(busy_nodes)
        nodes = [s for s in view.nodes() if view.is_live(s, now)]
        # A reservation whose node could no longer go (its model lost its other copies, or they are
        # saturated) is dropped before anything is planned on it.
        self._reserved = {n: m for n, m in self._reserved.items()
                          if (s := view.get(n)) is not None and s in nodes and n not in taken
                          and self._can_drain(s, nodes, now)}
        short: set[str] = set()
        for model in view.models():
            if not self._wanted(model, now):
                continue
            if model in loading or any(model in s.spec.loading_models for s in nodes):
                short.add(model)  # a load under way is not capacity: its reservation stays
                continue
            warm = [s for s in nodes if model in s.spec.warm_models and s.spec.node_id not in self._reserved]
            if warm:
                level = saturation(warm)
                if level < self.saturation:
                    continue
                reason = f"{len(warm)} warm node(s) saturated ({level:.2f})"
            else:
                reason = "no node has it warm"
            short.add(model)
            target = self._target(model, nodes, taken, now)
            if target is None:
                self._reserve(model, nodes, taken, now)
                continue
            self._reserved.pop(target.spec.node_id, None)
            taken.add(target.spec.node_id)
            for victim in sorted(target.spec.warm_models):
                actions.append(ModelAction("unload", target.spec.node_id, victim, f"make room for {model}"))
            actions.append(ModelAction("load", target.spec.node_id, model, reason))
        self._reserved = {n: m for n, m in self._reserved.items() if m in short and n not in taken}
        if self.idle_unload_s > 0:
            copies = {m: sum(m in s.spec.warm_models for s in nodes) for m in view.models()}
            for action in actions:  # the swaps' victims are going already
                if action.kind == "unload":
                    copies[action.model] -= 1
            for status in nodes:
                if status.spec.node_id in taken or status.idle_s(now) < self.idle_unload_s:
                    continue
                for model in sorted(status.spec.warm_models):
                    if copies[model] > 1:  # never the last warm copy
                        copies[model] -= 1
                        actions.append(ModelAction("unload", status.spec.node_id, model,
                                                   f"idle {status.idle_s(now):.0f} s; warm elsewhere"))
        return actions

    def _target(self, model: str, nodes: list[NodeStatus], taken: set[str], now: float) -> NodeStatus | None:
        """A node to load model on: free GPUs first, then idle ones whose models can go; quickest load first."""
        def can_give_up(status: NodeStatus) -> bool:
            if status.spec.loading_models:
                return False
            if self._reserved.get(status.spec.node_id) == model:
                return not _in_flight(status)  # drained for this swap (still drainable: checked this round)
            if status.idle_s(now) < self.idle_swap_s:
                return False
            # Warm elsewhere on a node this round leaves as it is: two models short at once each swapped out one of
            # the two warm copies of a third, wanted still, and its next request waited 65 s (helper-158).
            return all(not self._wanted(m, now)
                       or sum(m in s.spec.warm_models for s in nodes if s.spec.node_id not in taken) > 1
                       for m in status.spec.warm_models)

        options = [s for s in nodes if model in s.spec.cold_models and s.spec.node_id not in taken
                   and (s.spec.is_empty or can_give_up(s))]
        if not options:
            return None
        return min(options, key=lambda s: (not s.spec.is_empty, s.spec.load_time_s.get(model, 0.0),
                                           s.spec.price_per_hour, s.spec.node_id))

    def _can_drain(self, status: NodeStatus, nodes: list[NodeStatus], now: float,
                   taken: set[str] | frozenset[str] = frozenset()) -> bool:
        """Whether status could be drained for a swap: loading nothing, its warm models warm elsewhere on
        nodes not saturated without it (nor reserved, nor taken this round), and warm for at least as long as their
        load took (so a swap is not undone by the next one)."""
        if status.spec.loading_models or not status.spec.warm_models:
            return False
        settled_s = max([self.idle_swap_s, *(status.spec.load_time_s.get(m, 0.0) for m in status.spec.warm_models)])
        if now - status.models_since < settled_s:
            return False
        for other in status.spec.warm_models:
            rest = [s for s in nodes if other in s.spec.warm_models and s is not status
                    and s.spec.node_id not in self._reserved and s.spec.node_id not in taken]
            if not rest or saturation(rest) >= self.saturation:
                return False
        return True

    def _reserve(self, model: str, nodes: list[NodeStatus], taken: set[str], now: float) -> None:
        """Reserve a node to drain for model, unless one is reserved for it already: the least loaded
        with model on its disk that could be drained."""
        if model in self._reserved.values():
            return
        options = [s for s in nodes if model in s.spec.cold_models and s.spec.node_id not in taken
                   and s.spec.node_id not in self._reserved and self._can_drain(s, nodes, now, taken)]
        if options:
            chosen = min(options, key=lambda s: (_load(s), s.spec.price_per_hour, s.spec.node_id))
            self._reserved[chosen.spec.node_id] = model


def _load(status: NodeStatus) -> int:
    return status.load.num_running + status.load.num_waiting + status.placed_requests


def _in_flight(status: NodeStatus) -> bool:
    return _load(status) > 0

