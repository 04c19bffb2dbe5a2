"""A Baton cluster in virtual time: the services' own pure cores driven by a discrete-event loop.

Node engines are SimEngineCore (batching, KV cache, timing per GPU generation); placement is the
scheduler's ClusterView and a Policy with the kvindex's KVIndex; migration after a node failure
uses the router's Generation and the scheduler's RetryBudget. Nothing here re-implements them:
this module only moves events between them in time order.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from baton.v1 import common_pb2
from services.common.engine_profile import EngineProfile
from services.common.errors import BatonError, InvalidArgument, ResourceExhausted, Unavailable
from services.common.failure_cause import FailureCause
from services.common.load import Load
from services.kvindex.index import KVIndex
from services.node_agent.engines.sim.core import SimEngineCore
from services.node_agent.engines.sim.models import GPU_SPECS, SimModelSpec, get_model, kv_capacity_blocks, load_time_s
from services.node_agent.engines.sim.profile import configured_profile
from services.node_agent.engines.types import EngineRequest, SamplingParams, StepResult
from services.router.generation import Generation, NodeFailure
from services.router.relay import MOVE_WAIT_S, move_wait_s
from services.scheduler.admission import Admission, Verdict
from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import ClusterView, NodeSpec
from services.scheduler.model_planner import ModelAction, ModelPlanner
from services.scheduler.placement import PlaceAsk, Placer, Plan, Unmeetable
from services.scheduler.policies import Option, PlacementRequest, Policy
from services.scheduler.retry_budget import RetryBudget
from simulator.workload import SimRequest, TokenBook, Workload

_MAX_MERGED_STEPS = 256
ADMISSIONS = ("none", "baton", "gie")


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    gpu: str
    price_per_hour: float
    # The model warm at the start (None: the simulation's model; "": none) and the others on its disk.
    warm: str | None = None
    cold: tuple[str, ...] = ()


# The most nodes a simulated fleet may have.
MAX_FLEET_NODES = 4096


def fleet(spec: str) -> list[NodeConfig]:
    """'4xh100,4xa100,4xl4' -> node configs with catalogue prices, numbered in order (h100-0, ..., l4-11); a GPU
    named twice adds up. ValueError naming the part that is not COUNTxGPU with a known GPU and a count of 1 or more."""

    def refuse(why: str, part: str | None = None) -> NoReturn:
        raise ValueError(f"{spec!r}: {part!r} {why}" if part is not None and part != spec.strip()
                         else f"{spec!r} {why}" if part is not None else f"{spec!r}: {why}")

    parts = [part.strip() for part in spec.split(",")]
    if parts == [""]:
        refuse("no fleet part given")
    nodes = []
    for part in parts:
        if not part:
            refuse("an empty fleet part between commas")
        count, x, gpu = part.partition("x")
        if not x or not count or not gpu:
            refuse("is not COUNTxGPU" + (" (in lower case)" if part != part.lower() else "") + ", e.g. 4xh100", part)
        if gpu not in GPU_SPECS:
            hint = "; GPU names are lower case" if gpu.lower() in GPU_SPECS else ""
            refuse(f"unknown GPU {gpu!r}; known: {', '.join(GPU_SPECS)}{hint}")
        if not count.isdigit():
            refuse(f"the count {count!r} of {part!r} is not a whole number")
        if int(count) < 1:
            refuse(f"the count of {part!r} must be at least 1")
        if len(nodes) + int(count) > MAX_FLEET_NODES:  # (99999999999xh100 hung while its nodes were listed)
            refuse(f"more than {MAX_FLEET_NODES} nodes in all")
        for _ in range(int(count)):
            nodes.append(NodeConfig(f"{gpu}-{len(nodes)}", gpu, GPU_SPECS[gpu].price_per_hour))
    return nodes


@dataclass
class RequestRecord:
    """What happened to one request, for the metrics."""

    request: SimRequest
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    num_generated: int = 0
    cached_tokens: int = 0
    num_migrations: int = 0
    failed: str = ""  # why, when it could not complete
    # False for a lone request refused as bad input before any node ran it: no task, as the live router counts it.
    is_task: bool = True
    # The node it was last placed on ("": none).
    node_id: str = ""
    # GPU time it used at its nodes' prices (every attempt's: as the router reports it to the ledger).
    gpu_cost: float = 0.0
    # The running attempt's share so far, added to gpu_cost when the attempt ends.
    attempt_cost: float = 0.0

    @property
    def ended_s(self) -> float:
        """When it finished, or when it was given up (its arrival, if never placed)."""
        return self.finish_s if self.finish_s is not None else self.arrival_s

    def end_attempt(self) -> None:
        self.gpu_cost += self.attempt_cost
        self.attempt_cost = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.num_generated < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_generated - 1)


@dataclass
class _Node:
    config: NodeConfig
    # The engine of the warm model (None: nothing warm), and that model.
    core: SimEngineCore | None
    model: str
    is_alive: bool = True
    is_stepping: bool = False
    busy_s: float = 0.0
    # requests on this node now: request id -> generation
    flights: dict[str, Generation] = field(default_factory=dict)
    # The model being loaded, and the requests placed here that wait for it.
    loading: str = ""
    waiting_for_load: list[tuple[Generation, RequestRecord, tuple[int, ...]]] = field(default_factory=list)

    def load(self) -> Load:
        return self.core.load() if self.core is not None else Load()


@dataclass(frozen=True)
class _Pending:
    """A request between the steps of its placement."""

    plan: Plan
    generation: Generation
    record: RequestRecord
    block_hashes: tuple[int, ...]


@dataclass
class RunResult:
    records: list[RequestRecord]
    busy_s: dict[str, float]
    price_per_hour: dict[str, float]
    makespan_s: float
    num_steps: int
    # How long the operator provisions the fleet for: until the last request ends (the makespan), so a
    # slow drain after the last arrival is paid for.
    provisioned_s: float = 0.0

    @property
    def gpu_cost(self) -> float:
        """Busy GPU time at each node's price: what a fleet that scaled idle GPUs away to nothing would pay."""
        return sum(self.busy_s[n] * self.price_per_hour[n] / 3600.0 for n in self.busy_s)

    @property
    def fleet_cost(self) -> float:
        """Every provisioned GPU for the whole run, idle included: what the operator pays."""
        return sum(price * self.provisioned_s / 3600.0 for price in self.price_per_hour.values())


def _room(model: str, prompt: Sequence[int]) -> int:
    """Tokens model's context leaves after prompt: what a request may generate at most."""
    return get_model(model).max_context_tokens - len(prompt)


class Simulation:
    """One run of a workload on a fleet under a policy, with optional node failures."""

    def __init__(self, nodes: list[NodeConfig], policy: Policy, model: str = "sim-llama-3.1-8b",
                 failures: tuple[tuple[float, str], ...] = (), lease_ttl_s: float = 3.0, max_migrations: int = 3,
                 suspect_s: float = 5.0, ttft_budget_ms: int = 0, admission: str = "none",
                 max_queued: int = 2000,
                 max_num_batched_tokens: int = 2048, planner: ModelPlanner | None = None,
                 plan_interval_s: float = 1.0, tpot_budget_ms: int = 0, max_tokens: int = 2048,
                 timing_error: float = 0.0, seed: int = 0) -> None:
        self._model: SimModelSpec = get_model(model)
        self._policy = policy
        # What clients ask for (the policy never sees how long an output really is), and each GPU
        # generation's true speed against the timing model the scheduler reads: the engines run the
        # fitted coefficients scaled by a factor drawn once per generation from [1 − e, 1 + e].
        self._max_tokens = max_tokens
        # Drawn per (seed, generation), so that an H100 runs at the same speed in every fleet of a seed.
        self._timing_scale = {gpu: 1.0 + random.Random(f"{seed}:{gpu}").uniform(-timing_error, timing_error)
                              for gpu in {config.gpu for config in nodes}}
        self._max_num_batched_tokens = max_num_batched_tokens
        # The profile each (GPU, model) registers; the scheduler's policy reads nothing else.
        self._profiles: dict[tuple[str, str], EngineProfile] = {}
        self._nodes: dict[str, _Node] = {}
        for config in nodes:
            warm = model if config.warm is None else config.warm
            self._nodes[config.node_id] = _Node(config, self._new_core(config.gpu, warm) if warm else None, warm)
        self._view = ClusterView(load_timeout_s=float("inf"))
        self._now = 0.0
        self._registered = set(self._nodes)
        self._update_view()
        for node in self._nodes.values():
            self._view.report_load(node.config.node_id, node.load(), 0.0)
        # Model placement by the leader's planner (None: models stay where they started).
        self._planner = planner
        self._plan_interval_s = plan_interval_s
        self.model_actions: list[tuple[float, ModelAction]] = []
        # Fresh requests for a model no node can serve yet, as Place waits for the planner.
        self._unplaced: list[_Pending] = []
        self._index = KVIndex()
        self._failures = failures
        self._lease_ttl_s = lease_ttl_s
        self._max_migrations = max_migrations
        self._suspect_s = suspect_s
        self._ttft_budget_ms = ttft_budget_ms
        self._tpot_budget_ms = tpot_budget_ms
        # Admission at the leader: none (place at once, nodes queue FIFO), baton, or gie.
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}")
        self._admission = None if admission == "none" else Admission(
            max_queued=max_queued, fair_share="tokens" if admission == "baton" else "round_robin",
            check_deadlines=admission == "baton")
        # The leader's placement core, over this fleet view.
        self._placer = Placer(self._view, policy, RetryBudget(ratio=0.2, min_retries_per_s=5.0),
                              planner or ModelPlanner(), judges_ttft=admission == "baton")
        # Requests queued for admission, with the options they were offered.
        self._held: dict[str, tuple[_Pending, list[Option]]] = {}
        self._suspects: dict[str, float] = {}
        # When each move the retry budget holds back gives up (MOVE_WAIT_S from its first ask), by request and move.
        self._move_gives_up_at: dict[tuple[str, int], float] = {}
        self._seed = seed
        self._book = TokenBook()
        # Two queues: what can bring new work to a node (arrivals, failures), and step completions.
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._step_events: list[tuple[float, int, Callable[[], None]]] = []
        self._min_think_s = math.inf
        self._order = itertools.count()
        self._records: dict[str, RequestRecord] = {}
        self._num_steps = 0
        # When the last request ended, finished or given up, and when the last model load ends: the fleet is paid
        # until both have, not until a node's death or a planner's round scheduled after them (a --kill after the
        # trace's end billed the fleet until the kill). A load is paid whole: its GPU time is busy time at once.
        self._settled_s = 0.0
        self._loads_end_s = 0.0
        # How long a request waits for a model's load before it fails, as Place waits (--model-load-timeout-s).
        self._model_wait_s = SchedulerConfig().model_load_timeout_s

    # -- models on nodes -----------------------------------------------------------------------

    def _profile(self, gpu: str, model: str) -> EngineProfile:
        """What a sim node of gpu registers for model: its configured coefficients (not the true
        speed the engines run at, which timing_error sets apart)."""
        if (gpu, model) not in self._profiles:
            spec = get_model(model)
            self._profiles[(gpu, model)] = configured_profile(
                gpu, spec, kv_capacity_blocks(GPU_SPECS[gpu].hbm_bytes, spec), self._max_num_batched_tokens)
        return self._profiles[(gpu, model)]

    def _new_core(self, gpu: str, model: str) -> SimEngineCore:
        spec = get_model(model)
        timing = self._profile(gpu, model).timing
        scale = self._timing_scale.get(gpu, 1.0)
        timing = dataclasses.replace(timing, **{f.name: getattr(timing, f.name) * scale
                                                for f in dataclasses.fields(timing)})
        return SimEngineCore(spec, timing,
                             num_kv_blocks=kv_capacity_blocks(GPU_SPECS[gpu].hbm_bytes, spec),
                             max_num_batched_tokens=self._max_num_batched_tokens)

    def _spec(self, node: _Node) -> NodeSpec:
        config = node.config
        on_disk = {m for m in (config.warm if config.warm is not None else self._model.name, *config.cold) if m}
        hbm = GPU_SPECS[config.gpu].hbm_bytes
        kv_blocks = {m: kv_capacity_blocks(hbm, get_model(m)) for m in on_disk}
        return NodeSpec(config.node_id, config.node_id, config.gpu, config.price_per_hour,
                        frozenset({node.model} if node.model else ()), cold_models=frozenset(on_disk - {node.model}),
                        loading_models=frozenset({node.loading} if node.loading else ()),
                        load_time_s={m: load_time_s(get_model(m)) for m in on_disk},
                        max_num_batched_tokens=self._max_num_batched_tokens, kv_blocks=kv_blocks, engine="sim",
                        profiles={m: self._profile(config.gpu, m) for m in on_disk})

    def _update_view(self) -> None:
        """The registrations as etcd would show them now (nodes whose lease ended are gone)."""
        self._view.set_nodes([self._spec(n) for n in self._nodes.values() if n.config.node_id in self._registered],
                             self._now)

    def _start_load(self, node: _Node, model: str) -> None:
        """LoadModel: the GPU is busy (and billed) for the load time, then the model is warm."""
        seconds = load_time_s(get_model(model))
        node.loading = model
        node.busy_s += seconds
        self._loads_end_s = max(self._loads_end_s, self._now + seconds)
        self.model_actions.append((self._now, ModelAction("load", node.config.node_id, model, "")))
        self._update_view()
        self._at(self._now + seconds, lambda: self._loaded(node, model))

    def _loaded(self, node: _Node, model: str) -> None:
        if not node.is_alive:
            return
        node.loading = ""
        node.core, node.model = self._new_core(node.config.gpu, model), model
        self._update_view()
        self._view.report_load(node.config.node_id, node.load(), self._now)
        waiting, node.waiting_for_load = node.waiting_for_load, []
        for generation, record, block_hashes in waiting:  # Place returned this node once it was warm
            self._start_on(node, generation, record, block_hashes)
        self._dispatch()  # the fleet changed: as the live gate, judge saturation again

    def _unload(self, node: _Node) -> bool:
        """UnloadModel: refused while requests run or wait there."""
        if node.flights or node.loading or node.core is None or node.core.has_unfinished_requests():
            return False
        self.model_actions.append((self._now, ModelAction("unload", node.config.node_id, node.model, "")))
        node.core, node.model = None, ""
        self._index.remove_node(node.config.node_id)
        self._update_view()
        self._view.report_load(node.config.node_id, node.load(), self._now)
        return True

    def _plan(self) -> None:
        assert self._planner is not None
        self._refresh_loads()
        for action in self._planner.plan(self._view, self._now):
            node = self._nodes[action.node_id]
            if action.kind == "unload":
                self._unload(node)
            elif node.core is None and not node.loading:
                self._start_load(node, action.model)
        self._retry_unplaced()
        self._dispatch()
        # Plan again while anything is left to happen, a request waiting for a model's load included (planning
        # stopped with one waiting, and it failed: "no node could load its model").
        if self._events or self._step_events or self._unplaced:
            self._at(self._now + self._plan_interval_s, self._plan)

    def _retry_unplaced(self) -> None:
        """Place again the requests waiting for a model's load: placed where it is warm now, failed where their
        time ran out or no node has the model on disk any more, else waiting on."""
        unplaced, self._unplaced = self._unplaced, []
        for pending in unplaced:
            # Place waits for a load within the request's deadline and at most --model-load-timeout-s.
            deadline_ms = pending.record.request.deadline_ms
            if deadline_ms and self._now > pending.record.arrival_s + deadline_ms / 1000:
                self._fail(pending.record, f"deadline_ms={deadline_ms}: passed while it waited for its model's load")
                continue
            if self._now - pending.plan.started_at > self._model_wait_s:
                self._fail(pending.record, f"no node could load its model within {self._model_wait_s:g} s")
                continue
            self._placer.refresh(pending.plan, self._now)
            self._placed_or_waiting(pending)

    # -- the event loop ------------------------------------------------------------------------

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def _horizon_s(self) -> float:
        """How long from now until anything could add a request to some node's batch."""
        horizon = self._events[0][0] if self._events else math.inf
        if self._step_events and self._min_think_s < math.inf:
            # A step finishing elsewhere may send a task's next step after its think time.
            horizon = min(horizon, self._step_events[0][0] + self._min_think_s)
        return horizon - self._now

    def run(self, workload: Workload) -> RunResult:
        for steps in workload.tasks.values():
            first = steps[0]
            self._at(first.arrival_s, lambda r=first: self._arrive(r))
        self._next_step_of = {r.request_id: nxt for steps in workload.tasks.values()
                              for r, nxt in zip(steps, steps[1:], strict=False)}
        for when, node_id in self._failures:
            self._at(when, lambda n=node_id: self._kill(n))
        if self._planner is not None:
            self._at(self._plan_interval_s, self._plan)
        self._min_think_s = min((r.think_s for r in workload.requests if r.think_s is not None), default=math.inf)
        while self._events or self._step_events:
            if self._step_events and (not self._events or self._step_events[0] < self._events[0]):
                self._now, _, action = heapq.heappop(self._step_events)
            else:
                self._now, _, action = heapq.heappop(self._events)
            action()
        for pending in self._unplaced:  # still waiting when nothing else could happen
            self._fail(pending.record, "no node could load its model")
        paid_until = max(self._settled_s, self._loads_end_s)
        return RunResult(
            records=list(self._records.values()),
            busy_s={n: node.busy_s for n, node in self._nodes.items()},
            price_per_hour={n: node.config.price_per_hour for n, node in self._nodes.items()},
            makespan_s=paid_until,
            provisioned_s=paid_until,
            num_steps=self._num_steps,
        )

    # -- requests ------------------------------------------------------------------------------

    def _arrive(self, request: SimRequest) -> None:
        record = self._records[request.request_id] = RequestRecord(request, self._now)
        tokens = self._book.tokens(request)
        model = request.model or self._model.name
        # As the router does with a client that sets no max_tokens: a prompt the context cannot hold is
        # refused (INVALID_ARGUMENT); any other may generate up to the context's end, so the engine stops
        # at the trace's true length or there. Nothing here reads the true length to decide.
        room = _room(model, tokens)
        generation = Generation(request_id=request.request_id, model=model, prompt_token_ids=tokens,
                                sampling=common_pb2.SamplingParams(
                                    max_tokens=min(request.output_len, self._max_tokens, max(room, 0)),
                                    ignore_eos=True))
        if room <= 0:
            self._fail(record, f"a prompt of {len(tokens)} tokens does not fit {model}'s context of "
                               f"{get_model(model).max_context_tokens}")
        else:
            self._place(generation, record, self._book.block_hashes(request, tokens))
        # Open loop: a task's next step arrives at its own time, whatever happened to this one.
        following = self._next_step_of.get(request.request_id)
        if following is not None and following.think_s is None:
            self._at(max(self._now, following.arrival_s), lambda r=following: self._arrive(r))

    def _asked_tokens(self, generation: Generation) -> int:
        """The max_tokens the client asked for, less what was generated: all the scheduler knows of
        the output's length (the engine stops at the trace's true length)."""
        return max(1, min(self._max_tokens, _room(generation.model, generation.prompt_token_ids))
                   - len(generation.generated))

    def _place(self, generation: Generation, record: RequestRecord, block_hashes: tuple[int, ...],
               retry_cause: FailureCause | None = None) -> None:
        """The scheduler's Place, step by step through the same placement core, the awaits as events."""
        # As the router does: skip the nodes that failed this request, and any that failed lately.
        self._suspects = {n: until for n, until in self._suspects.items() if until > self._now}
        request = record.request
        deadline_ms = request.deadline_ms
        if retry_cause and deadline_ms:  # a move asks with what is left of its deadline, as the router's does
            deadline_ms = max(1, math.ceil((record.arrival_s + deadline_ms / 1000 - self._now) * 1000))
        ask = PlaceAsk(PlacementRequest(
            request_id=generation.request_id, model=generation.model, num_prompt_tokens=len(generation.context),
            num_prompt_blocks=len(block_hashes), max_tokens=self._asked_tokens(generation),
            block_hashes=block_hashes, ttft_budget_ms=request.ttft_budget_ms or self._ttft_budget_ms,
            tpot_budget_ms=request.tpot_budget_ms or self._tpot_budget_ms, deadline_ms=deadline_ms,
            tenant=request.tenant, priority=request.priority, workflow_id=request.task_id, step=request.step,
            total_steps=request.total_steps),
            exclude=frozenset(generation.excluded_nodes()) | frozenset(self._suspects),
            retry_cause=retry_cause.value if retry_cause else "", num_generated_tokens=len(generation.generated))
        # The scheduler sees each node's load as of now (the live one, as of its last report).
        self._refresh_loads()
        # A move the retry budget held back gives up MOVE_WAIT_S after its first ask (kept only while it waits).
        move = (generation.request_id, generation.num_migrations)
        gives_up_at = self._move_gives_up_at.pop(move, self._now + MOVE_WAIT_S)
        try:
            plan = self._placer.start(ask, self._now, refused_by_limits=self._admission.limits_refusal
                                      if self._admission is not None else None)
        except Unmeetable as error:  # a budget no node could meet: refused at once, as Place does
            self._refuse(record, error)
            return
        except BatonError as error:
            if retry_cause and isinstance(error, ResourceExhausted):  # waited out, as the router does (relay._place)
                # Drawn per request and move, so that runs of two policies on a seed draw alike for each.
                draw = random.Random(f"{self._seed}:{move[0]}:{move[1]}:{self._now}").random()
                wait_s = min(move_wait_s(error.retry_after_ms, draw), gives_up_at - self._now)
                if self._now + error.retry_after_ms / 1000 <= gives_up_at and (
                        not request.deadline_ms or self._now + wait_s < record.arrival_s + request.deadline_ms / 1000):
                    self._move_gives_up_at[move] = gives_up_at
                    self._at(self._now + wait_s, lambda: self._place(generation, record, block_hashes, retry_cause))
                    return
            self._fail(record, str(error))
            return
        self._placed_or_waiting(_Pending(plan, generation, record, block_hashes))

    def _placed_or_waiting(self, pending: _Pending) -> None:
        plan, record = pending.plan, pending.record
        if not plan.has_candidates:
            model = plan.models[0]
            if (not plan.is_retry and self._planner is not None
                    and any(model in s.spec.cold_models for s in self._view.nodes())):
                self._unplaced.append(pending)  # as Place waits for the planner
                return
            self._placer.abandon(plan)
            self._fail(record, str(self._placer.no_candidates(plan)))
            return
        options = self._placer.options(plan, lambda m: self._index.overlap(m, pending.block_hashes))
        try:
            admission = self._placer.ticket(plan, options, self._now) if self._admission is not None else None
        except BatonError as error:  # a deadline the fleet as it is could not meet: refused at once, as Place does
            self._placer.abandon(plan)
            if plan.is_retry:  # a move that could not end in what it had left: it was admitted once, not refused
                self._fail(record, f"its move ended: {error}")
            else:
                self._refuse(record, error)
            return
        if admission is None:
            self._commit(pending, options)
            return
        ticket, predicted_ttft_s = admission
        assert self._admission is not None
        outcome = self._admission.offer(ticket, self._now, self._placer.is_saturated(self._now), predicted_ttft_s)
        if outcome.shed is not None:
            shed, _ = self._held.pop(outcome.shed.request_id)
            self._fail(shed.record, f"shed: {outcome.reason}")
        if outcome.verdict == Verdict.REJECT:
            self._fail(record, f"refused: {outcome.reason}")
        elif outcome.verdict == Verdict.QUEUE:
            self._held[ticket.request_id] = (pending, options)
        else:
            self._admission.on_admitted(ticket, self._now)
            self._commit(pending, options)

    def _commit(self, pending: _Pending, options: list[Option]) -> None:
        """The policy's choice; the request starts there, or once the model it needs is loaded."""
        placed = self._placer.decide(options, self._now)
        generation, record, block_hashes = pending.generation, pending.record, pending.block_hashes
        node = self._nodes[placed.decision.node_id]
        record.node_id = node.config.node_id
        if not node.is_alive:  # placed on a dead node the fleet view still lists: the stream breaks at once
            self._migrate(generation, record, NodeFailure(node.config.node_id, FailureCause.CONNECT_FAILED))
            return
        if placed.is_cold or node.core is None:  # it serves once the load it needs is done
            node.waiting_for_load.append((generation, record, block_hashes))
            if not node.loading:
                self._start_load(node, placed.request.model)
            return
        self._start_on(node, generation, record, block_hashes)

    def _start_on(self, node: _Node, generation: Generation, record: RequestRecord,
                  block_hashes: tuple[int, ...]) -> None:
        assert node.core is not None
        node.flights[generation.request_id] = generation
        node.core.add_request(EngineRequest(
            request_id=generation.request_id, prompt_token_ids=tuple(generation.context),
            sampling=SamplingParams(max_tokens=generation.num_remaining, ignore_eos=True),
            num_resumed_tokens=len(generation.generated), prompt_block_hashes=block_hashes))
        self._kick(node)

    # -- admission (the scheduler's own core) -------------------------------------------------------

    def _refresh_loads(self) -> None:
        for status in self._view.nodes():
            node = self._nodes[status.spec.node_id]
            if node.is_alive:
                self._view.report_load(status.spec.node_id, node.load(), self._now)

    def _dispatch(self) -> None:
        """Release queued requests while the fleet has room, as the leader's gate does."""
        if self._admission is None or not self._held:
            return
        for ticket in self._admission.expired(self._now):
            pending, _ = self._held.pop(ticket.request_id)
            self._fail(pending.record, "deadline passed while queued")
        self._refresh_loads()  # what the gate judges: the loads as of now, as the live one has them reported
        while self._held and not self._placer.is_saturated(self._now):
            ticket = self._admission.pop_next(self._now)
            if ticket is None:
                break
            pending, options = self._held.pop(ticket.request_id)
            self._admission.on_admitted(ticket, self._now)
            self._refresh_loads()
            try:
                options = self._placer.after_queueing(pending.plan, options, self._now)
            except BatonError as error:
                self._admission.end(ticket.request_id, self._now, ran=False)  # never placed: as the leader does
                self._fail(pending.record, str(error))
                continue
            self._commit(pending, options)

    def _refuse(self, record: RequestRecord, error: BatonError) -> None:
        """Refused by the placement core; a lone request refused as bad input is no task (services/router/relay.py)."""
        self._fail(record, f"refused: {error}")
        if isinstance(error, InvalidArgument) and record.request.total_steps <= 1 and not record.gpu_cost:
            record.is_task = False

    def _fail(self, record: RequestRecord, why: str) -> None:
        record.failed = why
        record.finish_s = None
        record.end_attempt()
        self._settled_s = self._now

    # -- nodes ---------------------------------------------------------------------------------

    def _kick(self, node: _Node) -> None:
        """Start the node's next step if it is idle and has work."""
        if node.is_stepping or not node.is_alive or node.core is None or not node.core.has_unfinished_requests():
            return
        # Until the next event nothing can join this node's batch, so a decode-only batch may run
        # that many steps in one call (the core merges exactly the steps it would run one by one).
        result = node.core.step(max_decode_steps=_MAX_MERGED_STEPS, max_duration_s=self._horizon_s())
        self._num_steps += 1
        node.is_stepping = True
        node.busy_s += result.duration_s
        heapq.heappush(self._step_events, (self._now + result.duration_s, next(self._order),
                                           lambda: self._step_done(node, result)))

    def _step_done(self, node: _Node, result: StepResult) -> None:
        node.is_stepping = False
        if not node.is_alive:
            return
        if node.core is not None:
            node.core.step_ended()
        node_id = node.config.node_id
        for event in result.kv_events:
            self._index.apply(node_id, node.model, event)
        for output in result.outputs:
            generation = node.flights.get(output.request_id)
            if generation is None:
                continue
            record = self._records[output.request_id]
            record.attempt_cost = output.gpu_ms / 3_600_000.0 * node.config.price_per_hour
            if output.new_token_ids and record.first_token_s is None:
                record.first_token_s = self._now
                record.cached_tokens = output.num_cached_tokens
            generation.generated.extend(output.new_token_ids)
            record.num_generated = len(generation.generated)
            if output.finish_reason is not None:
                del node.flights[output.request_id]
                record.finish_s = self._settled_s = self._now
                record.end_attempt()
                self._placer.observe_finished(generation.model, record.num_generated)
                if self._admission is not None:
                    self._admission.release(output.request_id)
                self._follow_up(record.request)
        self._kick(node)
        self._dispatch()

    def _follow_up(self, request: SimRequest) -> None:
        """Closed loop: the task's next step leaves think_s after this one finished."""
        following = self._next_step_of.get(request.request_id)
        if following is not None and following.think_s is not None:
            self._at(self._now + following.think_s, lambda: self._arrive(following))

    # -- failures ------------------------------------------------------------------------------

    def _kill(self, node_id: str) -> None:
        node = self._nodes[node_id]
        node.is_alive = False
        flights, node.flights = node.flights, {}
        for generation in flights.values():
            self._migrate(generation, self._records[generation.request_id],
                          NodeFailure(node_id, FailureCause.STREAM_BROKEN))
        waiting, node.waiting_for_load = node.waiting_for_load, []
        for generation, record, _ in waiting:
            self._migrate(generation, record, NodeFailure(node_id, FailureCause.CONNECT_FAILED))
        # Its lease ends later: until then the fleet view lists it (and the index its blocks).
        self._at(self._now + self._lease_ttl_s, lambda: self._lease_end(node_id))

    def _lease_end(self, node_id: str) -> None:
        self._registered.discard(node_id)
        self._update_view()
        self._index.remove_node(node_id)
        if self._unplaced:  # as Place wakes when the fleet changes: a request whose model no node has any more fails
            self._retry_unplaced()
        self._dispatch()  # its last load no longer counts: the survivors' room may release the queue

    def _migrate(self, generation: Generation, record: RequestRecord, failure: NodeFailure) -> None:
        record.end_attempt()  # the lost attempt's GPU time is paid for
        self._suspects[failure.node_id] = self._now + self._suspect_s
        try:
            generation.record_failure(failure, self._max_migrations)
        except Unavailable as error:
            self._fail(record, str(error))
            return
        record.num_migrations = generation.num_migrations
        self._place(generation, record, tuple(generation.context_block_hashes()), retry_cause=failure.cause)
