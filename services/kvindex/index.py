"""The cluster-wide KV block index: which node holds which block, per model. Pure, no I/O."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KVIndex:
    """block hash -> nodes holding it, fed by engine KV events, queried by prompt block hashes."""

    def __init__(self) -> None:
        # (model, block hash) -> nodes that hold the block.
        self._holders: dict[tuple[str, int], set[str]] = defaultdict(set)
        # node -> its (model, block hash) keys, so a node can be dropped at once.
        self._node_blocks: dict[str, set[tuple[str, int]]] = defaultdict(set)

    def apply(self, node_id: str, model: str, event: KVEvent) -> None:
        """Fold one engine event from node_id into the index."""
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                key = (model, block_hash)
                self._holders[key].add(node_id)
                self._node_blocks[node_id].add(key)
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._forget(node_id, (model, block_hash))
        elif isinstance(event, AllBlocksCleared):
            for key in [k for k in self._node_blocks.get(node_id, ()) if k[0] == model]:
                self._forget(node_id, key)

    def _forget(self, node_id: str, key: tuple[str, int]) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(node_id)
            if not holders:
                del self._holders[key]
        blocks = self._node_blocks.get(node_id)
        if blocks is not None:
            blocks.discard(key)

    def remove_node(self, node_id: str) -> None:
        """Drop everything node_id held (it left the cluster or will re-sync)."""
        for key in self._node_blocks.pop(node_id, set()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(node_id)
                if not holders:
                    del self._holders[key]

    def reset_node(self, node_id: str, model: str, block_hashes: Sequence[int]) -> None:
        """Replace everything node_id holds with exactly block_hashes of model (a snapshot: the
        node's whole cache, of the one model it has warm; none when model is empty)."""
        self.remove_node(node_id)
        if model:
            self.apply(node_id, model, BlockStored(tuple(block_hashes), None, (), 0))

    def overlap(self, model: str, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each node holding the first block, how many leading blocks it holds."""
        matched: dict[str, int] = {}
        if not block_hashes:
            return matched
        active = set(self._holders.get((model, block_hashes[0]), ()))
        depth = 0
        for block_hash in block_hashes:
            holders = self._holders.get((model, block_hash))
            still = active & holders if holders else set()
            for node_id in active - still:
                matched[node_id] = depth
            active = still
            if not active:
                break
            depth += 1
        for node_id in active:
            matched[node_id] = depth
        return matched

    def num_blocks(self, node_id: str) -> int:
        return len(self._node_blocks.get(node_id, ()))

    def nodes(self) -> list[str]:
        return sorted(node for node, blocks in self._node_blocks.items() if blocks)
