"""Request ids inside the cluster: one namespace per tenant, never shown to the client."""

from __future__ import annotations

import pytest

from services.common.auth import TenantRecord
from services.common.errors import ResourceExhausted, Unavailable
from services.router.request_scope import cluster_request_id, name_as_client


def test_tenants_sending_one_id_are_two_requests_and_one_tenant_resending_it_is_one() -> None:
    assert cluster_request_id("a", "r1") != cluster_request_id("b", "r1")
    assert cluster_request_id("a", "r1") == cluster_request_id("a", "r1")  # a resume through another router
    # "a/b" + "r1" would spell "a" + "b/r1": tenant names hold no "/", so no tenant's id is another's.
    with pytest.raises(ValueError, match="no '/'"):
        TenantRecord(tenant="a/b")


def test_a_refusal_names_the_request_by_the_clients_id_and_keeps_its_retry_hint() -> None:
    shed = ResourceExhausted("request a/r1: shed for a more important request", retry_after_ms=1000)
    name_as_client(shed, "a/r1", "r1")
    assert (str(shed), shed.retry_after_ms) == ("request r1: shed for a more important request; retry after 1000 ms",
                                                1000)
    moved = Unavailable("request a/r1: node n1: stalled; could not move it")
    name_as_client(moved, "a/r1", "r1")
    assert str(moved) == "request r1: node n1: stalled; could not move it"
