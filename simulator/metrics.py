"""What a run achieved: latency percentiles, SLO attainment, goodput, cache hits, cost per successful task."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from services.common.slo import DEFAULT_TPOT_BUDGET_MS, DEFAULT_TTFT_BUDGET_MS, Outcome, classify
from services.common.slo import Slo as RequestSlo
from services.scheduler.tasks import TaskLedger, TaskStats
from simulator.simulation import RequestRecord, RunResult
from simulator.workload import Workload


class Slo:
    """The run's default SLO; each request is held to its own budgets, these where it sets none
    (services/common/slo.py classifies, as the live router does).

    Given in seconds, for the command line; a request meets it when it finished within its budgets."""

    def __init__(self, ttft_s: float = DEFAULT_TTFT_BUDGET_MS / 1000, tpot_s: float = DEFAULT_TPOT_BUDGET_MS / 1000,
                 deadline_s: float = 0.0) -> None:
        self.ttft_s, self.tpot_s = ttft_s, tpot_s
        self._slo = RequestSlo(ttft_s * 1000, tpot_s * 1000, deadline_s * 1000)

    def for_record(self, record: RequestRecord) -> RequestSlo:
        """The budgets the request is held to (in ms): its own, these where it sets none."""
        request = record.request
        return self._slo.for_request(request.ttft_budget_ms, request.tpot_budget_ms, request.deadline_ms)

    def outcome(self, record: RequestRecord) -> Outcome:
        slo = self.for_record(record)
        ttft, tpot = record.ttft_s, record.tpot_s
        return classify(slo, finished=record.finish_s is not None,
                        ttft_ms=None if ttft is None else ttft * 1000, tpot_ms=None if tpot is None else tpot * 1000,
                        elapsed_ms=((record.finish_s or 0.0) - record.arrival_s) * 1000)

    def is_met(self, record: RequestRecord) -> bool:
        return self.outcome(record) == Outcome.SUCCEEDED


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_completed: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    slo_attainment: float
    goodput_rps: float
    kv_hit_rate: float
    # Busy GPU time, and its cost at each node's price.
    gpu_hours: float
    gpu_cost: float
    # Every provisioned GPU for the whole run, idle included.
    fleet_gpu_hours: float
    fleet_cost: float
    num_tasks: int
    num_tasks_ok: int
    # The headline: the whole fleet's cost per task whose every step met its SLO (what an operator pays).
    cost_per_successful_task: float
    # The floor: busy GPU time only, failed work included (what scaling idle GPUs away could reach).
    busy_cost_per_successful_task: float
    num_migrations: int
    # Seconds the fleet ran after the last request arrived. On a fixed fleet where every policy meets
    # the SLO of every request of an open-loop trace (arrivals that do not depend on the policy), the
    # whole-fleet cost differs only by this; in a closed loop (agent steps) the last arrival moves too.
    drain_s: float = 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(result: RunResult, workload: Workload, slo: Slo) -> Summary:
    done = [r for r in result.records if r.finish_s is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    met = [r for r in result.records if slo.is_met(r)]
    prompt_tokens = sum(r.request.prompt_len for r in done)
    tasks = task_stats(result, slo)
    tasks_ok = tasks.succeeded
    gpu_cost, fleet_cost = result.gpu_cost, result.fleet_cost
    return Summary(
        num_requests=len(result.records),
        num_completed=len(done),
        ttft_p50=_pct(ttfts, 0.5),
        ttft_p90=_pct(ttfts, 0.9),
        ttft_p99=_pct(ttfts, 0.99),
        tpot_p50=_pct(tpots, 0.5),
        tpot_p99=_pct(tpots, 0.99),
        slo_attainment=len(met) / len(result.records) if result.records else 0.0,
        goodput_rps=len(met) / result.makespan_s if result.makespan_s else 0.0,
        kv_hit_rate=sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0,
        gpu_hours=sum(result.busy_s.values()) / 3600.0,
        gpu_cost=gpu_cost,
        fleet_gpu_hours=len(result.price_per_hour) * result.provisioned_s / 3600.0,
        fleet_cost=fleet_cost,
        num_tasks=len(workload.tasks),
        num_tasks_ok=tasks_ok,
        cost_per_successful_task=tasks.fleet_cost_per_successful_task if tasks_ok else float("inf"),
        busy_cost_per_successful_task=tasks.cost_per_successful_task if tasks_ok else float("inf"),
        num_migrations=sum(r.num_migrations for r in result.records),
        drain_s=result.provisioned_s - max((r.arrival_s for r in result.records), default=0.0),
    )


def task_stats(result: RunResult, slo: Slo) -> TaskStats:
    """The run's tasks as the live scheduler's ledger counts them (services/scheduler/tasks.py): each
    request's end, in the order they ended, with its outcome and the GPU time it used at its nodes'
    prices; GPU time no request used (model loads) as overhead; the whole fleet for the run."""
    ledger = TaskLedger(timeout_s=0.0)
    for record in sorted((r for r in result.records if r.is_task), key=lambda r: r.ended_s):
        request = record.request
        ledger.record(request.task_id, request.step, request.total_steps, record.gpu_cost, slo.is_met(record),
                      record.ended_s)
    ledger.expire(math.inf)  # the run is over: a task still missing a successful step failed
    ledger.add_overhead(max(0.0, result.gpu_cost - sum(r.gpu_cost for r in result.records)))
    ledger.add_fleet_time(result.provisioned_s, sum(result.price_per_hour.values()))
    return ledger.stats()


def ttft_values(result: RunResult) -> list[float]:
    return sorted(r.ttft_s for r in result.records if r.ttft_s is not None)




def met_by(result: RunResult, slo: Slo, key: Callable[[RequestRecord], object]) -> dict[str, tuple[int, int]]:
    """(requests meeting the SLO, requests) for each value of key, in sorted order."""
    counts: dict[str, list[int]] = {}
    for record in result.records:
        met_total = counts.setdefault(str(key(record)), [0, 0])
        met_total[0] += int(slo.is_met(record))
        met_total[1] += 1
    return {k: (met, total) for k, (met, total) in sorted(counts.items())}
