"""The placement sequence: retry budget → candidates → KV overlap → admission → policy → record → cold
load. Pure: time is passed in, and nothing here waits.

The scheduler's Place wraps it with the I/O between its steps (the kvindex's overlap, the admission
gate's queue, waiting for the model planner, the model load); the simulator calls the same steps
with its own index and event queue. One decision path, two callers.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.protocol import DEFAULT_TENANT
from services.common.block_hash import DEFAULT_BLOCK_SIZE
from services.common.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unavailable, shown
from services.common.load import Load
from services.scheduler.admission import SLOT_HINT_MAX_S, Outcome, Ticket
from services.scheduler.fleet import ClusterView, NodeStatus, saturation
from services.scheduler.model_planner import ModelPlanner
from services.scheduler.policies import Decision, Option, PlacementRequest, Policy
from services.scheduler.policies.baton import BatonPolicy
from services.scheduler.retry_budget import RetryBudget

Changing = Callable[[str], frozenset[str]]
# (a fresh request's ticket, now) -> its tenant's limits' refusal of it, if they refuse it (Admission.limits_refusal).
RefusedByLimits = Callable[[Ticket, float], Outcome | None]

# A budget is refused as one no node could meet only below this share of its floor (BatonPolicy.floor_s): a node may
# run up to 30 % faster than the profile it registered (the simulator's timing error; a calibrated vLLM profile's
# prefill fit is off by 3-5 %, at worst 27 %: ../shared/perf/fitted_coefficients.csv).
FLOOR_MARGIN = 0.7


class Unmeetable(InvalidArgument):
    """A budget no node serving the model could meet, idle or not: bad input, not a load to wait out."""


class DeadlineOutOfReach(ResourceExhausted):
    """A deadline the fleet as it is could not meet: asking again later may help (its retry hint)."""


class LeftOutOfReach(DeadlineExceeded):
    """What a resumed stream has left of its deadline, which the fleet as it is could not meet: sent again, it
    would have less left (no retry hint)."""


def _none_changing(model: str) -> frozenset[str]:
    return frozenset()


@dataclass(frozen=True)
class PlaceAsk:
    """What a Place call asks for, as domain types."""

    request: PlacementRequest
    # Models acceptable instead of request.model, preferred first.
    alternative_models: tuple[str, ...] = ()
    # Nodes not to use (one that just failed this request, say).
    exclude: frozenset[str] = frozenset()
    # Why this is a retry; empty for a first placement. Retries draw on the retry budget.
    retry_cause: str = ""
    # Its context holds tokens its client already has: a stream resumed through another router (or moved). Its
    # budgets were met or missed by its first attempt: never refused as invalid, nor on its TTFT budget.
    resumed: bool = False
    # Of the request's prompt, the tokens its stream generated already (a resumed or moved one's).
    num_generated_tokens: int = 0
    # The router that asks ("": not said): a holder of the id's admission slot.
    router_id: str = ""
    # Its prompt's and cache salt's digest (0: not said): a resend of a running id must have the running one's.
    prompt_digest: int = 0


@dataclass
class Plan:
    """A request being placed: the models it may run and, for each, the nodes that could run it."""

    ask: PlaceAsk
    models: list[str]
    needed_blocks: int
    candidates: dict[str, list[NodeStatus]] = field(default_factory=dict)
    # When a retry took its unit of the retry budget (None: a first placement, or not yet charged).
    charged_at: float | None = None
    # When placement started (the request's arrival at the scheduler): its deadline counts from here.
    started_at: float = 0.0
    # What admission could not predict, said in the decision: no candidate registered a profile.
    unpredicted: str = ""
    # Its tenant's limits' refusal of it, asked for when no node has its model warm (start): it then asks for no load.
    limits_refusal: Outcome | None = None

    @property
    def has_candidates(self) -> bool:
        return any(self.candidates.values())

    @property
    def is_retry(self) -> bool:
        return bool(self.ask.retry_cause)


@dataclass(frozen=True)
class Placed:
    """Where the request goes, under which model, and whether that node must load it first."""

    decision: Decision
    request: PlacementRequest
    is_cold: bool


class Placer:
    """Each step of a placement, over the scheduler's fleet view, policy, retry budget and model planner."""

    def __init__(self, cluster: ClusterView, policy: Policy, retry_budget: RetryBudget, planner: ModelPlanner,
                 predictor: BatonPolicy | None = None, judges_ttft: bool = True) -> None:
        """judges_ttft: admission judges a fresh request's TTFT budget on its predicted first token (Baton's does, GIE's
        flow control does not): then one its candidates could not meet idle is refused as bad input (ticket)."""
        self.cluster = cluster
        self.judges_ttft = judges_ttft
        self.policy = policy
        self.retry_budget = retry_budget
        self.planner = planner
        # Baton's own policy predicts for admission with what it knows (the prompt tokens it has been
        # sending each node); other policies get a predictor of their own.
        self._predictor = predictor or (policy if isinstance(policy, BatonPolicy) else BatonPolicy())
        # Predicts on idle copies of nodes: with no memory of the prompts sent them lately (the load it takes away).
        self._idle_predictor = BatonPolicy()

    def observe_finished(self, model: str, num_output_tokens: int) -> None:
        """A request of model ran to its end with num_output_tokens: the policy learns it, and admission's predictor
        when it is another policy's own (it judged moves on the typical answer it had never learned, helper-205)."""
        self.policy.observe_finished(model, num_output_tokens)
        if self._predictor is not self.policy:
            self._predictor.observe_finished(model, num_output_tokens)

    def start(self, ask: PlaceAsk, now: float, changing: Changing = _none_changing,
              refused_by_limits: RefusedByLimits | None = None) -> Plan:
        """Charge the retry budget (or count the request), find the models some node has and their
        candidates; changing(model) names the nodes busy changing models, which are never candidates.
        refused_by_limits: its tenant's limits' refusal of it (Admission.limits_refusal), asked when no node has its
        model warm: refused (plan.limits_refusal), it asks for no load."""
        request = ask.request
        models = [m for m in dict.fromkeys([request.model, *ask.alternative_models])
                  if self.cluster.has_model(m, now)]
        if not models and not any(self.cluster.is_listed(s, now) for s in self.cluster.nodes()):
            # None registered yet, or every one gone: either passes, and NOT_FOUND is a code no client retries.
            raise Unavailable(f"model={shown(request.model)}: no node is registered with this cluster now "
                              "(starting, or all gone); retry")
        alternatives = f" (nor {', '.join(map(shown, ask.alternative_models))})" if ask.alternative_models else ""
        if not models and any(self.cluster.served_lately(m, now) for m in (request.model, *ask.alternative_models)):
            # Their nodes died, drained or restart: an outage to retry through, not a name the client got wrong.
            raise Unavailable(f"model={shown(request.model)}{alternatives}: served by this cluster lately, by no node "
                              "now (its nodes are gone or restarting); retry")
        if not models:
            raise NotFound(f"model={shown(request.model)}: no registered node has it{alternatives}")
        if not ask.retry_cause and not ask.resumed:  # before it counts, waits or makes room for anything
            self._refuse_the_impossible(request, models)
        charged_at = None
        if ask.retry_cause:
            # The streams a failure may have to move: those the nodes last reported, a dead node's among them.
            in_flight = sum(s.load.num_running + s.load.num_waiting for s in self.cluster.nodes()
                            if s.reported_at is not None)
            if not self.retry_budget.try_retry(now, in_flight):
                budget = self.retry_budget
                why = (f"cluster retry budget exhausted: {budget.num_retries(now)} retries in the last "
                       f"{budget.window_s:.0f} s against {budget.num_requests(now)} requests placed then and "
                       f"{in_flight} in flight (allowed: {budget.min_retries_per_s:g}/s + {budget.ratio:.0%} of the "
                       "larger)")
                if not budget.num_retries(now):  # none to leave the window: waiting frees nothing
                    raise Unavailable(why)
                # A move the router waits out (relay._place), for as long as the oldest retry stays in the window.
                raise ResourceExhausted(why, retry_after_ms=max(1, math.ceil(budget.retry_after_s(now) * 1000)))
            charged_at = now
        else:
            self.retry_budget.record_request(now)
        needed = math.ceil((request.num_prompt_tokens + request.max_tokens) / DEFAULT_BLOCK_SIZE)
        plan = Plan(ask, models, needed, charged_at=charged_at, started_at=now)
        self.refresh(plan, now, changing)
        if not plan.is_retry and not any(m in s.spec.warm_models for m, nodes in plan.candidates.items()
                                         for s in nodes):
            # No node has it warm (a free GPU may load it) or every copy is on busy nodes' disks: make room and load
            # it, even if this request is then refused for its budget (one with a TTFT budget shorter than the load
            # was refused before anything noted it, and no load ever began: helper-126). Not for a request its
            # tenant's limits refuse: asking again and again, a tenant at its limit swapped a model in for nothing.
            plan.limits_refusal = refused_by_limits(ticket_of(ask, now), now) if refused_by_limits else None
            if plan.limits_refusal is None:
                self.planner.note_demand(models[0], now)
        return plan

    def refresh(self, plan: Plan, now: float, changing: Changing = _none_changing) -> None:
        """Candidates for each model as the fleet is now."""
        draining = self.planner.reserved_nodes()  # reserved for a swap: nothing new, unless nothing else can
        plan.candidates = {}
        for m in plan.models:
            exclude = plan.ask.exclude | changing(m)
            plan.candidates[m] = (self.candidates(m, now, exclude | draining, plan)
                                  or self.candidates(m, now, exclude, plan))

    def candidates(self, model: str, now: float, exclude: frozenset[str], plan: Plan) -> list[NodeStatus]:
        """Nodes with model warm; with those whose free GPU could load it when the policy weighs load
        time or no node has it warm. Never a node whose KV cache or context window for model is too small."""
        tokens = plan.ask.request.num_prompt_tokens + plan.ask.request.max_tokens
        warm = self.cluster.candidates(model, now, exclude, plan.needed_blocks, tokens)
        if warm and not self.policy.weighs_cold_nodes:
            return warm
        return warm + self.cluster.cold_candidates(model, now, exclude, plan.needed_blocks, tokens)

    def is_saturated(self, now: float) -> bool:
        """Whether the fleet has no room for more: llm-d's saturation of the live nodes that have reported
        load, placements not yet there counted as waiting. A node reserved for a swap takes nothing new,
        so it is no room. What the admission gate holds requests on, live and simulated."""
        draining = self.planner.reserved_nodes()
        return saturation(s for s in self.cluster.nodes() if s.reported_at is not None
                          and s.spec.node_id not in draining and self.cluster.is_live(s, now)) >= 1.0

    def no_candidates(self, plan: Plan, waited_s: float = 0.0) -> Unavailable:
        """waited_s: how long the request waited for the model planner to make room for its model."""
        excluded = plan.ask.exclude
        return Unavailable(f"model={shown(plan.ask.request.model)}: no live node has it warm, or a free GPU to load "
                           f"it, with KV cache for {plan.needed_blocks * DEFAULT_BLOCK_SIZE} tokens"
                           + (f" (excluded: {', '.join(sorted(excluded))})" if excluded else "")
                           + (f"; waited {waited_s:.1f} s for the model planner to load it on a node, and none was "
                              "given it" if waited_s >= 0.05 else ""))

    def abandon(self, plan: Plan) -> None:
        """A placement that placed nothing: a retry gets its unit of the budget back, since the budget
        bounds the load that moves and a move with nowhere to go moved nothing."""
        if plan.charged_at is not None:
            self.retry_budget.refund(plan.charged_at)
            plan.charged_at = None

    def options(self, plan: Plan, overlap: Callable[[str], dict[str, int]]) -> list[Option]:
        """Each model with candidates, its nodes and their cached prompt blocks (overlap(model))."""
        return [Option(dataclasses.replace(plan.ask.request, model=m), nodes, overlap(m))
                for m, nodes in plan.candidates.items() if nodes]

    def ticket(self, plan: Plan, options: list[Option], now: float, attempt: int = 0,
               cache_known: bool = True) -> tuple[Ticket, float] | None:
        """The admission ticket of a fresh request (asked for by Place call attempt) and its best predicted time to
        first token; None for a retry (a migrating stream is already admitted: never shed it). A retry's deadline_ms
        is what its stream has left, as a resumed one's: one that could not end in it is ended (LeftOutOfReach), not
        prefilled again on a survivor to miss it. cache_known: whether the options' matched blocks are a kvindex's
        answer (False: none answered, they read as nothing cached): only then is a budget refused as bad input on what
        idle nodes would do with what they cache."""
        with self._predictor.remembering():  # its passes over the candidates ask of one fleet state
            return self._ticket(plan, options, now, attempt, cache_known)

    def _ticket(self, plan: Plan, options: list[Option], now: float, attempt: int,
                cache_known: bool) -> tuple[Ticket, float] | None:
        request = plan.ask.request
        if plan.is_retry:
            if request.deadline_ms:
                self._check_deadline(request, options, now, resumed=True, judged=self._judged(options, now),
                                     generated=plan.ask.num_generated_tokens)
            return None
        if not any(s.profile(o.request.model) for o in options for s in o.candidates):
            plan.unpredicted = ("admission: no candidate registered an engine profile, so its time to first token"
                                + (" and deadline were" if request.deadline_ms else " was")
                                + " not predicted and nothing was refused on them")
        judged = self._judged(options, now)
        # A fresh request's budgets are bad input when no candidate could meet them idle, with what each caches of its
        # prompt: judged so only when a kvindex answered for its caches (with none, they read as empty: a prompt cached
        # in fact was refused as bad input, with no retry for when the kvindex answered again, helper-209).
        idle_models = plan.models if cache_known and not plan.ask.resumed else None
        self._check_deadline(request, options, now, resumed=plan.ask.resumed, idle_models=idle_models, judged=judged,
                             generated=plan.ask.num_generated_tokens)
        ticket = ticket_of(plan.ask, now, attempt)
        best_ttft_s = min(self._predictor.best_ttft_s(o.request, o.candidates, o.matched_blocks, now) for o in judged)
        # Admission will refuse it on its TTFT budget: is that the fleet's load, or would idle nodes miss it too?
        if (idle_models is not None and self.judges_ttft and request.ttft_budget_ms
                and best_ttft_s * 1000 > request.ttft_budget_ms):
            self._check_ttft_idle(request, options, idle_models, now)
        return ticket, best_ttft_s

    def _judged(self, options: list[Option], now: float) -> list[Option]:
        """The options a request placed now is judged on: admitted at once, it is placed on the fleet as it is
        (_choosable); queued (the fleet saturated), it is chosen later, on the fleet as it is then."""
        return self._choosable(options, now) if not self.is_saturated(now) else options

    def _choosable(self, options: list[Option], now: float) -> list[Option]:
        """options as Baton's policy chooses among them now: the candidates with KV room for the request while any
        has, across every model it accepts (it passes over a full node: judged on one, a request was let in on a node
        16 s from the end of its model's load against a 2 s budget, helper-195). Under another policy, as they are:
        it may choose a full node."""
        if self._predictor is not self.policy:
            return options

        def has_room(option: Option, status: NodeStatus) -> bool:
            matched = option.matched_blocks.get(status.spec.node_id, 0)
            terms = self._predictor.terms(option.request, status, matched, now)
            return terms is not None and terms.has_kv_room

        roomy = [dataclasses.replace(o, candidates=[s for s in o.candidates if has_room(o, s)]) for o in options]
        return [o for o in roomy if o.candidates] or options

    def _refuse_the_impossible(self, request: PlacementRequest, models: list[str]) -> None:
        """Unmeetable, naming the budget (ttft_budget_ms, tpot_budget_ms, deadline_ms) that no node listing one of
        models (those of the request some node lists) could meet, even idle with the whole prompt cached
        (BatonPolicy.floor_s, with FLOOR_MARGIN): asking again cannot help, so it gets no retry hint (a 429 had the
        openai client ask twice more). Every node listing the model counts, live or not, busy or loading: the fleet
        as it is now is what a retry may find changed. Nothing is refused so when one of them has no profile."""
        if not (request.ttft_budget_ms or request.tpot_budget_ms or request.deadline_ms):
            return
        floors = []
        for model in models:
            listing = [s for s in self.cluster.nodes() if s.spec.has(model)]
            floor = self._predictor.floor_s(dataclasses.replace(request, model=model), listing)
            if floor is None:
                return
            floors.append(floor)
        first_ms = min(f[0] for f in floors) * 1000 * FLOOR_MARGIN
        end_ms = min(f[1] for f in floors) * 1000 * FLOOR_MARGIN
        step_ms = min(f[2] for f in floors) * 1000 * FLOOR_MARGIN
        if request.ttft_budget_ms and request.ttft_budget_ms < first_ms:
            raise Unmeetable("ttft_budget_ms", request.ttft_budget_ms,
                             f"cannot be met by any node serving the model, even idle: its first token takes at "
                             f"least {first_ms:.1f} ms with the whole prompt cached (ask for a larger budget)")
        if request.tpot_budget_ms and request.max_tokens > 1 and request.tpot_budget_ms < step_ms:
            # (One token has no time per output token: such a request is never judged on it.)
            # (helper-166: a 1 ms budget was served, and counted late whatever happened: a failed task.)
            raise Unmeetable("tpot_budget_ms", request.tpot_budget_ms,
                             f"cannot be met by any node serving the model, even idle: each output token takes at "
                             f"least {step_ms:.1f} ms (ask for a larger budget)")
        if request.deadline_ms and request.deadline_ms < end_ms:
            raise Unmeetable("deadline_ms", request.deadline_ms,
                             f"cannot be met by any node serving the model, even idle: the first token and "
                             f"max_tokens={request.max_tokens} take at least {end_ms:.0f} ms with the whole prompt "
                             "cached (ask for fewer tokens or a later deadline)")

    def _check_deadline(self, request: PlacementRequest, options: list[Option], now: float,
                        waited_s: float = 0.0, resumed: bool = False, idle_models: list[str] | None = None,
                        judged: list[Option] | None = None, generated: int = 0) -> None:
        """Refuse a request that could not end by its deadline on any candidate: the time it has waited
        plus TTFT plus max_tokens decode steps, predicted from the candidates' registered profiles on
        the fleet as it is (candidates without a profile: not predicted; none has one: no refusal, see
        ticket). A resumed stream's deadline_ms is what its client has left: it ends DEADLINE_EXCEEDED, as its
        router's timer would end it, with no retry hint (sent again, it would have less left). A fresh one, on
        arrival (idle_models: the models it accepts that some node has, where that is judged, see ticket), that its
        candidates could not meet even with their load gone (_idle_end_s) is bad input (Unmeetable): a retry hint would
        send it again in vain (one between the floor and that prediction got 429, and the openai client sent it three
        times). After the queue it was admitted as meetable: what changed is the fleet, and a retry may help. judged:
        the options its end is
        predicted on (_choosable's, when it is placed now), options by default. A resumed (or moved) stream is judged
        on the tokens it is expected to generate yet, given the generated tokens it has (_expected), not on all of
        max_tokens: ended, it loses what its client was streaming, so it is ended only when even those cannot end in
        time (judged on max_tokens, a move with 20 s left was ended on an idle H100 for 3,000 tokens it would likely
        never generate, helper-204)."""
        if not request.deadline_ms:
            return
        judged = options if judged is None else judged
        if resumed:
            judged = [dataclasses.replace(o, request=dataclasses.replace(
                o.request, max_tokens=self._expected(o.request, generated))) for o in judged]
        ends = [end for o in judged
                if (end := self._predictor.best_finish_s(o.request, o.candidates, o.matched_blocks, now)) is not None]
        if not ends or (waited_s + min(ends)) * 1000 <= request.deadline_ms:
            return
        best_ms = (waited_s + min(ends)) * 1000
        if idle_models is not None and (idle_s := self._idle_end_s(options, idle_models, now)) is not None \
                and idle_s * 1000 > request.deadline_ms:
            raise Unmeetable("deadline_ms", request.deadline_ms,
                             f"cannot be met: the first token and max_tokens={request.max_tokens} are predicted to "
                             f"take {idle_s * 1000:.0f} ms on an idle node, with nothing else running (ask for fewer "
                             "tokens or a later deadline)")
        if resumed:
            expected = min(o.request.max_tokens for o in judged)
            raise LeftOutOfReach(
                f"deadline_ms={request.deadline_ms}: cannot be met in what the resumed stream has left; the "
                f"{expected} tokens it is expected to generate yet (of max_tokens={request.max_tokens}) are predicted "
                f"to take {best_ms:.0f} ms on the best node now")
        # Retry when the load that puts it out of reach may have passed: at least the excess, and no sooner than the
        # prompts sent the candidates lately stop weighing on their predicted steps (after a burst of large prompts a
        # hint of the 1 s excess sent the openai client back twice within the ~9 s they weighed, in vain).
        forgets_s = min((self._predictor.prompt_rate_forgets_in_s(s.spec.node_id, now)
                         for o in options for s in o.candidates), default=0.0)
        raise DeadlineOutOfReach(
            f"deadline_ms={request.deadline_ms}: cannot be met; the first token and max_tokens={request.max_tokens} "
            f"are predicted to take {best_ms:.0f} ms on the best node now"
            + (f", after {waited_s:.1f} s queued" if waited_s else "") + " (ask for fewer tokens or a later deadline)",
            # (At most SLOT_HINT_MAX_S, as every hint of admission's: the openai client waits out a Retry-After of up
            # to 60 s, and past it falls back to its own short backoff; 62,705 ms was sent, helper-189.)
            retry_after_ms=min(int(SLOT_HINT_MAX_S * 1000),
                               max(1000, int(best_ms - request.deadline_ms), math.ceil(forgets_s * 1000))))

    def _expected(self, request: PlacementRequest, generated: int) -> int:
        """The tokens request is expected to generate yet, having generated that many: the mean of what its model's
        answers longer than that had left, at most its max_tokens (the typical answer where none seen was longer).
        (Judged on the typical answer whatever it had, a stream 1,500 tokens into an answer of 2,000 moved as if 256
        were left, and a survivor prefilled it again to end it at its deadline.)"""
        return max(1, min(request.max_tokens, math.ceil(self._predictor.expected_remaining_tokens(request, generated))))

    def _idle_end_s(self, options: list[Option], models: list[str], now: float) -> float | None:
        """The soonest predicted end on the options' candidates as if nothing else ran there (their load, the
        placements they have not reported and the prompts sent them lately taken away); None unless every node
        listing one of models is a warm candidate with a profile (_all_warm) and some prediction is made."""
        if not self._all_warm(options, models):
            return None
        ends = [end for o in options
                if (end := self._idle_predictor.best_finish_s(o.request, [_idle(s) for s in o.candidates],
                                                              o.matched_blocks, now)) is not None]
        return min(ends) if ends else None

    def _all_warm(self, options: list[Option], models: list[str]) -> bool:
        """Whether every node listing one of models is one of the options' candidates, with it warm and a profile: else
        one may come back, end its load or calibrate, and do better than the candidates idle."""
        warm = {s.spec.node_id for o in options for s in o.candidates
                if o.request.model in s.spec.warm_models and s.profile(o.request.model) is not None}
        return all(s.spec.node_id in warm for s in self.cluster.nodes() if any(s.spec.has(m) for m in models))

    def _check_ttft_idle(self, request: PlacementRequest, options: list[Option], models: list[str],
                         now: float) -> None:
        """Unmeetable when a fresh request's TTFT budget could not be met on any candidate even with its load gone, with
        what each caches of the prompt now (the floor, _refuse_the_impossible, assumes it all cached): admission would
        refuse it with a retry hint, and the openai client sent an 8,000-token prompt with a 100 ms budget three times
        to an idle fleet in 2 s, each a 429 (helper-206). As for a deadline (_idle_end_s), only where every node listing
        one of models is a warm candidate with a profile; a retry may still find more of the prompt cached, which this
        does not wait for: the client can send its prefix first."""
        if not self._all_warm(options, models):
            return
        firsts = [self._idle_predictor.best_ttft_s(o.request, [_idle(s) for s in o.candidates], o.matched_blocks, now)
                  for o in options if o.candidates]
        if firsts and (first_ms := min(firsts) * 1000) > request.ttft_budget_ms:
            raise Unmeetable("ttft_budget_ms", request.ttft_budget_ms,
                             f"cannot be met: its first token is predicted to take {first_ms:.0f} ms on an idle node, "
                             "with nothing else running and what is cached of its prompt now (ask for a larger budget)")

    def after_queueing(self, plan: Plan, options: list[Option], now: float,
                       changing: Changing = _none_changing) -> list[Option]:
        """The options of a request that waited for admission, on the fleet as it is now."""
        self.refresh(plan, now, changing)
        fresh = [dataclasses.replace(o, candidates=plan.candidates[o.request.model]) for o in options]
        fresh = [o for o in fresh if o.candidates]
        if not fresh:
            raise Unavailable(f"model={shown(plan.ask.request.model)}: no live node left for it after queueing")
        with self._predictor.remembering():
            self._check_deadline(plan.ask.request, fresh, now, waited_s=now - plan.started_at,
                                 resumed=plan.ask.resumed, judged=self._choosable(fresh, now),
                                 generated=plan.ask.num_generated_tokens)
        return fresh

    def decide(self, options: list[Option], now: float) -> Placed:
        """The policy's choice, counted on the chosen node until its next load report."""
        index, decision = self.policy.choose_among(options, now)
        request = options[index].request
        self.cluster.record_placement(decision.node_id, request.num_prompt_blocks, now)
        self.planner.note_demand(request.model, now)
        chosen = self.cluster.get(decision.node_id)
        return Placed(decision, request, is_cold=chosen is not None and request.model not in chosen.spec.warm_models)


def ticket_of(ask: PlaceAsk, now: float, attempt: int = 0) -> Ticket:
    """The admission ticket of ask, a fresh request asked for at now by Place call attempt."""
    request = ask.request
    return Ticket(request_id=request.request_id, tenant=request.tenant or DEFAULT_TENANT, priority=request.priority,
                  num_tokens=request.num_prompt_tokens + request.max_tokens, arrived_at=now,
                  deadline_at=now + request.ttft_budget_ms / 1000
                  if request.ttft_budget_ms and not ask.resumed else math.inf,
                  ends_by=now + request.deadline_ms / 1000 if request.deadline_ms else math.inf,
                  # A step of a workflow only: a lone request claiming step 3 of 3 jumped its tenant's queue.
                  progress=(request.step - 1) / request.total_steps
                  if request.total_steps and request.workflow_id else 0.0,
                  max_tokens=request.max_tokens, holder=ask.router_id, resumed=ask.resumed,
                  prompt_digest=ask.prompt_digest, attempt=attempt)


def _idle(status: NodeStatus) -> NodeStatus:
    """status with nothing running, waiting or placed there (its KV room and cache as they are)."""
    return dataclasses.replace(status, load=Load(kv_blocks_total=status.load.kv_blocks_total), placed_prefill_blocks=0,
                               placed_requests=0, unreceived=deque(), num_received=None)
