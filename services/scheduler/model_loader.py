"""Carries out the model planner's actions on the nodes (LoadModel / UnloadModel) and keeps a log."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc

from baton.v1 import node_agent_pb2, node_agent_pb2_grpc, scheduler_pb2
from services.common.directory import ChannelPool
from services.common.errors import Unavailable
from services.scheduler.model_planner import ModelAction

log = logging.getLogger(__name__)

_ACTIONS_KEPT = 100


class ModelLoader:
    """At most one sequence of actions per node at a time; a Place may wait on a load."""

    def __init__(self, channels: ChannelPool, load_timeout_s: float,
                 on_loaded: Callable[[str, str], None] = lambda node_id, model: None) -> None:
        self._channels = channels
        self._on_loaded = on_loaded
        self._load_timeout_s = load_timeout_s
        # node id -> (model being loaded, or "" for unloads only; the task doing it)
        self._under_way: dict[str, tuple[str, asyncio.Task[str]]] = {}
        self.log: deque[scheduler_pb2.ModelAction] = deque(maxlen=_ACTIONS_KEPT)

    def busy_nodes(self) -> frozenset[str]:
        return frozenset(self._under_way)

    def changing_nodes(self, model: str) -> frozenset[str]:
        """Nodes with actions under way other than loading model (which a request may wait for)."""
        return frozenset(node for node, (loading, _) in self._under_way.items() if loading != model)

    def loading_models(self) -> frozenset[str]:
        return frozenset(model for model, _ in self._under_way.values() if model)

    def start(self, address: str, actions: list[ModelAction]) -> asyncio.Task[str] | None:
        """Run one node's actions in order, in the background; None if that node is busy."""
        node_id = actions[0].node_id
        if node_id in self._under_way:
            return None
        loading = next((a.model for a in actions if a.kind == "load"), "")
        task = asyncio.get_running_loop().create_task(self._run(address, actions))
        self._under_way[node_id] = (loading, task)
        task.add_done_callback(lambda _: self._under_way.pop(node_id, None))
        return task

    async def ensure_warm(self, node_id: str, address: str, model: str, reason: str) -> None:
        """Load model on node_id (or join the load under way) and wait until it is warm."""
        under_way = self._under_way.get(node_id)
        if under_way is not None and under_way[0] != model:
            doing = f"loading {under_way[0]}" if under_way[0] else "unloading a model"
            raise Unavailable(f"node {node_id} is busy {doing}; retry")
        task = under_way[1] if under_way is not None else self.start(
            address, [ModelAction("load", node_id, model, reason)])
        assert task is not None
        failure = await asyncio.shield(task)
        if failure:
            raise Unavailable(f"loading {model} on node {node_id} failed: {failure}")

    async def _run(self, address: str, actions: list[ModelAction]) -> str:
        """Each action in turn; stops at the first failure and returns it ("" when all succeeded)."""
        stub = node_agent_pb2_grpc.NodeAgentStub(self._channels.get(address))
        for action in actions:
            record = scheduler_pb2.ModelAction(node_id=action.node_id, model=action.model, kind=action.kind,
                                               reason=action.reason, at_ms=int(time.time() * 1000),
                                               result="pending")
            self.log.append(record)
            log.info("%s %s on %s: %s", action.kind, action.model, action.node_id, action.reason)
            try:
                if action.kind == "load":
                    reply = await stub.LoadModel(node_agent_pb2.LoadModelRequest(model=action.model),
                                                 timeout=self._load_timeout_s)
                    if reply.waited_s > 0:  # this call loaded it (or joined a load under way)
                        self._on_loaded(action.node_id, action.model)
                else:
                    await stub.UnloadModel(node_agent_pb2.UnloadModelRequest(model=action.model), timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                record.result = f"{exc.code().name}: {exc.details()}"
                log.warning("%s %s on %s failed: %s", action.kind, action.model, action.node_id, record.result)
                return record.result
            record.result = "done"
        return ""
