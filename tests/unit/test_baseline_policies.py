"""The anchors' placement policies as Baton re-implements them (ANCHORS.md): round robin, least loaded
(plain and weighted by GPU speed), SGLang's cache-aware policy, llm-d's default and precise scoring, and
the routed-prefix index SGLang and llm-d keep."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.load import Load
from services.scheduler.fleet import NodeSpec, NodeStatus
from services.scheduler.policies import POLICIES, PlacementRequest, make_policy
from services.scheduler.policies.kv_load import KvLoadPolicy
from services.scheduler.policies.llmd import LlmdPolicy, LlmdPrecisePolicy
from services.scheduler.policies.routed_prefix import RoutedPrefixIndex
from services.scheduler.policies.sglang import EVICTION_INTERVAL_S, SglangPolicy
from services.scheduler.policies.simple import LeastLoadedPolicy, RoundRobinPolicy, WeightedLeastLoadedPolicy
from tests.unit.sim_profiles import sim_profiles

pytestmark = pytest.mark.timeout(10)

M = "m"
# Ten distinct chained block keys; a prompt's keys are a prefix of these or of OTHER.
HASHES = tuple(range(1000, 1010))
OTHER = tuple(range(2000, 2010))


def _status(node_id: str, placed_requests: int = 0, gpu: str = "h100", model: str = M, **load: int) -> NodeStatus:
    spec = NodeSpec(node_id=node_id, address=f"{node_id}:1", gpu=gpu, price_per_hour=1.0,
                    warm_models=frozenset({model}), profiles=sim_profiles(gpu, model))
    return NodeStatus(spec=spec, load=Load(**load), placed_requests=placed_requests)


def _request(block_hashes: tuple[int, ...] = HASHES, num_prompt_blocks: int | None = None,
             model: str = M) -> PlacementRequest:
    blocks = len(block_hashes) if num_prompt_blocks is None else num_prompt_blocks
    return PlacementRequest(request_id="r", model=model, num_prompt_tokens=blocks * 16, num_prompt_blocks=blocks,
                            max_tokens=8, block_hashes=block_hashes)


def _choose(policy, candidates: list[NodeStatus], request: PlacementRequest | None = None, now: float = 0.0,
            matched_blocks: dict[str, int] | None = None) -> str:
    return policy.choose(request or _request(), candidates, matched_blocks or {}, now).node_id


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


SIM_MODEL = "sim-llama-3-8b"


def test_weighted_least_loaded_gives_the_faster_gpu_a_larger_share() -> None:
    policy = WeightedLeastLoadedPolicy()
    request = _request(model=SIM_MODEL)
    h100 = lambda n: _status("b-h100", gpu="h100", model=SIM_MODEL, num_running=n)  # noqa: E731
    l4 = lambda n: _status("a-l4", gpu="l4", model=SIM_MODEL, num_running=n)  # noqa: E731
    # Both idle: the faster GPU, though plain least-loaded would take the lower node id.
    assert _choose(policy, [l4(0), h100(0)], request) == "b-h100"
    assert _choose(LeastLoadedPolicy(), [l4(0), h100(0)], request) == "a-l4"
    # The H100 keeps winning with more in flight than the idle L4, until its share is used up.
    assert _choose(policy, [l4(0), h100(3)], request) == "b-h100"
    assert _choose(policy, [l4(0), h100(40)], request) == "a-l4"


def test_weighted_least_loaded_counts_an_unknown_gpu_as_the_slowest_known() -> None:
    request = _request(model=SIM_MODEL)
    nodes = [_status("a", gpu="tpu-v9", model=SIM_MODEL), _status("b", gpu="l4", model=SIM_MODEL)]
    # Equal loads and equal (slowest) speeds: the lower node id.
    assert _choose(WeightedLeastLoadedPolicy(), nodes, request) == "a"


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


def test_sglang_balanced_prefix_over_30_percent_wins_else_smallest_tree() -> None:
    nodes = [_status("a"), _status("b", num_running=5)]
    # 4 of 10 blocks routed to b: 0.4 > 0.3, b wins though busier.
    assert _choose(_sglang_with_prefix_on("b", HASHES[:4]), nodes) == "b"
    # 3 of 10: exactly 0.3 is not enough, the smallest tree (a's is empty) wins.
    assert _choose(_sglang_with_prefix_on("b", HASHES[:3]), nodes) == "a"


def test_sglang_short_match_goes_to_the_smallest_tree_not_the_least_loaded() -> None:
    policy = SglangPolicy()
    _choose(policy, [_status("a")], _request(OTHER))  # a's tree: 10 blocks
    _choose(policy, [_status("b")], _request(OTHER[:2]))  # b's tree: 2 blocks
    # A prompt neither has: b has the smaller tree, though it is the busier one.
    assert _choose(policy, [_status("a"), _status("b", num_running=5)], _request(HASHES)) == "b"


def test_sglang_tree_is_bounded_by_size_evicting_least_recent_on_the_interval_not_by_age() -> None:
    policy = SglangPolicy(max_tree_blocks=10)
    nodes = [_status("a"), _status("b", num_running=5)]
    assert _choose(policy, [_status("b")], _request(HASHES), now=0.0) == "b"
    # An old entry is not forgotten by age: an hour later the prompt still follows it to b.
    assert _choose(policy, nodes, now=3600.0) == "b"
    # Ten more blocks push b's tree to 20; nothing goes before the next eviction pass...
    assert _choose(policy, [_status("b")], _request(OTHER), now=3601.0) == "b"
    assert _choose(policy, nodes, now=3602.0) == "b"  # HASHES used again: OTHER is now the least recent
    # ...which trims b to 10 blocks, least recently used first: OTHER is forgotten.
    assert _choose(policy, nodes, _request(OTHER), now=3602.0 + EVICTION_INTERVAL_S) == "a"


def test_sglang_records_each_choice_so_a_repeated_prompt_follows() -> None:
    policy = SglangPolicy()
    # Nothing routed yet: every tree is empty, the first candidate.
    assert _choose(policy, [_status("a", num_running=2), _status("b")]) == "a"
    # Now a is much busier (still balanced), but it has the whole prompt.
    assert _choose(policy, [_status("a", num_running=40), _status("b")], now=1.0) == "a"
    # A different prompt is not drawn there: b's tree is the smaller.
    assert _choose(policy, [_status("a"), _status("b", num_running=3)], _request(OTHER), now=2.0) == "b"


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
    assert policy.scores(_request(), nodes) == pytest.approx({
        "a": 2 * 1.0 + 2 * 0.5,
        "b": 2 * 0.0 + 2 * 0.75,
        "c": 2 * 0.5 + 2 * 0.9 + 3 * 0.5,
    })
    decision = policy.choose(_request(), nodes, {}, 0.0)
    assert (decision.node_id, decision.cost) == ("c", pytest.approx(4.3))


def test_llmd_equal_queues_score_one_each() -> None:
    nodes = [_status("a", num_waiting=3), _status("b", num_waiting=3), _status("c", num_waiting=3, num_running=7)]
    assert LlmdPolicy().scores(_request(), nodes) == {"a": 4.0, "b": 4.0, "c": 4.0}


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


def test_llmd_breaks_ties_at_random_like_its_max_score_picker_but_replayably() -> None:
    """llm-d shuffles the pods before picking the highest score: a tie is no win for the first node."""
    picks = [_choose(LlmdPolicy(), [_status("a"), _status("b")], dataclasses.replace(_request(), request_id=f"r{i}"),
                     matched_blocks={}) for i in range(40)]
    assert 10 < picks.count("a") < 30
    # The same request, in any candidate order, gets the same node: a simulated run replays exactly.
    again = dataclasses.replace(_request(), request_id="r7")
    assert _choose(LlmdPolicy(), [_status("b"), _status("a")], again) == picks[7]


def test_llmd_precise_scores_the_engines_cached_prefix_min_max_normalised() -> None:
    policy = LlmdPrecisePolicy()
    nodes = [_status("a", num_waiting=1), _status("b", num_waiting=1), _status("c", num_waiting=1),
             _status("d", num_waiting=1)]
    # Cached 2, 6, 4 blocks and none: (x − 2)/(6 − 2) over the holders, 0 for d; weights 1, 1, 2.
    assert policy.scores(_request(), nodes, {"a": 2, "b": 6, "c": 4}) == pytest.approx(
        {"a": 2.0, "b": 4.0, "c": 3.0, "d": 2.0})
    # One holder, or all equal: 1 each.
    assert policy.scores(_request(), nodes, {"c": 3})["c"] == pytest.approx(4.0)


def test_llmd_precise_follows_the_kv_events_not_its_own_routing() -> None:
    policy = LlmdPrecisePolicy()
    nodes = [_status("a"), _status("b")]
    # Routed to a before (the approximate index would follow), but the engines say b caches it.
    assert _choose(policy, [_status("a")]) == "a"
    assert _choose(policy, nodes, matched_blocks={"b": 10}) == "b"
    assert _choose(LlmdPolicy(), [_status("a")]) == "a"


# -- the routed-prefix index ------------------------------------------------------------------------


def test_routed_prefix_capacity_evicts_least_recently_recorded_blocks() -> None:
    index = RoutedPrefixIndex(capacity_per_node=3)
    index.record("n", (1, 2, 3))
    index.record("n", (2,))  # 2 is now the most recent
    index.record("n", (4,))  # over capacity: 1 goes
    assert index.matched("n", (1, 2, 3)) == 0
    assert index.matched("n", (2, 3, 4)) == 3
    index.record("n", (5,))  # then 3, the least recently recorded
    assert index.matched("n", (2, 3)) == 1
    assert index.matched("n", (2, 4, 5)) == 3
    # Per node: another node's capacity is its own.
    index.record("m", (1, 2, 3))
    assert (index.matched("m", (1, 2, 3)), index.matched("n", (2, 4, 5))) == (3, 3)
    assert (index.size("m"), index.size("n"), index.size("none")) == (3, 3, 0)


def test_routed_prefix_matches_only_leading_blocks() -> None:
    index = RoutedPrefixIndex()
    index.record("n", (1, 3))
    assert index.matched("n", (1, 2, 3)) == 1
    assert index.matched("other", (1,)) == 0


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


def test_dynamo_counts_a_nodes_decoding_context_in_the_routers_blocks_whatever_its_engine_block() -> None:
    """A node whose engine has 32-token blocks (vLLM on CPU) reporting 100 decoding blocks holds 3,200
    tokens of context, more than a 16-token-block node reporting 150 (2,400): the second is less loaded."""
    big = _status("a", active_decode_blocks=100)
    big = dataclasses.replace(big, spec=dataclasses.replace(big.spec, kv_block_size=32))
    small = _status("b", active_decode_blocks=150)
    assert KvLoadPolicy().cost(_request(), big, matched=0) == 10 + 200 + 10
    assert _choose(KvLoadPolicy(), [big, small]) == "b"
    # So is its queued prefill: 3,200 tokens queued there are more than 2,400 on the other.
    big = dataclasses.replace(big, load=Load(pending_prefill_tokens=3200))
    small = _status("b", pending_prefill_tokens=2400)
    assert _choose(KvLoadPolicy(), [big, small]) == "b"


def test_make_policy_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'nope'") as error:
        make_policy("nope")
    for name in POLICIES:
        assert name in str(error.value)
