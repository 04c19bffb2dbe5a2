"""Time to first token and inter-token latency as clients see them, by the GPU that made the tokens."""

from __future__ import annotations

from opentelemetry.metrics import Meter

from baton.protocol import DEFAULT_TENANT
from services.common.telemetry import MAX_LABEL_VALUES, BoundedLabel

# Bucket bounds in ms: TTFT spans a cached prefix on an H100 to a long queue; inter-token gaps are
# a decode step or a few (OpenTelemetry's default bounds would put every gap in two buckets).
TTFT_BUCKETS_MS = (5, 10, 25, 50, 75, 100, 150, 250, 500, 750, 1000, 2500, 5000, 10000, 30000)
ITL_BUCKETS_MS = (1, 2, 5, 10, 15, 20, 30, 40, 50, 75, 100, 150, 250, 500, 1000)


class StreamLatency:
    """The router's TTFT and inter-token-latency histograms (labels: gpu, tenant, model).

    Without --auth a tenant is whatever its client sends: the first max_tenant_labels tenants keep their name in
    both histograms, later ones are "other" (gpu and model are the fleet's: the model is one a node serves).
    """

    def __init__(self, meter: Meter, max_tenant_labels: int = MAX_LABEL_VALUES) -> None:
        self._tenant = BoundedLabel(max_tenant_labels)
        self._ttft = meter.create_histogram(
            "baton.router.ttft", unit="ms", explicit_bucket_boundaries_advisory=TTFT_BUCKETS_MS,
            description="from a Generate stream's start (placement included) to its first token leaving the node")
        self._itl = meter.create_histogram(
            "baton.router.inter_token_latency", unit="ms", explicit_bucket_boundaries_advisory=ITL_BUCKETS_MS,
            description="gap between consecutive tokens of a stream (a chunk of k tokens after g counts k gaps "
                        "of g/k); the gap across a migration is baton.router.resume_stall instead")

    def first_token(self, ttft_s: float, gpu: str, tenant: str, model: str) -> None:
        self._ttft.record(ttft_s * 1000, self._labels(gpu, tenant, model))

    def next_tokens(self, gap_s: float, num_tokens: int, gpu: str, tenant: str, model: str) -> None:
        """num_tokens arrived together, gap_s after the stream's previous tokens."""
        labels = self._labels(gpu, tenant, model)
        per_token_ms = gap_s * 1000 / num_tokens
        for _ in range(num_tokens):
            self._itl.record(per_token_ms, labels)

    def _labels(self, gpu: str, tenant: str, model: str) -> dict[str, str]:
        # The scheduler's name for the tenant a request leaves unset (admission.md).
        return {"gpu": gpu or "unknown", "tenant": self._tenant(tenant or DEFAULT_TENANT), "model": model}
