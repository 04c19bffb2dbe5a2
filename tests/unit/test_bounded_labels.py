"""Labels whose values clients choose (a tenant, free text without --auth) stay bounded: the first
MAX_LABEL_VALUES values keep their name, later ones are "other". A live probe's four tenants made 144 new lines of
the router's latency histograms, and every new tenant would have made as many."""

from __future__ import annotations

import asyncio
import math

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.common.errors import ResourceExhausted
from services.common.telemetry import MAX_LABEL_VALUES, OTHER_LABEL, BoundedLabel
from services.router.latency import StreamLatency
from services.scheduler.admission import Admission, TenantLimits, Ticket
from services.scheduler.gate import AdmissionGate

pytestmark = pytest.mark.timeout(20)

NUM_TENANTS = MAX_LABEL_VALUES + 50


def _points(reader: InMemoryMetricReader, name: str) -> list:
    metrics = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
    return next(m for m in metrics if m.name == name).data.data_points


def _by_tenant(points: list) -> dict[str, int]:
    return {p.attributes["tenant"]: p.count if hasattr(p, "count") else p.value for p in points}


def test_a_label_keeps_its_first_values_and_calls_the_rest_other() -> None:
    label = BoundedLabel(limit=2)
    assert [label(v) for v in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER_LABEL, "a", OTHER_LABEL, "b"]


def test_the_routers_latency_histograms_keep_a_bounded_set_of_tenants() -> None:
    reader = InMemoryMetricReader()
    latency = StreamLatency(MeterProvider(metric_readers=[reader]).get_meter("test"))
    for i in range(NUM_TENANTS):
        tenant = "" if i == 0 else f"t-{i}"  # a request that names none is the tenant "default"
        latency.first_token(0.05, "h100", tenant, "m")
        latency.next_tokens(0.02, 2, "h100", tenant, "m")
    latency.first_token(0.05, "h100", "t-1", "m")  # a tenant labelled before stays itself
    for name, per_stream in (("baton.router.ttft", 1), ("baton.router.inter_token_latency", 2)):
        counts = _by_tenant(_points(reader, name))
        assert len(counts) == MAX_LABEL_VALUES + 1  # the series an operator sees, "other" included
        assert counts["default"] == per_stream and counts[f"t-{MAX_LABEL_VALUES - 1}"] == per_stream
        assert counts[OTHER_LABEL] == (NUM_TENANTS - MAX_LABEL_VALUES) * per_stream
    assert _by_tenant(_points(reader, "baton.router.ttft"))["t-1"] == 2


async def test_the_admission_metrics_keep_a_bounded_set_of_tenants() -> None:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    saturated = True
    admission = Admission(default_limits=TenantLimits(max_concurrency=1))
    gate = AdmissionGate(admission, lambda: saturated, meter, clock=lambda: 100.0)

    def ticket(rid: str, tenant: str) -> Ticket:
        return Ticket(request_id=rid, tenant=tenant, priority=0, num_tokens=10, arrived_at=99.0, deadline_at=math.inf)

    dispatcher = asyncio.create_task(gate.run())
    try:
        waiting = [asyncio.create_task(gate.enter(ticket(f"q-{i}", f"t-{i}"), 0.1)) for i in range(NUM_TENANTS)]
        await asyncio.sleep(0)
        assert admission.num_queued == NUM_TENANTS
        saturated = False
        gate.capacity_changed()
        assert await asyncio.wait_for(asyncio.gather(*waiting), 10) == [True] * NUM_TENANTS
        for i in range(NUM_TENANTS):  # each tenant at its limit of one request
            with pytest.raises(ResourceExhausted, match="concurrency limit"):
                await gate.enter(ticket(f"r-{i}", f"t-{i}"), 0.1)
    finally:
        dispatcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await dispatcher
    waited = _by_tenant(_points(reader, "baton.scheduler.queue_wait"))
    refused = _by_tenant([p for p in _points(reader, "baton.scheduler.admissions") if "tenant" in p.attributes])
    for counts in (waited, refused):
        assert len(counts) == MAX_LABEL_VALUES + 1
        assert counts["t-0"] == 1 and counts[OTHER_LABEL] == NUM_TENANTS - MAX_LABEL_VALUES


def test_with_max_tenant_labels_0_every_tenant_is_other() -> None:
    reader = InMemoryMetricReader()
    latency = StreamLatency(MeterProvider(metric_readers=[reader]).get_meter("test"), max_tenant_labels=0)
    for tenant in ("acme", "t-1", ""):
        latency.first_token(0.05, "h100", tenant, "m")
    assert _by_tenant(_points(reader, "baton.router.ttft")) == {OTHER_LABEL: 3}
