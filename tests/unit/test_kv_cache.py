"""The paged KV cache: prefix hits, LRU eviction, sharing and the events it publishes."""

from __future__ import annotations

from services.common.block_hash import block_hashes
from services.node_agent.engines.sim.kv_cache import KVCache
from services.node_agent.engines.types import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt) % 251 for i in range(n)]


def _fill(cache: KVCache, request_id: str, tokens: list[int]) -> list[int]:
    """Allocate and commit every full block of tokens, reusing cached prefix blocks."""
    hashes = block_hashes(tokens, BS)
    hits = cache.match_prefix(hashes)
    assert cache.allocate(request_id, len(tokens), hits)
    cache.commit_full_blocks(request_id, hashes, tokens)
    return hashes


def test_commit_publishes_one_chained_block_stored_per_run() -> None:
    cache = KVCache(8, BS)
    tokens = _tokens(10, 1)
    hashes = block_hashes(tokens, BS)
    assert cache.allocate("a", 6)
    cache.commit_full_blocks("a", hashes[:1], tokens)
    assert cache.allocate("a", 10)
    cache.commit_full_blocks("a", hashes[:2], tokens)
    assert cache.drain_events() == [
        BlockStored((hashes[0],), parent_block_hash=None, token_ids=tuple(tokens[:4]), block_size=BS),
        BlockStored((hashes[1],), parent_block_hash=hashes[0], token_ids=tuple(tokens[4:8]), block_size=BS),
    ]
    assert cache.drain_events() == []


def test_match_prefix_is_the_longest_leading_run() -> None:
    cache = KVCache(8, BS)
    hashes = _fill(cache, "a", _tokens(12, 1))
    other = block_hashes(_tokens(12, 2), BS)
    assert len(cache.match_prefix(hashes)) == 3
    assert len(cache.match_prefix([hashes[0], other[1], hashes[2]])) == 1
    assert cache.match_prefix(other) == []


def test_freed_blocks_stay_cached_and_free_blocks_are_used_before_evicting() -> None:
    cache = KVCache(6, BS)
    hashes = _fill(cache, "a", _tokens(12, 1))
    cache.free("a")
    assert cache.num_used_blocks == 0
    cache.drain_events()
    assert cache.allocate("b", 12)  # exactly the three never-used blocks
    assert cache.drain_events() == []
    assert len(cache.match_prefix(hashes)) == 3


def test_eviction_takes_least_recently_freed_chain_tail_first() -> None:
    cache = KVCache(6, BS)
    a = _fill(cache, "a", _tokens(12, 1))
    cache.free("a")
    b = _fill(cache, "b", _tokens(12, 2))
    cache.free("b")
    cache.drain_events()
    assert cache.allocate("c", 8)
    # a was freed first; its tail goes first so what survives is still a prefix.
    assert cache.drain_events() == [BlockRemoved(block_hashes=(a[2], a[1]))]
    assert len(cache.match_prefix(a)) == 1
    assert len(cache.match_prefix(b)) == 3


def test_referenced_blocks_are_never_evicted() -> None:
    cache = KVCache(4, BS)
    a = _fill(cache, "a", _tokens(12, 1))
    cache.drain_events()
    assert not cache.allocate("b", 8)  # one free block, a's three are in use
    assert cache.drain_events() == []
    assert cache.num_blocks_held("b") == 0
    assert len(cache.match_prefix(a)) == 3
    assert cache.allocate("b", 4)


def test_prefix_hits_share_blocks() -> None:
    cache = KVCache(8, BS)
    tokens = _tokens(12, 1)
    _fill(cache, "a", tokens)
    used = cache.num_used_blocks
    cache.drain_events()
    _fill(cache, "b", tokens)
    assert cache.num_used_blocks == used
    assert cache.drain_events() == []  # nothing new was stored
    cache.free("a")
    cache.free("b")
    assert cache.num_used_blocks == 0


def test_same_block_computed_twice_keeps_one_copy() -> None:
    cache = KVCache(8, BS)
    tokens = _tokens(8, 1)
    hashes = block_hashes(tokens, BS)
    # Both admitted before either committed: neither saw the other's blocks.
    assert cache.allocate("a", 8)
    assert cache.allocate("b", 8)
    assert cache.num_used_blocks == 4
    cache.commit_full_blocks("a", hashes, tokens)
    cache.commit_full_blocks("b", hashes, tokens)
    assert cache.num_used_blocks == 2
    assert cache.num_cached_blocks == 2
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [tuple(hashes)]
    cache.free("a")
    assert cache.num_used_blocks == 2  # still held by b
    cache.free("b")
    assert cache.num_free_blocks == 8


def test_failed_allocation_changes_nothing() -> None:
    cache = KVCache(3, BS)
    tokens = _tokens(8, 1)
    _fill(cache, "a", tokens)
    cache.free("a")
    hits = cache.match_prefix(block_hashes(tokens, BS))
    # Two hit blocks in the LRU plus one free: a 16-token table needs four.
    assert not cache.allocate("b", 16, hits)
    assert cache.num_used_blocks == 0
    assert cache.num_free_blocks == 3
    assert cache.allocate("b", 12, hits)
    assert cache.num_used_blocks == 3


def test_reset_forgets_everything_and_publishes_all_cleared() -> None:
    cache = KVCache(8, BS)
    a = _fill(cache, "a", _tokens(8, 1))
    b = _fill(cache, "b", _tokens(8, 2))
    cache.free("a")
    cache.drain_events()
    cache.reset()
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.match_prefix(a) == [] and cache.match_prefix(b) == []
    assert cache.num_used_blocks == 2
    cache.free("b")
    assert cache.num_used_blocks == 0
    assert cache.num_free_blocks == 8
