"""kvindex configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ServiceConfig, doc


@dataclass(frozen=True)
class KVIndexConfig(ServiceConfig):
    """The cluster-wide KV block index."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50300")
    instance_id: str = doc("this replica's id in etcd", "kvindex-0")
