"""TLS on every port, from a throwaway CA: clients check the router's certificate (gRPC and the HTTP
API); internal ports (scheduler, node agent) and etcd refuse a client that shows no certificate of the
cluster's CA."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster
from baton.v1 import node_agent_pb2, node_agent_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common import etcd_keys
from services.common.etcd_session import connect
from tests.integration.conftest import MODEL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def encrypted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(num_nodes=1, gpus=("h100",), speed=20.0, tls=True, http_port=0)
    with LocalCluster(spec, tmp_path_factory.mktemp("encrypted")) as started:
        yield started


def trusting_the_ca(cluster: LocalCluster) -> grpc.ChannelCredentials:
    """A client that checks the cluster's certificates but has none of its own."""
    assert cluster.pki is not None
    return grpc.ssl_channel_credentials(Path(cluster.pki.ca).read_bytes())


async def test_a_client_trusting_the_ca_streams_from_the_router_and_a_plaintext_one_is_refused(
        encrypted: LocalCluster) -> None:
    assert encrypted.router is not None
    async with BatonClient(encrypted.router.address, credentials=trusting_the_ca(encrypted)) as client:
        result = await client.complete(MODEL, "over TLS, end to end", max_tokens=8)
    assert len(result.token_ids) == 8  # router -> scheduler -> node agent, each hop mutual TLS

    async with BatonClient(encrypted.router.address, max_failovers=0) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await plaintext.complete(MODEL, "in the clear", max_tokens=8, timeout_s=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_api_serves_https_to_a_client_trusting_the_ca_and_refuses_plain_http(
        encrypted: LocalCluster) -> None:
    assert encrypted.pki is not None and encrypted.http_address
    # ignore_eos: at the HTTP API's default temperature (1) the sim model may end with EOS (1 token in 400).
    body = json.dumps({"model": MODEL, "prompt": "over HTTPS", "max_tokens": 4, "ignore_eos": True}).encode()

    def complete(scheme: str, context: ssl.SSLContext | None = None) -> dict[str, object]:
        request = urllib.request.Request(f"{scheme}://{encrypted.http_address}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return json.load(reply)

    reply = complete("https", ssl.create_default_context(cafile=str(encrypted.pki.ca)))
    assert reply["usage"]["completion_tokens"] == 4  # type: ignore[index]
    # The server answers a plaintext request with a TLS alert and hangs up: no HTTP reply comes back.
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
        complete("http")


@pytest.mark.parametrize("port", ["scheduler", "node agent"])
def test_an_internal_port_refuses_a_client_without_a_certificate(encrypted: LocalCluster, port: str) -> None:
    assert encrypted.scheduler is not None
    address = encrypted.scheduler.address if port == "scheduler" else encrypted.nodes[0].address

    def ask(credentials: grpc.ChannelCredentials | None) -> object:
        with grpc.secure_channel(address, credentials) as channel:
            if port == "scheduler":
                return scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                    scheduler_pb2.GetClusterStateRequest(), timeout=5)
            return node_agent_pb2_grpc.NodeAgentStub(channel).GetLoad(node_agent_pb2.GetLoadRequest(), timeout=5)

    with pytest.raises(grpc.RpcError) as refused:
        ask(trusting_the_ca(encrypted))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ask(encrypted.client_credentials)  # the operator's certificate is let in


@pytest.mark.parametrize("client", ["plaintext", "without a certificate"])
async def test_etcd_refuses_a_client_without_a_certificate_and_the_services_reach_it(
        encrypted: LocalCluster, client: str) -> None:
    refused = connect(encrypted.etcd_endpoint, timeout_s=2,
                      credentials=None if client == "plaintext" else trusting_the_ca(encrypted))
    try:
        with pytest.raises(Exception):  # noqa: B017 - aetcd wraps the refused handshake in its own errors
            await refused.get_prefix(etcd_keys.NODES.encode())
    finally:
        await refused.close()

    async with connect(encrypted.etcd_endpoint, timeout_s=5, credentials=encrypted.client_credentials) as operator:
        registered = await operator.get_prefix(etcd_keys.NODES.encode())
    assert [kv.key.decode() for kv in registered] == [etcd_keys.node_key("node-0")]  # the node got in over TLS
