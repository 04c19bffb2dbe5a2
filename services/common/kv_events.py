"""KV cache events, in the shapes vLLM publishes; produced by engines, consumed by the kvindex."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    # vLLM only: the cache salt of a chain's first block (parent_block_hash None), which vLLM mixed
    # into that block's hash; Baton's keys for the chain then start from block_hash.salted_root(it).
    root_salt: str = ""


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
