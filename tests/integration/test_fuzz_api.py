"""Property-based fuzzing of the public APIs, gRPC Generate and the HTTP API, against one live router:
whatever a client sends, the router neither crashes nor hangs nor fails on its own (no INTERNAL,
UNKNOWN or 5xx), and every refusal names the field it refuses. Bounded: a fixed number of examples."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from baton.cluster import ClusterSpec, LocalCluster
from baton.protocol import RETRY_AFTER_KEY
from baton.v1 import router_pb2, router_pb2_grpc
from tests.integration.conftest import MODEL, wait_router_serves

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Every call ends within this (no hang): a valid request here generates at most a few tokens.
CALL_TIMEOUT_S = 20.0

INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
EDGE_INTS = st.sampled_from([-(1 << 31), -1, 0, 1, 2, 3, 7, 8191, 8192, 8193, (1 << 31) - 1]) | INT32
FLOATS = st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.0])
SHORT_TEXT = st.text(max_size=12)
IDS = st.text(max_size=140)
TOKEN_IDS = st.lists(st.integers(-3, 300) | st.sampled_from([(1 << 31) - 1, -(1 << 31)]), max_size=12)
MODELS = st.sampled_from([MODEL, "", "nope"]) | SHORT_TEXT


def mostly(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """valid four times in five, else edge: every field is usually servable, so that a request gets
    past the first check and its other fields are exercised too."""
    return st.integers(0, 4).flatmap(lambda roll: edge if roll == 0 else valid)


# A refusal's message begins with the field it refuses, "field=value: reason" (field may be indexed).
FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\-]*)(\[\d+\])*(\.[\w]+)*=")


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One node without timing, a router that generates 8 tokens by default and serves HTTP."""
    spec = ClusterSpec(num_nodes=1, speed=0.0, http_port=0, router_args=("--default-max-tokens=8",))
    with LocalCluster(spec, tmp_path_factory.mktemp("fuzz-cluster")) as started:
        wait_router_serves(started)
        yield started


@st.composite
def generate_requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(model=draw(mostly(st.just(MODEL), MODELS)))
    match draw(mostly(st.sampled_from(["text", "tokens"]), st.just("none"))):
        case "text":
            request.prompt = draw(mostly(st.text(min_size=1, max_size=40), st.text(max_size=400)))
        case "tokens":
            request.prompt_token_ids.ids.extend(draw(mostly(st.lists(st.integers(0, 255), min_size=1, max_size=12),
                                                            TOKEN_IDS)))
    if draw(st.booleans()):
        request.max_tokens = draw(mostly(st.integers(1, 8), EDGE_INTS))
    request.temperature = draw(mostly(st.floats(0, 2), FLOATS))
    request.top_p = draw(mostly(st.floats(0, 1, exclude_min=True, width=32), FLOATS))
    if draw(st.booleans()):
        request.seed = draw(st.integers(0, (1 << 64) - 1))
    request.stop.extend(draw(mostly(st.lists(st.text(min_size=1, max_size=4), max_size=3),
                                    st.lists(SHORT_TEXT, max_size=20))))
    for name in ("request_id", "tenant", "workflow_id"):
        setattr(request, name, draw(mostly(st.text(max_size=20), IDS)))
    request.priority = draw(mostly(st.integers(0, 10), EDGE_INTS))
    for name in ("ttft_budget_ms", "tpot_budget_ms"):
        setattr(request, name, draw(mostly(st.sampled_from([0, 100, 5000]), EDGE_INTS)))
    request.deadline_ms = draw(mostly(st.sampled_from([0, 10_000]), EDGE_INTS))
    request.total_steps = draw(mostly(st.sampled_from([0, 3]), EDGE_INTS))
    request.step = draw(mostly(st.integers(1, 3), EDGE_INTS)) if request.total_steps else draw(mostly(
        st.just(0), EDGE_INTS))
    request.ignore_eos = draw(st.booleans())
    request.resume.token_ids.extend(draw(mostly(st.just([]), TOKEN_IDS)))
    request.alternative_models.extend(draw(mostly(st.just([]), st.lists(MODELS, max_size=3))))
    return request


def assert_names_a_field(message: str, fields: set[str]) -> None:
    match = FIELD_PREFIX.match(message)
    assert match is not None, f"refusal names no field: {message!r}"
    assert match.group(1).split(".")[0] in fields, f"refusal names an unknown field: {message!r}"


GRPC_FIELDS = {f.name for f in router_pb2.GenerateRequest.DESCRIPTOR.fields}


# Found by this test in CI: a workflow's step saying total_steps=2147483647 had the leader build the set of its
# 2,147,483,647 step numbers, and the leader answered no one again.
HUGE_WORKFLOW = router_pb2.GenerateRequest(model=MODEL, prompt_token_ids={"ids": [30, 143, 0, 0]},
                                           workflow_id="\u00a2", step=1, total_steps=2147483647)


@FUZZ
@given(request=generate_requests())
@example(request=HUGE_WORKFLOW)
def test_grpc_generate_answers_any_request_with_tokens_or_a_refusal_naming_the_field(
        fuzz_cluster: LocalCluster, request: router_pb2.GenerateRequest) -> None:
    assert fuzz_cluster.router is not None
    with grpc.insecure_channel(fuzz_cluster.router.address) as channel:
        try:
            chunks = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CALL_TIMEOUT_S))
        except grpc.RpcError as error:
            code, message = error.code(), error.details() or ""  # type: ignore[attr-defined]
            event(f"{code.name} {message.split('=')[0]}")
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED), (code, message)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert RETRY_AFTER_KEY in dict(error.trailing_metadata() or ()), message  # type: ignore[attr-defined]
            else:
                assert_names_a_field(message, GRPC_FIELDS)
            return
    event("OK")
    assert chunks and chunks[-1].finish_reason, "the stream ended without a finish"


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | JSON_SCALARS},
    optional={"content": st.text(max_size=30) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10) | JSON_SCALARS})),
              "name": SHORT_TEXT | JSON_SCALARS}), max_size=4)
# Each OpenAI or Baton field with the values a client may plausibly send, and any JSON at all.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": mostly(st.just(MODEL), MODELS),
    "prompt": st.text(max_size=40) | TOKEN_IDS | st.lists(st.text(max_size=10) | TOKEN_IDS, max_size=2),
    "messages": MESSAGES,
    "max_tokens": mostly(st.integers(1, 8), EDGE_INTS),
    "max_completion_tokens": mostly(st.integers(1, 8), EDGE_INTS),
    "temperature": FLOATS,
    "top_p": FLOATS,
    "seed": st.integers(-(1 << 65), 1 << 65),
    "stop": SHORT_TEXT | st.lists(SHORT_TEXT, max_size=20),
    "n": st.integers(-1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON_SCALARS}),
    "user": SHORT_TEXT,
    "tenant": IDS,
    "request_id": IDS,
    "priority": EDGE_INTS,
    "deadline_ms": mostly(st.sampled_from([0, 10_000]), EDGE_INTS),
    "ttft_budget_ms": EDGE_INTS,
    "step": mostly(st.just(0), EDGE_INTS),
    "total_steps": mostly(st.just(0), EDGE_INTS),
    "alternative_models": st.lists(MODELS, max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.sampled_from([None, False, 0, 2]),
    "presence_penalty": st.sampled_from([None, 0, 0.5]),
}


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.binary(max_size=40))
    body: dict[str, Any] = {"model": MODEL, "stream": draw(st.booleans())}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=6, unique=True)):
        body[name] = draw(mostly(PLAUSIBLE[name], JSON_VALUES))
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    return path, json.dumps(body).encode()


@FUZZ
@given(request=http_bodies())
def test_the_http_api_answers_any_body_with_a_completion_or_an_error_naming_the_field(
        fuzz_cluster: LocalCluster, request: tuple[str, bytes]) -> None:
    path, body = request
    host, _, port = fuzz_cluster.http_address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status, content_type, text = response.status, response.getheader("Content-Type", ""), response.read().decode()
        retry_after = response.getheader("Retry-After")
    finally:
        connection.close()
    event(f"{status} {json.loads(text)['error']['param'] if 400 <= status < 500 else content_type}")
    assert status < 500, text
    if status >= 400:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"]
        if status == 429:
            assert retry_after is not None
        else:
            assert error["param"] and error["message"].startswith(f"{error['param']}="), error
        return
    assert status == 200
    if content_type.startswith("text/event-stream"):
        # SSE ends lines at CR or LF only: str.splitlines() would also split a JSON string at the
        # U+2028 or U+0085 a drawn request_id may hold (the id is echoed raw in every event).
        events = [line.removeprefix("data: ") for line in re.split(r"\r\n|\r|\n", text)
                  if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text
        for sse in map(json.loads, events[:-1]):
            if "error" in sse:  # a failure after the first token: only its own deadline may end it
                assert sse["error"]["param"] == "deadline_ms", sse
    else:
        assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
