"""Tenant authentication and isolation on a cluster run with --auth: keys name tenants, unknown and
revoked keys are refused, tenants see neither each other's decisions nor each other's cached prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from baton.cli import main as baton_main
from baton.client import BatonClient, Completion
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common import etcd_keys
from services.common.auth import TenantRecord
from services.common.etcd_session import connect
from services.router.request_scope import cluster_request_id
from tests.integration.conftest import MODEL, eventually, wait_until
from tests.reference import reference_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One node (so that a repeated prompt can only meet the cache it was stored in), auth on."""
    spec = ClusterSpec(num_nodes=1, gpus=("h100",), speed=20.0, auth=True, http_port=0)
    with LocalCluster(spec, tmp_path_factory.mktemp("secured")) as started:
        yield started


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def add_tenant(cluster: LocalCluster, tenant: str, **fields: object) -> str:
    """A new key for tenant, once the router and the scheduler both know it."""
    key = cluster.add_tenant(tenant, **fields)
    wait_known(cluster, key)
    return key


def wait_known(cluster: LocalCluster, key: str) -> None:
    """Until the router and the scheduler both accept key (each learns it through an etcd watch)."""
    assert cluster.router is not None and cluster.scheduler is not None
    with grpc.insecure_channel(cluster.router.address) as router, \
            grpc.insecure_channel(cluster.scheduler.address) as scheduler:

        def known() -> bool:
            try:
                router_pb2_grpc.RouterStub(router).ListModels(router_pb2.ListModelsRequest(), timeout=5,
                                                              metadata=bearer(key))
                scheduler_pb2_grpc.SchedulerStub(scheduler).GetRecentDecisions(
                    scheduler_pb2.GetRecentDecisionsRequest(limit=1), timeout=5, metadata=bearer(key))
                return True
            except grpc.RpcError:
                return False

        wait_until(known, 10, "the new key to reach the router and the scheduler")


async def complete(cluster: LocalCluster, key: str | None, prompt: str, **fields: object) -> Completion:
    assert cluster.router is not None
    async with BatonClient(cluster.router.address, api_key=key) as client:
        return await client.complete(MODEL, prompt, max_tokens=4, **fields)


async def refusal(cluster: LocalCluster, key: str | None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(cluster, key, "who goes there?")
    return refused.value


async def wait_refused_as_revoked(cluster: LocalCluster, key: str) -> None:
    """Until a request with key is refused UNAUTHENTICATED as revoked (the revocation reaches the router through an
    etcd watch)."""
    async def refused_as_revoked() -> bool:
        try:
            await complete(cluster, key, "still welcome?")
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in exc.details()
        return False

    await eventually(refused_as_revoked, 10, "the revoked key to be refused")


def recent_decisions(cluster: LocalCluster, key: str) -> list[scheduler_pb2.PlacementDecision]:
    assert cluster.scheduler is not None
    with grpc.insecure_channel(cluster.scheduler.address) as channel:
        return list(scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
            scheduler_pb2.GetRecentDecisionsRequest(), timeout=5,
            metadata=bearer(key)).decisions)


async def test_the_key_names_the_tenant_whatever_the_body_says(secured: LocalCluster) -> None:
    key = add_tenant(secured, "acme")
    result = await complete(secured, key, "whose request is this?", tenant="mallory")

    placed = {d.request_id: d.context.tenant for d in recent_decisions(secured, secured.admin_key)}
    assert placed[cluster_request_id("acme", result.request_id)] == "acme"


async def test_a_call_without_a_valid_key_is_unauthenticated_saying_why(secured: LocalCluster) -> None:
    missing = await refusal(secured, None)
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: missing" in missing.details()

    made_up = "bt_" + "x" * 43
    unknown = await refusal(secured, made_up)
    assert unknown.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "unknown" in unknown.details() and made_up not in unknown.details()

    assert secured.router is not None
    with grpc.insecure_channel(secured.router.address) as channel:
        with pytest.raises(grpc.RpcError) as listing:
            router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=5)
    assert listing.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_key_revoked_with_the_cli_is_refused_as_revoked(
        secured: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = ["--state", str(tmp_path / "none.json"), "tenants", "--etcd", secured.etcd_endpoint]
    assert baton_main([*cli, "add", "leaver"]) == 0
    key = capsys.readouterr().out.strip()
    wait_known(secured, key)
    assert (await complete(secured, key, "still welcome?")).finish_reason
    assert baton_main([*cli, "list"]) == 0
    assert key not in capsys.readouterr().out  # only key ids are ever shown

    assert baton_main([*cli, "revoke", "leaver"]) == 0
    await wait_refused_as_revoked(secured, key)
    assert key not in (await refusal(secured, key)).details()


# Records under /baton/tenants/ no `baton tenants` wrote: not an object, a list for a name, and one that holds another
# tenant's name (and so would hold its keys, which a revocation by that name would never reach).
JUNK_RECORDS = {"zz-five": b"5", "zz-list": b'{"tenant": ["x"]}', "zz-impostor": None}


async def test_records_that_are_not_tenants_are_named_and_a_revocation_still_takes_effect(
        secured: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One record of `5` made every router's and scheduler's view of the tenants fail to update, so a key revoked
    meanwhile was still taken, and a new tenant's refused (helper-181)."""
    cli = ["--state", str(tmp_path / "none.json"), "tenants", "--etcd", secured.etcd_endpoint]
    assert baton_main([*cli, "add", "mallory"]) == 0
    key = capsys.readouterr().out.strip()
    wait_known(secured, key)
    async with connect(secured.etcd_endpoint) as client:
        mallory = TenantRecord.from_json((await client.get(etcd_keys.tenant_key("mallory").encode())).value)
        for name, value in JUNK_RECORDS.items():
            await client.put(etcd_keys.tenant_key(name).encode(), value or mallory.to_json())
        try:
            assert baton_main([*cli, "revoke", "mallory"]) == 0
            newcomer = add_tenant(secured, "newcomer")  # known to the router and the scheduler, junk and all
            await wait_refused_as_revoked(secured, key)
            assert (await complete(secured, newcomer, "welcome?")).finish_reason
            capsys.readouterr()
            assert baton_main([*cli, "list"]) == 0
            listed = capsys.readouterr()
            assert "mallory: weight 1" in listed.out and "newcomer" in listed.out
            for name, why in (("zz-five", "a JSON number (5), not an object"),
                              ("zz-list", "tenant=['x']: not a string"),
                              ("zz-impostor", "holds tenant 'mallory', not its own name's")):
                assert f"/baton/tenants/{name}: " in listed.err and why in listed.err, listed.err
        finally:
            for name in JUNK_RECORDS:
                await client.delete(etcd_keys.tenant_key(name).encode())


async def test_another_tenants_identical_prompt_finds_nothing_cached(secured: LocalCluster) -> None:
    alice, bob = add_tenant(secured, "alice"), add_tenant(secured, "bob")
    prompt = "A long shared system prompt that would be worth caching across requests. " * 4

    await complete(secured, alice, prompt)
    assert (await complete(secured, alice, prompt)).usage.cached_tokens > 0  # her own prefix is cached
    assert (await complete(secured, bob, prompt)).usage.cached_tokens == 0


async def test_tenants_of_one_cache_group_share_cached_prefixes(secured: LocalCluster) -> None:
    team = add_tenant(secured, "team-a", cache_group="team")
    mate = add_tenant(secured, "team-b", cache_group="team")
    prompt = "Another long prompt, shared on purpose by the tenants of one group of tenants. " * 4

    await complete(secured, team, prompt)
    assert (await complete(secured, mate, prompt)).usage.cached_tokens > 0


async def test_a_tenant_sees_only_its_own_decisions_and_no_cluster_state(secured: LocalCluster) -> None:
    own, other = add_tenant(secured, "watcher"), add_tenant(secured, "watched")
    mine = await complete(secured, own, "my own request")
    theirs = await complete(secured, other, "someone else's request")

    # Decisions name requests as the cluster knows them: in their tenant's namespace.
    mine_id = cluster_request_id("watcher", mine.request_id)
    theirs_id = cluster_request_id("watched", theirs.request_id)
    seen = {d.request_id: d for d in recent_decisions(secured, own)}
    assert mine_id in seen and theirs_id not in seen
    # Nor the nodes' figures, which tell their load and so the others' work (helper-164): the administrator's have.
    assert not seen[mine_id].candidates and not seen[mine_id].score and seen[mine_id].node_id
    everyone = {d.request_id: d for d in recent_decisions(secured, secured.admin_key)}
    assert theirs_id in everyone and everyone[mine_id].candidates
    assert secured.scheduler is not None
    with grpc.insecure_channel(secured.scheduler.address) as channel:
        with pytest.raises(grpc.RpcError) as state:
            scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                scheduler_pb2.GetClusterStateRequest(), timeout=5, metadata=bearer(own))
    assert state.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_tenants_record_carries_its_limits(secured: LocalCluster) -> None:
    key = add_tenant(secured, "frugal", tokens_per_minute=40)
    prompt = "thirty-three bytes of prompt here"  # 33 tokens and 4 to generate: 37 of the minute's 40
    await complete(secured, key, prompt)
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # the minute's tokens are spent: a wait lets it in
        await complete(secured, key, prompt)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'frugal' is over its limit of 40 tokens per minute" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as never:  # more than the whole minute: no wait lets it in
        await complete(secured, key, prompt + " and then some more")
    assert never.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=4" in never.value.details() and "tenant 'frugal', 40 tokens per minute" in never.value.details()



async def test_another_tenant_reusing_a_running_requests_id_is_served_and_disturbs_nothing(
        secured: LocalCluster) -> None:
    """Request ids are the client's choice: tenant B sending a live request's id of tenant A's is served
    its own tokens under that id, while A's stream goes on untouched and A keeps its admission slot."""
    first, second = add_tenant(secured, "ids-a", max_concurrency=1), add_tenant(secured, "ids-b")
    prompt = "a generation long enough to still run while the other tenant calls"
    num_tokens = 8192 - len(prompt) - 1  # about 3 s at this cluster's speed: the other calls take far less
    assert secured.router is not None
    async with BatonClient(secured.router.address, api_key=first) as client:
        stream = client.generate(MODEL, prompt, max_tokens=num_tokens, ignore_eos=True, request_id="same-id")
        chunks = [await anext(stream)]  # placed: it runs on the only node and holds its tenant's one slot
        theirs = await complete(secured, second, "the other tenant's prompt", request_id="same-id")
        with pytest.raises(grpc.aio.AioRpcError) as over:  # A's slot is still A's while A runs
            await complete(secured, first, "a second request of the first tenant")
        chunks += [chunk async for chunk in stream]

    assert (theirs.request_id, theirs.token_ids) == (
        "same-id", reference_completion(list(b"the other tenant's prompt"), 4)[0])
    assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, over.value.details()
    assert "concurrency limit of 1" in over.value.details()
    assert {chunk.request_id for chunk in chunks} == {"same-id"}
    assert [t for chunk in chunks for t in chunk.token_ids] == reference_completion(
        list(prompt.encode()), num_tokens, ignore_eos=True)[0]


async def test_tenants_using_the_same_workflow_id_keep_separate_tasks(secured: LocalCluster) -> None:
    """A workflow id is the client's choice too: tenant A's step 1 and tenant B's step 2 of "shared-wf"
    are two unfinished tasks, not one two-step task that B's step completed in A's name."""
    first, second = add_tenant(secured, "wf-a"), add_tenant(secured, "wf-b")

    def open_tasks() -> int:
        assert secured.scheduler is not None
        with grpc.insecure_channel(secured.scheduler.address) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                scheduler_pb2.GetClusterStateRequest(), timeout=5,
                metadata=bearer(secured.admin_key)).tasks.tasks_open

    before = open_tasks()
    for key, step in ((first, 1), (second, 2)):
        await complete(secured, key, f"step {step} of a two-step workflow", workflow_id="shared-wf",
                       step=step, total_steps=2)
    await eventually(lambda: open_tasks() >= before + 2, 20, "each tenant's step to open a task of its own")


def test_over_http_the_bearer_key_names_the_tenant_and_a_bad_key_gets_401(secured: LocalCluster) -> None:
    """The OpenAI-compatible API authenticates as gRPC does: the Authorization header's key decides the
    tenant (not extra_body's `tenant`), and its prefix cache is that tenant's own."""
    import openai

    key = add_tenant(secured, "http-a")
    base = f"http://{secured.http_address}/v1"
    prompt = "an HTTP prompt whose prefix only its own tenant may find cached " * 3
    with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"tenant": "someone-else"})
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens > 0
    decisions = recent_decisions(secured, secured.admin_key)
    assert {d.context.tenant for d in decisions if d.context.tenant.startswith(("http-a", "someone"))} == {"http-a"}
    for bad in ("not-a-baton-key", "bt_not-a-real-key"):
        with openai.OpenAI(base_url=base, api_key=bad, max_retries=0, timeout=30) as client:
            with pytest.raises(openai.AuthenticationError):
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()


async def test_a_tenant_asks_no_priority_above_its_records_and_an_operator_raises_it_without_a_new_key(
        secured: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tenant's requests set their own priority, which orders admission before any weight: one tenant at priority 1
    took all 40 starts from a tenant weighted ten times its own (helper-189), and a flood at 1000 held another's
    requests 48 s (helper-188). The key decides the tenant, and the tenant's record its highest priority."""
    import openai

    key = add_tenant(secured, "eager")
    assert (await complete(secured, key, "a default priority", priority=0)).finish_reason
    assert (await complete(secured, key, "a lower band is anyone's", priority=-3)).finish_reason
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(secured, key, "me first", priority=1)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details().startswith("priority=1: above the highest that tenant 'eager' may ask for, 0")
    with openai.OpenAI(base_url=f"http://{secured.http_address}/v1", api_key=key, max_retries=0, timeout=30) as client:
        with pytest.raises(openai.PermissionDeniedError, match="priority=1000"):
            client.completions.create(model=MODEL, prompt="me first", max_tokens=4, extra_body={"priority": 1000})

    cli = ["--state", str(tmp_path / "none.json"), "tenants", "--etcd", secured.etcd_endpoint]
    assert baton_main([*cli, "set", "eager", "--max-priority", "5"]) == 0
    assert "max_priority 5" in capsys.readouterr().out

    async def raised() -> bool:  # the record reaches the router through an etcd watch
        try:
            await complete(secured, key, "now allowed", priority=5)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
            return False
        return True

    await eventually(raised, 10, "the raised priority to reach the router")
    with pytest.raises(grpc.aio.AioRpcError) as still:
        await complete(secured, key, "beyond it", priority=6)
    assert "above the highest that tenant 'eager' may ask for, 5" in still.value.details()
    async with connect(secured.etcd_endpoint) as client:
        record = TenantRecord.from_json((await client.get(etcd_keys.tenant_key("eager").encode())).value)
    assert len(record.keys) == 1  # `set` changed the record and issued no key
