"""An approximate prefix index built from the router's own decisions, not from engine events. Pure.

It is what llm-d's approximate prefix scorer and SGLang's cache-aware policy keep: after each
placement, the request's prompt blocks are recorded for the chosen node. It never learns of
evictions, only forgets by age (SGLang) or by per-node capacity (llm-d's LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class RoutedPrefixIndex:
    def __init__(self, ttl_s: float | None = None, capacity_per_node: int | None = None) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity_per_node
        # Per node: block hash -> when it was last routed there, least recent first.
        self._blocks: dict[str, OrderedDict[int, float]] = {}

    def record(self, node_id: str, block_hashes: Sequence[int], now: float) -> None:
        blocks = self._blocks.setdefault(node_id, OrderedDict())
        for block_hash in block_hashes:
            blocks[block_hash] = now
            blocks.move_to_end(block_hash)
        if self._capacity is not None:
            while len(blocks) > self._capacity:
                blocks.popitem(last=False)

    def matched(self, node_id: str, block_hashes: Sequence[int], now: float) -> int:
        """Leading blocks of block_hashes recorded for node_id and not yet expired."""
        blocks = self._blocks.get(node_id)
        if not blocks:
            return 0
        self._expire(blocks, now)
        count = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            count += 1
        return count

    def _expire(self, blocks: OrderedDict[int, float], now: float) -> None:
        if self._ttl_s is None:
            return
        horizon = now - self._ttl_s
        while blocks:
            oldest = next(iter(blocks.values()))
            if oldest >= horizon:
                break
            blocks.popitem(last=False)
