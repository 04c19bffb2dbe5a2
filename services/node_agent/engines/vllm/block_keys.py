"""vLLM's KV block hashes mapped to Baton's block keys. Pure, no I/O.

vLLM names a cached block by its own chained hash over blocks of the engine's block size (32 on
CPU); the router and the kvindex name prompt blocks by Baton's chained keys over 16-token blocks
(services.common.block_hash). Each BlockStored carries the stored blocks' tokens and their
parent's vLLM hash, so each vLLM block maps to the Baton keys of the 16-token blocks it covers,
chained from its parent's last key; BlockRemoved and AllBlocksCleared are translated through the
same map. The kvindex then holds exactly the keys a router computes for a prompt; a chain vLLM
stored under a cache salt (a tenant's) is keyed from that salt's root, as the router keys it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.common.block_hash import DEFAULT_BLOCK_SIZE, hash_block, salted_root
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)


class BlockKeyMap:
    """vLLM block hash -> the Baton keys of the tokens it holds, kept as vLLM's events say."""

    def __init__(self, key_block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.key_block_size = key_block_size
        self._keys: dict[int, tuple[int, ...]] = {}
        # Every Baton key those blocks hold, with how many vLLM blocks hold it.
        self._held: dict[int, int] = {}
        #: BlockStored events whose parent was unknown (an event was lost): their blocks are not indexed.
        self.num_orphans = 0

    def translate(self, event: KVEvent) -> KVEvent | None:
        """The Baton event for one vLLM event; None when it changes nothing Baton can name."""
        if isinstance(event, AllBlocksCleared):
            self._keys.clear()
            self._held.clear()
            return event
        if isinstance(event, BlockRemoved):
            removed = [key for h in event.block_hashes for key in self._keys.pop(h, ())]
            for key in removed:
                if self._held.get(key, 0) <= 1:
                    self._held.pop(key, None)
                else:
                    self._held[key] -= 1
            return BlockRemoved(tuple(removed)) if removed else None
        return self._stored(event)

    def _stored(self, event: BlockStored) -> BlockStored | None:
        size = event.block_size
        if size % self.key_block_size or len(event.token_ids) != size * len(event.block_hashes):
            log.warning("BlockStored with block_size=%d and %d tokens for %d blocks: not indexed",
                        size, len(event.token_ids), len(event.block_hashes))
            return None
        if event.parent_block_hash is None:
            parent = salted_root(event.root_salt)  # ROOT_PARENT_HASH when unsalted
        elif event.parent_block_hash in self._keys:
            parent = self._keys[event.parent_block_hash][-1]
        else:
            self.num_orphans += 1
            return None
        stored: list[int] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            keys = chained_keys(event.token_ids[i * size:(i + 1) * size], self.key_block_size, parent)
            if vllm_hash in self._keys:  # stored again: its old keys are no longer held by it
                self.translate(BlockRemoved((vllm_hash,)))
            self._keys[vllm_hash] = keys
            for key in keys:
                self._held[key] = self._held.get(key, 0) + 1
            stored.extend(keys)
            parent = keys[-1]
        return BlockStored(tuple(stored), None, tuple(event.token_ids), self.key_block_size)

    def cached_prefix_tokens(self, prompt: Sequence[int], cache_salt: str = "") -> int:
        """How many of prompt's leading tokens vLLM holds cached (for its salt), in whole key blocks;
        never the last token, which vLLM always computes. What the node's pending prefill leaves out
        before vLLM itself reports the request's cached tokens (at its first output)."""
        parent, cached = salted_root(cache_salt), 0
        for start in range(0, len(prompt) - self.key_block_size + 1, self.key_block_size):
            parent = hash_block(parent, prompt[start:start + self.key_block_size])
            if parent not in self._held:
                break
            cached = start + self.key_block_size
        return min(cached, max(0, len(prompt) - 1))

    def cached_keys(self) -> list[int]:
        """Every Baton key of every block vLLM holds now (a snapshot)."""
        return [key for keys in self._keys.values() for key in keys]


def chained_keys(token_ids: Sequence[int], block_size: int, parent: int) -> tuple[int, ...]:
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return tuple(keys)
