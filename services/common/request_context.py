"""A request's context (tenant, priority, budgets, workflow) as one message, filled in one place.

The public GenerateRequest keeps these as its own top-level fields (the API clients and grpcurl
users write); every internal hop carries them as one RequestContext, read and written only here.
"""

from __future__ import annotations

from typing import Any

from baton.v1 import common_pb2
from services.common.errors import InvalidArgument

FIELDS = tuple(field.name for field in common_pb2.RequestContext.DESCRIPTOR.fields)


def context_of(source: Any) -> common_pb2.RequestContext:
    """The context of anything with the context's fields as attributes (a GenerateRequest, a
    PlacementRequest). Budgets stay as the client set them (0: the cluster's default, which the
    scheduler's policy aims at but admission never enforces as a deadline)."""
    return common_pb2.RequestContext(**{name: getattr(source, name) for name in FIELDS})


def context_fields(context: common_pb2.RequestContext) -> dict[str, Any]:
    """The context's fields by name, e.g. as keyword arguments of the pure core's PlacementRequest."""
    return {name: getattr(context, name) for name in FIELDS}


def check_context(source: Any) -> None:
    """Refuse a context (or anything with its fields as attributes) whose budgets or workflow step make
    no sense, naming the field and its value: the router checks what clients send, the scheduler what
    any caller of Place sends."""
    for name in ("ttft_budget_ms", "tpot_budget_ms", "deadline_ms", "step", "total_steps"):
        if getattr(source, name) < 0:
            raise InvalidArgument(name, getattr(source, name), "must not be negative")
    if not source.workflow_id:  # (taken and ignored, the request counted as a task of one step: helper-176)
        for name in ("step", "total_steps"):
            if getattr(source, name):
                raise InvalidArgument(name, getattr(source, name), "needs a workflow_id: a request without one is a "
                                      "task of its own, of one step")
    if source.total_steps and not 1 <= source.step <= source.total_steps:
        raise InvalidArgument("step", source.step, f"must be 1 to total_steps={source.total_steps}")
