"""Chained KV block keys, computed the same way by router, kvindex and engines."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16
# Most leading blocks of a prompt an overlap query asks a kvindex about (the scheduler's and the kvindexes'
# --max-overlap-blocks): 2^20 tokens' worth, a million-token context, and as many tokens as a text prompt within
# the routers' --max-prompt-bytes default (1 MiB) can have, a token being a byte at least.
MAX_OVERLAP_BLOCKS = (1 << 20) // DEFAULT_BLOCK_SIZE
# Parent of the first block of every chain.
ROOT_PARENT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Key of one full block: a 64-bit hash of its parent's key and its token ids."""
    payload = struct.pack(f"<Q{len(token_ids)}i", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def salted_root(cache_salt: str) -> int:
    """The parent of a chain's first block under cache_salt: every key of the chain depends on it, so
    blocks cached under one salt never match a prompt under another. The empty salt is the shared root."""
    if not cache_salt:
        return ROOT_PARENT_HASH
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"baton-salt").digest()
    return int.from_bytes(digest, "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    parent_hash: int = ROOT_PARENT_HASH,
) -> list[int]:
    """Keys of every full block of token_ids; a trailing partial block has none."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
