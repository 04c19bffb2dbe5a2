"""Node registrations as the scheduler and routers read them from etcd."""

from __future__ import annotations

import json

from services.common.node_registration import parse_node_info
from services.router.catalogue import models_from_registrations, registrations


def test_a_registration_from_a_newer_node_agent_is_read_and_its_unknown_fields_skipped() -> None:
    """A field added after this version (as max_num_seqs once was) must not make the node vanish."""
    newer = json.dumps({"nodeId": "n1", "gpu": "h100", "models": [
        {"name": "m", "isWarm": True, "state": "MODEL_STATE_WARM", "profile": {"aMs": 1.0, "aFieldFromTheFuture": 3}}],
        "anotherNewField": True}).encode()
    info = parse_node_info("/baton/nodes/n1", newer)
    assert info is not None and info.node_id == "n1" and info.models[0].profile.a_ms == 1.0
    assert registrations({"/baton/nodes/n1": newer})["n1"].gpu == "h100"
    assert models_from_registrations({"/baton/nodes/n1": newer})["m"].num_warm_nodes == 1


def test_a_registration_that_is_not_a_node_is_skipped() -> None:
    assert parse_node_info("/baton/nodes/x", b"not json") is None
    assert parse_node_info("/baton/nodes/x", json.dumps({"gpu": 7}).encode()) is None
    assert models_from_registrations({"/baton/nodes/x": b"{"}) == {}
