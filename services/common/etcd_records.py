"""Records read from etcd as JSON: whatever another process, or an operator's `etcdctl put`, wrote there. Pure.

A record that is not what its reader expects is that record's problem, never the reader's: one value of `5` under
/baton/services/ killed every node agent of a cluster, and one under /baton/tenants/ froze every router's view of
the tenants, so that a key revoked meanwhile was still taken (helper-181). Readers parse through these, which say
what is wrong with a record in a ValueError, and skip the record.
"""

from __future__ import annotations

import json
from typing import Any

from services.common.errors import shown

_JSON_KINDS = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}


def json_object(value: bytes | str) -> dict[str, Any]:
    """value as a JSON object; ValueError saying why it is not one (not JSON, not UTF-8, another kind of JSON value,
    nested too deep to parse)."""
    try:
        parsed = json.loads(value)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    if not isinstance(parsed, dict):
        kind = "null" if parsed is None else _JSON_KINDS.get(type(parsed), type(parsed).__name__)
        raise ValueError(f"a JSON {kind} ({shown(parsed)}), not an object")
    return parsed


def text_field(record: dict[str, Any], name: str) -> str:
    """record's field name, a non-empty string; ValueError saying what it is otherwise."""
    value = record.get(name)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}={shown(value)}: not a non-empty string")
    return value


def address_of(value: bytes | str) -> str:
    """The "address" of a service's, a node's or a leader's record; ValueError when it has none that is a string."""
    return text_field(json_object(value), "address")
