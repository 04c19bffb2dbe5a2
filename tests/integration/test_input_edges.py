"""Input edges end to end: each gets a status of Baton's own naming the field, and the router serves on."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.protocol import ORIGIN_KEY, is_transport_failure
from baton.v1 import router_pb2
from tests.integration.conftest import MODEL, wait_router_serves
from tests.reference import reference_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(ClusterSpec(num_nodes=1, speed=0.0), tmp_path_factory.mktemp("cluster")) as cluster:
        wait_router_serves(cluster)  # else the unknown model could meet an empty catalogue (UNAVAILABLE)
        yield cluster


async def refusal(cluster: LocalCluster, encoded: bytes) -> grpc.aio.AioRpcError:
    """The status the router answers these request bytes with."""
    assert cluster.router is not None
    async with grpc.aio.insecure_channel(cluster.router.address) as channel:
        generate = channel.unary_stream("/baton.v1.Router/Generate",
                                        response_deserializer=router_pb2.GenerateChunk.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in generate(encoded, timeout=30):
                pass
    return raised.value


def encode(**fields: object) -> bytes:
    request = router_pb2.GenerateRequest(**({"model": MODEL, "prompt": "hi", "max_tokens": 4} | fields))
    return request.SerializeToString()


EDGES = [
    ("prompt not UTF-8", encode(prompt="caf_").replace(b"caf_", b"caf\xe9"), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt=b'caf\\xe9': not valid UTF-8"),
    ("stop string not UTF-8", encode(stop=["ok", "ko"]).replace(b"ko", b"k\xff"), grpc.StatusCode.INVALID_ARGUMENT,
     "stop[1]=b'k\\xff': not valid UTF-8"),
    ("100 KB model name", encode(model="m" * 100_000), grpc.StatusCode.NOT_FOUND, "not served by this cluster"),
    ("1 MB tenant", encode(tenant="t" * 1_000_000), grpc.StatusCode.INVALID_ARGUMENT, "longer than 128"),
    ("stop strings over 4 KB", encode(stop=["s" * 1024] * 5), grpc.StatusCode.INVALID_ARGUMENT,
     "at most 4096 bytes together"),
    ("3.9 MB prompt", encode(prompt="p" * 3_900_000), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt='3900000 bytes': longer than 1048576 bytes"),
]


@pytest.mark.parametrize(("encoded", "code", "named"), [e[1:] for e in EDGES], ids=[e[0] for e in EDGES])
async def test_an_input_edge_gets_a_clear_status_of_batons_own(
        one_node: LocalCluster, encoded: bytes, code: grpc.StatusCode, named: str) -> None:
    error = await refusal(one_node, encoded)
    assert (error.code(), named in error.details()) == (code, True), error.details()
    assert len(error.details()) < 2100
    # Baton's own status: the client SDK does not take it for a dead router and fail over.
    assert (ORIGIN_KEY, "baton") in tuple(error.trailing_metadata() or ())
    assert not is_transport_failure(error)


async def test_the_router_serves_on_after_the_edges(one_node: LocalCluster) -> None:
    for _, encoded, _, _ in EDGES:
        await refusal(one_node, encoded)
    assert one_node.router is not None
    async with BatonClient(one_node.router.address) as client:
        completion = await client.complete(MODEL, "still here", max_tokens=8, timeout_s=30)
    assert completion.token_ids == reference_completion(list(b"still here"), 8)[0]
