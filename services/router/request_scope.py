"""The request id the cluster keys a request's state by. Pure.

Clients choose request ids. Node agents (engine requests), the scheduler (admission slots, tasks)
and this router's live reports key state by the id, so with --auth each tenant's ids are a
namespace of their own: "<tenant>/<request_id>" (tenant names hold no "/"), never shown to the
client, whose chunks and messages carry its own id. Workflow ids likewise: the scheduler keeps a
workflow's steps (the KPI's task) and its spend (what placement protects) by the id.
"""

from __future__ import annotations

from services.common.errors import BatonError


def cluster_request_id(tenant: str, request_id: str) -> str:
    """The id the cluster knows the authenticated tenant's request_id by."""
    return f"{tenant}/{request_id}"


def name_as_client(error: BatonError, cluster_id: str, client_id: str) -> None:
    """Make error's message name the request by the client's id wherever it named the cluster's."""
    if cluster_id != client_id:
        error.args = tuple(arg.replace(cluster_id, client_id) if isinstance(arg, str) else arg for arg in error.args)
