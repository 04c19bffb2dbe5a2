"""--otel-exporter file:PATH: one JSON object per finished span, with what a latency needs."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from services.common.telemetry import JsonLinesSpanExporter, Telemetry


def test_each_span_line_has_its_times_kind_status_parent_and_events(tmp_path: Path) -> None:
    """It had ids and attributes only: no latency could be read from it, nor what happened within a span."""
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer", kind=trace.SpanKind.SERVER):
        with tracer.start_as_current_span("inner", kind=trace.SpanKind.CLIENT, attributes={"n": 3}) as inner:
            inner.add_event("baton.node_failure", {"baton.node_id": "n1", "baton.tokens": 4})
            inner.set_status(trace.Status(trace.StatusCode.ERROR))
    inner_line, outer_line = (json.loads(line) for line in path.read_text().splitlines())
    assert (inner_line["name"], inner_line["kind"], inner_line["status"]) == ("inner", "CLIENT", "ERROR")
    assert (outer_line["kind"], outer_line["status"], outer_line["service"]) == ("SERVER", "UNSET", "router")
    assert inner_line["parent_span_id"] == outer_line["span_id"] and inner_line["attributes"] == {"n": 3}
    # Its events too (it had none: a request's span could not say which node it left, helper-152).
    (event,) = inner_line["events"]
    assert (event["name"], event["attributes"]) == ("baton.node_failure", {"baton.node_id": "n1", "baton.tokens": 4})
    assert inner_line["start_time_unix_nano"] <= event["time_unix_nano"] <= inner_line["end_time_unix_nano"]
    assert outer_line["events"] == []
    assert outer_line["start_time_unix_nano"] <= inner_line["start_time_unix_nano"]
    assert inner_line["start_time_unix_nano"] <= inner_line["end_time_unix_nano"] <= outer_line["end_time_unix_nano"]


def test_a_span_names_the_replica_that_made_it(tmp_path: Path) -> None:
    """service.instance.id was a fresh UUID per process, and the file's lines had no instance at all: two scheduler
    replicas' spans could not be told apart (helper-116)."""
    path = tmp_path / "spans.jsonl"
    telemetry = Telemetry("scheduler", f"file:{path}", instance_id="scheduler-1")
    with telemetry.tracer_provider.get_tracer("test").start_as_current_span("Place"):
        pass
    telemetry.tracer_provider.shutdown()  # (its spans written)
    line = json.loads(path.read_text().splitlines()[0])
    assert (line["service"], line["instance"]) == ("scheduler", "scheduler-1")
