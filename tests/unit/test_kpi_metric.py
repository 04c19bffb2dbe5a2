"""The leader exports cost per successful task two ways (the whole fleet, and busy GPU time with model
loads) as an OpenTelemetry gauge."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerService
from tests.unit.leading import fake_leadership


def exported(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict, float]]]:
    metrics = reader.get_metrics_data()
    if metrics is None:  # nothing observed at all
        return {}
    return {m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
            for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


@pytest.mark.parametrize("leading", [True, False])
async def test_the_leader_exports_the_kpi_and_a_standby_does_not(monkeypatch: pytest.MonkeyPatch,
                                                                  leading: bool) -> None:
    fake_leadership(monkeypatch, lambda: leading)
    reader = InMemoryMetricReader()
    telemetry = Telemetry("scheduler/test", "none")
    telemetry.meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    service = SchedulerService(SchedulerConfig(), telemetry)
    service._tasks.record("r1", 1, 1, 0.002, ok=True, now=time.monotonic())
    service._tasks.record("r2", 1, 1, 0.001, ok=False, now=time.monotonic())
    service._tasks.add_overhead(0.001)
    service._tasks.add_fleet_time(3600.0, 0.01)  # an hour of a fleet costing $0.01 an hour, idle or not
    metrics = exported(reader)
    if leading:
        assert sorted(metrics["baton.scheduler.cost_per_successful_task"], key=str) == [
            ({"accounting": "busy"}, pytest.approx(0.003)), ({"accounting": "fleet"}, pytest.approx(0.01))]
        assert ({"outcome": "succeeded"}, 1) in metrics["baton.scheduler.tasks"]
        assert ({"outcome": "open"}, 1) in metrics["baton.scheduler.tasks"]  # r2 may still be retried
    else:
        assert not metrics.get("baton.scheduler.cost_per_successful_task")
    await service.close()
