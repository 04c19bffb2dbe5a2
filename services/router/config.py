"""router configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check_listen, doc


@dataclass(frozen=True)
class RouterConfig:
    """The client-facing entry point."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50100")
    etcd: str = doc("etcd endpoint host:port", "127.0.0.1:2379")
    instance_id: str = doc("this router's id in etcd", "router-0")
    lease_ttl_s: int = doc("etcd lease TTL in seconds", 5)
    default_max_tokens: int = doc("max_tokens when a request leaves it unset", 256)
    placement_timeout_s: float = doc("deadline of a placement call to the scheduler", 2.0)
    otel_exporter: str = doc("span exporter: none, console or file:PATH", "none")
    log_level: str = doc("logging level", "INFO")

    def __post_init__(self) -> None:
        check_listen("listen", self.listen)
        check_listen("etcd", self.etcd)
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens: must be positive, got {self.default_max_tokens}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s: must be at least 1, got {self.lease_ttl_s}")
