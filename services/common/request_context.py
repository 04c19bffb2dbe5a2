"""A request's context (tenant, priority, budgets, workflow) as one message, filled in one place.

The public GenerateRequest keeps these as its own top-level fields (the API clients and grpcurl
users write); every internal hop carries them as one RequestContext, read and written only here.
"""

from __future__ import annotations

from typing import Any

from baton.v1 import common_pb2
from services.common.slo import Slo

FIELDS = tuple(field.name for field in common_pb2.RequestContext.DESCRIPTOR.fields)


def context_of(source: Any, slo: Slo | None = None) -> common_pb2.RequestContext:
    """The context of anything with the context's fields as attributes (a GenerateRequest, a
    PlacementRequest); with the cluster's SLO, its budgets where the request sets none, so that
    every later hop holds the request to the budgets its outcome will be judged by."""
    context = common_pb2.RequestContext(**{name: getattr(source, name) for name in FIELDS})
    if slo is not None:
        own = slo.for_request(context.ttft_budget_ms, context.tpot_budget_ms, context.deadline_ms)
        context.ttft_budget_ms, context.tpot_budget_ms = round(own.ttft_ms), round(own.tpot_ms)
        context.deadline_ms = round(own.deadline_ms)
    return context


def context_fields(context: common_pb2.RequestContext) -> dict[str, Any]:
    """The context's fields by name, e.g. as keyword arguments of the pure core's PlacementRequest."""
    return {name: getattr(context, name) for name in FIELDS}
