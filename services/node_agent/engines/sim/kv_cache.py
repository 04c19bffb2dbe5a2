"""Paged KV cache with prefix caching and LRU eviction, publishing vLLM-shaped KV events."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.node_agent.engines.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


@dataclass(eq=False)
class KVBlock:
    """One physical block: who references it and, once full and computed, its chained hash."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class KVCache:
    """Fixed pool of KV blocks, each request's block table, and the prefix-cache index."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"invalid KV cache shape: num_blocks={num_blocks} block_size={block_size}")
        self.block_size = block_size
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        # Unreferenced blocks holding no cached data: used before evicting anything.
        self._free: deque[KVBlock] = deque(self._blocks)
        # Unreferenced cached blocks by block id, least recently freed first.
        self._lru: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[int, KVBlock] = {}
        self._tables: dict[str, list[KVBlock]] = {}
        # Per request: how many leading blocks of its table are already registered by hash.
        self._num_committed: dict[str, int] = {}
        self._num_used = 0
        self._events: list[KVEvent] = []
        # Bumped whenever the set of findable hashes changes, so a prefix match can be reused.
        self.version = 0

    @property
    def num_total_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self._blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self._num_used

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, referenced or not."""
        return len(self._cached)

    def cached_block_hashes(self) -> list[int]:
        """Every hash findable in the prefix cache right now."""
        return list(self._cached)

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks in request_id's block table."""
        return len(self._tables.get(request_id, ()))

    def match_prefix(self, block_hashes: Sequence[int]) -> list[KVBlock]:
        """Cached blocks for the longest leading run of block_hashes."""
        matched: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            matched.append(block)
        return matched

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Grow request_id's table to hold num_tokens; False (and no change) if blocks run short.

        computed_blocks, from match_prefix, start a new table and are shared, not copied.
        """
        table = self._tables.get(request_id)
        if table is not None and computed_blocks:
            raise ValueError(
                f"request {request_id!r} already has blocks; prefix hits apply only to its first allocation"
            )
        num_held = len(table) if table is not None else 0
        num_needed = -(-num_tokens // self.block_size) - num_held - len(computed_blocks)
        # Hit blocks sitting in the LRU stop being evictable once this request takes them.
        num_hits_in_lru = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_needed > self.num_free_blocks - num_hits_in_lru:
            return False
        if table is None:
            table = self._tables[request_id] = []
            self._num_committed[request_id] = len(computed_blocks)
        for block in computed_blocks:
            self._touch(block)
            table.append(block)
        evicted: list[int] = []
        for _ in range(max(0, num_needed)):
            table.append(self._take_free_block(evicted))
        if evicted:
            self._events.append(BlockRemoved(block_hashes=tuple(evicted)))
        return True

    def commit_full_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        num_blocks: int | None = None,
    ) -> None:
        """Register the request's first num_blocks computed full blocks (default: all of block_hashes).

        block_hashes[i] is table block i.
        """
        table = self._tables[request_id]
        start = self._num_committed[request_id]
        end = len(block_hashes) if num_blocks is None else num_blocks
        if end <= start:
            return
        run: list[int] = []
        run_start = start
        for index in range(start, end):
            block_hash = block_hashes[index]
            existing = self._cached.get(block_hash)
            if existing is not None and existing is not table[index]:
                # Another request computed the same block first: share its copy and
                # give ours back, so the pool keeps one copy per hash (as vLLM does).
                self._emit_stored(run, run_start, block_hashes, token_ids)
                run = []
                run_start = index + 1
                self._touch(existing)
                self._release(table[index])
                table[index] = existing
                continue
            table[index].block_hash = block_hash
            self._cached[block_hash] = table[index]
            self.version += 1
            run.append(block_hash)
        self._emit_stored(run, run_start, block_hashes, token_ids)
        self._num_committed[request_id] = end

    def free(self, request_id: str) -> None:
        """Drop request_id's references; cached blocks become evictable, tail of the chain first."""
        table = self._tables.pop(request_id, [])
        self._num_committed.pop(request_id, None)
        # Releasing the tail first puts it ahead in the LRU, so a chain is evicted
        # from its end and the surviving blocks remain a usable prefix.
        for block in reversed(table):
            self._release(block)

    def reset(self) -> None:
        """Forget every cached hash (blocks in use keep their data but are no longer findable)."""
        for block in self._lru.values():
            self._free.append(block)
        self._lru.clear()
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.version += 1
        self._events.append(AllBlocksCleared())

    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""
        events, self._events = self._events, []
        return events

    def _emit_stored(
        self,
        run: list[int],
        run_start: int,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
    ) -> None:
        """Publish a run of consecutive newly stored blocks as one BlockStored."""
        if not run:
            return
        size = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(run),
                parent_block_hash=block_hashes[run_start - 1] if run_start > 0 else None,
                token_ids=tuple(token_ids[run_start * size : (run_start + len(run)) * size]),
                block_size=size,
            )
        )

    def _touch(self, block: KVBlock) -> None:
        """Take a reference, pulling the block out of the LRU if it was evictable."""
        if block.ref_count == 0:
            self._lru.pop(block.block_id, None)
            self._num_used += 1
        block.ref_count += 1

    def _release(self, block: KVBlock) -> None:
        """Drop a reference; an unreferenced block becomes evictable or free."""
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self._num_used -= 1
        if block.block_hash is not None:
            self._lru[block.block_id] = block
        else:
            self._free.append(block)

    def _take_free_block(self, evicted: list[int]) -> KVBlock:
        """A referenced empty block: a free one if any, else the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            _, block = self._lru.popitem(last=False)
            assert block.block_hash is not None
            del self._cached[block.block_hash]
            self.version += 1
            evicted.append(block.block_hash)
            block.block_hash = None
        block.ref_count = 1
        self._num_used += 1
        return block
