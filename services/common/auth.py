"""Tenant authentication: API keys, stored hashed, mapped to tenant records. Pure, no I/O.

A tenant's record (JSON under /baton/tenants/<name> in etcd, written by `baton tenants`) holds the
hashes of its API keys, its admission weight and limits, its prefix-cache group and whether it is an
administrator. A key is "bt_" and 43 random URL-safe characters (256 bits): a plain SHA-256 of it
is a safe stored form, since nobody can guess such a key from its hash. A key's id, the first 12 hex
digits of that hash, names it in listings, revocations and errors, so no message ever carries a key.

Clients send the key as request metadata `authorization: Bearer <key>` over gRPC, and in the same
header over HTTP: both go through `TenantKeys.tenant_from_authorization`.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace

from services.common import etcd_keys
from services.common.errors import PermissionDenied, Unauthenticated, shown
from services.common.etcd_records import json_object

KEY_PREFIX = "bt_"
_KEY_ID_CHARS = 12
# Limits are kept as JSON in etcd and read by every scheduler; beyond int64 other clients cannot hold them.
_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
_BEARER = "bearer "


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def hash_api_key(key: str) -> str:
    """The stored form of a key: its SHA-256, in hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key_hash: str) -> str:
    """The short public name of a key (a prefix of its hash)."""
    return key_hash[:_KEY_ID_CHARS]


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ApiKey:
    """One of a tenant's keys, as stored: never the key itself."""

    key_hash: str
    created_at_ms: int
    # 0 while the key is valid.
    revoked_at_ms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.key_hash, str):
            raise ValueError(f"key_hash={shown(self.key_hash)}: not a string")
        for name in ("created_at_ms", "revoked_at_ms"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name}={shown(getattr(self, name))}: not an integer")

    @property
    def key_id(self) -> str:
        return key_id_of(self.key_hash)


@dataclass(frozen=True)
class TenantRecord:
    """A tenant: its keys, its admission share and limits, the prefix cache it may see."""

    tenant: str
    keys: tuple[ApiKey, ...] = ()
    # Admission: share of the fleet under contention, relative to other tenants' weights.
    weight: float = 1.0
    # Admission: requests in flight at once, prompt+completion tokens per minute (None: unlimited).
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    # Tenants with the same group share prefix-cache blocks; the default, the tenant's own name,
    # shares with nobody (unless another tenant names this one as its group).
    cache_group: str = ""
    # Administrators see every tenant's decisions and the cluster state.
    is_admin: bool = False
    # The highest priority its requests may ask for (a request's priority orders admission before any weight, so a
    # tenant that set its own jumped every other: helper-188, helper-189). 0 or more: a lower band is any
    # request's to ask, and a default-priority request is never refused.
    max_priority: int = 0

    def __post_init__(self) -> None:
        # Read back from etcd, where anyone may have written anything: a list for a name crashed every router's
        # view of the tenants (helper-181).
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant={shown(self.tenant)}: not a string")
        if not isinstance(self.cache_group, str):
            raise ValueError(f"cache_group={shown(self.cache_group)}: not a string")
        if not isinstance(self.is_admin, bool):
            raise ValueError(f"is_admin={shown(self.is_admin)}: not true or false")
        if not all(isinstance(k, ApiKey) for k in self.keys):
            raise ValueError("keys: not all keys")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise ValueError(f"weight={shown(self.weight)}: not a number")
        if not self.tenant or "/" in self.tenant:
            raise ValueError(f"tenant={self.tenant!r}: must be non-empty and contain no '/'")
        # (JSON has no Infinity or NaN: a record holding one would not be read back by other clients.)
        if not 0 < self.weight < math.inf:
            raise ValueError(f"weight={self.weight!r}: must be positive and finite")
        if not (_is_int(self.max_priority) and 0 <= self.max_priority <= _INT32_MAX):
            raise ValueError(f"max_priority={shown(self.max_priority)}: must be a whole number from 0 to "
                             f"{_INT32_MAX} (a request's priority is a 32-bit integer)")
        for name in ("max_concurrency", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 1 <= value <= _INT64_MAX):
                raise ValueError(f"{name}={value!r}: must be at least 1 and at most {_INT64_MAX} "
                                 "(or unset: unlimited)")

    @property
    def cache_salt(self) -> str:
        """The prefix-cache namespace of this tenant's requests (NodeGenerateRequest.cache_salt)."""
        return "tenant-cache:" + (self.cache_group or self.tenant)

    def with_key(self, key: str, now_ms: int) -> TenantRecord:
        return replace(self, keys=(*self.keys, ApiKey(hash_api_key(key), now_ms)))

    def revoked(self, now_ms: int, key_id: str | None = None) -> TenantRecord:
        """This record with key_id revoked (every key when None); KeyError when no key has that id."""
        if key_id is not None and not any(k.key_id == key_id for k in self.keys):
            raise KeyError(key_id)
        return replace(self, keys=tuple(
            replace(k, revoked_at_ms=now_ms) if (key_id is None or k.key_id == key_id) and not k.revoked_at_ms
            else k for k in self.keys))

    def to_json(self) -> bytes:
        fields = asdict(self)
        if not self.max_priority:  # (as a record was before it had the field: a router of then reads it still)
            del fields["max_priority"]
        return json.dumps(fields, sort_keys=True).encode()

    def check_priority(self, priority: int) -> None:
        """PermissionDenied when a request of this tenant's asks for a priority above its max_priority."""
        if priority > self.max_priority:
            raise PermissionDenied(f"priority={priority}: above the highest that tenant {self.tenant!r} may ask for, "
                                   f"{self.max_priority} (an operator raises it: baton tenants set {self.tenant} "
                                   "--max-priority N)")

    @classmethod
    def from_json(cls, data: bytes) -> TenantRecord:
        """The record data holds; ValueError saying why it is not one."""
        raw = json_object(data)
        keys = raw.pop("keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, dict) for k in keys):
            raise ValueError(f"keys={shown(keys)}: not a list of keys")
        try:
            return cls(keys=tuple(ApiKey(**k) for k in keys), **raw)
        except TypeError as exc:  # a field missing, or one a record has not
            raise ValueError(f"not a tenant record: {exc}") from None

    @classmethod
    def at_key(cls, key: str, data: bytes) -> TenantRecord:
        """The record etcd holds at key; ValueError saying why it is none there: not a record, or one under another
        name than its own, or a copy further down (/baton/tenants/old/alice), which would hold that tenant's keys
        where a revocation by its name never reaches them (helper-183)."""
        record = cls.from_json(data)
        if key != etcd_keys.tenant_key(record.tenant):
            raise ValueError(f"holds tenant {record.tenant!r}, not its own name's")
        return record


@dataclass(frozen=True)
class _Entry:
    record: TenantRecord
    key: ApiKey


@dataclass
class TenantKeys:
    """Every tenant's keys, indexed by hash: the lookup a router or scheduler does per request."""

    records: dict[str, TenantRecord] = field(default_factory=dict)
    _by_hash: dict[str, _Entry] = field(default_factory=dict)

    @classmethod
    def from_records(cls, records: Iterable[TenantRecord]) -> TenantKeys:
        index = cls()
        for record in records:
            index.records[record.tenant] = record
            for key in record.keys:
                index._by_hash[key.key_hash] = _Entry(record, key)
        return index

    @classmethod
    def from_etcd_items(cls, items: Mapping[str, bytes]) -> TenantKeys:
        """From the values under /baton/tenants/; a record that does not parse is skipped (logged by the caller)."""
        records = []
        for key, value in items.items():
            try:
                records.append(TenantRecord.at_key(key, value))
            except ValueError:
                continue
        return cls.from_records(records)

    def tenant_from_key(self, key: str) -> TenantRecord:
        """The tenant whose valid key this is; Unauthenticated saying what is wrong otherwise (the key
        itself never appears in the message: only its id, a prefix of its hash)."""
        if not key.startswith(KEY_PREFIX):
            raise Unauthenticated(f"API key: not a Baton key (expected {KEY_PREFIX}..., "
                                  f"from `baton tenants add`)")
        key_hash = hash_api_key(key)
        entry = self._by_hash.get(key_hash)
        if entry is None:
            raise Unauthenticated(f"API key {key_id_of(key_hash)}: unknown to this cluster")
        if entry.key.revoked_at_ms:
            raise Unauthenticated(f"API key {entry.key.key_id} of tenant {entry.record.tenant!r}: revoked")
        return entry.record

    def tenant_from_authorization(self, value: str | None) -> TenantRecord:
        """The tenant named by an `authorization: Bearer <key>` value (gRPC metadata or HTTP header); several
        entries come joined by ", " (`joined_authorization`), and are refused: no key has a comma, and which of two
        keys would decide is not the caller's to leave to the server."""
        if not value:
            raise Unauthenticated("authorization: missing; send 'authorization: Bearer <API key>' "
                                  "(`baton tenants add` issues keys)")
        if "," in value:
            raise Unauthenticated(f"authorization: {value.count(',') + 1} values (several entries, or a list); "
                                  "send one 'Bearer <API key>'")
        if not value[:len(_BEARER)].lower() == _BEARER:
            raise Unauthenticated(f"authorization: expected 'Bearer <API key>', got a value of {len(value)} "
                                  "characters without the Bearer scheme")
        return self.tenant_from_key(value[len(_BEARER):].strip())

    def tenant_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> TenantRecord:
        """The tenant of a gRPC call, from its invocation metadata."""
        return self.tenant_from_authorization(joined_authorization(metadata))


def joined_authorization(entries: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """A call's `authorization` entries (gRPC metadata, HTTP headers), joined by ", " as HTTP joins a field sent
    several times; None without one. Before, the first decided, whatever the second said (helper-164)."""
    values = [value.decode(errors="replace") if isinstance(value, bytes) else value
              for name, value in entries or () if name.lower() == "authorization"]
    return ", ".join(values) if values else None
