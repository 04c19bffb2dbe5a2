"""The KPI's ledger: GPU cost and outcome of every task, for cost per successful task. Pure.

A task is a workflow (its steps share workflow_id; total_steps says how many) or a request
without one (a task of one step). The router reports every placed request's end with the GPU
time it used on each node; the ledger prices it and adds it to its task. A task succeeds when
every one of its steps has succeeded (a step retried after a failure counts once it succeeds; a
step that succeeded stays so, whatever late notice of another attempt of it says); it fails when
it stays silent for `timeout_s` before that (a step the routers report running is not silence). A
workflow that does not say how many steps it has ends at the timeout, succeeded if every step it
numbered has succeeded (unnumbered: if its last request did). Failed tasks' GPU cost stays in the
numerator, and so does GPU time spent loading models: the busy-time cost per successful task =
(cost of every ended task + model loads) ÷ tasks succeeded — the floor that scaling idle GPUs away
could reach. The headline is what the operator pays: every registered GPU, idle or not, for as long
as the ledger has run (the leader adds each interval's fleet cost) ÷ tasks succeeded.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# The least time an ended task's id is remembered, whatever --task-timeout-s: twice as long as a router tries a
# Finished notice (and as the ended tasks a leader hands over), so that no notice retried is taken for a new task.
ENDED_MEMORY_MIN_S = 60.0


def workflow_task(workflow_id: str) -> str:
    """The ledger's key of a workflow's task: its own key space, so that no request id names it (a lone request
    reusing an ended workflow's id was taken for a late notice of it, and its success went uncounted)."""
    return "workflow:" + workflow_id


def task_digest(task_id: str) -> str:
    """A short digest of a task's key, as a leader hands its ended tasks over."""
    return hashlib.blake2b(task_id.encode(), digest_size=8).hexdigest()


def request_task(request_id: str) -> str:
    """The ledger's key of a lone request's task (a task of one step)."""
    return "request:" + request_id


def _is_keyed(task_id: str) -> bool:
    return task_id.startswith(("workflow:", "request:"))


def _has_every_step(steps: set[int], total_steps: int) -> bool:
    """Whether steps holds each of 1..total_steps. Counted, not compared with the set of them: a request saying
    total_steps=2147483647 had the leader build that set, and it stopped answering anyone (the fuzz test, in CI)."""
    return len(steps) >= total_steps and sum(1 for step in steps if 1 <= step <= total_steps) == total_steps


def _keyed(task_id: str, total_steps: int) -> str:
    """task_id as this version keys it: a key from a version with one key space (its successor is a newer leader)
    is a lone request's when its task has one step, else a workflow's."""
    if _is_keyed(task_id):
        return task_id
    return request_task(task_id) if total_steps <= 1 else workflow_task(task_id)


@dataclass
class _Task:
    total_steps: int
    spent_usd: float = 0.0
    succeeded: set[int] = field(default_factory=set)
    # Steps that failed and have not succeeded since.
    failed: set[int] = field(default_factory=set)
    last_ok: bool = False
    last_at: float = 0.0
    # The step whose total_steps is in force: the latest in the workflow's order that said one.
    total_from_step: int = 0
    # Of the failed steps, those whose last attempt ran to its end, late: their client has its answer (not handed
    # over: a successor waits for such a task's timeout, as before).
    answered_late: set[int] = field(default_factory=set)

    def all_ok(self) -> bool:
        """Whether a task of unknown length went well: every step it numbered succeeded, or, with none
        numbered, its last request did."""
        if self.succeeded or self.failed:
            return not self.failed
        return self.last_ok


def json_str_bytes(text: str) -> int:
    """The bytes of text as a JSON string (json.dumps's), without encoding it in the common case."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return len(text) + 2
    return len(json.dumps(text))


def _open_entry_bytes(task_id: str, task: _Task) -> int:
    """About the most an open task takes in the hand-over state's JSON: its key (in open, in open_failed_steps when
    it has failed steps, in open_total_from_step when a step said its total), its five fields, its steps."""
    return (json_str_bytes(task_id) * (1 + bool(task.failed) + bool(task.total_from_step)) + 108
            + sum(len(str(step)) + 2 for step in (*task.succeeded, *task.failed)))


@dataclass(frozen=True)
class TaskStats:
    succeeded: int
    failed: int
    open: int
    ended_cost_usd: float
    # GPU time spent loading models: part of what the successes cost, though no task's own.
    overhead_usd: float = 0.0
    # Every registered GPU at its price for the time the ledger ran, idle included.
    fleet_cost_usd: float = 0.0

    @property
    def cost_per_successful_task(self) -> float:
        """Busy GPU time per success: the floor."""
        return (self.ended_cost_usd + self.overhead_usd) / self.succeeded if self.succeeded else 0.0

    @property
    def fleet_cost_per_successful_task(self) -> float:
        """The whole fleet's cost per success: the headline."""
        return self.fleet_cost_usd / self.succeeded if self.succeeded else 0.0


class TaskLedger:
    def __init__(self, timeout_s: float = 300.0, max_open: int = 100_000) -> None:
        self.timeout_s = timeout_s
        self._max_open = max_open
        # Open tasks, least recently active first.
        self._open: OrderedDict[str, _Task] = OrderedDict()
        self.succeeded = 0
        self.failed = 0
        self.ended_cost_usd = 0.0
        self.overhead_usd = 0.0
        self.fleet_cost_usd = 0.0
        # Ids of the tasks ended most recently, with when, so that a late notice does not open them again; and the
        # digests (task_digest) of those a predecessor had ended lately.
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._ended_digests: dict[str, float] = {}

    def record(self, task_id: str, step: int, total_steps: int, cost_usd: float, ok: bool,
               now: float, answered: bool = False, cancelled: bool = False) -> bool | None:
        """One request of task_id ended: its GPU cost and whether it succeeded (finished in budget); answered: it
        ran to its end, late, and its client has the answer. A task whose every step has succeeded or was answered
        late, one of them late, has failed now: it stayed open for --task-timeout-s, waiting for a resend that a
        client with its answers does not send (an etcd freeze's late requests showed as open for 5 minutes, their
        cost left out of the KPI, helper-173; so did a workflow whose step 2 was late, helper-176). cancelled: an
        attempt its client gave up (a frozen router's, reported when it wakes): a late answer of its step stands.

        Returns the task's outcome if this ended it (True: succeeded), None while it stays open.
        """
        if task_id in self._ended or (self._ended_digests and task_digest(task_id) in self._ended_digests):
            # A late notice for a task already counted: its cost still counts.
            self.ended_cost_usd += cost_usd
            return None
        task = self._open.pop(task_id, None) or _Task(total_steps=max(total_steps, 0),
                                                      total_from_step=step if total_steps > 0 else 0)
        if total_steps > 0 and step >= task.total_from_step:
            # The latest step says how many there are (an agent's plan may change): with the largest said, a workflow
            # whose step 3 said 5 and whose steps 1 to 4 then said 4 waited for a step 5 and failed (helper-160).
            task.total_steps, task.total_from_step = total_steps, step
        task.spent_usd += cost_usd
        task.last_ok = ok
        task.last_at = now
        if ok and step > 0:
            task.succeeded.add(step)
            task.failed.discard(step)
            task.answered_late.discard(step)
        elif not ok and step > 0 and step not in task.succeeded:  # a late loser does not undo a success
            task.failed.add(step)
            if answered:
                task.answered_late.add(step)
            elif not cancelled:  # refused or failed: it may be sent again
                task.answered_late.discard(step)
        # Every step it has, and nothing failed (a step past total_steps, numbered by a request that did not say
        # total_steps, counted towards it: a workflow whose step 1 failed succeeded on steps 2 and 3 of 2).
        if task.total_steps and not task.failed and _has_every_step(task.succeeded, task.total_steps):
            self._end(task_id, task, True, now)
            return True
        if task.total_steps and task.failed and task.failed <= task.answered_late \
                and _has_every_step(task.succeeded | task.answered_late, task.total_steps):
            self._end(task_id, task, False, now)
            return False
        self._open[task_id] = task
        if len(self._open) > self._max_open:  # the least recently active gives way: it failed
            self._end(*self._open.popitem(last=False), False, now)
        return None

    def touch(self, task_ids: Iterable[str], now: float) -> None:
        """These tasks have a step running: they are not silent (an open one's timeout starts again)."""
        for task_id in task_ids:
            task = self._open.get(task_id)
            if task is not None:
                task.last_at = max(task.last_at, now)
                self._open.move_to_end(task_id)

    def spent(self, task_id: str) -> float:
        task = self._open.get(task_id)
        return task.spent_usd if task is not None else 0.0

    def expire(self, now: float) -> int:
        """End the tasks silent for timeout_s; how many ended. And forget those ended timeout_s ago (at least
        ENDED_MEMORY_MIN_S): a notice that late is taken for a new task under an id used again (a pipeline that names
        its workflow the same each run). Remembered without an end, every later run's success went uncounted at
        that leader, though counted after a failover, whose successor is handed only the tasks ended lately
        (helper-196). A straggler later still (a router frozen that long, telling on waking of an attempt its client
        gave up) opens a task that fails at the timeout (helper-198)."""
        remember_s = max(self.timeout_s, ENDED_MEMORY_MIN_S)
        while self._ended and now - next(iter(self._ended.values())) >= remember_s:
            self._ended.popitem(last=False)
        for digest in [d for d, at in self._ended_digests.items() if now - at >= remember_s]:
            del self._ended_digests[digest]
        ended = 0
        while self._open:
            task_id, task = next(iter(self._open.items()))
            if now - task.last_at < self.timeout_s:
                break
            del self._open[task_id]
            self._end(task_id, task, not task.total_steps and task.all_ok(), now)
            ended += 1
        return ended

    def _end(self, task_id: str, task: _Task, succeeded: bool, now: float) -> None:
        self._ended[task_id] = now
        if len(self._ended) > self._max_open:
            self._ended.popitem(last=False)
        if succeeded:
            self.succeeded += 1
        else:
            self.failed += 1
        self.ended_cost_usd += task.spent_usd

    def add_overhead(self, cost_usd: float) -> None:
        """GPU cost that belongs to no task (a model load)."""
        self.overhead_usd += cost_usd

    def add_fleet_time(self, seconds: float, price_per_hour: float) -> None:
        """seconds of the whole fleet, whose GPUs together cost price_per_hour."""
        self.fleet_cost_usd += seconds / 3600.0 * price_per_hour

    def stats(self) -> TaskStats:
        return TaskStats(self.succeeded, self.failed, len(self._open), self.ended_cost_usd, self.overhead_usd,
                         self.fleet_cost_usd)

    # -- hand-over to the next leader -------------------------------------------------------------

    def is_open(self, task_id: str) -> bool:
        return task_id in self._open

    def has_ended(self, task_id: str) -> bool:
        """Whether task_id ended lately (among the last max_open to end)."""
        return task_id in self._ended

    def to_state(self, max_open: int, now: float, ended_within_s: float = math.inf,
                 max_open_bytes: int | None = None, max_digests: int | None = None) -> dict[str, Any]:
        """Totals, and the most recently active open tasks with their age (clocks differ between hosts), at most
        max_open of them in about max_open_bytes of JSON: first those with a step done or GPU time spent (a workflow
        between its steps), then the rest (a request refused, open until its timeout in case its client sends it
        again), newest first. Those left out end here as failed, their cost kept (as the ledger's own overflow
        does), when their digests fit; else they are only left out (a later notice of one opens it at the
        successor, and it is counted there).

        The digests of the tasks ended within ended_within_s, whose late notices the successor must not take for
        new tasks, at most max_digests (max_open if None), the latest to end first: all of the last max_open, at one
        write a second, made the state grow with the traffic, and etcd keeps thousands of past writes in memory
        (helper-134). Then those of the tasks left out, in the room that is left: counted failed with no digest, a
        task was counted again when a notice reopened it at the successor (helper-141)."""
        open_tasks = list(self._open.items())
        kept = sorted(self._kept_open(open_tasks, max_open, max_open_bytes))  # their places, least recent first
        kept_ids = {open_tasks[i][0] for i in kept}
        # The latest to end last; those a predecessor handed over too: a third leader within the window must know
        # them (helper-137).
        ended = ([digest for digest, at in self._ended_digests.items() if now - at <= ended_within_s]
                 + [task_digest(k) for k, at in self._ended.items() if now - at <= ended_within_s])
        cap = max_open if max_digests is None else max_digests
        ended = ended[-cap:] if cap > 0 else []
        failed_here: list[str] = []  # the newest left out, as many as have room for their digests
        for task_id, _ in reversed(open_tasks):
            if len(ended) + len(failed_here) >= cap or len(failed_here) + len(kept) >= len(open_tasks):
                break
            if task_id not in kept_ids:
                failed_here.append(task_id)
        left_out_cost = sum(t.spent_usd for _, t in open_tasks) - sum(open_tasks[i][1].spent_usd for i in kept)
        return {
            "succeeded": self.succeeded, "failed": self.failed + len(failed_here),
            "ended_cost_usd": self.ended_cost_usd + left_out_cost,
            "overhead_usd": self.overhead_usd, "fleet_cost_usd": self.fleet_cost_usd,
            # Five fields each, as every version reads them; failed steps under a key of their own.
            "open": {k: [t.total_steps, t.spent_usd, sorted(t.succeeded), t.last_ok, now - t.last_at]
                     for k, t in (open_tasks[i] for i in kept)},
            "open_failed_steps": {k: sorted(t.failed) for k, t in (open_tasks[i] for i in kept) if t.failed},
            "open_total_from_step": {k: t.total_from_step for k, t in (open_tasks[i] for i in kept)
                                     if t.total_from_step},
            # As digests: 16 characters, where a tenant-scoped id may have 257.
            "ended_digests": ended + [task_digest(k) for k in reversed(failed_here)],
        }

    @staticmethod
    def _kept_open(open_tasks: list[tuple[str, _Task]], max_open: int, max_bytes: int | None) -> list[int]:
        """The places in open_tasks (least recently active first) of the open tasks to hand over: to_state's order
        and bounds. An overload's refused requests, the newest, pushed out the workflows between their steps, whose
        later steps could then never succeed at the successor (helper-141)."""
        kept: list[int] = []
        size = 0
        for started in (True, False):
            for i in range(len(open_tasks) - 1, -1, -1):
                task_id, task = open_tasks[i]
                if bool(task.succeeded or task.spent_usd > 0) != started:
                    continue
                if len(kept) >= max_open:
                    return kept
                if max_bytes is not None:
                    size += _open_entry_bytes(task_id, task)
                    if size > max_bytes:
                        return kept
                kept.append(i)
        return kept

    def restore(self, state: dict[str, Any], now: float) -> None:
        self.succeeded = int(state["succeeded"])
        self.failed = int(state["failed"])
        self.ended_cost_usd = float(state["ended_cost_usd"])
        self.overhead_usd = float(state.get("overhead_usd", 0.0))
        self.fleet_cost_usd = float(state.get("fleet_cost_usd", 0.0))
        failed_steps = state.get("open_failed_steps", {})
        from_step = state.get("open_total_from_step", {})
        self._open = OrderedDict(
            (_keyed(k, int(total)),
             _Task(int(total), float(spent), set(steps), set(failed_steps.get(k, legacy[0] if legacy else ())),
                   bool(ok), now - float(age), int(from_step.get(k, 0))))
            # A state written by the versions that put failed steps in a sixth field.
            for k, (total, spent, steps, ok, age, *legacy) in state["open"].items())
        # An ended task's key from a version with one key space may be either kind.
        # (A state from a version that handed the ids themselves over.)
        self._ended = OrderedDict.fromkeys((key for k in state.get("ended", ())
                                            for key in ((k,) if _is_keyed(k) else (request_task(k), workflow_task(k)))),
                                           now)
        self._ended_digests = dict.fromkeys(map(str, state.get("ended_digests", ())), now)
