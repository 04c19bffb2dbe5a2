"""router configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ServiceConfig, doc


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    """The client-facing entry point."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50100")
    instance_id: str = doc("this router's id in etcd", "router-0")
    default_max_tokens: int = doc("max_tokens when a request leaves it unset", 256)
    placement_timeout_s: float = doc("deadline of a placement call to the scheduler", 2.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens: must be positive, got {self.default_max_tokens}")
        if self.placement_timeout_s <= 0:
            raise ValueError(f"--placement-timeout-s: must be positive, got {self.placement_timeout_s}")
