"""The anchors' placement policies as Baton re-implements them (ANCHORS.md): round robin, least loaded,
SGLang's cache-aware policy, llm-d's default scoring, and the routed-prefix index both keep."""

from __future__ import annotations

import pytest

from services.common.load import Load
from services.scheduler.cluster import NodeSpec, NodeStatus
from services.scheduler.policies import POLICIES, PlacementRequest, make_policy
from services.scheduler.policies.kv_load import KvLoadPolicy
from services.scheduler.policies.llmd import LlmdPolicy
from services.scheduler.policies.routed_prefix import RoutedPrefixIndex
from services.scheduler.policies.sglang import SglangPolicy
from services.scheduler.policies.simple import LeastLoadedPolicy, RoundRobinPolicy

pytestmark = pytest.mark.timeout(10)

M = "m"
# Ten distinct chained block keys; a prompt's keys are a prefix of these or of OTHER.
HASHES = tuple(range(1000, 1010))
OTHER = tuple(range(2000, 2010))


def _status(node_id: str, placed_requests: int = 0, **load: int) -> NodeStatus:
    spec = NodeSpec(node_id=node_id, address=f"{node_id}:1", gpu="h100", price_per_hour=1.0,
                    warm_models=frozenset({M}))
    return NodeStatus(spec=spec, load=Load(**load), placed_requests=placed_requests)


def _request(block_hashes: tuple[int, ...] = HASHES, num_prompt_blocks: int | None = None) -> PlacementRequest:
    blocks = len(block_hashes) if num_prompt_blocks is None else num_prompt_blocks
    return PlacementRequest(request_id="r", model=M, num_prompt_tokens=blocks * 16, num_prompt_blocks=blocks,
                            max_tokens=8, block_hashes=block_hashes)


def _choose(policy, candidates: list[NodeStatus], request: PlacementRequest | None = None, now: float = 0.0) -> str:
    return policy.choose(request or _request(), candidates, {}, now).node_id


# -- round robin and least loaded -------------------------------------------------------------------


def test_round_robin_cycles_through_candidates_in_order() -> None:
    policy = RoundRobinPolicy()
    nodes = [_status("a"), _status("b"), _status("c", num_running=50)]
    assert [_choose(policy, nodes) for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_least_loaded_counts_running_waiting_and_placed() -> None:
    nodes = [
        _status("c", placed_requests=3),  # reported idle, but three placed since: 3
        _status("b", num_waiting=2),  # 2
        _status("a", num_running=1, num_waiting=1),  # 2
    ]
    decision = LeastLoadedPolicy().choose(_request(), nodes, {"b": 4}, 0.0)
    # a and b tie at 2: the lower node id wins, whatever the candidates' order.
    assert (decision.node_id, decision.matched_blocks, decision.cost) == ("a", 0, 2.0)
    assert _choose(LeastLoadedPolicy(), nodes + [_status("d", num_running=1)]) == "d"


# -- SGLang cache-aware -----------------------------------------------------------------------------


def _sglang_with_prefix_on(node_id: str, block_hashes: tuple[int, ...], now: float = 0.0) -> SglangPolicy:
    """A policy that has routed block_hashes to node_id (the only candidate) at now."""
    policy = SglangPolicy()
    assert _choose(policy, [_status(node_id)], _request(block_hashes), now) == node_id
    return policy


def test_sglang_imbalanced_fleet_goes_to_least_loaded_despite_full_prefix_elsewhere() -> None:
    policy = _sglang_with_prefix_on("a", HASHES)
    # 100 vs 10: max − min = 90 > 64 and 100 > 1.5 · 10.
    assert _choose(policy, [_status("a", num_running=100), _status("b", num_running=10)]) == "b"


@pytest.mark.parametrize(("high", "low"), [(64, 0), (200, 135)], ids=["abs-gap-64", "ratio-below-1.5"])
def test_sglang_fleet_just_inside_balance_keeps_prefix(high: int, low: int) -> None:
    policy = _sglang_with_prefix_on("a", HASHES)
    assert _choose(policy, [_status("a", num_running=high), _status("b", num_running=low)]) == "a"


def test_sglang_balanced_prefix_over_30_percent_wins_else_least_loaded() -> None:
    nodes = [_status("a"), _status("b", num_running=5)]
    # 4 of 10 blocks routed to b: 0.4 > 0.3, b wins though busier.
    assert _choose(_sglang_with_prefix_on("b", HASHES[:4]), nodes) == "b"
    # 3 of 10: exactly 0.3 is not enough, the least-loaded a wins.
    assert _choose(_sglang_with_prefix_on("b", HASHES[:3]), nodes) == "a"


def test_sglang_tree_forgets_entries_after_120_s() -> None:
    nodes = [_status("a"), _status("b", num_running=5)]
    assert _choose(_sglang_with_prefix_on("b", HASHES, now=0.0), nodes, now=119.0) == "b"
    assert _choose(_sglang_with_prefix_on("b", HASHES, now=0.0), nodes, now=121.0) == "a"


def test_sglang_records_each_choice_so_a_repeated_prompt_follows() -> None:
    policy = SglangPolicy()
    # Nothing routed yet: least loaded b.
    assert _choose(policy, [_status("a", num_running=2), _status("b")]) == "b"
    # Now b is the busier one, but it has the whole prompt.
    assert _choose(policy, [_status("a"), _status("b", num_running=3)], now=1.0) == "b"
    # A different prompt is not drawn there.
    assert _choose(policy, [_status("a"), _status("b", num_running=3)], _request(OTHER), now=2.0) == "a"


# -- llm-d ------------------------------------------------------------------------------------------


def _llmd_with_prefix_on(node_id: str, block_hashes: tuple[int, ...]) -> LlmdPolicy:
    policy = LlmdPolicy()
    assert _choose(policy, [_status(node_id)], _request(block_hashes)) == node_id
    return policy


def test_llmd_total_is_weighted_queue_kv_and_prefix() -> None:
    policy = _llmd_with_prefix_on("c", HASHES[:5])
    nodes = [
        _status("a", num_waiting=2, kv_blocks_used=50, kv_blocks_total=100),
        _status("b", num_waiting=6, num_running=9, kv_blocks_used=25, kv_blocks_total=100),
        _status("c", num_waiting=1, placed_requests=3, kv_blocks_used=10, kv_blocks_total=100),
    ]
    # queue over waiting+placed (2, 6, 4) in [min, max]: 1, 0, 0.5; kv free: 0.5, 0.75, 0.9; prefix 0, 0, 0.5.
    assert policy.scores(_request(), nodes, 0.0) == pytest.approx({
        "a": 2 * 1.0 + 2 * 0.5,
        "b": 2 * 0.0 + 2 * 0.75,
        "c": 2 * 0.5 + 2 * 0.9 + 3 * 0.5,
    })
    decision = policy.choose(_request(), nodes, {}, 0.0)
    assert (decision.node_id, decision.cost) == ("c", pytest.approx(4.3))


def test_llmd_equal_queues_score_one_each() -> None:
    nodes = [_status("a", num_waiting=3), _status("b", num_waiting=3), _status("c", num_waiting=3, num_running=7)]
    assert LlmdPolicy().scores(_request(), nodes, 0.0) == {"a": 4.0, "b": 4.0, "c": 4.0}


def test_llmd_routed_prefix_wins_when_queue_and_kv_are_equal() -> None:
    policy = _llmd_with_prefix_on("b", HASHES)
    nodes = [_status("a", num_waiting=1, kv_blocks_used=10, kv_blocks_total=100),
             _status("b", num_waiting=1, kv_blocks_used=10, kv_blocks_total=100)]
    assert _choose(policy, nodes) == "b"


def test_llmd_long_queue_loses_to_idle_node_when_prefixes_are_equal() -> None:
    policy = LlmdPolicy()
    assert _choose(policy, [_status("a", num_waiting=40), _status("b")]) == "b"
    # Now both have it (a seeded alone): still equal prefixes, and the queue decides.
    assert _choose(policy, [_status("a")]) == "a"
    assert _choose(policy, [_status("a", num_waiting=40), _status("b")]) == "b"


def test_llmd_ties_go_to_the_first_candidate() -> None:
    assert _choose(LlmdPolicy(), [_status("a"), _status("b")]) == "a"
    assert _choose(LlmdPolicy(), [_status("b"), _status("a")]) == "b"


# -- the routed-prefix index ------------------------------------------------------------------------


def test_routed_prefix_capacity_evicts_least_recently_recorded_blocks() -> None:
    index = RoutedPrefixIndex(capacity_per_node=3)
    index.record("n", (1, 2, 3), 0.0)
    index.record("n", (2,), 1.0)  # 2 is now the most recent
    index.record("n", (4,), 2.0)  # over capacity: 1 goes
    assert index.matched("n", (1, 2, 3), 3.0) == 0
    assert index.matched("n", (2, 3, 4), 3.0) == 3
    index.record("n", (5,), 4.0)  # then 3, the least recently recorded
    assert index.matched("n", (2, 3), 5.0) == 1
    assert index.matched("n", (2, 4, 5), 5.0) == 3
    # Per node: another node's capacity is its own.
    index.record("m", (1, 2, 3), 6.0)
    assert (index.matched("m", (1, 2, 3), 7.0), index.matched("n", (2, 4, 5), 7.0)) == (3, 3)


def test_routed_prefix_matches_only_leading_blocks() -> None:
    index = RoutedPrefixIndex()
    index.record("n", (1, 3), 0.0)
    assert index.matched("n", (1, 2, 3), 0.0) == 1
    assert index.matched("other", (1,), 0.0) == 0


# -- make_policy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_builds_each_by_its_name(name: str) -> None:
    policy = make_policy(name)
    assert isinstance(policy, POLICIES[name])
    assert policy.name == name
    # Fresh each time: no routing state shared between two runs.
    assert make_policy(name) is not policy


def test_make_policy_passes_prefill_load_scale_to_dynamo() -> None:
    policy = make_policy("dynamo", prefill_load_scale=2.0)
    assert isinstance(policy, KvLoadPolicy)
    # prefill 10 blocks · 2 + 0 decode + 10 prompt
    assert policy.cost(_request(), _status("a"), matched=0) == 30.0


def test_make_policy_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'") as error:
        make_policy("nope")
    for name in POLICIES:
        assert name in str(error.value)
