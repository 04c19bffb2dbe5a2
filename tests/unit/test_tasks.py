"""Cost per successful task: every task's GPU cost, failed ones included, over the tasks that succeeded."""

from __future__ import annotations

import json

import pytest

from services.scheduler.tasks import ENDED_MEMORY_MIN_S, TaskLedger, request_task, task_digest, workflow_task


def test_a_request_without_a_workflow_is_a_task_of_one_step() -> None:
    ledger = TaskLedger()
    assert ledger.record("r1", 1, 1, 0.002, ok=True, now=0.0) is True
    assert ledger.stats().cost_per_successful_task == pytest.approx(0.002)


def test_a_workflow_succeeds_when_every_step_has_and_failed_work_stays_in_the_cost() -> None:
    ledger = TaskLedger()
    assert ledger.record("wf", 1, 3, 0.01, ok=True, now=0.0) is None
    assert ledger.record("wf", 2, 3, 0.01, ok=False, now=1.0) is None  # step 2 failed ...
    assert ledger.spent("wf") == pytest.approx(0.02)
    assert ledger.record("wf", 2, 3, 0.01, ok=True, now=2.0) is None  # ... and was retried
    assert ledger.record("wf", 3, 3, 0.01, ok=True, now=3.0) is True
    stats = ledger.stats()
    assert (stats.succeeded, stats.failed, stats.open) == (1, 0, 0)
    assert stats.cost_per_successful_task == pytest.approx(0.04)


def test_a_step_past_total_steps_does_not_stand_in_for_a_failed_one() -> None:
    """Step 1 of 2 late, step 2 met, then a step 3 whose request did not say total_steps: the workflow counted as
    succeeded, on two successful steps (helper-115). It succeeds only when steps 1 to total_steps all have."""
    ledger = TaskLedger(timeout_s=60.0)
    assert ledger.record("wf", 1, 2, 0.01, ok=False, now=0.0) is None
    assert ledger.record("wf", 2, 2, 0.01, ok=True, now=1.0) is None
    assert ledger.record("wf", 3, 0, 0.01, ok=True, now=2.0) is None
    ledger.expire(62.0)
    assert (ledger.stats().succeeded, ledger.stats().failed) == (0, 1)
    assert ledger.record("other", 3, 0, 0.01, ok=False, now=0.0) is None  # a failed step past them holds it too
    assert ledger.record("other", 1, 2, 0.01, ok=True, now=1.0) is None
    assert ledger.record("other", 2, 2, 0.01, ok=True, now=2.0) is None


def test_an_abandoned_workflow_fails_at_the_timeout_and_its_cost_burdens_the_successes() -> None:
    ledger = TaskLedger(timeout_s=60.0)
    ledger.record("abandoned", 1, 5, 0.03, ok=True, now=0.0)
    ledger.record("abandoned", 2, 5, 0.03, ok=False, now=1.0)
    ledger.record("done", 1, 1, 0.01, ok=True, now=2.0)
    assert ledger.expire(now=60.5) == 0
    assert ledger.expire(now=61.0) == 1
    stats = ledger.stats()
    assert (stats.succeeded, stats.failed, stats.open) == (1, 1, 0)
    assert stats.cost_per_successful_task == pytest.approx(0.07)


def test_a_workflow_of_unknown_length_ends_at_the_timeout_as_its_last_step_went() -> None:
    ledger = TaskLedger(timeout_s=10.0)
    ledger.record("ok", 0, 0, 0.01, ok=True, now=0.0)
    ledger.record("bad", 0, 0, 0.01, ok=False, now=0.0)
    ledger.expire(now=10.0)
    assert (ledger.stats().succeeded, ledger.stats().failed) == (1, 1)


def test_the_next_leader_continues_the_ledger() -> None:
    ledger = TaskLedger(timeout_s=60.0)
    ledger.record(request_task("done"), 1, 1, 0.01, ok=True, now=0.0)
    ledger.record(workflow_task("wf"), 1, 2, 0.02, ok=True, now=95.0)
    successor = TaskLedger(timeout_s=60.0)
    successor.restore(ledger.to_state(max_open=100, now=100.0), now=5000.0)  # another host's clock
    assert successor.spent(workflow_task("wf")) == pytest.approx(0.02)
    assert successor.record(workflow_task("wf"), 2, 2, 0.02, ok=True, now=5001.0) is True
    assert successor.stats().cost_per_successful_task == pytest.approx(0.05 / 2)
    assert successor.expire(now=5050.0) == 0  # its age (5 s) came across


def test_a_late_notice_for_an_ended_task_adds_its_cost_but_no_task() -> None:
    ledger = TaskLedger(timeout_s=10.0)
    ledger.record("wf", 1, 1, 0.01, ok=True, now=0.0)
    assert ledger.record("wf", 1, 1, 0.01, ok=False, now=1.0) is None  # a retried attempt's notice, late
    ledger.expire(now=100.0)
    stats = ledger.stats()
    assert (stats.succeeded, stats.failed, stats.open) == (1, 0, 0)
    assert stats.ended_cost_usd == pytest.approx(0.02)


def test_an_id_used_again_after_the_timeout_is_a_new_task() -> None:
    """A workflow named the same each run (a nightly pipeline) succeeded once ever at one leader, every later run's
    cost added to that one, and after a failover it counted again (helper-196). An id is remembered the timeout, and
    at least as long as a router retries a notice (with a 10 s timeout, a notice retried 30 s on opened a task that
    never was, helper-198)."""
    ledger = TaskLedger(timeout_s=10.0)
    for step in (1, 2):
        ledger.record("nightly", step, 2, 0.01, ok=True, now=float(step))
    assert ledger.stats().succeeded == 1
    ledger.expire(32.0)
    ledger.record("nightly", 1, 2, 0.01, ok=False, now=32.0, cancelled=True)  # a notice retried: a late one
    assert not ledger.is_open("nightly")
    ledger.expire(2.0 + ENDED_MEMORY_MIN_S)
    for step in (1, 2):  # the next run
        ledger.record("nightly", step, 2, 0.01, ok=True, now=100.0 + step)
    assert ledger.stats().succeeded == 2
    # As for one a predecessor had ended.
    successor = TaskLedger(timeout_s=10.0)
    successor.restore(ledger.to_state(100, now=102.0), now=102.0)
    assert successor.record("nightly", 1, 1, 0.01, ok=True, now=103.0) is None
    successor.expire(102.0 + ENDED_MEMORY_MIN_S)
    assert successor.record("nightly", 1, 1, 0.01, ok=True, now=200.0) is True


def test_the_headline_counts_the_whole_fleet_idle_time_included_and_survives_a_hand_over() -> None:
    ledger = TaskLedger()
    ledger.record("a", 1, 1, 0.001, ok=True, now=0.0)
    ledger.record("b", 1, 1, 0.001, ok=True, now=0.0)
    ledger.add_fleet_time(1800.0, 4.0)  # half an hour of GPUs costing $4 an hour together, mostly idle
    stats = ledger.stats()
    assert stats.fleet_cost_per_successful_task == pytest.approx(2.0 / 2)
    assert stats.cost_per_successful_task == pytest.approx(0.001)  # the busy-time floor
    successor = TaskLedger()
    successor.restore(ledger.to_state(10, now=5.0), now=100.0)
    assert successor.stats().fleet_cost_usd == pytest.approx(2.0)


def test_a_late_failure_of_a_step_that_succeeded_does_not_undo_it() -> None:
    # Hedged step requests, or a router that notices its client's failover after the next router's success:
    # the loser's notice comes after the winner's.
    ledger = TaskLedger()
    ledger.record("wf", 1, 3, 0.01, ok=True, now=0.0)
    ledger.record("wf", 2, 3, 0.01, ok=True, now=1.0)
    ledger.record("wf", 2, 3, 0.01, ok=False, now=2.0)
    assert ledger.record("wf", 3, 3, 0.01, ok=True, now=3.0) is True
    stats = ledger.stats()
    assert (stats.succeeded, stats.failed) == (1, 0)
    assert stats.ended_cost_usd == pytest.approx(0.04)


def test_a_workflow_of_unknown_length_succeeds_only_if_every_numbered_step_has() -> None:
    gave_up = TaskLedger(timeout_s=10.0)
    gave_up.record("wf", 1, 0, 0.01, ok=False, now=0.0)  # step 1 failed for good ...
    gave_up.record("wf", 2, 0, 0.01, ok=True, now=1.0)  # ... though the last step went well
    gave_up.expire(now=20.0)
    assert (gave_up.stats().succeeded, gave_up.stats().failed) == (0, 1)
    late_loser = TaskLedger(timeout_s=10.0)
    late_loser.record("wf", 1, 0, 0.01, ok=True, now=0.0)
    late_loser.record("wf", 2, 0, 0.01, ok=True, now=1.0)
    late_loser.record("wf", 1, 0, 0.01, ok=False, now=2.0)  # a late notice of another attempt of step 1
    late_loser.expire(now=20.0)
    assert (late_loser.stats().succeeded, late_loser.stats().failed) == (1, 0)


def test_a_failed_step_is_handed_to_the_next_leader() -> None:
    ledger = TaskLedger(timeout_s=10.0)
    ledger.record("wf", 1, 0, 0.01, ok=False, now=0.0)
    ledger.record("wf", 2, 0, 0.01, ok=True, now=1.0)
    successor = TaskLedger(timeout_s=10.0)
    successor.restore(ledger.to_state(max_open=100, now=1.0), now=1.0)
    successor.expire(now=20.0)
    assert (successor.stats().succeeded, successor.stats().failed) == (0, 1)


def test_a_workflow_whose_step_runs_longer_than_the_timeout_is_not_abandoned() -> None:
    ledger = TaskLedger(timeout_s=300.0)
    ledger.record("wf", 1, 2, 0.01, ok=True, now=0.0)
    ledger.record("other", 1, 2, 0.01, ok=True, now=1.0)
    ledger.touch(["wf"], now=250.0)  # step 2 is running (the routers say so)
    assert ledger.expire(now=302.0) == 1  # "other" went silent; "wf" did not
    assert ledger.record("wf", 2, 2, 0.01, ok=True, now=400.0) is True
    assert (ledger.stats().succeeded, ledger.stats().failed) == (1, 1)


def test_open_tasks_beyond_what_is_handed_over_reach_the_next_leader_as_failed_with_their_cost() -> None:
    ledger = TaskLedger(timeout_s=60.0)
    for i in range(4):
        ledger.record(workflow_task(f"wf{i}"), 1, 2, 0.01, ok=True, now=float(i))
    successor = TaskLedger(timeout_s=60.0)
    successor.restore(ledger.to_state(max_open=2, now=4.0), now=4.0)
    stats = successor.stats()
    assert (stats.succeeded, stats.failed, stats.open) == (0, 2, 2)
    assert stats.ended_cost_usd == pytest.approx(0.02)
    assert successor.spent(workflow_task("wf3")) == pytest.approx(0.01)  # the most recently active go on
    assert ledger.stats().open == 4  # the leader's own ledger is unchanged
    # A late notice of a dropped one adds its cost and does not open it again (to be counted twice).
    assert successor.record(workflow_task("wf0"), 2, 2, 0.01, ok=True, now=5.0) is None
    stats = successor.stats()
    assert (stats.succeeded, stats.failed, stats.open) == (0, 2, 2)
    assert stats.ended_cost_usd == pytest.approx(0.03)


def test_the_hand_over_state_keeps_the_form_an_earlier_version_reads() -> None:
    # A rollback's successor unpacks five fields per open task; the failed steps travel beside them.
    ledger = TaskLedger(timeout_s=10.0)
    ledger.record("wf", 1, 0, 0.01, ok=False, now=0.0)
    state = ledger.to_state(max_open=100, now=0.0)
    assert [len(fields) for fields in state["open"].values()] == [5]
    assert state["open_failed_steps"] == {"wf": [1]}


def test_a_state_with_failed_steps_in_a_sixth_field_is_restored() -> None:
    state = {"succeeded": 0, "failed": 0, "ended_cost_usd": 0.0, "ended": [],
             "open": {"wf": [0, 0.01, [2], False, 1.0, [1]]}}
    successor = TaskLedger(timeout_s=10.0)
    successor.restore(state, now=0.0)
    successor.expire(now=20.0)
    assert (successor.stats().succeeded, successor.stats().failed) == (0, 1)


def test_a_successor_keys_the_open_and_ended_tasks_of_a_leader_with_one_key_space_as_it_does() -> None:
    """A leader of the version before the key spaces hands over "wf" (2 steps, one done) and "r" (a lone request
    that failed, open for its retry), and "gone" ended: the successor counted each again under its own keys, a
    workflow's success as two failures (helper-117)."""
    state = {"succeeded": 0, "failed": 0, "ended_cost_usd": 0.0,
             "open": {"wf": [2, 0.01, [1], True, 1.0], "r": [1, 0.01, [], False, 1.0]}, "ended": ["gone"]}
    successor = TaskLedger(timeout_s=60.0)
    successor.restore(state, now=10.0)
    assert successor.record(workflow_task("wf"), 2, 2, 0.01, ok=True, now=11.0) is True
    assert successor.record(request_task("r"), 1, 1, 0.01, ok=True, now=11.0) is True
    assert successor.record(request_task("gone"), 1, 1, 0.01, ok=True, now=11.0) is None  # ended: a late notice
    assert (successor.stats().succeeded, successor.stats().failed, successor.stats().open) == (2, 0, 0)


def test_the_hand_over_keeps_only_the_tasks_ended_lately() -> None:
    """At one write a second, handing over the last 10,000 tasks to end made the state grow with the traffic (24 KB
    after 3 minutes of 6 requests a second, helper-134); etcd keeps thousands of past writes in memory. A late notice
    comes within seconds (a router's, after a leader change)."""
    ledger = TaskLedger()
    for n in range(1000):
        ledger.record(request_task(f"r{n}"), 1, 1, 0.01, True, float(n))
    state = ledger.to_state(10_000, 1000.0, ended_within_s=60.0)
    assert state["ended_digests"] == [task_digest(request_task(f"r{n}")) for n in range(940, 1000)]
    assert all(len(d) == 16 for d in state["ended_digests"])  # whatever the id's length
    successor = TaskLedger()
    successor.restore(state, 5.0)
    successor.record(request_task("r999"), 1, 1, 0.01, True, 6.0)  # a late notice: not a task of its own
    assert successor.stats().succeeded == 1000


def test_tasks_ended_at_a_predecessor_are_handed_on_at_the_next_failover() -> None:
    """A ended a task and failed over to B, and B to C within the window: a router's repeated notice opened the task
    again at C and counted it twice (helper-137)."""
    a = TaskLedger()
    a.record(request_task("r"), 1, 1, 0.01, True, 0.0)
    b = TaskLedger()
    b.restore(a.to_state(100, 1.0, ended_within_s=30.0), 50.0)
    c = TaskLedger()
    c.restore(b.to_state(100, 60.0, ended_within_s=30.0), 7.0)
    assert c.record(request_task("r"), 1, 1, 0.01, True, 8.0) is None and c.stats().succeeded == 1
    assert b.to_state(100, 81.0, ended_within_s=30.0)["ended_digests"] == []  # past the window


def test_open_tasks_past_the_byte_bound_are_left_out_and_each_task_is_counted_once() -> None:
    """10,000 open tasks of 257-character ids passed etcd's 1.5 MiB for a request, and every write of the hand-over
    state was refused. The newest that fit are handed over. Those left out end as failed where their digests fit
    beside those of the tasks ended lately, and are otherwise only left out: counted failed with no digest, one was
    counted again when a notice reopened it at the successor (helper-141)."""
    ledger = TaskLedger()
    for n in range(3_000):
        ledger.record(request_task(f"ok{n}"), 1, 1, 0.01, True, 75.0)  # ended lately: their digests go first
    ids = [request_task(f"{n:05d}" + "x" * 252) for n in range(10_000)]  # 257 characters, then the key's prefix
    for n, task_id in enumerate(ids):
        ledger.record(task_id, 1, 1, 0.01, False, 80.0 + n / 1000)  # refused: open until they time out
    state = json.loads(json.dumps(ledger.to_state(10_000, 100.0, 30.0, max_open_bytes=128 * 1024,
                                                  max_digests=4_000)))
    assert len(json.dumps(state["open"])) + len(json.dumps(state["open_failed_steps"])) <= 128 * 1024
    kept = list(state["open"])
    assert kept == ids[-len(kept):] and 100 < len(kept) < 1_000  # the newest, in order
    assert len(state["ended_digests"]) == 4_000  # 3,000 ended lately, then 1,000 of those left out
    assert state["failed"] == 1_000
    assert state["ended_cost_usd"] == pytest.approx(0.01 * (3_000 + 10_000 - len(kept)))
    successor = TaskLedger(timeout_s=10.0)
    successor.restore(state, 0.0)
    assert successor.stats().open == len(kept)
    for task_id in ids:  # a notice of each (its client sent it again under its id, and it failed again)
        successor.record(task_id, 1, 1, 0.0, False, 1.0)
    successor.expire(100.0)
    stats = successor.stats()
    assert (stats.succeeded, stats.failed, stats.open) == (3_000, 10_000, 0)


def test_a_workflow_between_its_steps_is_handed_over_before_the_requests_an_overload_refused() -> None:
    """The refused requests are the newest open tasks: they pushed the workflows between their steps out of the
    hand-over, and those workflows' later steps could never succeed at the successor (helper-141)."""
    ledger = TaskLedger()
    for n in range(100):
        ledger.record(workflow_task(f"wf{n}"), 1, 3, 0.02, True, float(n))  # step 1 of 3 done
    for n in range(5_000):
        ledger.record(request_task(f"refused{n}"), 1, 1, 0.0, False, 200.0 + n / 100)
    state = ledger.to_state(10_000, 300.0, 30.0, max_open_bytes=16 * 1024, max_digests=100)
    assert {workflow_task(f"wf{n}") for n in range(100)} <= set(state["open"])
    assert len(state["open"]) < 300


@pytest.mark.parametrize("hand_over", [False, True])
def test_the_latest_step_says_how_many_steps_a_workflow_has(hand_over: bool) -> None:
    """With the largest total_steps said, a workflow whose step 3 said 5 and whose steps 1, 2 and 4 then said 4
    waited for a step 5 that never came, and failed at the timeout (helper-160). A late notice of an earlier step
    does not change it back, and a successor leader keeps which step said it."""
    ledger = TaskLedger(timeout_s=60.0)
    wf = workflow_task("wf")
    assert ledger.record(wf, 3, 5, 0.01, ok=True, now=0.0) is None
    assert ledger.record(wf, 2, 4, 0.01, ok=True, now=1.0) is None  # an earlier step: 5 still stands
    assert ledger.record(wf, 4, 4, 0.01, ok=True, now=2.0) is None  # the latest step: 4
    if hand_over:
        successor = TaskLedger(timeout_s=60.0)
        successor.restore(ledger.to_state(max_open=100, now=3.0), now=3.0)
        ledger = successor
    assert ledger.record(wf, 1, 5, 0.01, ok=True, now=4.0) is True  # a late notice of step 1, as first sent
    assert (ledger.stats().succeeded, ledger.stats().failed) == (1, 0)


def test_a_total_said_only_by_a_late_notice_of_an_earlier_step_counts() -> None:
    """Step 2, which said no total, came first: the total that step 1 said later was taken for an earlier one's, and
    the task stayed open until the timeout (helper-162)."""
    ledger = TaskLedger(timeout_s=60.0)
    wf = workflow_task("wf")
    assert ledger.record(wf, 2, 0, 0.01, ok=True, now=0.0) is None
    assert ledger.record(wf, 1, 2, 0.01, ok=True, now=1.0) is True


def test_a_task_whose_every_step_is_answered_one_of_them_late_has_failed_at_once() -> None:
    """Its client has every answer and sends nothing more: it stayed open for the timeout (helper-173, helper-176).
    A step that was late and then sent again is waited for: refused, it may come again; succeeding, it counts."""
    ledger = TaskLedger(timeout_s=300.0)
    assert ledger.record(request_task("lone"), 1, 1, 0.01, ok=False, now=0.0, answered=True) is False
    assert ledger.record(workflow_task("w"), 1, 3, 0.01, ok=True, now=0.0) is None
    assert ledger.record(workflow_task("w"), 2, 3, 0.01, ok=False, now=1.0, answered=True) is None
    assert ledger.record(workflow_task("w"), 3, 3, 0.01, ok=True, now=2.0) is False
    assert ledger.record(workflow_task("again"), 1, 2, 0.01, ok=False, now=0.0, answered=True) is None
    assert ledger.record(workflow_task("again"), 1, 2, 0.01, ok=False, now=1.0) is None  # its resend refused
    assert ledger.record(workflow_task("again"), 2, 2, 0.01, ok=True, now=2.0) is None  # step 1 may come again
    assert ledger.record(workflow_task("again"), 1, 2, 0.01, ok=True, now=3.0) is True
    # An attempt its client gave up (a frozen router's, told when it wakes) leaves the late answer standing
    # (helper-177: the workflow waited out the timeout again).
    assert ledger.record(workflow_task("woken"), 1, 2, 0.01, ok=False, now=0.0, answered=True) is None
    assert ledger.record(workflow_task("woken"), 1, 2, 0.01, ok=False, now=1.0, cancelled=True) is None
    assert ledger.record(workflow_task("woken"), 2, 2, 0.01, ok=True, now=2.0) is False
    assert (ledger.stats().succeeded, ledger.stats().failed, ledger.stats().open) == (1, 3, 0)
