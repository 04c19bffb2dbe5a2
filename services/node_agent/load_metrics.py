"""This node's load as metrics: the engine's queue depth, KV cache usage and latest decode step time."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.common.change_signal import wait_or_timeout
from services.common.load import Load
from services.node_agent.model_host import ModelHost


class LoadGauges:
    """Gauges of the host's load, read from a copy the event loop refreshes: metric readers call
    gauges from their own threads, and the engine's state belongs to the loop."""

    def __init__(self, host: ModelHost, meter: Meter, attributes: dict[str, str]) -> None:
        self._host = host
        self._attributes = attributes
        self._load = Load()
        gauges = {
            "baton.node.requests_running": (lambda load: load.num_running, "requests the engine is running"),
            "baton.node.requests_waiting": (lambda load: load.num_waiting, "requests queued in the engine"),
            "baton.node.kv_blocks_used": (lambda load: load.kv_blocks_used, "KV cache blocks in use"),
            "baton.node.kv_blocks_total": (lambda load: load.kv_blocks_total, "KV cache blocks in all"),
        }
        for name, (read, description) in gauges.items():
            meter.create_observable_gauge(name, [self._observe(read)], description=description)
        meter.create_observable_gauge("baton.node.kv_cache_usage", [self._observe(_usage)], unit="1",
                                      description="fraction of the KV cache's blocks in use")
        meter.create_observable_gauge(
            "baton.node.decode_step", [self._observe(lambda load: load.recent_decode_step_ms)], unit="ms",
            description="mean time of the engine's latest decode steps (about their last second), the prefill "
                        "chunks riding in them included")

    def _observe(self, read: Callable[[Load], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read(self._load), self._attributes)]
        return observe

    async def follow(self, interval_s: float) -> None:
        """Copy the load on every change, and at least every interval_s."""
        while True:
            changed = self._host.load_changed.since_now()
            self._load = self._host.load()
            await wait_or_timeout(changed, interval_s)


def _usage(load: Load) -> float:
    return load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
