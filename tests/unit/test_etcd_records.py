"""Records read from etcd that no Baton process wrote: each reader skips such a record, saying why, and goes on
(helper-181: one `5` killed every node agent, another every scheduler replica in turn as each took over)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import json_format

from baton.v1 import common_pb2
from services.common.auth import TenantKeys, TenantRecord
from services.common.election import Election
from services.common.etcd_records import address_of, json_object
from services.common.etcd_session import PrefixView
from services.common.node_registration import parse_node_info
from services.common.tenant_directory import TenantDirectory
from services.router.catalogue import models_from_registrations
from services.scheduler.leadership import LeaderRole

NOT_OBJECTS = [(b"5", "a JSON number (5), not an object"), (b"[]", "a JSON array ([]), not an object"),
               (b'"x"', "a JSON string ('x'), not an object"), (b"null", "a JSON null (null), not an object"),
               (b"true", "a JSON boolean (true), not an object"), (b"{", "Expecting"), (b"\xff", "decode"),
               (b"[" * 100_000, "nested too deeply")]


@pytest.mark.parametrize(("value", "why"), NOT_OBJECTS)
def test_what_is_not_a_json_object_is_a_value_error_saying_why(value: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        json_object(value)


@pytest.mark.parametrize("value", [b'{"address": 5}', b'{"address": ""}', b'{"addr": "h:1"}', b"5"])
def test_a_record_without_a_string_address_has_none(value: bytes) -> None:
    with pytest.raises(ValueError):
        address_of(value)
    assert address_of(b'{"address": "127.0.0.1:1", "more": [1]}') == "127.0.0.1:1"


def role(restored: list[dict[str, Any]], stored: bytes | None = None) -> LeaderRole:
    async def get(key: bytes) -> SimpleNamespace | None:
        return None if stored is None else SimpleNamespace(value=stored)

    def restore(state: dict[str, Any]) -> None:
        restored.append(state)
        state["nodes"].items()  # as a real restore reads it: a record without it raises

    return LeaderRole(SimpleNamespace(get=get), "me", "127.0.0.1:1", 3,  # type: ignore[arg-type]
                      save_state=dict, restore_state=restore)


@pytest.mark.parametrize("stored", [b"5", b"[1]", b'{"no": "nodes"}', b'{"nodes": 5}'])
async def test_a_predecessor_state_that_is_not_one_is_ignored_and_the_leader_starts_fresh(stored: bytes) -> None:
    restored: list[dict[str, Any]] = []
    await role(restored, stored)._take_over()
    assert len(restored) == (stored.startswith(b"{") and 1 or 0)
    await role(restored, b'{"nodes": {}}')._take_over()
    assert restored[-1] == {"nodes": {}}


@pytest.mark.parametrize("first", [b"5", b"junk", b'{"address": "h:1"}', b'{"instance_id": 3, "address": "h:1"}'])
def test_an_election_record_first_in_line_that_no_replica_wrote_shows_no_leader(first: bytes) -> None:
    leader = role([])
    leader._view.items = {"/baton/election/scheduler/a": first,
                          "/baton/election/scheduler/b": b'{"instance_id": "s1", "address": "h:2"}'}
    leader._view.create_revisions = {"/baton/election/scheduler/a": 1, "/baton/election/scheduler/b": 2}
    assert leader.leader() is None
    leader._view.create_revisions["/baton/election/scheduler/a"] = 3
    assert leader.leader() == ("s1", "h:2")


def tenant_items(**values: bytes) -> dict[str, bytes]:
    return {f"/baton/tenants/{name}": value for name, value in values.items()}


def test_tenant_records_that_are_not_tenants_are_skipped_and_the_others_kept() -> None:
    alice = TenantRecord("alice").with_key("bt_a", 1)
    keys = TenantKeys.from_etcd_items(tenant_items(
        alice=alice.to_json(), five=b"5", listed=b'{"tenant": ["x"]}', admin=b'{"tenant": "admin", "is_admin": 1}',
        weighty=b'{"tenant": "weighty", "weight": "9"}', keyless=b'{"tenant": "keyless", "keys": [5]}',
        extra=b'{"tenant": "extra", "color": "red"}', impostor=TenantRecord("alice").with_key("bt_b", 1).to_json()))
    assert set(keys.records) == {"alice"}
    assert keys.tenant_from_key("bt_a") == alice
    with pytest.raises(Exception, match="unknown"):
        keys.tenant_from_key("bt_b")  # held under another tenant's name: never that tenant's key


def test_a_tenant_record_copied_below_its_name_holds_no_key() -> None:
    """A stale copy at /baton/tenants/old/alice kept alice's revoked key valid: the name was checked against the key's
    last part only (helper-183)."""
    alice = TenantRecord("alice").with_key("bt_a", 1)
    keys = TenantKeys.from_etcd_items({"/baton/tenants/alice": alice.revoked(2).to_json(),
                                       "/baton/tenants/old/alice": alice.to_json()})
    with pytest.raises(Exception, match="revoked"):
        keys.tenant_from_key("bt_a")


def test_a_node_registration_that_is_not_utf8_is_skipped() -> None:
    """Bytes not UTF-8 raised past the parse's own error, and the scheduler's and every router's view of the nodes
    stayed as it was (helper-183)."""
    good = json_format.MessageToJson(common_pb2.NodeInfo(node_id="a", models=[common_pb2.ModelInfo(name="m")]))
    assert parse_node_info("/baton/nodes/x", b"\xff") is None
    assert set(models_from_registrations({"/baton/nodes/x": b"\xff", "/baton/nodes/a": good.encode()})) == {"m"}


class _Listing(list):
    header = SimpleNamespace(revision=1)


async def test_a_key_that_is_not_utf8_is_listed_and_the_view_syncs() -> None:
    """A key not UTF-8 under a watched prefix failed every listing, and the view stayed as it was for good
    (helper-183)."""
    listing = _Listing([SimpleNamespace(key=b"/baton/tenants/\xff", value=b"5", create_revision=1),
                        SimpleNamespace(key=b"/baton/tenants/alice", value=b"{}", create_revision=1)])
    never = asyncio.Event()

    async def get_prefix(prefix: bytes) -> _Listing:
        return listing

    async def watch_prefix(prefix: bytes, start_revision: int) -> AsyncIterator[object]:
        await never.wait()
        yield None

    view = PrefixView(SimpleNamespace(get_prefix=get_prefix, watch_prefix=watch_prefix),  # type: ignore[arg-type]
                      "/baton/tenants/")
    running = asyncio.create_task(view.run())
    try:
        await asyncio.wait_for(view.synced.wait(), 5)
        assert set(view.items) == {"/baton/tenants/\ufffd", "/baton/tenants/alice"}
    finally:
        running.cancel()


def test_the_tenant_view_names_the_records_it_skips(caplog: pytest.LogCaptureFixture) -> None:
    """It logged only how many, and no operator could tell which (helper-186)."""
    directory = TenantDirectory(None)  # type: ignore[arg-type]
    directory._changed(tenant_items(alice=TenantRecord("alice").to_json(), five=b"5"))
    assert set(directory.keys.records) == {"alice"}
    assert "1 records under /baton/tenants/ are not tenant records at their own key" in caplog.text
    assert "'/baton/tenants/five'" in caplog.text


async def test_a_candidate_waits_out_its_predecessors_beside_a_key_that_is_not_utf8() -> None:
    """Its listing decoded every key, and one not UTF-8 under the prefix failed every campaign (helper-186)."""
    listing = _Listing([SimpleNamespace(key=b"/e/\xff", value=b"5", create_revision=9),
                        SimpleNamespace(key=b"/e/own", value=b"{}", create_revision=5)])

    async def get_prefix(prefix: bytes) -> _Listing:
        return listing

    election = Election(SimpleNamespace(get_prefix=get_prefix), "/e/", 3)  # type: ignore[arg-type]
    await asyncio.wait_for(election._wait_for_predecessors("/e/own", 5), 5)
