"""The vllm engine's pure parts: vLLM block hashes to Baton keys, GPU time shares, stop sequences."""

from __future__ import annotations

import pytest

from services.common.block_hash import block_hashes, salted_root
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.kvindex.index import KVIndex
from services.node_agent.engines.vllm.block_keys import BlockKeyMap
from services.node_agent.engines.vllm.gpu_time import GpuTimeShare
from services.node_agent.engines.vllm.stop_sequences import StopMatcher

PROMPT = list(range(100, 196))  # 96 tokens: three 32-token vLLM blocks, six 16-token Baton blocks


def stored(vllm_hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(tuple(vllm_hashes), parent, tuple(tokens), 32)


def test_vllm_blocks_index_under_the_keys_a_router_computes() -> None:
    keys = BlockKeyMap()
    index = KVIndex()
    # vLLM stores the first two blocks in one step and the third, chained to the second, later.
    for event in (stored([7001, 7002], None, PROMPT[:64]), stored([7003], 7002, PROMPT[64:96])):
        translated = keys.translate(event)
        assert translated is not None
        index.apply("node-0", "tiny", translated)
    assert index.overlap("tiny", block_hashes(PROMPT + [1, 2, 3])) == {"node-0": 6}
    assert sorted(keys.cached_keys()) == sorted(block_hashes(PROMPT))


def test_blocks_stored_under_a_cache_salt_index_under_the_salted_keys_a_router_computes() -> None:
    keys = BlockKeyMap()
    salted = BlockStored((7001, 7002, 7003), None, tuple(PROMPT), 32, root_salt="tenant-cache:a")
    translated = keys.translate(salted)
    assert translated is not None
    assert list(translated.block_hashes) == block_hashes(PROMPT, parent_hash=salted_root("tenant-cache:a"))
    assert not set(translated.block_hashes) & set(block_hashes(PROMPT))


def test_removed_and_cleared_blocks_leave_the_index() -> None:
    keys = BlockKeyMap()
    index = KVIndex()
    for event in (stored([1, 2, 3], None, PROMPT), BlockRemoved((3,))):
        index.apply("node-0", "tiny", keys.translate(event))
    assert index.overlap("tiny", block_hashes(PROMPT)) == {"node-0": 4}
    index.apply("node-0", "tiny", keys.translate(AllBlocksCleared()))
    assert index.overlap("tiny", block_hashes(PROMPT)) == {}
    assert keys.cached_keys() == []
    assert keys.translate(BlockRemoved((99,))) is None  # never stored: nothing to tell the index


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    keys = BlockKeyMap()
    assert keys.translate(stored([5], 4, PROMPT[32:64])) is None
    assert keys.num_orphans == 1


def test_the_cached_prefix_of_a_queued_prompt_is_what_vllm_holds_of_it_under_its_salt() -> None:
    """The node's pending prefill leaves out what its cache holds of a prompt (as the sim engine's
    does), before vLLM reports the request's cached tokens: the leading blocks held, for its salt."""
    keys = BlockKeyMap()
    keys.translate(stored([7001, 7002], None, PROMPT[:64]))
    follow_up = PROMPT[:64] + [1] * 40
    assert keys.cached_prefix_tokens(follow_up) == 64
    assert keys.cached_prefix_tokens(PROMPT[:64]) == 63  # the last token is always computed
    assert keys.cached_prefix_tokens(follow_up, cache_salt="tenant-cache:b") == 0
    assert keys.cached_prefix_tokens([5] + PROMPT[1:64]) == 0  # a prefix, or nothing
    keys.translate(BlockRemoved((7002,)))
    assert keys.cached_prefix_tokens(follow_up) == 32
    keys.translate(AllBlocksCleared())
    assert keys.cached_prefix_tokens(follow_up) == 0


def test_gpu_time_is_the_busy_time_shared_among_the_requests_held() -> None:
    share = GpuTimeShare()
    share.start("a", 10.0)
    share.start("b", 11.0)  # a ran alone for 1 s
    assert share.finish("b", 13.0) == pytest.approx(1000.0)  # 2 s shared by two
    assert share.gpu_ms("a", 14.0) == pytest.approx(1000.0 + 1000.0 + 1000.0)
    assert share.finish("a", 14.0) == pytest.approx(3000.0)
    assert share.gpu_ms("gone", 20.0) == 0.0


def test_stop_sequence_across_outputs_keeps_tokens_through_the_stop() -> None:
    matcher = StopMatcher([(5, 6, 7)])
    assert matcher.feed([1, 5, 6]) is None
    assert matcher.feed([7, 8, 9]) == 1


def test_stop_sequence_may_begin_among_resumed_tokens_never_in_the_prompt() -> None:
    assert StopMatcher([(5, 6)], resumed_token_ids=[4, 5]).feed([6]) == 1
    assert StopMatcher([(5, 6)]).feed([6]) is None  # the prompt's 5 is not the completion's
    assert StopMatcher([]).feed([1, 2]) is None
