"""Tenant keys and cache namespaces: what a key proves, how it is refused, and that a cache salt
separates prefix caches without changing tokens."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from services.common.auth import TenantKeys, TenantRecord, hash_api_key, key_id_of, new_api_key
from services.common.block_hash import block_hashes, salted_root
from services.common.errors import PermissionDenied, Unauthenticated
from tests.unit.test_sim_engine import make_core, prompt, request, run_until_idle


def index_with(*records: TenantRecord) -> TenantKeys:
    return TenantKeys.from_etcd_items({f"/baton/tenants/{r.tenant}": r.to_json() for r in records})


def test_a_bearer_key_names_its_tenant_and_the_record_survives_etcd() -> None:
    key = new_api_key()
    record = TenantRecord("acme", weight=2.0, max_concurrency=8, cache_group="team").with_key(key, 1)
    keys = index_with(record)

    assert keys.tenant_from_authorization(f"Bearer {key}") == record
    assert keys.tenant_from_metadata([("x-other", "1"), ("authorization", f"bearer {key}")]).tenant == "acme"
    assert record.cache_salt == TenantRecord("other", cache_group="team").cache_salt != TenantRecord("x").cache_salt


@pytest.mark.parametrize("second", ["valid", "unknown"])
def test_a_call_with_two_authorization_entries_is_refused_whichever_comes_first(second: str) -> None:
    """Before, the first entry decided: a proxy that adds its own key, or a client that sends two, was served as
    whichever came first (helper-164)."""
    key, other = new_api_key(), new_api_key()
    keys = index_with(TenantRecord("acme").with_key(key, 1), TenantRecord("beta").with_key(other, 1))
    second_key = other if second == "valid" else "bt_unknown-key-material"
    for entries in ([("authorization", f"Bearer {key}"), ("authorization", f"Bearer {second_key}")],
                    [("authorization", f"Bearer {second_key}"), ("Authorization", f"Bearer {key}")]):
        with pytest.raises(Unauthenticated, match="authorization: 2 values") as refused:
            keys.tenant_from_metadata(entries)
        assert key not in str(refused.value) and second_key not in str(refused.value)


@pytest.mark.parametrize(("authorization", "says"), [
    (None, "authorization: missing"),
    ("Basic dXNlcjpwYXNz", "expected 'Bearer <API key>'"),
    ("Bearer not-a-baton-key", "not a Baton key"),
    ("Bearer bt_unknown-key-material", "unknown to this cluster"),
])
def test_a_bad_authorization_is_refused_saying_what_is_wrong_without_the_key(authorization: str | None,
                                                                               says: str) -> None:
    with pytest.raises(Unauthenticated) as refused:
        index_with().tenant_from_authorization(authorization)
    assert says in str(refused.value)
    if authorization:
        assert authorization.split()[-1] not in str(refused.value)


def test_a_revoked_key_is_refused_as_revoked_and_the_tenants_other_keys_still_work() -> None:
    old, new = new_api_key(), new_api_key()
    record = TenantRecord("acme").with_key(old, 1).with_key(new, 2)
    keys = index_with(record.revoked(3, key_id_of(hash_api_key(old))))

    with pytest.raises(Unauthenticated, match=f"API key {key_id_of(hash_api_key(old))} of tenant 'acme': revoked"):
        keys.tenant_from_key(old)
    assert keys.tenant_from_key(new).tenant == "acme"


def test_salted_block_keys_share_nothing_with_the_shared_namespace_or_another_salt() -> None:
    tokens = list(range(64))
    shared = block_hashes(tokens)
    a, b = (block_hashes(tokens, parent_hash=salted_root(s)) for s in ("tenant-cache:a", "tenant-cache:b"))
    assert salted_root("") == 0 and block_hashes(tokens, parent_hash=salted_root("")) == shared
    assert not set(a) & set(shared) and not set(a) & set(b)


def test_the_sim_engine_caches_per_salt_and_generates_the_same_tokens_under_any_salt() -> None:
    core = make_core()
    text = prompt(100)
    core.add_request(dataclasses.replace(request("a1", text), cache_salt="tenant-cache:a"))
    first = run_until_idle(core)
    core.add_request(dataclasses.replace(request("b1", text), cache_salt="tenant-cache:b"))
    other = run_until_idle(core)
    core.add_request(dataclasses.replace(request("a2", text), cache_salt="tenant-cache:a"))
    again = run_until_idle(core)

    assert other.finals["b1"].num_cached_tokens == 0
    assert again.finals["a2"].num_cached_tokens == 96
    assert first.tokens["a1"] == other.tokens["b1"] == again.tokens["a2"]


@pytest.mark.parametrize(("fields", "named"), [
    ({"weight": math.inf}, "weight=inf: must be positive and finite"),
    ({"weight": math.nan}, "weight=nan"),
    ({"max_concurrency": 1 << 63}, "max_concurrency=9223372036854775808: must be at least 1 and at most"),
    ({"max_priority": -1}, "max_priority=-1: must be a whole number from 0 to 2147483647"),
    ({"max_priority": 1 << 31}, "max_priority=2147483648"),
    ({"max_priority": True}, "max_priority=true"),
])
def test_a_record_etcd_could_not_give_back_as_json_is_refused_by_its_field(fields: dict[str, float],
                                                                          named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        TenantRecord("acme", **fields)  # type: ignore[arg-type]


def test_a_record_bounds_its_tenants_priority_and_reads_as_before_at_the_default() -> None:
    """A tenant chose its own priority, which orders admission before any weight (helper-188, helper-189)."""
    record = TenantRecord("acme")
    record.check_priority(0)
    record.check_priority(-5)
    with pytest.raises(PermissionDenied, match=re.escape("priority=1: above the highest that tenant 'acme' may ask "
                                                         "for, 0")):
        record.check_priority(1)
    TenantRecord("acme", max_priority=9).check_priority(9)
    # At the default the record is written as before the field was (a router of then reads it still).
    assert b"max_priority" not in record.to_json()
    raised = TenantRecord("acme", max_priority=9)
    assert TenantRecord.from_json(raised.to_json()) == raised
