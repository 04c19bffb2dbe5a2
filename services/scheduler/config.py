"""scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check_listen, doc


@dataclass(frozen=True)
class SchedulerConfig:
    """Places each request on a node."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50200")
    etcd: str = doc("etcd endpoint host:port", "127.0.0.1:2379")
    instance_id: str = doc("this replica's id in etcd", "scheduler-0")
    lease_ttl_s: int = doc("etcd lease TTL in seconds", 5)
    load_timeout_s: float = doc("a node silent for longer than this is no candidate", 10.0)
    kvindex_timeout_s: float = doc("deadline of an overlap query; past it, place without cache info", 0.25)
    prefill_load_scale: float = doc("weight of prefill blocks in the KV/load cost", 1.0)
    otel_exporter: str = doc("span exporter: none, console or file:PATH", "none")
    log_level: str = doc("logging level", "INFO")

    def __post_init__(self) -> None:
        check_listen("listen", self.listen)
        check_listen("etcd", self.etcd)
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s: must be at least 1, got {self.lease_ttl_s}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"--load-timeout-s: must be positive, got {self.load_timeout_s}")
