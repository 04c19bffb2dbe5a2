"""A request's context (tenant, priority, budgets, workflow) as one message, filled in one place.

The public GenerateRequest keeps these as its own top-level fields (the API clients and grpcurl
users write); every internal hop carries them as one RequestContext, read and written only here.
"""

from __future__ import annotations

from typing import Any

from baton.v1 import common_pb2

FIELDS = tuple(field.name for field in common_pb2.RequestContext.DESCRIPTOR.fields)


def context_of(source: Any) -> common_pb2.RequestContext:
    """The context of anything with the context's fields as attributes (a GenerateRequest, a
    PlacementRequest). Budgets stay as the client set them (0: the cluster's default, which the
    scheduler's policy aims at but admission never enforces as a deadline)."""
    return common_pb2.RequestContext(**{name: getattr(source, name) for name in FIELDS})


def context_fields(context: common_pb2.RequestContext) -> dict[str, Any]:
    """The context's fields by name, e.g. as keyword arguments of the pure core's PlacementRequest."""
    return {name: getattr(context, name) for name in FIELDS}
