"""`baton tenants add|list|revoke`: API keys and per-tenant limits, kept hashed in etcd (services/common/auth.py)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import aetcd
import grpc

from baton.flag_types import INT32, INT64, int_in, positive_finite
from services.common import etcd_keys
from services.common.auth import TenantRecord, new_api_key
from services.common.errors import shown
from services.common.etcd_session import connect

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run coro to its end from synchronous code, whether or not this thread runs an event loop."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _now_ms() -> int:
    return int(time.time() * 1000)


# The longest tenant name `baton tenants add` creates: the routers' default --max-id-len.
MAX_TENANT_LEN = 128
# How often a change of a tenant's record is tried again when another changed the record meanwhile.
_MAX_TRIES = 20


async def _change(client: Any, tenant: str, change: Callable[[TenantRecord | None], TenantRecord]) -> TenantRecord:
    """Read tenant's record, change it and write it back only if no one wrote it meanwhile, else again from the
    read: with a plain read and put, a key added while another was revoked wrote the revoked key back as valid
    (helper-164). change may raise, and is then not written."""
    key = etcd_keys.tenant_key(tenant).encode()
    tx = client.transactions
    for _ in range(_MAX_TRIES):
        kv = await client.get(key)
        try:
            stored = TenantRecord.from_json(kv.value) if kv is not None and kv.value else None
        except ValueError as exc:
            raise ValueError(f"tenant {tenant!r}: its record in etcd is not one Baton wrote ({exc}); its keys are "
                             f"refused; remove it with `etcdctl del {key.decode()}`") from None
        record = change(stored)
        unchanged = tx.mod(key) == kv.mod_revision if kv is not None else tx.version(key) == 0
        written, _ = await client.transaction(compare=[unchanged], success=[tx.put(key, record.to_json())],
                                              failure=[])
        if written:
            return record
    raise RuntimeError(f"tenant {tenant!r}: its record changed under every one of {_MAX_TRIES} tries; try again")


# A limit flag's value that removes the limit (`baton tenants set --max-concurrency unlimited`).
UNLIMITED = "unlimited"


# The fields that UNLIMITED removes (a cache group may be named "unlimited": helper-190).
_LIMITS = ("max_concurrency", "tokens_per_minute")


def _with_fields(record: TenantRecord, fields: dict[str, Any]) -> TenantRecord:
    """record with the fields given replacing its own (None: not given; UNLIMITED for a limit: the limit removed)."""
    given = {name: None if name in _LIMITS and value == UNLIMITED else value
             for name, value in fields.items() if value is not None}
    return TenantRecord(**{**record.__dict__, **given})


async def set_tenant(etcd: str, tenant: str, fields: dict[str, Any],
                     credentials: grpc.ChannelCredentials | None = None) -> TenantRecord:
    """Change a tenant's limits, weight, cache group, priority or role, issuing no key (adding one to change a limit
    left every earlier key valid, and a limit could never be removed: helper-189); LookupError for no such tenant."""
    def change(record: TenantRecord | None) -> TenantRecord:
        if record is None:
            raise LookupError(f"tenant {tenant!r}: no such tenant (`baton tenants add` creates one, with a key)")
        return _with_fields(record, fields)

    async with connect(etcd, credentials=credentials) as client:
        return await _change(client, tenant, change)


async def add_tenant(etcd: str, tenant: str, *, weight: float | None = None, max_concurrency: int | None = None,
                     tokens_per_minute: int | None = None, cache_group: str | None = None,
                     is_admin: bool | None = None, max_priority: int | None = None,
                     credentials: grpc.ChannelCredentials | None = None) -> tuple[TenantRecord, str]:
    """Issue a new API key for tenant (creating it); the fields given replace the record's. Returns the
    record and the key, which exists nowhere else: etcd keeps only its hash."""
    # What the routers take for a tenant (their --max-id-len, 128 by default; no control character): a longer name
    # was created, and every request with its key refused (helper-164).
    if len(tenant) > MAX_TENANT_LEN:
        raise ValueError(f"tenant {shown(tenant)}: {len(tenant)} characters, longer than {MAX_TENANT_LEN} (the "
                         "routers' --max-id-len refuses such a tenant's every request)")
    if any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in tenant):
        raise ValueError(f"tenant {shown(tenant)}: holds a control character")
    if tenant != tenant.strip():  # as the routers refuse such a tenant (a header would drop it)
        raise ValueError(f"tenant {shown(tenant)}: begins or ends with white space (the routers refuse such a "
                         "tenant's every request)")
    fields = {"weight": weight, "max_concurrency": max_concurrency, "tokens_per_minute": tokens_per_minute,
              "cache_group": cache_group, "is_admin": is_admin, "max_priority": max_priority}
    key = new_api_key()

    def add(record: TenantRecord | None) -> TenantRecord:
        return _with_fields(record or TenantRecord(tenant=tenant), fields).with_key(key, _now_ms())

    async with connect(etcd, credentials=credentials) as client:
        record = await _change(client, tenant, add)
    return record, key


async def list_tenants(etcd: str, credentials: grpc.ChannelCredentials | None = None
                       ) -> tuple[list[TenantRecord], list[str]]:
    """The tenants' records, and a line for each record under /baton/tenants/ that is not one (whose keys every
    router and scheduler refuses)."""
    async with connect(etcd, credentials=credentials) as client:
        listing = await client.get_prefix(etcd_keys.TENANTS.encode())
    records, unreadable = [], []
    for kv in listing:
        key = kv.key.decode(errors="replace")
        try:
            records.append(TenantRecord.at_key(key, kv.value))
        except ValueError as exc:
            unreadable.append(f"{key}: not a tenant record ({exc}); its keys are refused")
    return sorted(records, key=lambda r: r.tenant), sorted(unreadable)


async def revoke(etcd: str, tenant: str, key_id: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> TenantRecord:
    """Revoke one key of tenant's (every key when key_id is None); LookupError naming what is unknown.
    The record stays, so a revoked key is refused as revoked, not as unknown."""
    def revoke_in(record: TenantRecord | None) -> TenantRecord:
        if record is None:
            raise LookupError(f"tenant {tenant!r}: no such tenant")
        try:
            return record.revoked(_now_ms(), key_id)
        except KeyError:
            raise LookupError(f"--key-id {key_id!r}: tenant {tenant!r} has keys "
                              f"{', '.join(k.key_id for k in record.keys) or '(none)'}") from None

    async with connect(etcd, credentials=credentials) as client:
        return await _change(client, tenant, revoke_in)


def _describe(record: TenantRecord) -> str:
    limits = ", ".join(f"{name} {value}" for name, value in (
        ("max_concurrency", record.max_concurrency), ("tokens_per_minute", record.tokens_per_minute),
        ("max_priority", record.max_priority)) if value)
    keys = ", ".join(k.key_id + (" (revoked)" if k.revoked_at_ms else "") for k in record.keys) or "none"
    return (f"{record.tenant}{' [admin]' if record.is_admin else ''}: weight {record.weight:g}"
            f"{', ' + limits if limits else ''}; cache group {record.cache_group or record.tenant}; keys {keys}")


def cmd_tenants(args: argparse.Namespace, etcd: str, credentials: grpc.ChannelCredentials | None = None) -> int:
    """credentials: TLS to etcd (None: plaintext)."""
    try:
        if args.action == "add":
            record, key = run_sync(add_tenant(
                etcd, args.tenant, weight=args.weight, max_concurrency=args.max_concurrency,
                tokens_per_minute=args.tokens_per_minute, cache_group=args.cache_group,
                is_admin=True if args.admin else None, max_priority=args.max_priority, credentials=credentials))
            print(_describe(record), file=sys.stderr)
            print("the new key (shown once; etcd keeps only its hash):", file=sys.stderr)
            print(key)
        elif args.action == "list":
            records, unreadable = run_sync(list_tenants(etcd, credentials))
            for record in records:
                print(_describe(record))
            for line in unreadable:
                print(f"baton tenants list: {line}", file=sys.stderr)
        elif args.action == "set":
            fields = {"is_admin" if name == "admin" else name: getattr(args, name) for name in _SET_FIELDS}
            if all(value is None for value in fields.values()):
                raise ValueError("nothing to change: give at least one of "
                                 + ", ".join("--" + name.replace("_", "-") for name in _SET_FIELDS))
            print(_describe(run_sync(set_tenant(etcd, args.tenant, fields, credentials))))
        else:
            record = run_sync(revoke(etcd, args.tenant, args.key_id, credentials))
            print(_describe(record))
    except (LookupError, ValueError) as exc:
        print(f"baton tenants {args.action}: {exc}", file=sys.stderr)
        return 2
    except aetcd.exceptions.ClientError as exc:  # refused, timed out, ... (tracebacks, helper-161, helper-163)
        print(f"baton tenants {args.action}: etcd at {etcd} did not answer: {exc}", file=sys.stderr)
        return 1
    return 0


_SET_FIELDS = ("weight", "max_concurrency", "tokens_per_minute", "cache_group", "max_priority", "admin")


def _limit_or_unlimited(text: str) -> int | str:
    """A limit flag of `set`: an integer from 1, or `unlimited` to remove the limit."""
    return UNLIMITED if text.strip() == UNLIMITED else int_in(1, INT64[1])(text)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """The `tenants` subcommand and its actions, under commands (argparse subparsers)."""
    tenants = commands.add_parser("tenants", help="API keys, limits and weights per tenant (stored hashed in etcd)")
    tenants.add_argument("--etcd", default="", help="etcd host:port, or several members' comma-separated "
                         "(default: the running `baton up`'s)")
    actions = tenants.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="issue a new API key for a tenant (creating it); prints the key once")
    add.add_argument("tenant")
    add.add_argument("--weight", type=positive_finite, default=None,
                     help="admission share under contention (default 1)")
    add.add_argument("--max-concurrency", type=int_in(1, INT64[1]), default=None,
                     help="requests in flight at once (default: unlimited)")
    add.add_argument("--tokens-per-minute", type=int_in(1, INT64[1]), default=None,
                     help="prompt+completion tokens per minute")
    add.add_argument("--cache-group", default=None, help="share the prefix cache with the tenants of this group "
                     "(default: the tenant's own name, shared with nobody)")
    add.add_argument("--admin", action="store_true", help="may read every tenant's decisions and the cluster state")
    add.add_argument("--max-priority", type=int_in(0, INT32[1]), default=None,
                     help="the highest priority its requests may ask for (default 0: none above the default)")
    change = actions.add_parser("set", help="change a tenant's limits, weight, cache group, highest priority or role "
                                "(no new key)")
    change.add_argument("tenant")
    change.add_argument("--weight", type=positive_finite, default=None, help="admission share under contention")
    change.add_argument("--max-concurrency", type=_limit_or_unlimited, default=None,
                        help="requests in flight at once, or `unlimited`")
    change.add_argument("--tokens-per-minute", type=_limit_or_unlimited, default=None,
                        help="prompt+completion tokens per minute, or `unlimited`")
    change.add_argument("--cache-group", default=None, help="share the prefix cache with the tenants of this group")
    change.add_argument("--max-priority", type=int_in(0, INT32[1]), default=None,
                        help="the highest priority its requests may ask for")
    change.add_argument("--admin", action=argparse.BooleanOptionalAction, default=None,
                        help="may read every tenant's decisions and the cluster state (--no-admin: no longer)")
    actions.add_parser("list", help="tenants, their limits and key ids (never keys)")
    rev = actions.add_parser("revoke", help="revoke a tenant's keys (or one, --key-id)")
    rev.add_argument("tenant")
    rev.add_argument("--key-id", default=None, help="the key to revoke, as `baton tenants list` names it")
    return tenants
