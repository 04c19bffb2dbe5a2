"""Baton's placement: the node that minimises the expected cost per successful task. Pure.

For every candidate it predicts, from that node's GPU generation (the engine's own timing model),
its load and what it caches of the prompt:

- TTFT: the prefill queued ahead of the request plus its own uncached prefill, chunked as the
  engine chunks it, each chunk a step of its own (riding in a decode step of the running batch, or a
  prefill-only step with its launch overhead on a node with none); and, when the node already
  holds as many sequences as its engine runs at once (max_num_seqs, from its profile), the time for
  enough of them to end;
- TPOT: a decode step of the node's batch with this request in it, plus the prefill chunks that
  ride in each step: the prompt tokens this policy has been sending the node (a rate over the last
  `RATE_WINDOW_S`) arrive while the request decodes, so a node that keeps receiving work predicts a
  slower TPOT and the next request spreads to another — packing stops before it risks the SLO;
- the GPU time the request takes from others there: its prefill, at the node's price and priced at
  what it displaces (half the price on an idle node, all of it on a busy one: an idle GPU of a
  provisioned fleet is paid for anyway, so a prefix cached on a busy node does not outweigh an idle
  GPU), and a model load in full. Its decode steps are not priced at the node's price: a step is
  shared by its batch, and on a provisioned fleet the node is paid whether or not this request
  rides in it. (Charged per token at the node's price, a long answer went to a cheaper, slower GPU
  and held the fleet late; charged a share of each step, work packed onto few GPUs);
- its latency, the predicted TTFT plus the time to decode the expected answer, at the fleet's mean
  GPU price: the fleet is paid while the request waits and runs, whichever GPU it runs on, so on a
  provisioned fleet a slower, cheaper GPU is not free, a fuller batch (a slower step) costs more,
  and a request queued behind others' prefill while a GPU idles holds its user and, at the end of
  a run, the fleet;
- the chance of meeting the request's own SLO (TTFT and TPOT budgets, deadline; the cluster's
  defaults where it sets none): a smooth function of the predicted slack, so a prediction error of
  a quarter of the budget is not fatal;
- on a node where the model is not warm (its GPU free, the model on its disk): the time left to
  load it, added to the TTFT, and the GPU time the load takes, added to the cost.

- the successes it would cost others there: its prefill chunks ride in the decode steps of the
  requests decoding on that node, and a short answer among them (a 3-token reply with one
  2,048-token chunk step in it averages over 30 ms) misses its TPOT budget. Over the output
  lengths it has seen end (as a histogram; those found decoding are likelier long ones), with the
  requests queued ahead of it counted as fresh: they start decoding just as its chunks run.

The score is (cost · (1 + lost) + (1 − p) · at_risk) / p: the cost of this step per success, each
success it costs others counted as a failure of its own, plus — weighted by the chance of failing —
what a failure would forfeit: what the workflow has already spent, and the request's priority as a
stake of priority × its own cost. (Subtracting the others' losses from p instead sent requests to a
node where they would surely miss, since it harms no one there.) A fresh request with slack goes where it
ends soonest at the least displaced prefill, a cheaper GPU once the fast one's queue or batch would
make it end later; a tight budget pays for a fast GPU; a late step of an
expensive workflow, or a high-priority request, buys certainty; a cold node wins only when the
warm ones would likely miss a budget that allows the load. Nodes without KV room are avoided.
Every decision keeps its per-axis terms (`last_terms()`).

A node whose profile is only its start-up sweep's (a vLLM engine's calibration, not yet refined from
real steps) may be slower on paper than it is: a sweep slowed by a neighbour. Such a node would get
no request while faster ones have room, and so never be corrected. So when it is idle, predicted to
meet the request's SLO and to cache no less of the prompt than the best node, it is given the
request as a trial (not a workflow's later step nor a prioritised request), at most once every
`TRIAL_EVERY_S`, and the decision says so. Once its engine has
refined the profile online, it is placed like any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Iterator

from services.common.block_hash import DEFAULT_BLOCK_SIZE
from services.common.engine_profile import ProfileSource
from services.common.slo import DEFAULT_TPOT_BUDGET_MS, DEFAULT_TTFT_BUDGET_MS
from services.scheduler.fleet import NodeStatus
from services.scheduler.policies.base import (
    Decision,
    Option,
    PlacementRequest,
    Policy,
    Terms,
    decision,
    num_in_flight,
    warm_first,
)
from services.scheduler.policies.kv_load import KvLoadPolicy
from services.scheduler.policies.node_timing import TimingModel, noting_unprofiled

# Spread of the success curve, as a fraction of the budget.
SLACK_SPREAD = 0.25
# The least success chance a score divides by: small enough that between two nodes that would both
# likely miss, the one nearer its budget still wins (at 1e-3 both floored, and the cheaper won).
MIN_SUCCESS = 1e-9
# Predictions ignore the requests that will join the batch later, so aim well inside the budgets (0.4 was
# tuned in the simulator on the first 2,500 requests of the Mooncake conversation trace).
BUDGET_MARGIN = 0.4
# A TPOT budget gets a wider fraction: a decode step varies far less than a queue does, and at 0.4 a
# 30 ms budget became 12 ms, which an H100's plain decode step nearly fills, so every node looked like
# a coin flip and the score followed noise (tuned over 0.4–1.0 on requests 3,000–3,600 and 6,000–6,600
# of the Mooncake conversation trace, TPOT 30 ms, 8 H100 and the mixed fleet: 0.6–0.8 all alike).
TPOT_BUDGET_MARGIN = 0.7
# Prefill time on a node is priced at IDLE_COST_SHARE of its price when the node is idle, rising to all
# of it once BUSY_BATCH requests (or that many chunks of queued prefill) are there: an idle GPU of a
# provisioned fleet is paid for anyway, so a prefix cached on a busy node is worth less than the time
# an idle one would take to compute it (chosen among (8, 0.5), (16, 0.5), (8, 0.25), (32, 0.5), on
# prefill and decode time alike, then on prefill time only, on the windows TPOT_BUDGET_MARGIN was
# chosen on and at TPOT 100 ms on 8 H100, the mixed fleet, 2 H100 + 8 L4 and an SLO mix there).
IDLE_COST_SHARE = 0.5
BUSY_BATCH = 8
# Each millisecond of predicted latency (TTFT plus decode) costs this share of a millisecond of the
# fleet's mean GPU price. Chosen on the windows TPOT_BUDGET_MARGIN was chosen on (seeds 10 and 11; 8 H100,
# the mixed fleet at 1x and 3x, 2 H100 + 8 L4, an SLO mix): first TTFT alone at the node's price (0.5–8:
# 1, and 2–8 no better), then TTFT and decode at the fleet's mean price, decode weighted 0, 0.5, 1 or 2
# (2 had fewer SLO misses at similar cost; 1 keeps one weight for the whole latency). Chosen while decode
# was also priced at the node's price; checked again on the tuning windows since decode is priced only here
# (seeds 10-19: decode weighted 0.5, or by the size-biased mean output length, both failed the adoption
# rule; docs/evaluation.md, "Tried after this round").
LATENCY_PRICE_SHARE = 1.0
# A priority-k request's failure forfeits k times its own cost beyond that cost (k ≤ 0: nothing).
PRIORITY_STAKE = 1.0
# Workflows whose spend is remembered; the least recently active are forgotten first.
MAX_WORKFLOWS = 100_000
# A node whose profile is its start-up calibration's gets a request as a trial at most this often, and only one
# predicted to meet its SLO there with at least this chance (see the module docstring). 30 s is the online
# refinement's least interval between refits; the first refit comes after 64 observed steps.
TRIAL_EVERY_S = 30.0
TRIAL_MIN_SUCCESS = 0.9
# Expected output length before any request of a model has ended, and how fast the average follows them.
DEFAULT_OUTPUT_TOKENS = 256.0
OUTPUT_SMOOTHING = 0.02
# The prompt tokens sent to a node over this many seconds give the prefill rate its decode steps carry.
RATE_WINDOW_S = 10.0
# Output lengths of ended requests are kept per model in power-of-two bins (1, 2–3, 4–7, … tokens).
OUTPUT_BINS = 16
# And the last this many of them as they were, for what a stream that has generated some is expected to generate yet.
RECENT_OUTPUTS = 1024
# What places a request when no candidate registered an engine profile, and what becomes of the
# candidates without one when others have one (docs/placement.md, "Engine profiles").
NO_PROFILE_FALLBACK = "dynamo's KV-load cost (uncached prompt blocks plus load)"
NOT_SCORED = "not scored, placed among the candidates that have one"


def _success(budget_ms: float, predicted_ms: float) -> float:
    if budget_ms <= 0:
        return 1.0
    slack = (budget_ms - predicted_ms) / (SLACK_SPREAD * budget_ms)
    return 1.0 / (1.0 + math.exp(min(-4.0 * slack, 700.0)))  # far past the budget: 0, without overflow


def _tpot_ms(timing: TimingModel, decode_ms: float, prefill_tokens_per_s: float, chunk: int) -> float:
    """A decode step's time with the prefill chunks that arrive at the node meanwhile riding in it.

    A step of T ms carries rate · T prompt tokens (at most a chunk), which lengthen it by
    b·x + c·x²: the fixed point of T = decode + b·x(T) + c·x(T)², found by iteration.
    """
    step_ms = decode_ms
    for _ in range(8):
        riding = min(prefill_tokens_per_s * step_ms / 1000.0, float(chunk))
        step_ms = decode_ms + timing.riding_chunk_ms(riding)
    return step_ms


def _prefill_steps_ms(timing: TimingModel, tokens: int, chunk: int, decode_ms: float) -> float:
    """The steps that prefill tokens in chunks of at most chunk, as the engine runs them: beside a decode
    batch of step decode_ms each chunk rides in a decode step (decode + b·n + c·n²); on a node with none,
    each is a prefill-only step with its own launch overhead and floor (max(floor, a + b·n) + c·n²)."""
    full, last = divmod(tokens, chunk)

    def step_ms(n: int) -> float:
        return decode_ms + timing.riding_chunk_ms(n) if decode_ms else timing.prefill_ms([n])

    return max(timing.prefill_floor_ms, full * step_ms(chunk) + (step_ms(last) if last else 0.0))


class BatonPolicy(Policy):
    name = "baton"
    #: It predicts load time, so it may be offered nodes where the model is cold.
    weighs_cold_nodes = True

    def __init__(self, default_ttft_budget_ms: float = DEFAULT_TTFT_BUDGET_MS,
                 default_tpot_budget_ms: float = DEFAULT_TPOT_BUDGET_MS,
                 default_output_tokens: float = DEFAULT_OUTPUT_TOKENS) -> None:
        self._default_ttft_budget_ms = default_ttft_budget_ms
        self._default_tpot_budget_ms = default_tpot_budget_ms
        # What each workflow has been placed for so far (its steps' cost, as priced here: prefill, loads
        # and latency), by workflow id, least recent first.
        self.workflow_spent: OrderedDict[str, float] = OrderedDict()
        self._last_terms: list[Terms] = []
        # Per model: the mean output length of requests that ended (an exponential average), which
        # with max_tokens bounds the decode a request is expected to run; it is never told the true length.
        self._default_output_tokens = default_output_tokens
        self._output_tokens: dict[str, float] = {}
        # Per model: how many ended requests made 2^i … 2^(i+1) − 1 tokens, for the harm a prefill does
        # to the short ones decoding beside it.
        self._output_bins: dict[str, list[int]] = {}
        self._recent_outputs: dict[str, deque[int]] = {}
        self._fallback = KvLoadPolicy()
        # Per node: (when, uncached prompt tokens) of the placements of the last RATE_WINDOW_S, and their sum.
        self._sent: dict[str, deque[tuple[float, int]]] = {}
        self._sent_tokens: dict[str, int] = {}
        # Per node: when it was last given a request as a trial of its calibrated profile.
        self._tried: dict[str, float] = {}
        # terms() by request, node, cached blocks, time and fleet price, while a caller asks several questions of
        # one fleet state (remembering), with the request and node they were computed for; None otherwise.
        self._remembered: dict[tuple[int, int, int, float, float | None],
                               tuple[PlacementRequest, NodeStatus, Terms | None]] | None = None

    @contextlib.contextmanager
    def remembering(self) -> Iterator[None]:
        """Within, terms() is computed once for each request, node, cached blocks, time and fleet price: for a
        caller that asks several questions of the fleet as it is, changing nothing in between (admission judges a
        request's KV room, end and first token on each candidate: it computed each term three times, helper-195's
        review). Placing a request here forgets them; within a scope already open, it is that scope."""
        if self._remembered is not None:
            yield
            return
        self._remembered = {}
        try:
            yield
        finally:
            self._remembered = None

    def _prefill_rate(self, node_id: str, now: float) -> float:
        """Prompt tokens a second this policy has lately sent node_id to prefill."""
        sent = self._sent.get(node_id)
        if not sent:
            return 0.0
        while sent and sent[0][0] <= now - RATE_WINDOW_S:
            self._sent_tokens[node_id] -= sent.popleft()[1]
        return self._sent_tokens[node_id] / RATE_WINDOW_S

    def prompt_rate_forgets_in_s(self, node_id: str, now: float) -> float:
        """How long until the prompts this policy sent node_id lately no longer count in its predicted decode steps
        (0: none count)."""
        sent = self._sent.get(node_id)
        return max(0.0, sent[-1][0] + RATE_WINDOW_S - now) if sent else 0.0

    def _record_sent(self, node_id: str, tokens: int, now: float) -> None:
        if self._remembered is not None:
            self._remembered.clear()
        self._sent.setdefault(node_id, deque()).append((now, tokens))
        self._sent_tokens[node_id] = self._sent_tokens.get(node_id, 0) + tokens

    def terms(self, request: PlacementRequest, status: NodeStatus, matched_blocks: int,
              now: float = 0.0, fleet_price_per_hour: float | None = None) -> Terms | None:
        """The per-axis prediction for one node; None when it registered no profile for the model.

        fleet_price_per_hour prices the request's latency: the mean price of the GPUs it could run on
        (the node's own price when not given).
        """
        if self._remembered is None:
            return self._terms(request, status, matched_blocks, now, fleet_price_per_hour)
        # By identity (a request's hash would sum its prompt's block hashes), kept alive with the terms, so that no
        # other object takes its id within the scope (two requests made one after the other inside it had one id,
        # and the second got the first's terms, helper-204).
        key = (id(request), id(status), matched_blocks, now, fleet_price_per_hour)
        if key not in self._remembered:
            self._remembered[key] = (request, status,
                                     self._terms(request, status, matched_blocks, now, fleet_price_per_hour))
        return self._remembered[key][2]

    def _terms(self, request: PlacementRequest, status: NodeStatus, matched_blocks: int, now: float,
               fleet_price_per_hour: float | None) -> Terms | None:
        profile = status.profile(request.model)
        if profile is None:
            return None
        timing = profile.timing
        warm = request.model in status.spec.warm_models
        load_s = 0.0
        if not warm:  # a free GPU with the model on disk: it must be loaded (or finish loading) first
            load_s = status.spec.load_time_s.get(request.model, 0.0)
            if request.model in status.spec.loading_models:
                load_s = max(0.0, load_s - (now - status.models_since))
            matched_blocks = 0
        load = status.load
        # Matched and placed prompt blocks count the router's keys, DEFAULT_BLOCK_SIZE tokens each; the node's
        # own counts (its KV blocks, its decoding context) are in its engine's blocks (vLLM's are 32 tokens on CPU).
        block, chunk = status.spec.kv_block_size, status.spec.max_num_batched_tokens
        cached = min(matched_blocks * DEFAULT_BLOCK_SIZE // block * block, max(0, request.num_prompt_tokens - 1))
        own = request.num_prompt_tokens - cached
        ahead = load.pending_prefill_tokens + status.placed_prefill_blocks * DEFAULT_BLOCK_SIZE
        batch = load.num_running + load.num_waiting + status.placed_requests
        # A step runs at most max_num_seqs sequences; those beyond wait for running ones to end.
        slots = profile.max_num_seqs or batch + 1
        context = load.active_decode_blocks * block
        decode_ms = timing.decode_step_ms(min(batch, slots), context) if batch else 0.0
        decode_tokens = self.expected_output_tokens(request)
        ttft_ms = _prefill_steps_ms(timing, ahead + own, chunk, decode_ms) + load_s * 1000
        rate = self._prefill_rate(status.spec.node_id, now)
        base_tpot_ms = _tpot_ms(timing, decode_ms, rate, chunk)
        # Past the limit it waits for the (batch + 1 − slots) ahead of it in line to end, slots at a time,
        # each a typical answer of the model long (not this request's max_tokens: a short request waits as
        # long as a long one), in steps with the arriving prefill riding in them (unmodelled, 16 requests on
        # two nodes of max_num_seqs 2 all went to the faster one, queued there while the other idled).
        if batch + 1 > slots:
            typical = self._output_tokens.get(request.model, self._default_output_tokens)
            ttft_ms += (batch + 1 - slots) / slots * typical * base_tpot_ms
        tpot_ms = _tpot_ms(timing, timing.decode_step_ms(min(batch + 1, slots), context + request.num_prompt_tokens),
                           rate, chunk)
        own_prefill_ms = timing.b_ms_per_tok * own + timing.c_ms_per_tok2 * min(own, chunk) * own
        # Prefill is priced at what it displaces: an idle GPU's time is paid for whether used or not, so
        # computing a prompt there costs half, and a prefix cached on a busy node is worth less than an
        # idle GPU's time. A load takes the GPU out of service whatever else would come: it is paid in
        # full. Decode steps are not priced at the node's price, only as latency (below): the batch
        # shares each step, and the node is paid whether this request rides in it or not.
        busy = min(1.0, (batch + ahead / chunk) / BUSY_BATCH)
        displaced = IDLE_COST_SHARE + (1.0 - IDLE_COST_SHARE) * busy
        # Latency is priced, at the fleet's mean price: the fleet is paid while the request waits and
        # decodes, whichever GPU it is on (unpriced, a cached prefix on a queued node won: a median TTFT of
        # 0.46 s against llm-d's 0.32 s on 8 H100 at TPOT 30 ms; at the node's price a slow cheap GPU
        # looked cheap while it held the fleet).
        price = status.spec.price_per_hour
        latency_ms = ttft_ms + decode_tokens * tpot_ms
        cost = ((own_prefill_ms * displaced + load_s * 1000) * price
                + LATENCY_PRICE_SHARE * latency_ms * (fleet_price_per_hour or price)) / 3_600_000.0
        ttft_budget = (request.ttft_budget_ms or self._default_ttft_budget_ms) * BUDGET_MARGIN
        full_tpot_budget = request.tpot_budget_ms or self._default_tpot_budget_ms
        tpot_budget = full_tpot_budget * TPOT_BUDGET_MARGIN
        tpot_success = _success(tpot_budget, tpot_ms)
        # A node decoding now reports its measured steps, the prefill chunks riding in them included, which the
        # prediction leaves out (a burst of prompts younger than the prompt rate's window). The measured step plus
        # what this request's joining adds is judged against the budget itself: the margin above is for what a
        # prediction leaves out, not for a measurement (judged against it, work went to idle L4s whose long
        # answers held the fleet: docs/evaluation.md, the ninth to eleventh rounds).
        measured_ms = measured_steps = 0.0
        if load.num_running and load.recent_decode_step_ms:
            measured_ms = load.recent_decode_step_ms + max(0.0, tpot_ms - base_tpot_ms)
            tpot_success = min(tpot_success, _success(full_tpot_budget, measured_ms))
            # The steps stay that slow while prompts ride in them: those queued there, and as many again as were
            # sent it over the prompt rate's window (a measurement of the last second after one long prompt, taken
            # for every step of a request, predicted 158 s for what ends in 15, helper-198).
            measured_steps = (ahead + rate * RATE_WINDOW_S) / chunk
        success = _success(ttft_budget, ttft_ms) * tpot_success
        if request.deadline_ms:
            success *= _success(request.deadline_ms * BUDGET_MARGIN, ttft_ms + decode_tokens * tpot_ms)
        needed = (math.ceil((request.num_prompt_tokens + request.max_tokens) / block)
                  - matched_blocks * DEFAULT_BLOCK_SIZE // block)
        if warm:
            placed_blocks = math.ceil(status.placed_prefill_blocks * DEFAULT_BLOCK_SIZE / block)
            free = load.kv_blocks_total - load.kv_blocks_used - placed_blocks
        else:  # a loaded model gets the free GPU's whole KV cache
            capacity = status.kv_capacity(request.model)
            free = needed if capacity is None else capacity
        spent = self.workflow_spent.get(request.workflow_id, 0.0) if request.workflow_id else 0.0
        at_risk = spent + PRIORITY_STAKE * max(0, request.priority) * cost
        # Successes this placement costs others: its prefill chunks ride in the decode steps of the
        # requests decoding there, and a short one among them may be pushed past its TPOT budget. Those
        # queued ahead of it start decoding as its chunks run; those already decoding are likelier long.
        lost = 0.0
        if warm:
            chunk_ms = timing.riding_chunk_ms(chunk)
            fresh = load.num_waiting + status.placed_requests
            for victims, bias in ((fresh, 0), (load.num_running, 1)):
                if victims:
                    lost += victims * self._harm(request.model, tpot_budget, base_tpot_ms, own_prefill_ms,
                                                 chunk_ms, bias)
        # The score is the cost per success, the successes it costs others counted as failures of its own.
        score = (cost * (1.0 + lost) + (1.0 - success) * at_risk) / max(success, MIN_SUCCESS)
        return Terms(status.spec.node_id, status.spec.gpu, cached, ttft_ms, tpot_ms, cost, success, spent,
                     needed <= free, score, warm, load_s * 1000, free, at_risk, request.model, measured_ms,
                     measured_steps)

    def _harm(self, model: str, tpot_budget_ms: float, tpot_ms: float, extra_ms: float, chunk_ms: float,
              length_bias: int) -> float:
        """The chance that a request decoding on the node misses its TPOT budget because extra_ms of
        prefill, in chunks of chunk_ms, joins its steps: over the output lengths seen so far (weighted
        by length when length_bias is 1: a request found decoding is likelier a long one), each step
        carrying at most one chunk."""
        bins = self._output_bins.get(model)
        if not bins or extra_ms <= 0:
            return 0.0
        base = _success(tpot_budget_ms, tpot_ms)
        weight = harm = 0.0
        for i, count in enumerate(bins):
            if count:
                tokens = 1.5 * (1 << i)
                share = count * tokens ** length_bias
                weight += share
                if tokens >= 2:
                    added = min(extra_ms / (tokens - 1), chunk_ms)
                    harm += share * (base - _success(tpot_budget_ms, tpot_ms + added))
        return harm / weight

    def choose(
        self, request: PlacementRequest, candidates: list[NodeStatus], matched_blocks: dict[str, int], now: float
    ) -> Decision:
        return self.choose_among([Option(request, candidates, matched_blocks)], now)[1]

    def choose_among(self, options: list[Option], now: float) -> tuple[int, Decision]:
        """The best (model, node) of every model the request accepts: each priced the same way."""
        everyone = [(o.request.model, s) for o in options for s in o.candidates]
        fleet_price = sum(s.spec.price_per_hour for _, s in everyone) / len(everyone) if everyone else None
        scored = [(t, i, s) for i, option in enumerate(options) for s in option.candidates
                  if (t := self.terms(option.request, s, option.matched_blocks.get(s.spec.node_id, 0), now,
                                      fleet_price))]
        if not scored:  # no candidate registered a profile: place by KV overlap and load, and say so
            self._last_terms = []
            index = next(i for i, option in enumerate(options) if option.candidates)
            option = options[index]
            chosen = self._fallback.choose(option.request, warm_first(option.request, option.candidates),
                                           option.matched_blocks, now)
            return index, noting_unprofiled(chosen, everyone, NO_PROFILE_FALLBACK, none_scored=True)
        roomy = [entry for entry in scored if entry[0].has_kv_room] or scored
        best_terms, index, best = min(roomy, key=lambda e: (e[0].score, e[0].ttft_ms, e[1], e[2].spec.node_id))
        trial = self._trial(roomy, options, best_terms, index, now)
        if trial is not None:
            best_terms, index, best = trial
        self._last_terms = [t for t, _, _ in scored]
        request = options[index].request
        self._record_sent(best.spec.node_id, request.num_prompt_tokens - best_terms.cached_tokens, now)
        if request.workflow_id:
            self.workflow_spent[request.workflow_id] = best_terms.workflow_spent + best_terms.cost
            self.workflow_spent.move_to_end(request.workflow_id)
            if len(self.workflow_spent) > MAX_WORKFLOWS:
                self.workflow_spent.popitem(last=False)
        chosen = decision(best, options[index].matched_blocks, best_terms.score)
        if trial is not None:
            chosen = dataclasses.replace(chosen, fallback=(
                f"a trial of {best.spec.node_id}: its profile is its start-up calibration's, not yet refined from "
                f"real steps; idle, predicted to meet the SLO with chance {best_terms.success:.2f}"))
        return index, noting_unprofiled(chosen, everyone, NOT_SCORED, none_scored=False)

    def _trial(self, scored: list[tuple[Terms, int, NodeStatus]], options: list[Option], best: Terms, index: int,
               now: float) -> tuple[Terms, int, NodeStatus] | None:
        """An idle node whose profile is its start-up calibration's, to be tried instead of best (the best of option
        index; see the module docstring); None when there is none, or when best is one (its trial is counted). Of the
        same model only: a trial never changes which model answers. Never a request with more at stake than its own
        cost: a workflow's later step, or one with a priority."""
        model = options[index].request.model

        def is_calibrated(status: NodeStatus) -> bool:
            profile = status.profile(model)
            return profile is not None and profile.source is ProfileSource.CALIBRATED

        trials = [(t, i, s) for t, i, s in scored
                  if i == index and is_calibrated(s) and t.warm and num_in_flight(s) == 0
                  and t.success >= TRIAL_MIN_SUCCESS and t.cached_tokens >= best.cached_tokens and t.at_risk == 0
                  and now - self._tried.get(s.spec.node_id, -math.inf) >= TRIAL_EVERY_S]
        if not trials:
            return None
        trial = min(trials, key=lambda e: (e[0] is not best, e[0].score, e[2].spec.node_id))
        self._tried[trial[2].spec.node_id] = now
        return None if trial[0] is best else trial

    def last_terms(self) -> list[Terms]:
        return self._last_terms

    def expected_output_tokens(self, request: PlacementRequest) -> float:
        """Tokens the request is expected to generate: max_tokens, or less when its model's requests
        have lately ended sooner on average."""
        typical = self._output_tokens.get(request.model, self._default_output_tokens)
        return min(float(request.max_tokens), typical) if request.max_tokens else typical

    def expected_remaining_tokens(self, request: PlacementRequest, generated: int) -> float:
        """Tokens a stream of request that has generated that many is expected to generate yet, at most its max_tokens
        more: over the model's last RECENT_OUTPUTS answers longer than that, the mean of what each had left, each
        capped at max_tokens (a 20,000-token answer in 20 weighs as a max_tokens one, not as 20,000);
        expected_output_tokens where none was longer (or none has ended)."""
        cap = request.max_tokens or math.inf
        left = [min(length - generated, cap) for length in self._recent_outputs.get(request.model, ())
                if length > generated]
        return sum(left) / len(left) if left else self.expected_output_tokens(request)

    def observe_finished(self, model: str, num_output_tokens: int) -> None:
        bins = self._output_bins.setdefault(model, [0] * OUTPUT_BINS)
        bins[min(max(num_output_tokens, 1).bit_length() - 1, OUTPUT_BINS - 1)] += 1
        self._recent_outputs.setdefault(model, deque(maxlen=RECENT_OUTPUTS)).append(num_output_tokens)
        mean = self._output_tokens.get(model)
        self._output_tokens[model] = float(num_output_tokens) if mean is None else (
            mean + OUTPUT_SMOOTHING * (num_output_tokens - mean))

    def workflow_state(self) -> dict[str, float]:
        return dict(self.workflow_spent)

    def restore_workflow_state(self, state: dict[str, float]) -> None:
        self.workflow_spent.update(state)

    def best_finish_s(self, request: PlacementRequest, candidates: list[NodeStatus],
                      matched_blocks: dict[str, int], now: float = 0.0) -> float | None:
        """The soonest predicted end of request, max_tokens generated, on its best candidate: TTFT + max_tokens ×
        TPOT, the node's measured step where it decodes now and that
        is slower, for as many steps as prompts are expected to ride in them (the chunks of the prompts riding in its
        steps, which the prediction leaves out: 157 ms steps predicted as 45 ms let in requests three quarters of
        which then missed their deadlines on the nodes left after a host died, helper-195); None without a timing
        model."""
        ends = [t.ttft_ms + request.max_tokens * t.tpot_ms
                + min(request.max_tokens, t.measured_steps) * max(0.0, t.measured_tpot_ms - t.tpot_ms)
                for s in candidates if (t := self.terms(request, s, matched_blocks.get(s.spec.node_id, 0), now))]
        return min(ends) / 1000 if ends else None

    def floor_s(self, request: PlacementRequest, statuses: list[NodeStatus]) -> tuple[float, float, float] | None:
        """A floor under request's first token, its end (max_tokens generated) and its time per output token on any
        of statuses, whatever their load, caches or models' state: its last prompt token alone to prefill (the rest
        cached), in the cheaper of a prefill-only step and a decode step of one, then max_tokens - 1 decode steps
        alone, each one such step. Below every terms() prediction on them, so a budget under it cannot be met by
        asking again. None when one has no profile for the model (nothing is known of it) or there are none."""
        floors = []
        for status in statuses:
            profile = status.profile(request.model)
            if profile is None:
                return None
            timing = profile.timing
            first_ms = min(timing.prefill_ms([1]), timing.decode_step_ms(1, 0) + timing.riding_chunk_ms(1))
            step_ms = timing.decode_step_ms(1, request.num_prompt_tokens)
            floors.append((first_ms, first_ms + (request.max_tokens - 1) * step_ms, step_ms))
        if not floors:
            return None
        return tuple(min(f[i] for f in floors) / 1000 for i in range(3))  # type: ignore[return-value]

    def best_ttft_s(self, request: PlacementRequest, candidates: list[NodeStatus],
                    matched_blocks: dict[str, int], now: float = 0.0) -> float:
        """The shortest predicted time to first token any candidate offers (0 without a timing model)."""
        terms = [t for s in candidates
                 if (t := self.terms(request, s, matched_blocks.get(s.spec.node_id, 0), now))]
        return min(t.ttft_ms for t in terms) / 1000 if terms else 0.0

