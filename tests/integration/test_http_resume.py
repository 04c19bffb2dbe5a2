"""A node killed mid-stream is invisible to an HTTP client: the router resumes the generation
elsewhere and the openai client's stream reads on, identical to an uninterrupted run."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import grpc
import openai
import pytest

from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess
from baton.v1 import node_agent_pb2, node_agent_pb2_grpc
from services.router.chat_template import PLAIN, ChatMessage
from tests.integration.conftest import MODEL, wait_router_serves
from tests.integration.test_http_api import expected_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NUM_TOKENS = 300


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three h100 nodes in real time with 2 s leases; the router serves HTTP."""
    spec = ClusterSpec(num_nodes=3, speed=1.0, lease_ttl_s=2, http_port=0)
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as started:
        wait_router_serves(started)
        yield started


def serving_node(cluster: LocalCluster) -> ManagedProcess:
    """The one node running a request now."""
    running = []
    for node in cluster.nodes:
        with grpc.insecure_channel(node.address) as channel:
            load = node_agent_pb2_grpc.NodeAgentStub(channel).GetLoad(node_agent_pb2.GetLoadRequest(), timeout=5)
        if load.num_running:
            running.append(node)
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
