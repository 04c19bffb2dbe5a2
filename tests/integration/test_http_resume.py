"""HTTP streams and the nodes under them: a node killed mid-stream is invisible to an HTTP client
(the router resumes the generation elsewhere and the openai client's stream reads on, identical to
an uninterrupted run), and a client that hangs up frees its node."""

from __future__ import annotations

import http.client
import json
import signal
from collections.abc import Iterator

import grpc
import openai
import pytest

from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess
from baton.v1 import common_pb2, node_agent_pb2, node_agent_pb2_grpc
from services.router.chat_template import PLAIN, ChatMessage
from tests.integration.conftest import MODEL, wait_router_serves, wait_until
from tests.integration.test_http_api import expected_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NUM_TOKENS = 300


def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three h100 nodes in real time with 2 s leases; the router serves HTTP."""
    spec = ClusterSpec(num_nodes=3, speed=1.0, lease_ttl_s=2, http_port=0)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as started:
        wait_router_serves(started)
        yield started


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of the test's own: it kills a node."""
    yield from start(tmp_path_factory)


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster for the tests that leave every node as they found it."""
    yield from start(tmp_path_factory)


def load_of(node: ManagedProcess) -> common_pb2.NodeLoad:
    with grpc.insecure_channel(node.address) as channel:
        return node_agent_pb2_grpc.NodeAgentStub(channel).GetLoad(node_agent_pb2.GetLoadRequest(), timeout=5)


def serving_node(cluster: LocalCluster) -> ManagedProcess:
    """The one node running a request now."""
    running = [node for node in cluster.nodes if load_of(node).num_running]
    assert len(running) == 1, [n.name for n in running]
    return running[0]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_sigkill_of_the_serving_node_mid_stream_leaves_the_stream_identical(cluster: LocalCluster,
                                                                             kind: str) -> None:
    prompt = "a generation that outlives its node. " * 2
    sampling = {"max_tokens": NUM_TOKENS, "temperature": 0.9, "seed": 1234}
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        if kind == "completions":
            stream = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                               extra_body={"ignore_eos": True}, **sampling)  # type: ignore[arg-type]
        else:
            stream = client.chat.completions.create(  # type: ignore[call-overload]
                model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True,
                extra_body={"ignore_eos": True}, **sampling)
        texts: list[str] = []
        victim: ManagedProcess | None = None
        last = None
        for event in stream:
            last = event
            choice = event.choices[0]
            texts.append((choice.text if kind == "completions" else choice.delta.content) or "")
            if victim is None and len("".join(texts)) >= 20:
                victim = serving_node(cluster)
                victim.signal(signal.SIGKILL)
    assert victim is not None and not victim.is_running()
    if kind == "chat":
        prompt = PLAIN.render([ChatMessage("user", prompt)])
    assert "".join(texts) == expected_text(prompt, NUM_TOKENS, temperature=0.9, seed=1234, ignore_eos=True)
    assert last is not None and last.choices[0].finish_reason == "length"
    baton = last.model_extra["baton"]  # type: ignore[index]
    assert baton["num_migrations"] == 1 and baton["node_ids"][0] == victim.name and len(baton["node_ids"]) == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_frees_its_node(shared_cluster: LocalCluster, stream: bool) -> None:
    cluster = shared_cluster
    baseline = {node.name: load_of(node).kv_blocks_used for node in cluster.nodes}
    host, _, port = cluster.http_address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": "hang up on me " * 40, "max_tokens": 3000, "ignore_eos": True,
            "stream": stream}))
        if stream:
            response = connection.getresponse()
            assert response.status == 200 and response.readline().startswith(b"data: ")
        else:  # nothing comes back before the end: wait until a node runs it
            wait_until(lambda: any(load_of(node).num_running for node in cluster.nodes), 10, "the request to run")
        serving = serving_node(cluster)
        assert load_of(serving).kv_blocks_used > baseline[serving.name]
    finally:
        connection.close()
    # 3000 tokens in real time take far longer than this wait: only the hang-up can end the request.
    wait_until(lambda: load_of(serving).num_running == 0 and load_of(serving).kv_blocks_used == baseline[serving.name],
               10, "the node to drop the abandoned request and free its KV blocks")
