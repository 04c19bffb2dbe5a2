"""Changes of a tenant's record in etcd (`baton tenants`): one made while another is under way is not lost."""

from __future__ import annotations

import asyncio
import threading

import pytest

from baton import tenants
from baton.cluster import ManagedProcess
from services.common.auth import TenantRecord, hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_a_key_added_while_another_is_revoked_leaves_that_one_revoked(
        etcd: ManagedProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """add read the record, revoke wrote it, and add wrote the revoked key back as valid: two concurrent CLI runs in
    ten did so (helper-164). A change is written only if no other was meanwhile, and is made again if one was."""
    _, first_key = await tenants.add_tenant(etcd.address, "acme")
    with_key = TenantRecord.with_key
    revoked_meanwhile: list[TenantRecord] = []

    def with_key_while_revoked(record: TenantRecord, key: str, now_ms: int) -> TenantRecord:
        if not revoked_meanwhile:  # between add's read and its write, another process revokes every key
            thread = threading.Thread(target=lambda: revoked_meanwhile.append(
                asyncio.run(tenants.revoke(etcd.address, "acme"))))
            thread.start()
            thread.join()
        return with_key(record, key, now_ms)

    monkeypatch.setattr(TenantRecord, "with_key", with_key_while_revoked)
    record, second_key = await tenants.add_tenant(etcd.address, "acme")
    (listed,), _ = await tenants.list_tenants(etcd.address)
    assert listed == record
    revoked = {key.key_hash: bool(key.revoked_at_ms) for key in listed.keys}
    assert revoked == {hash_api_key(first_key): True, hash_api_key(second_key): False}


@pytest.mark.parametrize(("tenant", "why"), [("t" * 129, "129 characters, longer than 128"),
                                             ("t\x1b[2J", "holds a control character"),
                                             ("ws ", "begins or ends with white space")])
async def test_a_tenant_no_router_would_take_is_not_created(etcd: ManagedProcess, tenant: str, why: str) -> None:
    """A 200-character tenant was created, and its key then refused on every request (helper-164)."""
    with pytest.raises(ValueError, match=why):
        await tenants.add_tenant(etcd.address, tenant)
    assert await tenants.list_tenants(etcd.address) == ([], [])


async def test_set_changes_and_removes_limits_issuing_no_key(etcd: ManagedProcess) -> None:
    """Changing a limit took `baton tenants add`, which left one more valid key each time, and a limit once set could
    never be removed (helper-189)."""
    record, _ = await tenants.add_tenant(etcd.address, "acme", max_concurrency=2, tokens_per_minute=1000)
    changed = await tenants.set_tenant(etcd.address, "acme", {"max_concurrency": tenants.UNLIMITED,
                                                              "weight": 3.0, "max_priority": 7})
    assert (changed.max_concurrency, changed.tokens_per_minute, changed.weight, changed.max_priority) == (
        None, 1000, 3.0, 7)
    assert changed.keys == record.keys
    (listed,), _ = await tenants.list_tenants(etcd.address)
    assert listed == changed
    # "unlimited" removes a limit, and only a limit: a cache group may be named so (helper-190).
    grouped = await tenants.set_tenant(etcd.address, "acme", {"cache_group": tenants.UNLIMITED})
    assert grouped.cache_group == "unlimited"
    with pytest.raises(LookupError, match="'nobody': no such tenant"):
        await tenants.set_tenant(etcd.address, "nobody", {"weight": 2.0})
    assert [r.tenant for r in (await tenants.list_tenants(etcd.address))[0]] == ["acme"]
