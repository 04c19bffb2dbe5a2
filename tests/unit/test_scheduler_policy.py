"""The scheduler's fleet view and the KV-load placement cost (Dynamo's KV router cost)."""

from __future__ import annotations

import dataclasses

from services.common.load import Load
from services.scheduler.fleet import PLACEMENT_TRANSIT_S, ClusterView, NodeSpec, NodeStatus
from services.scheduler.policies import PlacementRequest
from services.scheduler.policies.kv_load import KvLoadPolicy

M = "m"
TIMEOUT_S = 5.0


def _spec(node_id: str, models: tuple[str, ...] = (M,), block_size: int = 16) -> NodeSpec:
    return NodeSpec(
        node_id=node_id,
        address=f"{node_id}:1",
        gpu="h100",
        price_per_hour=1.0,
        warm_models=frozenset(models),
        kv_block_size=block_size,
    )


def _status(node_id: str, **load: int) -> NodeStatus:
    return NodeStatus(spec=_spec(node_id), load=Load(**load))


def _request(prompt_blocks: int = 10) -> PlacementRequest:
    return PlacementRequest(
        request_id="r", model=M, num_prompt_tokens=prompt_blocks * 16, num_prompt_blocks=prompt_blocks, max_tokens=8
    )


def _view(*specs: NodeSpec) -> ClusterView:
    view = ClusterView(load_timeout_s=TIMEOUT_S)
    view.set_nodes(list(specs))
    return view


def _ids(statuses: list[NodeStatus]) -> list[str]:
    return [status.spec.node_id for status in statuses]


def test_cost_is_the_docstring_formula() -> None:
    status = NodeStatus(
        spec=_spec("a", block_size=16),
        load=Load(pending_prefill_tokens=17, active_decode_blocks=7),
        placed_prefill_blocks=3,
    )
    # pending = ceil(17 / 16) + 3 = 5; prefill = max(5 + 10 - 4, 0) = 11; cost = 2 * 11 + 7 + 10
    assert KvLoadPolicy(prefill_load_scale=2.0).cost(_request(10), status, matched=4) == 39.0
    # A fully cached prompt on an idle node has no prefill: cost = 0 + 0 + 10.
    assert KvLoadPolicy().cost(_request(10), _status("b"), matched=10) == 10.0


def test_cached_prefix_wins_when_loads_are_equal() -> None:
    nodes = [_status("a", active_decode_blocks=5), _status("b", active_decode_blocks=5)]
    decision = KvLoadPolicy().choose(_request(10), nodes, {"b": 6}, 0.0)
    assert (decision.node_id, decision.address, decision.matched_blocks) == ("b", "b:1", 6)
    assert decision.cost == 4 + 5 + 10


def test_loaded_node_with_prefix_loses_to_idle_node_when_decode_exceeds_saving() -> None:
    # Full hit saves 10 prefill blocks: a(prefix) = 0 + decode + 10, b(idle) = 10 + 0 + 10.
    policy = KvLoadPolicy()
    nodes = [_status("a", active_decode_blocks=9), _status("b")]
    assert policy.choose(_request(10), nodes, {"a": 10}, 0.0).node_id == "a"
    decision = policy.choose(_request(10), [_status("a", active_decode_blocks=11), _status("b")], {"a": 10}, 0.0)
    assert (decision.node_id, decision.matched_blocks, decision.cost) == ("b", 0, 20.0)


def test_ties_go_to_fewer_running_then_lower_node_id() -> None:
    policy = KvLoadPolicy()
    busy = [_status("a", num_running=2), _status("b", num_running=1), _status("c", num_running=1)]
    assert policy.choose(_request(), busy, {}, 0.0).node_id == "b"
    idle = [_status("c"), _status("b"), _status("a")]
    assert policy.choose(_request(), idle, {}, 0.0).node_id == "a"


def test_record_placement_raises_cost_until_a_load_report_shows_it_arrived() -> None:
    view, policy = _view(_spec("a")), KvLoadPolicy()
    view.report_load("a", Load(num_received=4), now=0.0)
    (before,) = view.candidates(M, now=0.0)
    assert policy.cost(_request(10), before, matched=0) == 20.0
    view.record_placement("a", num_prompt_blocks=10, now=0.1)
    assert policy.cost(_request(10), before, matched=0) == 30.0
    # Sent before the request reached the node: the placement still counts.
    view.report_load("a", Load(active_decode_blocks=2, num_received=4), now=0.2)
    assert policy.cost(_request(10), before, matched=0) == 32.0
    view.report_load("a", Load(active_decode_blocks=2, num_received=5), now=0.3)
    assert policy.cost(_request(10), before, matched=0) == 22.0


def test_a_placement_the_node_never_receives_stops_counting() -> None:
    view = _view(_spec("a"))
    view.report_load("a", Load(num_received=4), now=0.0)
    view.record_placement("a", num_prompt_blocks=10, now=1.0)
    view.report_load("a", Load(num_received=4), now=1.0 + PLACEMENT_TRANSIT_S - 0.1)
    assert view.candidates(M, now=6.0)[0].placed_requests == 1
    view.report_load("a", Load(num_received=4), now=1.0 + PLACEMENT_TRANSIT_S + 0.1)
    assert view.candidates(M, now=6.2)[0].placed_requests == 0


def test_placements_on_a_node_loading_its_model_count_until_it_is_warm_and_has_them() -> None:
    """Placed while the model loads (49 s for an 8B model), sent on when it is warm: they neither
    expire during the load nor, arriving after it, take the place of newer placements."""
    loading = dataclasses.replace(_spec("a", models=()), loading_models=frozenset({M}))
    view = ClusterView(load_timeout_s=TIMEOUT_S)
    view.set_nodes([loading], now=0.0)
    view.report_load("a", Load(num_received=0), now=0.0)
    for _ in range(3):
        view.record_placement("a", num_prompt_blocks=1, now=0.1)
    view.report_load("a", Load(num_received=0), now=30.0)
    view.set_nodes([_spec("a")], now=49.0)  # warm: the three are sent on now
    view.record_placement("a", num_prompt_blocks=1, now=49.5)
    view.report_load("a", Load(num_received=3), now=50.0)  # the three arrived, the newest not yet
    assert view.candidates(M, now=50.0)[0].placed_requests == 1


def test_only_the_placements_a_report_shows_arrived_stop_counting() -> None:
    view = _view(_spec("a"))
    view.report_load("a", Load(num_received=10), now=0.0)
    for i in range(4):
        view.record_placement("a", num_prompt_blocks=i, now=0.1)
    view.report_load("a", Load(num_received=12), now=0.2)
    (status,) = view.candidates(M, now=0.2)
    assert (status.placed_requests, status.placed_prefill_blocks) == (2, 2 + 3)


def test_a_node_agent_that_does_not_count_arrivals_supersedes_every_placement() -> None:
    view = _view(_spec("a"))
    view.report_load("a", Load(), now=0.0)
    view.record_placement("a", num_prompt_blocks=10, now=0.1)
    view.report_load("a", Load(num_waiting=1), now=0.2)
    assert view.candidates(M, now=0.2)[0].placed_requests == 0


def test_an_engine_that_restarted_counts_every_placement_as_arrived() -> None:
    view = _view(_spec("a"))
    view.report_load("a", Load(num_received=9), now=0.0)
    view.record_placement("a", num_prompt_blocks=10, now=0.1)
    view.report_load("a", Load(num_received=0), now=0.2)
    assert view.candidates(M, now=0.2)[0].placed_requests == 0


def test_placements_break_ties_between_otherwise_equal_nodes() -> None:
    view = _view(_spec("a"), _spec("b"))
    view.record_placement("a", num_prompt_blocks=0)
    assert KvLoadPolicy().choose(_request(), view.candidates(M, now=0.0), {}, 0.0).node_id == "b"


def test_candidates_are_live_warm_and_not_excluded() -> None:
    view = _view(_spec("a"), _spec("b"), _spec("c"), _spec("d", models=("other",)), _spec("e"))
    view.report_load("a", Load(), now=100.0)
    view.report_load("b", Load(), now=100.0 - TIMEOUT_S)
    view.report_load("c", Load(), now=100.0 - TIMEOUT_S - 0.001)
    # e never reported: still a candidate.
    assert _ids(view.candidates(M, now=100.0)) == ["a", "b", "e"]
    assert _ids(view.candidates(M, now=100.0, exclude=frozenset({"a", "e"}))) == ["b"]
    assert _ids(view.candidates("other", now=100.0)) == ["d"]
    assert view.candidates("missing", now=100.0) == []


def test_set_nodes_keeps_load_of_staying_nodes_and_drops_leaving_ones() -> None:
    view = _view(_spec("a"), _spec("b"))
    view.report_load("a", Load(num_running=3), now=1.0)
    view.report_load("b", Load(num_running=4), now=1.0)
    view.set_nodes([_spec("a", models=(M, "new")), _spec("c")])
    (a, c) = view.nodes()
    assert (a.spec.node_id, a.load.num_running, a.reported_at, a.spec.warm_models) == ("a", 3, 1.0, {M, "new"})
    assert (c.spec.node_id, c.load, c.reported_at) == ("c", Load(), None)
    view.report_load("b", Load(num_running=9), now=2.0)  # gone: ignored
    assert _ids(view.nodes()) == ["a", "c"]
    assert view.has_model("new") and not view.has_model("gone")


def test_a_node_whose_kv_cache_cannot_hold_the_request_is_no_candidate_warm_or_cold() -> None:
    model = "sim-llama-3.1-8b"
    small = NodeSpec("small", "small", "l4", 0.8, frozenset({model}), kv_blocks={model: 1393})
    big = NodeSpec("big", "big", "h100", 4.25, frozenset({model}), kv_blocks={model: 25_426})
    free_small = NodeSpec("free", "free", "l4", 0.8, frozenset(), cold_models=frozenset({model}),
                          kv_blocks={model: 1393})
    cluster = ClusterView(load_timeout_s=10.0)
    cluster.set_nodes([small, big, free_small])
    assert [s.spec.node_id for s in cluster.candidates(model, 0.0, needed_blocks=1891)] == ["big"]
    assert cluster.cold_candidates(model, 0.0, needed_blocks=1891) == []
    assert [s.spec.node_id for s in cluster.cold_candidates(model, 0.0, needed_blocks=1000)] == ["free"]
