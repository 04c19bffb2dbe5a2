"""scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ServiceConfig, doc
from services.scheduler.policies import POLICIES


@dataclass(frozen=True)
class SchedulerConfig(ServiceConfig):
    """Places each request on a node."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50200")
    instance_id: str = doc("this replica's id in etcd", "scheduler-0")
    load_timeout_s: float = doc("a node silent for longer than this is no candidate", 10.0)
    kvindex_timeout_s: float = doc("deadline of an overlap query; past it, place without cache info", 0.25)
    policy: str = doc("placement policy: dynamo, llm_d, sglang, least_loaded or round_robin", "dynamo")
    prefill_load_scale: float = doc("weight of prefill blocks in the KV/load cost (dynamo policy)", 1.0)
    retry_ratio: float = doc("retries (migrations) allowed as a fraction of requests, over 10 s", 0.2)
    retry_min_per_s: float = doc("retries allowed per second whatever the request rate", 5.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load_timeout_s <= 0:
            raise ValueError(f"--load-timeout-s: must be positive, got {self.load_timeout_s}")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy: unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.retry_ratio < 0 or self.retry_min_per_s < 0:
            raise ValueError("--retry-ratio and --retry-min-per-s must be 0 or more")
        if self.kvindex_timeout_s <= 0:
            raise ValueError(f"--kvindex-timeout-s: must be positive, got {self.kvindex_timeout_s}")
