"""Keys whose etcd lease lapsed: held for a grace period, in the views and in the scheduler's fleet."""

from __future__ import annotations

from google.protobuf import json_format

from baton.v1 import common_pb2
from services.common.lapsed_keys import LapsedKeys
from services.common.load import Load
from services.router.catalogue import models_from_registrations
from services.scheduler.fleet import ClusterView, NodeSpec

GRACE_S = 3.0


def test_a_key_put_back_within_the_grace_never_leaves_the_view() -> None:
    keys = LapsedKeys(GRACE_S)
    keys.update({"a": b"1", "b": b"2"}, now=0.0)
    keys.update({"b": b"2"}, now=10.0)  # a's lease lapsed
    assert keys.view() == {"a": b"1", "b": b"2"} and keys.lapsed() == {"a"}
    assert keys.next_expiry() == 10.0 + GRACE_S
    keys.update({"a": b"1'", "b": b"2"}, now=11.0)  # re-put under a new lease, maybe with news
    assert keys.view() == {"a": b"1'", "b": b"2"} and keys.lapsed() == frozenset()
    assert keys.next_expiry() is None


def test_a_key_not_put_back_goes_when_its_grace_ends() -> None:
    keys = LapsedKeys(GRACE_S)
    keys.update({"a": b"1"}, now=0.0)
    keys.update({}, now=10.0)
    assert not keys.expire(12.9) and keys.view() == {"a": b"1"}
    assert keys.expire(13.0) == ["a"] and keys.view() == {} and keys.lapsed() == frozenset()


def test_a_key_its_holder_gave_up_goes_at_once() -> None:
    keys = LapsedKeys(GRACE_S)
    keys.update({"a": b"1", "b": b"2"}, now=0.0)
    keys.update({"b": b"2"}, now=1.0, leaving=frozenset({"a"}))
    assert keys.view() == {"b": b"2"} and keys.lapsed() == frozenset()


def test_without_a_grace_a_vanished_key_goes_at_once() -> None:
    keys = LapsedKeys(0.0)
    keys.update({"a": b"1"}, now=0.0)
    keys.update({}, now=1.0)
    assert keys.view() == {} and keys.next_expiry() is None


def spec(node_id: str) -> NodeSpec:
    return NodeSpec(node_id=node_id, address=f"{node_id}:1", gpu="h100", price_per_hour=1.0,
                    warm_models=frozenset({"m"}))


def fleet(lapsed: frozenset[str], reported_at: dict[str, float]) -> ClusterView:
    view = ClusterView(load_timeout_s=10.0, lapsed_silence_s=1.0)
    view.set_nodes([spec("a"), spec("b")], now=0.0)
    for node_id, at in reported_at.items():
        view.report_load(node_id, Load(), at)
    view.set_nodes([spec("a"), spec("b")], now=20.0, lapsed=lapsed)
    return view


def test_a_lapsed_node_that_still_reports_load_stays_a_candidate() -> None:
    view = fleet(frozenset({"a", "b"}), {"a": 19.8, "b": 19.9})  # etcd froze; both nodes live on
    assert [s.spec.node_id for s in view.candidates("m", now=20.0)] == ["a", "b"]
    assert view.has_model("m", now=20.0)


def test_a_lapsed_node_that_went_silent_is_gone_at_once() -> None:
    view = fleet(frozenset({"a"}), {"a": 18.0, "b": 19.9})  # a died: silent before its lease ran out
    assert [s.spec.node_id for s in view.candidates("m", now=20.0)] == ["b"]
    assert [s.spec.node_id for s in view.nodes() if view.is_listed(s, 20.0)] == ["b"]
    # A registered node is held to the load timeout only, as before.
    assert [s.spec.node_id for s in fleet(frozenset(), {"a": 18.0, "b": 19.9}).candidates("m", 20.0)] == ["a", "b"]


def test_a_lapsed_node_that_goes_silent_during_its_grace_stops_being_a_candidate() -> None:
    view = fleet(frozenset({"a", "b"}), {"a": 19.9, "b": 19.9})
    assert view.has_model("m", now=20.5) and not view.has_model("m", now=21.5)
    assert view.candidates("m", now=21.5) == []


def registration(node_id: str) -> bytes:
    info = common_pb2.NodeInfo(node_id=node_id, models=[common_pb2.ModelInfo(name="m", is_warm=True)])
    return json_format.MessageToJson(info).encode()


def test_a_lapsed_registration_keeps_its_model_served_but_counts_no_warm_node() -> None:
    items = {"/baton/nodes/a": registration("a"), "/baton/nodes/b": registration("b")}
    assert models_from_registrations(items)["m"].num_warm_nodes == 2
    held = models_from_registrations(items, frozenset({"/baton/nodes/a", "/baton/nodes/b"}))
    assert held["m"].num_warm_nodes == 0


def test_the_routers_context_for_a_model_is_the_largest_its_nodes_register_whichever_is_read_last() -> None:
    """One extra registration saying 0 made every request for the model `does not fit the context window of 0`,
    where two nodes served it at 8,192 (helper-181): the router took whichever record it read last."""
    def with_context(node_id: str, context: int) -> bytes:
        info = common_pb2.NodeInfo(node_id=node_id, models=[common_pb2.ModelInfo(
            name="m", is_warm=True, max_context_tokens=context, tokenizer="t", vocab_size=256)])
        return json_format.MessageToJson(info).encode()

    for last in ("a", "z"):
        items = {"/baton/nodes/b": with_context("b", 8192), f"/baton/nodes/{last}": with_context(last, 0)}
        assert models_from_registrations(items)["m"].max_context_tokens == 8192
