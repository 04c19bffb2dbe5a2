"""The compose deployment under TLS (docker-compose.tls.yml, its throwaway CA made by the `certs`
service): clients trusting the CA reach the routers over gRPC and HTTPS, a plaintext client is
refused there, and the internal ports (scheduler, node agent) and etcd refuse a client that shows no
certificate, from inside the cluster's network, while the operator's certificate is let in.

Runs with `make test-compose` (BATON_COMPOSE_TEST=1), after the plaintext deployment's test, on the
same images, under its own project name.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from baton.client import BatonClient
from tests.compose.deployment import Deployment, Images, brought_up
from tests.integration.conftest import MODEL

pytestmark = [
    pytest.mark.skipif(os.environ.get("BATON_COMPOSE_TEST") != "1",
                       reason="the docker compose test runs with `make test-compose` (BATON_COMPOSE_TEST=1)"),
    pytest.mark.timeout(600),
]

PROJECT = "batontesttls"

# Run inside router-1's container (Baton's image, on the cluster's network): ask a service's gRPC
# health, or read etcd, over TLS trusting the cluster's CA, once without a client certificate and once
# with the operator's (/tls/client.pem); print what each got.
PROBE = """
import asyncio, json, sys
from pathlib import Path
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services.common.etcd_session import connect

kind, address = sys.argv[1], sys.argv[2]

def credentials(with_cert):
    read = lambda name: Path('/tls', name).read_bytes()
    return grpc.ssl_channel_credentials(read('ca.pem'), read('client-key.pem') if with_cert else None,
                                        read('client.pem') if with_cert else None)

async def etcd_keys(with_cert):
    async with connect(address, timeout_s=5, credentials=credentials(with_cert)) as etcd:
        return [kv.key.decode() for kv in await etcd.get_prefix(b'/baton/nodes/')]

def ask(with_cert):
    try:
        if kind == 'etcd':
            return asyncio.run(etcd_keys(with_cert))
        with grpc.secure_channel(address, credentials(with_cert)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        return error.code().name
    except Exception as error:
        return 'refused: ' + type(error).__name__

print(json.dumps({'without a certificate': ask(False), 'with the operator certificate': ask(True)}))
"""


@dataclass
class TlsDeployment:
    deployment: Deployment
    ca: Path  # the CA a client checks the routers by, copied out of the cluster's `tls` volume


@pytest.fixture(scope="module")
def tls(compose_images: Images, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsDeployment]:
    with brought_up(compose_images, PROJECT, ["docker-compose.yml", "docker-compose.tls.yml"],
                    one_shot=("certs",)) as started:
        ca = tmp_path_factory.mktemp("compose-tls") / "ca.pem"
        ca.write_text(started("exec", "-T", "router-1", "cat", "/tls/ca.pem").stdout)
        yield TlsDeployment(started, ca)


async def test_generate_over_grpc_with_the_ca_and_a_plaintext_client_is_refused(tls: TlsDeployment) -> None:
    trusting = grpc.ssl_channel_credentials(tls.ca.read_bytes())
    for router in tls.deployment.routers:
        async with BatonClient(router, credentials=trusting) as client:
            # The prompt names the router's (random) port: without ignore_eos some ports sample the end of text.
            result = await client.complete(MODEL, f"over TLS through {router}", max_tokens=8, ignore_eos=True,
                                           timeout_s=60)
        assert len(result.token_ids) == 8  # router -> scheduler -> node agent, each hop mutual TLS

    async with BatonClient(tls.deployment.routers[0], max_failovers=0) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await plaintext.complete(MODEL, "in the clear", max_tokens=8, timeout_s=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_api_answers_over_https_with_the_ca_and_not_over_plain_http(tls: TlsDeployment) -> None:
    # ignore_eos: without it the sim engine may sample the end of text at once (0 tokens), as the gRPC test notes.
    body = json.dumps({"model": MODEL, "prompt": "over HTTPS", "max_tokens": 4, "ignore_eos": True}).encode()

    def complete(url: str, context: ssl.SSLContext | None = None) -> dict[str, object]:
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            return json.load(reply)

    address = tls.deployment.http[0]
    reply = complete(f"https://{address}", ssl.create_default_context(cafile=str(tls.ca)))
    assert reply["usage"]["completion_tokens"] == 4  # type: ignore[index]
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
        complete(f"http://{address}")  # a TLS port answers plain HTTP with no HTTP reply


@pytest.mark.parametrize(("kind", "address"), [("scheduler", "scheduler-1:50200"), ("node agent", "node-h100:50400"),
                                               ("etcd", "etcd-2:2379")])
def test_an_internal_port_refuses_a_client_without_a_certificate(tls: TlsDeployment, kind: str,
                                                                  address: str) -> None:
    probe = kind if kind == "etcd" else "grpc"
    printed = tls.deployment("exec", "-T", "router-1", "python", "-c", PROBE, probe, address).stdout
    answers = json.loads(next(line for line in printed.splitlines() if line.startswith("{")))  # gRPC logs too
    if kind == "etcd":
        assert str(answers["without a certificate"]).startswith("refused"), answers  # not the node keys
        registered = answers["with the operator certificate"]
        assert isinstance(registered, list) and len(registered) == 4, answers  # the 4 nodes got in over TLS
    else:
        assert answers == {"without a certificate": "UNAVAILABLE", "with the operator certificate": "SERVING"}
