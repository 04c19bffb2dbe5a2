"""kvindex configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check_listen, doc


@dataclass(frozen=True)
class KVIndexConfig:
    """The cluster-wide KV block index."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50300")
    etcd: str = doc("etcd endpoint host:port", "127.0.0.1:2379")
    instance_id: str = doc("this replica's id in etcd", "kvindex-0")
    lease_ttl_s: int = doc("etcd lease TTL in seconds", 5)
    otel_exporter: str = doc("span exporter: none, console or file:PATH", "none")
    log_level: str = doc("logging level", "INFO")

    def __post_init__(self) -> None:
        check_listen("listen", self.listen)
        check_listen("etcd", self.etcd)
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s: must be at least 1, got {self.lease_ttl_s}")
