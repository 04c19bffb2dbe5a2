"""OpenTelemetry set-up: a tracer provider per process, trace context carried in gRPC metadata."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.instrumentation.grpc.filters import service_prefix
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from prometheus_client import CollectorRegistry, start_http_server

from services.common.call_tracing import StreamUnaryTracing, UnaryUnaryTracing


# Distinct values a label that clients choose (a tenant) keeps in one process by default (--max-tenant-labels);
# later ones are OTHER_LABEL.
MAX_LABEL_VALUES = 100
OTHER_LABEL = "other"


class BoundedLabel:
    """A label whose values come from clients: the first `limit` distinct values label as themselves, every later
    one as OTHER_LABEL, so that no client can add series without bound. One event loop's (not thread-safe)."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self._limit = limit
        self._kept: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        if len(self._kept) >= self._limit:
            return OTHER_LABEL
        self._kept.add(value)
        return value


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (several processes may share it)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "service": span.resource.attributes.get("service.name"),
                        "instance": span.resource.attributes.get("service.instance.id"),
                        "name": span.name,
                        "trace_id": f"{ctx.trace_id:032x}",
                        "span_id": f"{ctx.span_id:016x}",
                        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
                        # What a latency needs (it had none): epoch nanoseconds, the span's kind and status.
                        "kind": span.kind.name,
                        "start_time_unix_nano": span.start_time,
                        "end_time_unix_nano": span.end_time,
                        "status": span.status.status_code.name,
                        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
                        # What happened within it (a node a request left, an exception), each at its time.
                        "events": [{"name": event.name, "time_unix_nano": event.timestamp,
                                    "attributes": {k: _plain(v) for k, v in (event.attributes or {}).items()}}
                                   for event in span.events],
                    }
                )
            )
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


class Telemetry:
    """The process's tracer and meter providers, and the gRPC interceptors that use them.

    exporter is --otel-exporter (none, console, file:PATH or otlp:HOST:PORT); channel_credentials TLS
    for calls to other services (None: plaintext); metrics_listen the host:port of the Prometheus
    endpoint, "" for none. The endpoint serves once serve_metrics is called.
    """

    def __init__(self, service_name: str, exporter: str,
                 channel_credentials: grpc.ChannelCredentials | None = None, metrics_listen: str = "",
                 instance_id: str = "") -> None:
        # TLS for calls to other services (see `channel`); None: plaintext.
        self.channel_credentials = channel_credentials
        # The replica by its --instance-id (--node-id), not a fresh UUID: two schedulers' spans told apart.
        resource = Resource.create({"service.name": service_name,
                                    **({"service.instance.id": instance_id} if instance_id else {})})
        self.tracer_provider = TracerProvider(resource=resource)
        span_exporter: SpanExporter | None = None
        metric_readers: list[MetricReader] = []
        if exporter == "console":
            span_exporter = ConsoleSpanExporter()
            metric_readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), 10_000))
        elif exporter.startswith("file:"):
            span_exporter = JsonLinesSpanExporter(exporter.removeprefix("file:"))
        elif exporter.startswith("otlp:"):
            span_exporter, metric_reader = _otlp(exporter.removeprefix("otlp:"))
            metric_readers.append(metric_reader)
        elif exporter != "none":
            raise ValueError(f"--otel-exporter: expected none, console, file:PATH or otlp:HOST:PORT, got {exporter!r}")
        if span_exporter is not None:
            self.tracer_provider.add_span_processor(
                BatchSpanProcessor(span_exporter, schedule_delay_millis=200)
            )
        self.metrics_listen = metrics_listen
        # A registry of this process's own: nothing else registers there, and tests may build several.
        self._registry = CollectorRegistry()
        self._metrics_server: WSGIServer | None = None
        if metrics_listen:
            metric_readers.append(PrometheusMetricReader(registry=self._registry))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=metric_readers)
        # Make the providers global so that library instrumentation finds them too.
        trace.set_tracer_provider(self.tracer_provider)
        metrics.set_meter_provider(self.meter_provider)
        self.tracer = self.tracer_provider.get_tracer(service_name)
        self.meter = self.meter_provider.get_meter(service_name)

    def serve_metrics(self) -> None:
        """Start serving Prometheus text at http://metrics_listen/metrics (a thread of its own), if
        there is an endpoint; OSError if its port cannot be bound."""
        if not self.metrics_listen or self._metrics_server is not None:
            return
        host, _, port = self.metrics_listen.rpartition(":")
        self._metrics_server, _ = start_http_server(int(port), addr=host.strip("[]"), registry=self._registry)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        # Only Baton's own services: the interceptor cannot wrap grpc.health's coroutine-style
        # Watch stream, and health/reflection traffic is not worth tracing anyway.
        return [aio_server_interceptor(tracer_provider=self.tracer_provider,
                                       filter_=service_prefix("baton."))]

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """OpenTelemetry's for the calls that stream their answers; for those that answer once, one whose calls a
        cancel() reaches (services/common/call_tracing.py)."""
        streaming = [interceptor for interceptor in aio_client_interceptors(tracer_provider=self.tracer_provider)
                     if isinstance(interceptor, (grpc.aio.UnaryStreamClientInterceptor,
                                                 grpc.aio.StreamStreamClientInterceptor))]
        return [UnaryUnaryTracing(self.tracer_provider), StreamUnaryTracing(self.tracer_provider), *streaming]

    def insecure_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel whose calls carry the current trace context."""
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=self.client_interceptors())

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """A channel to another Baton service whose calls carry the current trace context: over TLS, with
        this process's certificate, when it was given channel credentials (--tls-ca), else plaintext."""
        if self.channel_credentials is None:
            return self.insecure_channel(address, options)
        return grpc.aio.secure_channel(address, self.channel_credentials, options=list(options),
                                       interceptors=self.client_interceptors())

    def shutdown(self) -> None:
        try:
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()
        except Exception:  # noqa: BLE001 - telemetry must never block shutdown
            logging.getLogger(__name__).exception("telemetry shutdown failed")


def _otlp(endpoint: str) -> tuple[SpanExporter, MetricReader]:
    """Span exporter and metric reader for an OTLP gRPC collector at endpoint (host:port, plaintext).

    Metrics go every OTEL_METRIC_EXPORT_INTERVAL ms (the SDK's variable; 60 s unset) and at shutdown.
    """
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    url = f"http://{endpoint}"
    return (OTLPSpanExporter(endpoint=url, insecure=True),
            PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=url, insecure=True)))
