"""kvindex configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.block_hash import MAX_OVERLAP_BLOCKS
from services.common.config import ServiceConfig, check_instance_id, doc


@dataclass(frozen=True)
class KVIndexConfig(ServiceConfig):
    """The cluster-wide KV block index."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:50300")
    instance_id: str = doc("this replica's id in etcd (1 to 128 of letters, digits and . _ : @ -)", "kvindex-0")
    max_overlap_blocks: int = doc("most block hashes one QueryOverlap may carry (the schedulers' "
                                  "--max-overlap-blocks: they ask about no more of a prompt)", MAX_OVERLAP_BLOCKS)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_instance_id("instance-id", self.instance_id)
        if self.max_overlap_blocks <= 0:
            raise ValueError(f"--max-overlap-blocks: must be positive, got {self.max_overlap_blocks}")
