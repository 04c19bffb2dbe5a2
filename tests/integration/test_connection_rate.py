"""The request rate per client connection, end to end: a connection over its burst is refused with
RESOURCE_EXHAUSTED (gRPC) or 429 (HTTP), naming the limit and when to retry, while another
connection is served at the same moment."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import openai
import pytest

from baton.cluster import ClusterSpec, LocalCluster
from baton.protocol import RETRY_AFTER_KEY
from baton.v1 import router_pb2, router_pb2_grpc
from tests.integration.conftest import MODEL, wait_until
from tests.integration.test_metrics import scrape, value
from tests.reference import reference_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BURST = 3
# One request back every 100 s: however slow the machine, a burst is not refilled during a test.
RATE_PER_S = 0.01
LIMIT_NAMED = f"--max-requests-per-connection-per-s={RATE_PER_S:g} after a burst of --connection-request-burst={BURST}"
# A channel of its own TCP connection: channels of one process to one address share a connection otherwise.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_nodes=1, speed=0.0, http_port=0, metrics=True, router_args=(
        "--max-requests-per-connection-per-s", str(RATE_PER_S), "--connection-request-burst", str(BURST)))
    with LocalCluster(spec, tmp_path_factory.mktemp("limited")) as cluster:
        assert cluster.router is not None
        address = cluster.router.address

        def serves() -> bool:  # a connection per try: a try that fails still spends its connection's burst
            with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
                try:
                    list(router_pb2_grpc.RouterStub(channel).Generate(
                        router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=1), timeout=10))
                    return True
                except grpc.RpcError:
                    return False

        wait_until(serves, 30, "the router to serve a request")
        yield cluster


async def test_a_grpc_connection_over_its_burst_is_refused_and_another_is_served(limited: LocalCluster) -> None:
    assert limited.router is not None
    address = limited.router.address
    refused_before = value(scrape(limited.router), "baton_router_rate_limited_total")
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as flooding, \
            grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as calm:
        flood = router_pb2_grpc.RouterStub(flooding)
        for _ in range(BURST):
            await flood.ListModels(router_pb2.ListModelsRequest(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in flood.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="one more", max_tokens=4),
                                          timeout=10):
                pass
        tokens = [t async for chunk in router_pb2_grpc.RouterStub(calm).Generate(
            router_pb2.GenerateRequest(model=MODEL, prompt="calm", max_tokens=4), timeout=10)
            for t in chunk.token_ids]

    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert LIMIT_NAMED in refused.value.details()
    retry_after_ms = int(dict(refused.value.trailing_metadata() or ())[RETRY_AFTER_KEY])
    assert retry_after_ms > 1000 and f"retry after {retry_after_ms} ms" in refused.value.details()
    assert tokens == reference_completion(list(b"calm"), 4)[0]
    assert value(scrape(limited.router), "baton_router_rate_limited_total") >= refused_before + 1


def test_an_http_connection_over_its_burst_gets_429_with_retry_after_and_another_is_served(
        limited: LocalCluster) -> None:
    def client() -> openai.OpenAI:  # each with its own connection pool: one keep-alive connection here
        return openai.OpenAI(base_url=f"http://{limited.http_address}/v1", api_key="unused", max_retries=0,
                             timeout=30)

    with client() as flooding, client() as calm:
        for _ in range(BURST):
            flooding.models.list()
        with pytest.raises(openai.RateLimitError) as refused:
            flooding.completions.create(model=MODEL, prompt="one more", max_tokens=4)
        served = calm.completions.create(model=MODEL, prompt="calm", max_tokens=4, temperature=0)

    assert LIMIT_NAMED in refused.value.message
    assert int(refused.value.response.headers["Retry-After"]) > 1
    expected = reference_completion(list(b"calm"), 4)[0]
    assert served.choices[0].text == bytes(t for t in expected if t < 256).decode(errors="replace")
