"""The router's OpenAI-compatible HTTP API against a live cluster, through the official openai client
and curl: the same tokens the gRPC API gives, streamed or whole, and OpenAI-shaped refusals."""

from __future__ import annotations

import codecs
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from baton.cluster import ClusterSpec, LocalCluster
from services.router.chat_template import PLAIN, ChatMessage
from tests.integration.conftest import MODEL, wait_router_serves
from tests.reference import reference_completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def http_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two nodes, the sim engine 20x faster than real time, the first router serving HTTP."""
    spec = ClusterSpec(num_nodes=2, gpus=("h100", "a100"), speed=20.0, http_port=0)
    with LocalCluster(spec, tmp_path_factory.mktemp("http-cluster")) as started:
        wait_router_serves(started)
        yield started


@pytest.fixture
def client(http_cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{http_cluster.http_address}/v1", api_key="unused", max_retries=0,
                       timeout=60) as made:
        yield made


def expected_text(prompt: str, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                  ignore_eos: bool = False) -> str:
    """What an uninterrupted generation of prompt decodes to, as the router decodes a byte-level model."""
    tokens, _ = reference_completion(list(prompt.encode()), max_tokens, temperature, seed, ignore_eos=ignore_eos)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(bytes(t for t in tokens if t < 256))


def test_models_lists_what_the_cluster_serves(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_a_completion_streamed_or_whole_is_the_models_own_output(client: openai.OpenAI) -> None:
    prompt = "The HTTP API returns what the engine generates: "
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
    expected = expected_text(prompt, 40, ignore_eos=True)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 40)

    events = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == expected
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 40
    assert events[-2].choices[0].finish_reason == "length"


def test_a_seeded_chat_streamed_or_whole_renders_the_plain_template(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    prompt = PLAIN.render([ChatMessage(m["role"], m["content"]) for m in messages])
    expected = expected_text(prompt, 30, temperature=0.8, seed=11, ignore_eos=True)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,  # type: ignore[arg-type]
                                           temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt.encode())

    events = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,  # type: ignore[arg-type]
                                                 temperature=0.8, seed=11, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == expected
    assert events[-1].choices[0].finish_reason == "length"


def test_a_repeated_prompt_reports_its_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "a prefix long enough to fill several KV blocks of sixteen tokens each. " * 3
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    events = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    usage = events[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 16 * (len(prompt) // 16 - 1)


def test_baton_fields_travel_in_extra_body_and_headers(client: openai.OpenAI) -> None:
    by_body = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"request_id": "from-body"})
    assert by_body.id == "cmpl-from-body"
    by_header = client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                          extra_headers={"X-Baton-Request-Id": "from-header"})
    assert by_header.id == "cmpl-from-header"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", extra_headers={"X-Baton-Total-Steps": "2",
                                                                         "X-Baton-Step": "3"})
    assert caught.value.body["param"] == "X-Baton-Step"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:  # below the floor: refused before its timer starts
        client.completions.create(model=MODEL, prompt="x", max_tokens=4000, extra_body={"deadline_ms": 1,
                                                                                        "ignore_eos": True})
    assert caught.value.body["param"] == "deadline_ms"  # type: ignore[index]
    assert "deadline_ms=1: below the floor" in caught.value.message


def test_refusals_are_openai_errors_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="x")
    assert not_found.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=10 ** 6, stream=True)
    assert too_long.value.body["param"] == "max_completion_tokens"  # type: ignore[index]
    assert "max_completion_tokens=1000000" in too_long.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model=MODEL, prompt="x", extra_body={"priorty": 3})
    assert unknown.value.body["param"] == "priorty"  # type: ignore[index]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed here")
def test_curl_streams_server_sent_events_and_gets_error_codes(http_cluster: LocalCluster, tmp_path: Path) -> None:
    url = f"http://{http_cluster.http_address}/v1/completions"
    body = json.dumps({"model": MODEL, "prompt": "curl says hi", "max_tokens": 12, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    streamed = subprocess.run(["curl", "-sSN", "--max-time", "30", "-H", "Content-Type: application/json",
                               "-d", body, url], capture_output=True, text=True, timeout=60, check=True)
    lines = [line.removeprefix("data: ") for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == expected_text("curl says hi", 12, ignore_eos=True)

    refused = subprocess.run(["curl", "-sS", "--max-time", "30", "-o", str(tmp_path / "body"), "-w", "%{http_code}",
                              "-d", json.dumps({"model": MODEL, "prompt": ""}), url],
                             capture_output=True, text=True, timeout=60, check=True)
    assert refused.stdout == "400"
    assert json.loads((tmp_path / "body").read_text())["error"]["param"] == "prompt"


def test_a_ttft_budget_no_idle_node_could_meet_is_a_400_naming_it_not_a_429(client: openai.OpenAI) -> None:
    """A 429 asks the client to come back; the openai client does, twice, for a budget no wait could meet. (Under 10
    ms the router refuses it itself, naming the floor; the leader refuses larger ones under a slow engine's floor.)"""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="a long prompt that cannot be read in time. " * 150,
                                  max_tokens=8, stream=True, extra_headers={"X-Baton-Ttft-Budget-Ms": "1"})
    assert caught.value.body["param"] == "X-Baton-Ttft-Budget-Ms"  # type: ignore[index]
    assert "X-Baton-Ttft-Budget-Ms=1: below the floor of 10 ms" in caught.value.message
    assert "Retry-After" not in caught.value.response.headers
