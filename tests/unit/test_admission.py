"""Admission: limits, feasibility, shedding, bands, fair share between tenants, EDF."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.scheduler.admission import Admission, TenantLimits, Ticket, Verdict, pool_saturation


def ticket(rid: str, tenant: str = "t", priority: int = 0, tokens: int = 100, at: float = 0.0,
           deadline: float = math.inf) -> Ticket:
    return Ticket(request_id=rid, tenant=tenant, priority=priority, num_tokens=tokens, arrived_at=at,
                  deadline_at=deadline)


def test_an_idle_fleet_admits_at_once() -> None:
    assert Admission().offer(ticket("a"), 0.0, is_saturated=False, predicted_ttft_s=0.1).verdict == Verdict.ADMIT


def test_an_impossible_deadline_is_refused_at_once_with_a_hint() -> None:
    outcome = Admission().offer(ticket("a", deadline=0.5), 0.0, is_saturated=False, predicted_ttft_s=2.0)
    assert outcome.verdict == Verdict.REJECT
    assert outcome.reason == ("TTFT budget cannot be met: needs about 2000 ms to the first token (of which 0 ms "
                              "behind those queued ahead), has 500 ms") and outcome.retry_after_s > 0


def test_a_ttft_refusal_hints_no_sooner_than_its_excess() -> None:
    """Its prediction counted a model's 124 s load on a free GPU: asked again a second later (the hint was the 1 s
    floor), it was refused again, every time until the load was nearly done (helper-126)."""
    outcome = Admission().offer(ticket("a", deadline=20.0), 0.0, is_saturated=False, predicted_ttft_s=64.5)
    assert outcome.verdict == Verdict.REJECT and outcome.retry_after_s == 44.5
    # Never past the longest Retry-After the openai client waits out (longer, it does not retry at all).
    longer = Admission().offer(ticket("a", deadline=20.0), 0.0, is_saturated=False, predicted_ttft_s=124.5)
    assert longer.retry_after_s == 60.0


def test_a_saturated_fleet_queues_and_sheds_the_sheddable() -> None:
    admission = Admission()
    assert admission.offer(ticket("a"), 0.0, True, 0.1).verdict == Verdict.QUEUE
    refused = admission.offer(ticket("b", priority=-1), 0.0, True, 0.1)
    assert refused.verdict == Verdict.REJECT and "sheddable" in refused.reason


def test_tenant_limits_name_the_limit() -> None:
    admission = Admission(limits={"t": TenantLimits(max_concurrency=1, tokens_per_minute=150)})
    first = ticket("a")
    assert admission.offer(first, 0.0, False, 0.1).verdict == Verdict.ADMIT
    admission.on_admitted(first, 0.0)
    busy = admission.offer(ticket("b"), 1.0, False, 0.1)
    assert busy.verdict == Verdict.REJECT and "concurrency limit of 1" in busy.reason
    admission.release("a")
    over = admission.offer(ticket("c"), 2.0, False, 0.1)
    assert over.verdict == Verdict.REJECT and "150 tokens per minute" in over.reason
    assert over.retry_after_s == 58.0
    assert admission.offer(ticket("d"), 61.0, False, 0.1).verdict == Verdict.ADMIT  # the window moved on


def test_a_queued_request_its_own_router_sends_again_takes_its_own_place() -> None:
    """A router abandons a Place when etcd shows a new leader, and sends it again: when the new leader was the same
    replica, elected again, the first call could still be queued there. Refused as a duplicate, the request failed
    for good (409, not retried), and the first ask ran later with no router behind it (helper-125). From another
    router, unresumed, it is still a duplicate."""
    admission = Admission()
    first = dataclasses.replace(ticket("a", at=0.0, deadline=10.0), holder="r1")
    assert admission.offer(first, 0.0, True, 0.1).verdict == Verdict.QUEUE
    later = dataclasses.replace(ticket("b", at=0.5, deadline=10.4), holder="r1")
    assert admission.offer(later, 0.5, True, 0.1).verdict == Verdict.QUEUE
    # Its TTFT budget counted again from the resend (its router's clock) would end later than the first call's.
    again = admission.offer(dataclasses.replace(ticket("a", at=1.0, deadline=11.0), holder="r1"), 1.0, True, 0.1)
    assert again.verdict == Verdict.QUEUE and again.replaced is first
    other = admission.offer(dataclasses.replace(ticket("a", at=2.0), holder="r2"), 2.0, True, 0.1)
    assert other.verdict == Verdict.REJECT and other.duplicate
    popped = admission.pop_next(3.0)
    assert popped is not None and (popped.request_id, popped.arrived_at, popped.deadline_at) == ("a", 0.0, 10.0)
    assert admission.pop_next(3.0).request_id == "b" and admission.pop_next(3.0) is None


def test_earliest_deadline_first_counts_deadline_ms_as_well_as_the_ttft_budget() -> None:
    """Within a tenant, a request with only an end-to-end deadline went after its tenant's requests with none
    (helper-125); it goes by the earlier of its deadlines."""
    admission = Admission()
    for queued in (ticket("none", at=0.0), dataclasses.replace(ticket("ends", at=1.0), ends_by=20.0),
                   ticket("first_token", at=2.0, deadline=30.0)):
        assert admission.offer(queued, queued.arrived_at, True, 0.1).verdict == Verdict.QUEUE
    assert [admission.pop_next(3.0).request_id for _ in range(3)] == ["ends", "first_token", "none"]
    # And a request judged on its TTFT budget counts those that will go before it, by that order.
    admission.offer(dataclasses.replace(ticket("ends", at=0.0), ends_by=1.0), 0.0, True, 1.0)
    behind = admission.offer(ticket("budget", at=0.0, deadline=1.5), 0.0, True, 1.0)
    assert behind.verdict == Verdict.REJECT and "(of which 1000 ms behind those queued ahead)" in behind.reason


def test_a_tenant_over_its_tokens_per_minute_is_told_when_enough_of_them_expire() -> None:
    """Told when its oldest charge expired, a client came back while later charges still filled the window, and was
    refused again (helper-157: 300 tokens at 0 s, 600 at 10 s, a limit of 1000; 500 more at 12 s were told 48 s)."""
    admission = Admission(limits={"t": TenantLimits(tokens_per_minute=1000)})
    for name, at, tokens in (("a", 0.0, 300), ("b", 10.0, 600)):
        admission.on_admitted(ticket(name, tenant="t", tokens=tokens), at)
        admission.release(name)
    over = admission.offer(ticket("d", tenant="t", tokens=500), 12.0, False, 0.1)
    assert over.verdict == Verdict.REJECT and over.retry_after_s == 58.0  # b's 600 expire at 70 s, a's alone do not do
    # With its tenant's requests waiting for admission, a whole window: they charge theirs once dispatched (told when
    # the last charge expired, a client came back in vain, helper-159).
    waiting = Admission(limits={"t": TenantLimits(tokens_per_minute=1000)})
    waiting.on_admitted(ticket("old", tenant="t", tokens=100), 0.0)
    assert waiting.offer(ticket("q", tenant="t", tokens=600), 58.0, True, 0.1).verdict == Verdict.QUEUE
    behind = waiting.offer(ticket("f", tenant="t", tokens=500), 58.0, True, 0.1)
    assert behind.verdict == Verdict.REJECT and behind.retry_after_s == 60.0  # not 2 s, when "old" expires
    small = admission.offer(ticket("e", tenant="t", tokens=200), 12.0, False, 0.1)
    assert small.verdict == Verdict.REJECT and small.retry_after_s == 48.0  # a's 300 expiring at 60 s make room
    assert admission.offer(ticket("d", tenant="t", tokens=500), 60.5, False, 0.1).verdict == Verdict.REJECT
    assert admission.offer(ticket("d", tenant="t", tokens=500), 70.0, False, 0.1).verdict == Verdict.ADMIT


def test_a_request_larger_than_its_tenants_whole_minute_is_refused_under_a_reason_of_its_own() -> None:
    """Refused INVALID_ARGUMENT (no wait lets it in), it was counted under the limit's own reason, beside the 429s
    (helper-185: the scheduler's metric showed 3 such refusals, where clients got 2 429s and one 400)."""
    admission = Admission(limits={"t": TenantLimits(tokens_per_minute=1000)})
    never = admission.offer(ticket("big", tenant="t", tokens=5000), 0.0, False, 0.1)
    assert (never.verdict, never.never, never.kind) == (Verdict.REJECT, True,
                                                        "tenant tokens per minute less than the request")
    admission.on_admitted(ticket("a", tenant="t", tokens=900), 0.0)
    later = admission.offer(ticket("b", tenant="t", tokens=500), 1.0, False, 0.1)
    assert (later.verdict, later.never, later.kind) == (Verdict.REJECT, False, "tenant tokens per minute limit")
    # At its concurrency limit too, it is the same bad input: it was answered 429 with a hint, and once the slot
    # freed, 400 (helper-189).
    both = Admission(limits={"t": TenantLimits(max_concurrency=1, tokens_per_minute=1000)})
    both.on_admitted(ticket("running", tenant="t", tokens=10), 0.0)
    busy = both.offer(ticket("big", tenant="t", tokens=5000), 1.0, False, 0.1)
    assert (busy.verdict, busy.never, busy.kind) == (Verdict.REJECT, True,
                                                     "tenant tokens per minute less than the request")


def test_a_tenants_limits_count_its_requests_waiting_for_admission() -> None:
    """On a saturated fleet requests queue, and each takes a slot and its tokens when dispatched: counted only once
    admitted, a tenant at max_concurrency 1 had all three of its requests queued and then run (helper-125)."""
    admission = Admission(limits={"z": TenantLimits(max_concurrency=1), "y": TenantLimits(tokens_per_minute=1000)})
    assert admission.offer(ticket("z1", tenant="z"), 0.0, True, 0.1).verdict == Verdict.QUEUE
    over = admission.offer(ticket("z2", tenant="z"), 0.0, True, 0.1)
    assert over.verdict == Verdict.REJECT
    assert over.reason == "tenant 'z' is at its concurrency limit of 1 (1 of them waiting for admission)"
    assert admission.offer(ticket("y1", tenant="y", tokens=400), 0.0, True, 0.1).verdict == Verdict.QUEUE
    assert admission.offer(ticket("y2", tenant="y", tokens=400), 0.0, True, 0.1).verdict == Verdict.QUEUE
    over = admission.offer(ticket("y3", tenant="y", tokens=400), 0.0, True, 0.1)
    assert over.verdict == Verdict.REJECT
    assert over.reason == ("tenant 'y' is over its limit of 1000 tokens per minute (800 of them in requests waiting "
                           "for admission)")
    dispatched = []
    while (next_ticket := admission.pop_next(1.0)) is not None:
        admission.on_admitted(next_ticket, 1.0)
        dispatched.append(next_ticket.request_id)
    assert sorted(dispatched) == ["y1", "y2", "z1"]
    assert admission.in_flight("z") == 1


def test_an_admitted_request_that_never_ran_gives_its_tokens_back() -> None:
    """Admitted, then never placed (its model's load failed; its router abandoned the call after a leader's stall):
    its tokens stayed charged, and the tenant was refused for a minute for tokens it never used (helper-128)."""
    admission = Admission(limits={"t": TenantLimits(tokens_per_minute=1000)})
    first = ticket("first", tokens=700)
    admission.on_admitted(first, 0.0)
    assert admission.offer(ticket("again", tokens=700), 1.0, False, 0.1).verdict == Verdict.REJECT
    assert admission.end("first", 1.0, ran=False)
    assert admission.offer(ticket("again", tokens=700), 1.0, False, 0.1).verdict == Verdict.ADMIT
    ran = ticket("ran", tokens=600)
    admission.on_admitted(ran, 2.0)
    assert admission.end("ran", 3.0)  # it ran: its tokens stay charged for the minute
    assert admission.offer(ticket("more", tokens=600), 3.0, False, 0.1).verdict == Verdict.REJECT


def test_a_call_that_never_placed_its_id_leaves_the_slot_to_a_later_call_that_took_it_over() -> None:
    """A router abandons its Place when etcd shows a new leader, and sends it again: to this replica, elected again.
    The resend is admitted on the first call's slot. The first call's cleanup (it never placed the id) freed that
    slot and gave its tokens back while the resend ran: the tenant ran past its limits (helper-130)."""
    admission = Admission(limits={"t": TenantLimits(tokens_per_minute=2000)})
    first, resend = (dataclasses.replace(ticket("d0", tokens=700), holder="router-0", attempt=n) for n in (1, 2))
    admission.on_admitted(first, 0.0)
    assert admission.offer(resend, 5.0, False, 0.1).verdict == Verdict.ADMIT
    admission.on_admitted(resend, 5.0)
    assert not admission.end("d0", 5.1, holder="router-0", ran=False, attempt=1)  # the first call's late cleanup
    assert admission.in_flight("t") == 1 and admission._tenants["t"].served_tokens == 700
    admission.on_placed("d0")
    # The resend's own end frees the slot; once placed (it may have run) its tokens stay charged.
    assert admission.end("d0", 6.0, holder="router-0", ran=False, attempt=2)
    assert admission.in_flight("t") == 0 and admission._tenants["t"].served_tokens == 700


@pytest.mark.parametrize("resumed", [False, True])
def test_the_first_call_admitted_again_after_its_resend_does_not_take_the_slot_back(resumed: bool) -> None:
    """The abandoned first call went through admission again after its router's resend (its queue waiter ran late,
    or a cold node failed and it tried another): the slot went back to it, and its cleanup freed it while the resend
    ran. A resumed resend's slot was freed whatever the order (helper-132)."""
    admission = Admission(limits={"t": TenantLimits(tokens_per_minute=2000)})
    first, resend = (dataclasses.replace(ticket("d0", tokens=700), holder="router-0", attempt=n, resumed=resumed)
                     for n in (1, 2))
    admission.on_admitted(first, 0.0)
    admission.on_admitted(resend, 5.0)
    admission.on_admitted(first, 5.1)
    assert not admission.end("d0", 5.2, holder="router-0", ran=False, attempt=1)
    assert admission.in_flight("t") == 1 and admission._tenants["t"].served_tokens == 700
    # A resumed one never placed frees its slot but keeps its charge: it stands for its earlier stream.
    assert admission.end("d0", 6.0, holder="router-0", ran=False, attempt=2)
    assert admission._tenants["t"].served_tokens == (700 if resumed else 0)


def test_a_tenant_at_its_concurrency_limit_is_told_when_its_oldest_request_should_end() -> None:
    """The openai client retries a 429 after its Retry-After (up to 60 s): told 1 s while the one holding the slot
    runs 30 s, it asked twice in vain and gave up. The hint is the tenant's mean hold less the oldest one's age."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=1)}, lease_s=15.0)  # (none is renewed)
    admission.on_admitted(ticket("first"), 0.0)
    assert admission.offer(ticket("early"), 5.0, False, 0.1).retry_after_s == 1.0  # nothing has ended yet
    assert admission.end("first", 30.0)  # held 30 s
    admission.on_admitted(ticket("second"), 40.0)
    busy = admission.offer(ticket("b"), 50.0, False, 0.1)
    assert busy.verdict == Verdict.REJECT and busy.retry_after_s == 20.0
    assert admission.offer(ticket("c"), 75.0, False, 0.1).retry_after_s == 1.0  # past the mean: soon, at least 1 s
    assert admission.end("second", 80.0)  # held 40 s: the mean moves a fifth of the way, to 32 s
    admission.on_admitted(ticket("third"), 80.0)
    assert admission.offer(ticket("d"), 80.0, False, 0.1).retry_after_s == 32.0
    assert admission.expire_holds(96.0) == ["third"]  # a lapsed lease is no end: the mean stays
    admission.on_admitted(ticket("fourth"), 100.0)
    assert admission.offer(ticket("e"), 100.0, False, 0.1).retry_after_s == 32.0
    # Its slot taken by a request of its own waiting in the queue (the fleet saturated), which gets the next slot
    # first: a whole mean hold after that one frees (it was 1 s, helper-127).
    assert admission.end("fourth", 110.0)  # held 10 s: the mean, to 27.6 s
    assert admission.offer(ticket("queued"), 110.0, True, 0.1).verdict == Verdict.QUEUE
    assert admission.offer(ticket("f"), 111.0, True, 0.1).retry_after_s == pytest.approx(27.6)


def test_a_concurrency_hint_is_at_most_a_minute() -> None:
    admission = Admission(limits={"t": TenantLimits(max_concurrency=1)})
    admission.on_admitted(ticket("long"), 0.0)
    assert admission.end("long", 600.0)
    admission.on_admitted(ticket("next"), 600.0)
    assert admission.offer(ticket("b"), 601.0, False, 0.1).retry_after_s == 60.0


def test_a_fresh_request_for_an_id_another_router_runs_is_refused_as_a_duplicate() -> None:
    """It was admitted on the running one's slot, before any limit: a tenant at a concurrency limit of one ran three
    streams of one id on three nodes (helper-108). Its resume shares the slot; the asking router's own claim is no
    other stream (the router refuses its own duplicates; its claim may be a stream whose end is under way)."""
    admission = Admission(limits={"t": TenantLimits(max_concurrency=1)}, lease_s=15.0)
    running = Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=0.0, holder="router-a")
    admission.on_admitted(running, 0.0)
    fresh = Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=1.0, holder="router-b")
    refused = admission.offer(fresh, 1.0, False, 0.1)
    assert refused.verdict == Verdict.REJECT and refused.duplicate and "'r': is already running" in refused.reason
    resumed = Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=1.0, holder="router-b",
                     resumed=True)
    assert admission.offer(resumed, 1.0, False, 0.1).verdict == Verdict.ADMIT
    again = Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=1.0, holder="router-a")
    assert admission.offer(again, 1.0, False, 0.1).verdict == Verdict.ADMIT
    assert admission.offer(fresh, 16.0, False, 0.1).verdict == Verdict.ADMIT  # router-a silent for a lease: gone
    assert admission.end("r", 16.0, "router-a")
    assert admission.offer(fresh, 17.0, False, 0.1).verdict == Verdict.ADMIT  # ended: the id is free


def test_a_router_gone_from_etcd_holds_no_stream_of_an_id() -> None:
    """Its node streams ended with its connections: an HTTP client behind a load balancer, its router killed, had
    its SDK's automatic resend (no `resume` over HTTP) refused 409 for a whole lease (helper-113). One gone from etcd
    that still reports the id may run it: a router stopping leaves etcd first (helper-117)."""
    registered = {"router-a"}
    admission = Admission(lease_s=15.0, is_registered=lambda router_id: router_id in registered)
    admission.on_admitted(Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=0.0,
                                 holder="router-a"), 0.0)
    fresh = Ticket(request_id="r", tenant="t", priority=0, num_tokens=100, arrived_at=1.0, holder="router-b")
    assert admission.offer(fresh, 1.0, False, 0.1).duplicate
    registered.clear()  # router-a left etcd: stopping (its streams run on), or its lease lapsed in an etcd hiccup
    assert admission.renew(["r"], 2.0, "router-a") == 1  # ... and it still reports the id live
    assert admission.offer(fresh, 6.9, False, 0.1).duplicate  # within a third of the lease of its last word
    assert admission.offer(fresh, 7.0, False, 0.1).verdict == Verdict.ADMIT  # gone and silent: dead


def test_a_resend_with_another_prompt_under_a_running_or_queued_id_is_refused_as_a_duplicate() -> None:
    """Sent as a "resume" with another prompt, it was admitted on the running id's slot and, placed away from the node
    running the id (only that node compared prompts), ran beside it: tenant lim, at a concurrency limit of 1, ran
    three streams under one id (helper-118). A resend with the running one's prompt shares the slot as before."""
    admission = Admission(limits={"lim": TenantLimits(max_concurrency=1)})
    running = Ticket(request_id="r", tenant="lim", priority=0, num_tokens=100, arrived_at=0.0, holder="router-a",
                     prompt_digest=11)
    admission.on_admitted(running, 0.0)
    other = dataclasses.replace(running, holder="router-b", resumed=True, prompt_digest=12)
    refused = admission.offer(other, 1.0, False, 0.1)
    assert refused.duplicate and "is already running as another request" in refused.reason
    assert admission.offer(dataclasses.replace(other, prompt_digest=11), 1.0, False, 0.1).verdict == Verdict.ADMIT
    assert admission.offer(dataclasses.replace(other, prompt_digest=0), 1.0, False, 0.1).verdict == Verdict.ADMIT
    queued = Admission()
    assert queued.offer(dataclasses.replace(ticket("q"), prompt_digest=11), 0.0, True, 0.1).verdict == Verdict.QUEUE
    assert queued.offer(dataclasses.replace(ticket("q"), resumed=True, prompt_digest=12), 1.0, True, 0.1).duplicate


def test_a_resend_of_a_queued_request_takes_its_place_in_the_queue() -> None:
    """Its first router froze while it waited; its client resent it (`resume`) through another router, which was
    refused as a duplicate."""
    admission = Admission()
    first = ticket("q")
    assert admission.offer(first, 0.0, True, 0.1).verdict == Verdict.QUEUE
    resend = dataclasses.replace(ticket("q", at=1.0), holder="router-b", resumed=True)
    outcome = admission.offer(resend, 1.0, True, 0.1)
    assert outcome.verdict == Verdict.QUEUE and outcome.replaced is first and admission.num_queued == 1
    assert admission.pop_next(2.0) is resend


def test_a_fresh_request_for_an_id_in_the_queue_is_refused_as_a_duplicate() -> None:
    """The second took the first's place in the queue, and the first's caller waited for a dispatch that never came."""
    admission = Admission()
    assert admission.offer(ticket("q"), 0.0, True, 0.1).verdict == Verdict.QUEUE
    refused = admission.offer(ticket("q"), 1.0, True, 0.1)
    assert refused.duplicate and "'q': is already waiting for admission" in refused.reason
    assert admission.num_queued == 1


def test_dispatch_takes_the_highest_band_first_then_earliest_deadline() -> None:
    admission = Admission()
    for t in (ticket("low", priority=0, deadline=5), ticket("high-late", priority=1, deadline=9),
              ticket("high-soon", priority=1, deadline=3)):
        assert admission.offer(t, 0.0, True, 0.1).verdict == Verdict.QUEUE
    assert [admission.pop_next(0.0).request_id for _ in range(3)] == ["high-soon", "high-late", "low"]
    assert admission.pop_next(0.0) is None


def test_among_equal_deadlines_a_late_workflow_step_goes_before_a_fresh_request() -> None:
    admission = Admission()
    fresh = ticket("fresh", at=0.0)
    late_step = Ticket(request_id="step-4-of-5", tenant="t", priority=0, num_tokens=100, arrived_at=1.0,
                       progress=0.8)
    for t in (fresh, late_step):
        assert admission.offer(t, 1.0, True, 0.1).verdict == Verdict.QUEUE
    assert [admission.pop_next(1.0).request_id for _ in range(2)] == ["step-4-of-5", "fresh"]


def test_a_flooding_tenant_cannot_starve_another() -> None:
    admission = Admission()
    for i in range(50):
        admission.offer(ticket(f"flood{i}", tenant="flood", at=i * 0.01), 0.0, True, 0.01)
    for i in range(5):
        admission.offer(ticket(f"calm{i}", tenant="calm", at=1 + i), 0.0, True, 0.01)
    order = []
    for _ in range(10):
        chosen = admission.pop_next(0.0)
        admission.on_admitted(chosen, 0.0)
        order.append(chosen.tenant)
    assert order.count("calm") == 5  # served turn about, not after the flood's 50


def test_weights_tilt_the_share() -> None:
    admission = Admission(limits={"gold": TenantLimits(weight=3.0)})
    for i in range(40):
        admission.offer(ticket(f"g{i}", tenant="gold"), 0.0, True, 0.01)
        admission.offer(ticket(f"s{i}", tenant="silver"), 0.0, True, 0.01)
    served = []
    for _ in range(20):
        chosen = admission.pop_next(0.0)
        admission.on_admitted(chosen, 0.0)
        served.append(chosen.tenant)
    assert served.count("gold") == 15 and served.count("silver") == 5


def test_a_full_queue_sheds_its_least_important_entry_for_a_more_important_one() -> None:
    admission = Admission(max_queued=2)
    admission.offer(ticket("a", priority=0), 0.0, True, 0.1)
    admission.offer(ticket("b", priority=0), 0.0, True, 0.1)
    same = admission.offer(ticket("c", priority=0), 0.0, True, 0.1)
    assert same.verdict == Verdict.REJECT and "queue full" in same.reason
    higher = admission.offer(ticket("d", priority=2), 0.0, True, 0.1)
    assert higher.verdict == Verdict.QUEUE and higher.shed is not None and higher.shed.priority == 0
    assert admission.num_queued == 2


def test_cancelled_and_expired_tickets_leave_the_queue() -> None:
    admission = Admission()
    admission.offer(ticket("gone"), 0.0, True, 0.1)
    admission.offer(ticket("late", deadline=1.0), 0.0, True, 0.1)
    assert admission.cancel("gone") and not admission.cancel("gone")
    assert [t.request_id for t in admission.expired(2.0)] == ["late"]
    assert admission.num_queued == 0


def test_the_queue_is_reported_by_tenant() -> None:
    admission = Admission()
    for rid, tenant in (("a", "flood"), ("b", "flood"), ("c", "calm")):
        admission.offer(ticket(rid, tenant=tenant), 0.0, True, 0.1)
    assert admission.queued_by_tenant() == {"flood": 2, "calm": 1}
    admission.pop_next(0.0)
    assert sum(admission.queued_by_tenant().values()) == 2


def test_pool_saturation_follows_queue_depth_and_kv_use() -> None:
    assert pool_saturation([(0, 0, 100), (0, 10, 100)]) < 1
    assert pool_saturation([(10, 0, 100), (0, 90, 100)]) >= 1


def test_a_full_queue_makes_room_for_a_newcomer_by_shedding_the_flood() -> None:
    admission = Admission(max_queued=3)
    for i in range(3):
        admission.offer(ticket(f"flood{i}", tenant="flood"), 0.0, True, 0.1)
    outcome = admission.offer(ticket("calm", tenant="calm"), 0.0, True, 0.1)
    assert outcome.verdict == Verdict.QUEUE and outcome.shed is not None and outcome.shed.tenant == "flood"
    again = admission.offer(ticket("flood9", tenant="flood"), 0.0, True, 0.1)
    assert again.verdict == Verdict.REJECT  # the flood cannot push the newcomer out in turn

