"""A node's registration as etcd holds it (`/baton/nodes/<id>`, NodeInfo as JSON), read by the
scheduler and the routers."""

from __future__ import annotations

import logging

from google.protobuf import json_format

from baton.v1 import common_pb2

log = logging.getLogger(__name__)


def parse_node_info(key: str, value: bytes, quiet: bool = False) -> common_pb2.NodeInfo | None:
    """The NodeInfo at key; None (logged unless quiet) when it is not one.

    Fields this version does not know are skipped, not refused: a node agent newer than this
    scheduler or router (one registering a profile field added since) is still a node.
    """
    try:
        return json_format.Parse(value, common_pb2.NodeInfo(), ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError):  # (bytes not UTF-8 raised past it and froze the view: helper-183)
        if not quiet:
            log.warning("malformed node registration at %s", key)
        return None
