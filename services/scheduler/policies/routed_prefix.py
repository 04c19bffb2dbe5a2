"""An approximate prefix index built from the router's own decisions, not from engine events. Pure.

It is what llm-d's approximate prefix scorer and SGLang's cache-aware policy keep: after each
placement, the request's prompt blocks are recorded for the chosen node. It never learns of
evictions; it forgets by per-node capacity, least recently routed first — at once (llm-d's LRU),
or only when `evict_to` is called (SGLang's periodic eviction pass).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RoutedPrefixIndex:
    def __init__(self, capacity_per_node: int | None = None) -> None:
        self._capacity = capacity_per_node
        # Per node: the block hashes routed there, least recently routed first.
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def record(self, node_id: str, block_hashes: Sequence[int]) -> None:
        blocks = self._blocks.setdefault(node_id, OrderedDict())
        for block_hash in block_hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        if self._capacity is not None:
            self._trim(blocks, self._capacity)

    def matched(self, node_id: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of block_hashes recorded for node_id."""
        blocks = self._blocks.get(node_id)
        if not blocks:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            count += 1
        return count

    def size(self, node_id: str) -> int:
        """Blocks recorded for node_id: how much of its cache the index believes is taken."""
        return len(self._blocks.get(node_id, ()))

    def evict_to(self, max_blocks: int) -> None:
        """Forget each node's least recently routed blocks until it holds at most max_blocks."""
        for blocks in self._blocks.values():
            self._trim(blocks, max_blocks)

    @staticmethod
    def _trim(blocks: OrderedDict[int, None], max_blocks: int) -> None:
        while len(blocks) > max_blocks:
            blocks.popitem(last=False)
