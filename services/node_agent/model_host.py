"""The models a node holds: at most one warm on the GPU, the others cold on local disk.

LoadModel reads a cold model's weights and starts its engine (the sim engine waits the modelled
load time: weights ÷ disk bandwidth + engine start-up); until then the model serves nothing.
UnloadModel frees the GPU of a warm model with nothing in flight. One model at a time is what
vLLM does per GPU: its engine takes the HBM left after the weights for KV cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.common.change_signal import ChangeSignal
from services.common.engine_profile import EngineProfile
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, shown
from services.common.load import Load
from services.node_agent.engines.base import Engine
from services.node_agent.engines.types import AllBlocksCleared, KVEvent

log = logging.getLogger(__name__)


class ModelState(enum.Enum):
    COLD = "cold"
    LOADING = "loading"
    WARM = "warm"


@dataclass(frozen=True)
class LocalModel:
    """A model on this node's local disk."""

    name: str
    max_context_tokens: int
    vocab_size: int
    tokenizer: str
    weights_bytes: int
    # Modelled time to make it warm here, in (unscaled) seconds.
    load_time_s: float
    # Its KV cache here when warm, in blocks.
    kv_blocks: int = 0
    # Its engine's configured profile (the sim engine's); None when the engine measures its own.
    profile: EngineProfile | None = None
    # Whether load_time_s is a model the host waits out (the sim engine) or a measurement of the
    # engine's own start-up (vLLM: starting the engine is the load, re-measured on every load).
    load_is_modelled: bool = True


class ModelHost:
    """The node's models and the engine of the warm one; the node agent's one view of its engine."""

    def __init__(self, node_id: str, models: list[LocalModel], make_engine: Callable[[str], Engine],
                 warm: str = "", speed: float = 1.0, kv_block_size: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._node_id = node_id
        self._clock = clock
        self._models = {m.name: m for m in models}
        self._make_engine = make_engine
        self._speed = speed
        self.kv_block_size = kv_block_size
        self.state = {name: ModelState.COLD for name in self._models}
        self._engine: Engine | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._loading: asyncio.Task[None] | None = None
        self._crashed: asyncio.Future[None] | None = None  # made by run()
        self._kv_batches: deque[tuple[str, list[KVEvent]]] = deque()
        self._kv_ready = asyncio.Event()
        #: Requests arrived or ended (the load report goes out at once).
        self.load_changed = ChangeSignal()
        #: A model became warm, loading or cold, or its engine's profile is new (the etcd registration is rewritten).
        self.models_changed = ChangeSignal()
        if warm:  # warm from the start: its engine runs once run() does
            self._install(warm)

    @property
    def models(self) -> list[LocalModel]:
        return [self._models[name] for name in sorted(self._models)]

    @property
    def warm_model(self) -> str:
        """The model warm now, or empty."""
        return next((n for n, s in self.state.items() if s is ModelState.WARM), "")

    async def run(self) -> None:
        """Drive the engine of the model warm from the start; stop every engine when cancelled.
        Raises what an engine raised, so that the node agent exits (and its lease ends) rather
        than stay registered with an engine that serves nothing."""
        self._crashed = asyncio.get_running_loop().create_future()
        if self._engine is not None:
            self._engine_task = asyncio.get_running_loop().create_task(self._drive(self._engine))
        try:
            await self._crashed
        finally:
            for task in (self._loading, self._engine_task):
                if task is not None:
                    task.cancel()

    def engine_for(self, model: str) -> Engine:
        """The warm engine of model: NOT_FOUND if the node does not have it, UNAVAILABLE if not warm."""
        self.local(model)
        if self.state[model] is not ModelState.WARM or self._engine is None:
            raise Unavailable(f"model={model!r} is {self.state[model].value} on node {self._node_id}, not warm")
        return self._engine

    async def load_model(self, model: str) -> float:
        """Make model warm; seconds waited (0 if it already was). Joins a load under way."""
        self.local(model)
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.state[model] is ModelState.WARM:
            return 0.0
        if self.state[model] is ModelState.COLD:
            other = next((n for n, s in self.state.items() if s is not ModelState.COLD), None)
            if other is not None:
                # A load under way cannot be unloaded (UnloadModel refuses it): telling the caller to would send it
                # round in a circle (helper-126).
                then = "unload it first" if self.state[other] is ModelState.WARM else \
                    "wait for its load to end, then unload it"
                raise FailedPrecondition(
                    f"node {self._node_id} has model {other!r} {self.state[other].value}; {then} "
                    f"(a GPU holds one model at a time)")
            self.state[model] = ModelState.LOADING
            self.models_changed.notify()
            self._loading = loop.create_task(self._load(model))
        assert self._loading is not None
        await asyncio.shield(self._loading)
        return loop.time() - started

    async def _load(self, model: str) -> None:
        local = self._models[model]
        if local.load_is_modelled:
            log.info("loading %s: %.1f s modelled", model, local.load_time_s)
            try:
                await asyncio.sleep(local.load_time_s / self._speed if self._speed > 0 else 0)
            except asyncio.CancelledError:
                self.state[model] = ModelState.COLD
                raise
        started = self._clock()
        engine = self._install(model)
        if not local.load_is_modelled:  # the engine's start was the load: report what it took this time
            self._models[model] = dataclasses.replace(local, load_time_s=self._clock() - started)
            log.info("loaded %s in %.1f s", model, self._models[model].load_time_s)
        self._engine_task = asyncio.get_running_loop().create_task(self._drive(engine))
        self.models_changed.notify()
        self.load_changed.notify()
        log.info("model %s is warm", model)

    def _install(self, model: str) -> Engine:
        engine = self._engine = self._make_engine(model)
        engine.load_changed = self.load_changed  # its changes are the node's
        engine.profile_changed = self.models_changed
        self.state[model] = ModelState.WARM
        return engine

    async def _drive(self, engine: Engine) -> None:
        async def forward_kv_events() -> None:
            while True:
                events = await engine.next_kv_events()
                self._publish_kv(engine.model, events)

        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(engine.run())
                group.create_task(forward_kv_events())
        except Exception as exc:
            log.exception("engine of %s failed", engine.model)
            if self._crashed is not None and not self._crashed.done():
                self._crashed.set_exception(exc)

    def unload_model(self, model: str) -> None:
        """Free the GPU of model: FAILED_PRECONDITION while it loads or has requests in flight."""
        self.local(model)
        state = self.state[model]
        if state is ModelState.COLD:
            return
        if state is ModelState.LOADING or self._engine is None:
            raise FailedPrecondition(f"model={model!r} is still loading on node {self._node_id}; unload it once "
                                     "its load has ended")
        load = self._engine.load()
        if load.num_running or load.num_waiting:
            raise FailedPrecondition(f"model={model!r} has {load.num_running + load.num_waiting} requests in flight "
                                     f"on node {self._node_id}")
        if self._engine_task is not None:
            self._engine_task.cancel()
        self._engine = self._engine_task = None
        self.state[model] = ModelState.COLD
        # The freed GPU memory held the KV cache: tell the index it is gone.
        self._publish_kv(model, [AllBlocksCleared()])
        self.models_changed.notify()
        self.load_changed.notify()
        log.info("model %s unloaded", model)

    def profile(self, model: str) -> EngineProfile | None:
        """model's profile to register: what its engine measured while warm, else the configured one."""
        engine = self._engine
        measured = engine.profile() if engine is not None and engine.model == model else None
        return measured or self._models[model].profile

    def local(self, model: str) -> LocalModel:
        """model's entry: INVALID_ARGUMENT if none is named (no node has a model of no name), NOT_FOUND if this
        node does not have it."""
        if not model:
            raise InvalidArgument("model", model, "required")
        try:
            return self._models[model]
        except KeyError:
            raise NotFound(f"model={shown(model)}: not on node {self._node_id} (it has: "
                           f"{', '.join(sorted(self._models)) or 'none'})") from None

    # -- the node's load and KV cache, whichever model is warm ----------------------------------------

    def load(self) -> Load:
        return self._engine.load() if self._engine is not None else Load()

    async def next_kv_events(self) -> tuple[str, list[KVEvent]]:
        """Wait for the next batch of KV events: (model, events)."""
        while not self._kv_batches:
            self._kv_ready.clear()
            await self._kv_ready.wait()
        return self._kv_batches.popleft()

    def _publish_kv(self, model: str, events: list[KVEvent]) -> None:
        self._kv_batches.append((model, events))
        self._kv_ready.set()

    def cached_blocks(self) -> tuple[str, list[int]]:
        """(warm model, every block it caches); ("", []) with nothing warm."""
        if self._engine is None:
            return "", []
        return self._engine.model, self._engine.cached_block_hashes()
