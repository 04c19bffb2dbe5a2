"""The HTTP API as the official openai client sees it, in front of a fake router core: how refusals
before and during a stream arrive, and what a malformed request gets."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import re
import logging
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from unittest import mock

import aiohttp
import grpc
import openai
import pytest
from aiohttp import StreamReader, web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton.cluster import free_port
from baton.v1 import common_pb2, router_pb2
from services.common.auth import TenantRecord
from services.common.errors import (Aborted, AlreadyExists, BatonError, DeadlineExceeded, InvalidArgument,
                                    ResourceExhausted, Unauthenticated, Unavailable)
from services.router import openai_schema as schema
from services.router.http_api import RUNNER_OPTIONS, HttpApi
from services.router.validation import InputLimits, ModelEntry, validate

pytestmark = pytest.mark.timeout(30)

MODEL = ModelEntry(name="m", max_context_tokens=64, tokenizer="byte", vocab_size=257, num_warm_nodes=1)


class _FakeRouter:
    """Answers every request with `texts`, then `failure` (if any) or a finish."""

    def __init__(self, texts: list[str], failure: BatonError | None = None,
                 unread: BatonError | None = None, served: tuple[ModelEntry, ...] = (MODEL,),
                 key_refused: BatonError | None = None, validating: bool = False,
                 gone: tuple[ModelEntry, ...] = (), key_record: TenantRecord | None = None) -> None:
        self.texts = texts
        self.key_record = key_record  # the tenant every key names (None: no --auth)
        self.gone = {m.name: m for m in gone}  # served lately, by no node now
        self.validating = validating  # validate each request as the router does
        self.key_refused = key_refused
        self.served = {m.name: m for m in served}
        self.failure = failure
        self.unread = unread  # what waiting for the nodes' registrations ends in (None: they are read)
        self.requests: list[router_pb2.GenerateRequest] = []

    @property
    def models(self) -> Mapping[str, ModelEntry]:
        return self.served

    def gone_model(self, name: str) -> ModelEntry | None:
        return self.gone.get(name)

    def served_models(self) -> list[router_pb2.ServedModel]:
        return [router_pb2.ServedModel(name=m.name, max_context_tokens=m.max_context_tokens, tokenizer=m.tokenizer,
                                       num_warm_nodes=m.num_warm_nodes) for m in self.served.values()]

    async def authorize(self, authorization: str | None) -> TenantRecord | None:
        if self.key_refused is not None:
            raise self.key_refused
        return self.key_record

    def has_read_nodes(self) -> bool:
        return self.unread is None

    async def nodes_read(self) -> None:
        if self.unread is not None:
            raise self.unread

    async def generate(self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                       authorization: str | None = None) -> AsyncIterator[router_pb2.GenerateChunk]:
        self.requests.append(request)
        if self.validating:
            validate(request, dict(self.served), 16, random.Random(0), InputLimits(max_prompt_bytes=1024),
                     self.gone_model)
        for i, text in enumerate(self.texts):
            yield router_pb2.GenerateChunk(request_id="r", text=text, index=i, node_id="n", model="m")
        if self.failure is not None:
            raise self.failure
        yield router_pb2.GenerateChunk(request_id="r", index=len(self.texts), node_id="n", model="m",
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                       usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=len(self.texts)))


async def _client(router: _FakeRouter, max_retries: int = 0) -> tuple[TestClient, openai.AsyncOpenAI]:
    http = TestClient(TestServer(HttpApi(router, "127.0.0.1:0", InputLimits(max_prompt_bytes=1024)).app))
    await http.start_server()
    return http, openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="k", max_retries=max_retries)


async def test_a_refusal_to_retry_later_is_a_429_the_client_sees_with_its_retry_after() -> None:
    http, client = await _client(_FakeRouter([], ResourceExhausted("tenant 'a' over its share", 2500)))
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model="m", prompt="x", stream=True)
        assert caught.value.response.headers["Retry-After"] == "3"
        assert caught.value.response.headers["retry-after-ms"] == "2500"
        assert caught.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    finally:
        await client.close()
        await http.close()


async def test_a_503_says_when_to_come_back_so_the_clients_retries_outlast_a_failover() -> None:
    """A 503 said nothing of when to retry, so the openai client's two retries came 0.5 and 1 s after it, both within
    1.3 s of a refusal whose cause (a failover, a node's start) lasts seconds (helper-166)."""
    http, client = await _client(_FakeRouter([], Unavailable("no live node serves model 'm'")))
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.completions.create(model="m", prompt="x")
        headers = caught.value.response.headers
        assert (headers["Retry-After"], headers["retry-after-ms"], headers["x-should-retry"]) == ("2", "2000", "true")
    finally:
        await client.close()
        await http.close()


async def test_a_router_that_has_not_read_the_nodes_is_a_503_not_a_404_for_the_model() -> None:
    """Before its nodes were read from etcd the router knew no model, and a served one was a 404, which the openai
    client does not retry (its models listing was empty)."""
    unread = Unavailable("this router has not read the cluster's nodes from etcd (is etcd reachable?) within 30.0 s")
    router = _FakeRouter(["a"], unread=unread)
    http, client = await _client(router)
    try:
        for call in (client.completions.create(model="m", prompt="x"), client.models.list(),
                     client.models.retrieve("m")):
            with pytest.raises(openai.InternalServerError) as caught:
                await call
            assert caught.value.status_code == 503 and "has not read the cluster's nodes" in caught.value.message
        assert not router.requests
    finally:
        await client.close()
        await http.close()


async def test_a_model_while_no_node_is_registered_is_a_503_to_retry_and_an_unknown_one_a_404() -> None:
    """A router whose first listing of the nodes was empty (none registered yet) answered a model the cluster is about
    to serve 404, "not served by this cluster (served: none)", which the openai client does not retry."""
    for served, status in (((), 503), ((MODEL,), 404)):
        router = _FakeRouter(["a"], served=served, validating=True)
        http, client = await _client(router)
        try:
            # (Token ids: the HTTP API reads the model's context window for them, before the router's validation.)
            for call in (client.completions.create(model="gone", prompt="x"),
                         client.completions.create(model="gone", prompt=[1, 2]), client.models.retrieve("gone")):
                with pytest.raises(openai.APIStatusError) as caught:
                    await call
                assert caught.value.status_code == status, caught.value.message
                assert "model='gone': " in caught.value.message
            # Bad fields are a 400 whether or not any model is served: a retry could never serve them (helper-147).
            for prompt in ("x", [1, 2]):
                with pytest.raises(openai.BadRequestError, match="temperature"):
                    await client.completions.create(model="m", prompt=prompt, temperature=-1)
            with pytest.raises(openai.BadRequestError, match="tenant"):
                await client.completions.create(model="m", prompt="x", extra_body={"tenant": "a\x1b[2J"})
            # A chat is not judged by the plain template's rendering while no model's own is known (helper-148).
            chat = client.chat.completions.create(model="gone", messages=[{"role": "user", "content": "x" * 1000,
                                                                            "name": "n" * 40}])
            with pytest.raises(openai.APIStatusError) as caught:
                await chat
            assert caught.value.status_code == status and "model='gone'" in caught.value.message
        finally:
            await client.close()
            await http.close()


async def test_a_model_whose_nodes_are_all_gone_is_a_503_to_retry_or_served_by_an_alternative() -> None:
    """A model served lately whose every node went (died, drained, restarting) was a 404, "not served by this
    cluster", which no client retries, and a request that accepted an alternative served now was refused too."""
    lost = ModelEntry("lost", 4096, "byte", 257, 0)
    router = _FakeRouter(["a"], validating=True, gone=(lost,))
    http, client = await _client(router)
    try:
        for call in (client.completions.create(model="lost", prompt="x"),
                     client.completions.create(model="lost", prompt=[1, 2]),
                     client.chat.completions.create(model="lost", messages=[{"role": "user", "content": "x"}]),
                     client.models.retrieve("lost")):
            with pytest.raises(openai.APIStatusError) as caught:
                await call
            assert caught.value.status_code == 503, caught.value.message
            assert "model='lost': served by this cluster lately, by no node now" in caught.value.message
        # Still a 404 for a model never served, and a 400 for bad fields (a retry would never serve them).
        with pytest.raises(openai.NotFoundError, match="model='typo'"):
            await client.completions.create(model="typo", prompt="x")
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.completions.create(model="lost", prompt="x", temperature=-1)
        # Accepting the served model instead, it is served.
        served = await client.completions.create(model="lost", prompt="x",
                                                 extra_body={"alternative_models": ["m"]})
        assert served.choices[0].text == "a"
        assert list(router.requests[-1].alternative_models) == ["m"]
    finally:
        await client.close()
        await http.close()


async def test_bad_fields_are_refused_at_once_by_a_router_that_has_not_read_the_nodes() -> None:
    """Until its nodes were read, a request with bad fields waited with the rest (--leader-wait-s) and got the 503
    that says to retry, as if it were fine. Its own fields are checked first; the model's context, which only the
    nodes tell, is not."""
    unread = Unavailable("this router has not read the cluster's nodes from etcd (is etcd reachable?) within 30.0 s")
    router = _FakeRouter(["a"], unread=unread)
    http, client = await _client(router)
    try:
        for call, field in ((client.completions.create(model="m", prompt="x", temperature=-1), "temperature"),
                            (client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            max_tokens=0), "max_tokens"),
                            (client.completions.create(model="m", prompt="x", extra_body={"deadline_ms": 5}),
                             "deadline_ms"),
                            (client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            extra_body={"request_id": "a\x1b[2J"}), "request_id")):
            with pytest.raises(openai.BadRequestError) as caught:
                await call
            assert caught.value.status_code == 400 and caught.value.param == field, caught.value.message
        # Fine fields wait, then get the 503: past the context (token ids) or, for a chat, the prompt size as the
        # plain template renders it (the model's own may render it shorter, helper-145). The size is judged after.
        for call in (client.completions.create(model="m", prompt=[1] * 100),
                     client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 1000,
                                                                          "name": "n" * 40}])):
            with pytest.raises(openai.InternalServerError) as waited:
                await call
            assert waited.value.status_code == 503
        assert not router.requests
    finally:
        await client.close()
        await http.close()
    # With --auth, the key comes first, as it does once the nodes are read; and an unknown model's 404, which names
    # the served ones, is for callers with a key (a token-id prompt's context window was looked up first, helper-148).
    for unread_or_not in (unread, None):
        router = _FakeRouter(["a"], unread=unread_or_not, key_refused=Unauthenticated("no valid key"))
        http, client = await _client(router)
        try:
            for call in (client.completions.create(model="m", prompt="x", temperature=-1),
                         client.completions.create(model="secret?", prompt=[1, 2])):
                with pytest.raises(openai.AuthenticationError):
                    await call
            # Nor is the body read or parsed for a caller without a key (helper-150: "not valid JSON", a 400).
            answer = await http.post("/v1/completions", data=b"garbage")
            assert answer.status == 401, await answer.text()
        finally:
            await client.close()
            await http.close()


async def test_a_priority_above_the_tenants_is_refused_403_by_a_router_that_serves_no_model_yet() -> None:
    """The router's generate checks it, which a request waiting for the nodes never reached: it was answered 503, to
    retry, which the openai client did (helper-190)."""
    unread = Unavailable("this router has not read the cluster's nodes from etcd (is etcd reachable?) within 30.0 s")
    router = _FakeRouter(["a"], unread=unread, key_record=TenantRecord("acme"))
    http, client = await _client(router)
    try:
        with pytest.raises(openai.PermissionDeniedError, match="priority=5: above the highest that tenant 'acme'"):
            await client.completions.create(model="m", prompt="x", extra_body={"priority": 5})
        with pytest.raises(openai.InternalServerError) as waited:  # within it: the wait, then the 503
            await client.completions.create(model="m", prompt="x", extra_body={"priority": 0})
        assert waited.value.status_code == 503
    finally:
        await client.close()
        await http.close()


def _failure(code: grpc.StatusCode, message: str) -> BatonError:
    failure = BatonError(message)
    failure.code = code
    return failure


@pytest.mark.parametrize(("failure", "num_sent"), [
    (AlreadyExists("request_id='r': already running"), 1),
    (Aborted("request r: superseded by a newer request of its id"), 1),
    (DeadlineExceeded("deadline_ms=50: passed after 0 generated tokens of request r"), 1),
    (InvalidArgument("max_tokens", 0, "must be at least 1"), 1),
    (_failure(grpc.StatusCode.UNIMPLEMENTED, "not implemented"), 1),
    (ResourceExhausted("tenant 'a' over its share", 1), 3),
    (Unavailable("no live node serves model 'm'"), 3),
])
async def test_the_openai_client_sends_again_only_a_refusal_that_a_retry_may_pass(
        failure: BatonError, num_sent: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "UNAVAILABLE_RETRY_AFTER_MS", 1)  # (the client waits as long as a 503 says)
    router = _FakeRouter([], failure)
    http, client = await _client(router, max_retries=2)  # the SDK's default
    try:
        with pytest.raises(openai.APIStatusError):
            await client.completions.create(model="m", prompt="x")
        assert len(router.requests) == num_sent
    finally:
        await client.close()
        await http.close()


@pytest.mark.parametrize(("code", "error_class"), [
    (grpc.StatusCode.UNAUTHENTICATED, openai.AuthenticationError),
    (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError),
])
async def test_a_refusal_before_the_first_token_has_its_own_status(code: grpc.StatusCode,
                                                                    error_class: type[Exception]) -> None:
    failure = BatonError("refused for a reason")
    failure.code = code
    http, client = await _client(_FakeRouter([], failure))
    try:
        with pytest.raises(error_class) as caught:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert "refused for a reason" in str(caught.value)
        # RFC 7235: a 401 names the scheme it wants (helper-125: it had none).
        assert caught.value.response.headers.get("WWW-Authenticate") == (  # type: ignore[attr-defined]
            'Bearer realm="baton"' if code == grpc.StatusCode.UNAUTHENTICATED else None)
    finally:
        await client.close()
        await http.close()


async def test_a_failure_mid_stream_reaches_the_client_as_an_error_after_the_text_so_far() -> None:
    http, client = await _client(_FakeRouter(["Hel", "lo"], Unavailable("request r: migration limit of 3 reached")))
    received = []
    try:
        stream = await client.completions.create(model="m", prompt="x", stream=True)
        with pytest.raises(openai.APIError) as caught:
            async for event in stream:
                received.append(event.choices[0].text)
        assert "migration limit" in caught.value.message
        assert "".join(received) == "Hello"
    finally:
        await client.close()
        await http.close()


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_a_failure_mid_stream_sends_the_text_held_back_for_a_stop_before_its_error(kind: str) -> None:
    """Text that might begin a stop string is held back until the next shows it does not; a stream ending with an
    error gave that text up, where the same request without stop got it (helper-182: 0 characters of 88 tokens)."""
    http, client = await _client(_FakeRouter(["Hel", "lo"], DeadlineExceeded("deadline_ms=1450: passed")))
    received = []
    try:
        if kind == "chat":
            stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                          stream=True, stop=["Q" * 300])
        else:
            stream = await client.completions.create(model="m", prompt="x", stream=True, stop=["Q" * 300])
        with pytest.raises(openai.APIError) as caught:
            async for event in stream:
                received.append(event.choices[0].delta.content or "" if kind == "chat" else event.choices[0].text)
        assert "deadline_ms=1450: passed" in caught.value.message
        assert "".join(received) == "Hello"
    finally:
        await client.close()
        await http.close()


@pytest.mark.parametrize(("method", "path", "data", "status", "param"), [
    ("POST", "/v1/completions", b"{not json", 400, "body"),
    ("POST", "/v1/completions", b"\xff\xfe\x00", 400, "body"),
    ("POST", "/v1/completions", b"[" * 50_000, 400, "body"),
    ("POST", "/v1/completions", b"x" * 200_000, 413, "body"),
    ("GET", "/v1/nowhere", None, 404, "path"),
    ("GET", "/v1/completions", None, 405, "path"),
    ("GET", "/v1/models/nope", None, 404, "model"),
])
async def test_malformed_requests_get_openai_shaped_errors_naming_what_was_wrong(
        method: str, path: str, data: bytes | None, status: int, param: str) -> None:
    http, client = await _client(_FakeRouter(["x"]))
    try:
        response = await http.request(method, path, data=data)
        assert response.status == status
        error = (await response.json())["error"]
        assert error["param"] == param and error["message"]
        assert error["type"] != "server_error"  # every one of these is the client's to fix
        assert response.headers["x-should-retry"] == "false"  # nor would sending it again help
        if status == 405:  # HTTP requires it: which methods the path takes
            assert response.headers["Allow"] == "POST" and "allowed: POST" in error["message"]
    finally:
        await client.close()
        await http.close()


async def test_the_tenant_comes_from_the_body_or_the_tenant_header() -> None:
    router = _FakeRouter(["x"])
    http, client = await _client(router)
    try:
        await client.completions.create(model="m", prompt="x", extra_body={"tenant": "acme"})
        await client.completions.create(model="m", prompt="x", extra_headers={"X-Baton-Tenant": "globex"})
        assert [r.tenant for r in router.requests] == ["acme", "globex"]
        models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
    finally:
        await client.close()
        await http.close()


@pytest.mark.parametrize(("where", "param"), [("header", "X-Baton-Tenant"), ("body", "tenant")])
async def test_a_refused_tenant_is_named_as_the_client_sent_it(where: str, param: str) -> None:
    tenant = "t" * 200
    http, client = await _client(_FakeRouter([], InvalidArgument("tenant", tenant, "200 characters, longer than 128")))
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model="m", prompt="x", extra_headers={"X-Baton-Tenant": tenant} if where == "header" else None,
                extra_body={"tenant": tenant} if where == "body" else None)
        assert refused.value.body["param"] == param  # type: ignore[index]
        assert refused.value.body["message"].startswith(f"{param}='tttt")  # type: ignore[index]
    finally:
        await client.close()
        await http.close()


async def test_each_v1_request_counts_against_its_own_connection_and_health_probes_do_not() -> None:
    counted: list[str] = []
    http = TestClient(TestServer(HttpApi(_FakeRouter(["a"]), "127.0.0.1:0", InputLimits(max_prompt_bytes=1024),
                                         counted.append).app))
    await http.start_server()
    try:
        for path in ("/health", "/v1/models", "/v1/models"):
            assert (await http.get(path)).status == 200
        async with aiohttp.ClientSession() as another_connection:
            async with another_connection.get(http.make_url("/v1/models")) as response:
                assert response.status == 200
    finally:
        await http.close()
    assert len(counted) == 3 and counted[0] == counted[1] != counted[2]
    assert counted[0].startswith("http:127.0.0.1:")


class _DeliveryRouter(_FakeRouter):
    """Notes, as the router core does, whether its stream was asked for more after its last reply (delivered) or
    closed there (the client gone), and whether the response was written by then."""

    def __init__(self, written: Callable[[], bool]) -> None:
        super().__init__(["a", "b"])
        self.written = written
        self.delivered: bool | None = None
        self.written_when_delivered = False

    async def generate(self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                       authorization: str | None = None) -> AsyncIterator[router_pb2.GenerateChunk]:
        self.delivered = False
        async for chunk in super().generate(request, time_remaining, authorization):
            yield chunk
        self.delivered, self.written_when_delivered = True, self.written()


@pytest.mark.parametrize("client_gone", [False, True])
async def test_a_whole_answer_counts_delivered_only_once_its_response_is_written(client_gone: bool) -> None:
    """Not streamed, the answer goes out as one response after the last token: a client gone by then (the write
    fails) did not get it, and the router must not count it a success."""
    writes: list[bytes] = []

    async def write_eof(data: bytes = b"") -> None:  # where aiohttp's write to a closed connection fails
        if client_gone:
            raise ConnectionResetError("Cannot write to closing transport")
        writes.append(data)

    writer = mock.Mock(write_headers=mock.AsyncMock(), write=mock.AsyncMock(), drain=mock.AsyncMock(),
                       write_eof=write_eof)
    request = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                                  payload=_body({"model": "m", "prompt": "x"}), writer=writer)
    router = _DeliveryRouter(lambda: bool(writes))
    api = HttpApi(router, "127.0.0.1:0", InputLimits(max_prompt_bytes=1024))
    handler = (await api.app.router.resolve(request)).handler
    if client_gone:
        with pytest.raises(ConnectionResetError):
            await handler(request)
        assert router.delivered is False
    else:
        response = await handler(request)
        assert response.status == 200 and router.delivered and router.written_when_delivered


def _body(body: dict) -> StreamReader:
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(json.dumps(body).encode())
    payload.feed_eof()
    return payload


async def test_a_request_is_one_trace_its_calls_inside_its_server_span_under_the_clients_traceparent() -> None:
    """Without a span of its own, an HTTP request's calls to the leader and the nodes each began a trace."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    inside: list[trace.SpanContext] = []

    class _Traced(_FakeRouter):
        async def generate(self, *args, **kwargs) -> AsyncIterator[router_pb2.GenerateChunk]:  # type: ignore[override]
            inside.append(trace.get_current_span().get_span_context())  # where its calls' spans would hang
            async for chunk in super().generate(*args, **kwargs):
                yield chunk

    server = TestServer(HttpApi(_Traced(["a"]), "127.0.0.1:0", InputLimits(max_prompt_bytes=1024),
                                tracer=provider.get_tracer("test")).app)
    await server.start_server(**RUNNER_OPTIONS)  # (the body's encoding is the API's to read, as a router's runner does)
    http = TestClient(server)
    client_trace = 0x0AF7651916CD43DD8448EB211C80319C
    try:
        reply = await http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, headers={
            "traceparent": f"00-{client_trace:032x}-b7ad6b7169203331-01"})
        assert reply.status == 200
        assert (await http.post("/v1/completions", data=b"not json")).status == 400
        assert (await http.post("/v1/completions", data=b"x", headers={"Content-Encoding": "br"})).status == 415
    finally:
        await http.close()
    span, refused, unencoded = spans.get_finished_spans()
    # A client's mistake is its status code on the span, not a server error (a 415 was traced a 500, helper-197).
    assert refused.attributes["http.response.status_code"] == 400 and refused.status.is_unset
    assert unencoded.attributes["http.response.status_code"] == 415 and unencoded.status.is_unset
    assert span.name == "POST /v1/completions" and span.kind == trace.SpanKind.SERVER
    assert span.attributes["http.response.status_code"] == 200
    assert span.context.trace_id == client_trace and span.parent is not None
    assert inside == [span.context]


async def test_a_refusal_of_the_call_itself_carries_an_id_its_span_carries_too() -> None:
    """OpenAI's API says an x-request-id in every answer; a call refused before its body was read as a request (no
    valid key, no JSON, a field of the wrong type) had none, so its trace could not be found from the answer."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    router = _FakeRouter(["a"])
    http = TestClient(TestServer(HttpApi(router, "127.0.0.1:0", InputLimits(max_prompt_bytes=1024),
                                         tracer=provider.get_tracer("test")).app))
    await http.start_server()
    try:
        answers = [await http.post("/v1/completions", data=b"not json"),
                   await http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": "2"})]
        router.key_refused = Unauthenticated("authorization: missing")
        answers.append(await http.post("/v1/chat/completions", json={"model": "m", "messages": []}))
        # A request refused once parsed is known by its own id (here the client's), as before.
        router.key_refused, router.validating = None, True
        answers.append(await http.post("/v1/completions", json={"model": "m", "prompt": "x", "temperature": -1,
                                                                "request_id": "mine"}))
        # Parsed, then failing in the router (a bug's 500): its answer says its id, as its span does (helper-193: the
        # answer said none, and a refusal said the client's id where the span kept the call's).
        router.validating = False
        router.failure = RuntimeError("a bug")  # type: ignore[assignment]
        answers.append(await http.post("/v1/completions", json={"model": "m", "prompt": "x", "request_id": "boom"}))
    finally:
        await http.close()
    assert [answer.status for answer in answers] == [400, 400, 401, 400, 500]
    ids = [answer.headers.get("x-request-id") for answer in answers]
    assert all(re.fullmatch("[0-9a-f]{32}", call_id or "") for call_id in ids[:3]) and len(set(ids[:3])) == 3
    assert ids[3:] == ["mine", "boom"]
    assert [span.attributes["baton.request_id"] for span in spans.get_finished_spans()] == ids


_BODY = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
_BOMB = gzip.compress(b" " * (1 << 20) + _BODY)  # 1 MiB once decoded; the limit is 8 x 1024 + 64 KiB
_ENCODED_BODIES = [
    ("gzip", "gzip", gzip.compress(_BODY), 200, None, ""),
    ("deflate", "deflate", zlib.compress(_BODY), 200, None, ""),
    ("raw deflate", "deflate", zlib.compress(_BODY, wbits=-zlib.MAX_WBITS), 200, None, ""),
    ("not gzip", "gzip", b"notgzip", 400, "body", "body='7 bytes': not valid gzip data"),
    ("not deflate", "deflate", b"garbage", 400, "body", "body='7 bytes': not valid deflate data"),
    ("cut short", "gzip", gzip.compress(_BODY)[:-10], 400, "body", "body="),
    ("brotli", "br", b"garbage", 415, "Content-Encoding", "Content-Encoding='br': not supported"),
    ("zstd", "zstd", b"garbage", 415, "Content-Encoding", "Content-Encoding='zstd': not supported"),
    ("bomb", "gzip", _BOMB, 413, "body",
     f"body='{len(_BOMB)} bytes gzip-encoded': longer than 73728 bytes once decoded"),
    # Several gzip members one after another (RFC 1952), and a list naming identity beside gzip (RFC 9110): both
    # were refused (helper-150). Two codings stacked are not supported.
    ("gzip members", "gzip", gzip.compress(_BODY[:9]) + gzip.compress(_BODY[9:]), 200, None, ""),
    ("bomb in members", "gzip", gzip.compress(_BODY) + _BOMB, 413, "body", "body="),
    # Each member's decoding copied all decoded and all left: 360,000 tiny members held the router for 84 s
    # (helper-179). The JSON is valid with the blanks after it, so only the count refuses it.
    ("members past 16", "gzip", gzip.compress(_BODY) + gzip.compress(b" ") * 16, 400, "body",
     f"body='{len(gzip.compress(_BODY) + gzip.compress(b' ') * 16)} bytes': more than 16 gzip members"),
    ("16 members", "gzip", gzip.compress(_BODY) + gzip.compress(b" ") * 15, 200, None, ""),
    ("deflate and more", "deflate", zlib.compress(_BODY) + zlib.compress(_BODY), 400, "body",
     "body='"),
    ("gzip, identity", "gzip, identity", gzip.compress(_BODY), 200, None, ""),
    ("stacked", "deflate, gzip", gzip.compress(zlib.compress(_BODY)), 415, "Content-Encoding",
     "Content-Encoding='deflate, gzip': not supported"),
]


@pytest.mark.parametrize(("encoding", "body", "status", "param", "message"), [c[1:] for c in _ENCODED_BODIES],
                         ids=[c[0] for c in _ENCODED_BODIES])
async def test_a_compressed_body_is_decoded_or_refused_in_openais_shape_naming_the_body_or_header(
        caplog: pytest.LogCaptureFixture, encoding: str, body: bytes, status: int, param: str | None,
        message: str) -> None:
    server = TestServer(HttpApi(_FakeRouter(["a"]), "127.0.0.1:0", InputLimits(max_prompt_bytes=1024)).app)
    await server.start_server(**RUNNER_OPTIONS)
    http = TestClient(server)
    try:
        with caplog.at_level(logging.ERROR):
            reply = await http.post("/v1/completions", data=body, headers={"Content-Encoding": encoding,
                                                                            "Content-Type": "application/json"})
            answer = await reply.json()
    finally:
        await http.close()
    assert reply.status == status, answer
    if status != 200:
        assert answer["error"]["param"] == param and answer["error"]["message"].startswith(message)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a client's mistake, not a bug


async def test_every_response_is_counted_by_route_and_status_the_http_layers_own_refusals_too() -> None:
    """A parameter Baton does not take, or a body that is no JSON, is refused by the HTTP layer before any Generate:
    no metric counted it, so an operator could not see a client library sending what Baton refuses. The path a
    client chose is no label: one no route matches counts as "unmatched"."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    http = TestClient(TestServer(HttpApi(_FakeRouter(["a"]), "127.0.0.1:0", InputLimits(max_prompt_bytes=1024),
                                         meter=meter).app))
    await http.start_server()
    try:
        for body in ({"model": "m", "prompt": "x", "max_tokens": 1}, {"model": "m", "prompt": "x", "foo": 1},
                     {"model": "m", "prompt": "x", "n": 2}):
            await (await http.post("/v1/completions", json=body)).read()
        await (await http.post("/v1/completions", data=b"{not json")).read()
        for path in ("/v1/nope-1", "/v1/nope-2"):
            await (await http.get(path)).read()
        await (await http.get("/v1/models/m")).read()
    finally:
        await http.close()
    counts = {(p.attributes["route"], p.attributes["status"]): p.value
              for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if m.name == "baton.router.http_responses" for p in m.data.data_points}
    assert counts == {("/v1/completions", "200"): 1, ("/v1/completions", "400"): 3, ("unmatched", "404"): 2,
                      ("/v1/models/{model}", "200"): 1}


async def test_close_ends_a_stream_still_running_when_the_shutdown_timeout_passes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aiohttp waits the shutdown timeout for a handler, then only fails its request body and waits as long again: a
    stream ran on for twice the grace (20 s, where the gRPC API gives 10), and a router stopping with its leader away
    outlived baton up's window and was SIGKILLed with its notices unsent (helper-106). The handler now ends at the
    grace, within aiohttp's first wait: its second phase (failing the request, then waiting again) never comes."""
    ended = asyncio.Event()
    second_phase: list[BaseException] = []
    monkeypatch.setattr(web.BaseRequest, "_cancel", lambda self, exc: second_phase.append(exc))

    class _Endless(_FakeRouter):
        async def generate(self, *args, **kwargs) -> AsyncIterator[router_pb2.GenerateChunk]:  # type: ignore[override]
            try:
                yield router_pb2.GenerateChunk(request_id="r", text="a", index=0, node_id="n", model="m")
                await asyncio.Event().wait()  # a generation that outlasts any grace
            finally:
                ended.set()

    port = free_port()
    api = HttpApi(_Endless([]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024), shutdown_timeout_s=0.2)
    assert await api.start()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"model": "m", "prompt": "x", "stream": True}) as response:
            assert (await response.content.readline()).startswith(b"data: ")  # the stream runs
            await api.close()
            assert ended.is_set() and second_phase == []  # its generation ended at the grace, in the first wait
            # Its client is told, as of a failure (cut with nothing said, it saw a broken connection: helper-166).
            rest = await response.content.read()
    events = [line[6:] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and b"the router is stopping" in events[-2], rest


def _responses_by_status(reader: InMemoryMetricReader) -> dict[str, int]:
    """baton.router.http_responses, by status."""
    return {p.attributes["status"]: p.value for rm in reader.get_metrics_data().resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics if m.name == "baton.router.http_responses"
            for p in m.data.data_points}


@pytest.mark.parametrize(("stream", "first_chunk"), [(False, True), (False, False), (True, False)])
async def test_a_request_cut_by_the_routers_stop_before_its_answer_is_answered_503(stream: bool,
                                                                                   first_chunk: bool) -> None:
    """A whole answer still being generated, or any request still waiting for its first token, when the router's
    grace ended got no response at all: "Remote end closed connection without response" (helper-173)."""
    running = asyncio.Event()

    class _Endless(_FakeRouter):
        async def generate(self, *args, **kwargs) -> AsyncIterator[router_pb2.GenerateChunk]:  # type: ignore[override]
            running.set()
            if first_chunk:
                yield router_pb2.GenerateChunk(request_id="r", text="a", index=0, node_id="n", model="m")
            await asyncio.Event().wait()  # a generation (or a placement) that outlasts any grace
            yield router_pb2.GenerateChunk()  # (never reached)

    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    port = free_port()
    api = HttpApi(_Endless([]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024), shutdown_timeout_s=0.2,
                  tracer=provider.get_tracer("test"), meter=MeterProvider(metric_readers=[reader]).get_meter("test"))
    assert await api.start()
    async with aiohttp.ClientSession() as session:
        sent = asyncio.ensure_future(session.post(f"http://127.0.0.1:{port}/v1/completions",
                                                  json={"model": "m", "prompt": "x", "stream": stream,
                                                        "request_id": "job-9"}))
        await running.wait()
        await api.close()
        async with await sent as response:
            body = await response.json()
            assert response.status == 503 and response.headers["x-request-id"] == "job-9"
            assert response.headers["Retry-After"] == "2"
    assert body["error"]["message"].startswith("the router is stopping: the request was cut at the end of its grace")
    # Counted and traced as answered (the handler's cancellation skipped both: helper-174).
    [span] = spans.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 503 and span.status.status_code == trace.StatusCode.ERROR
    assert _responses_by_status(reader) == {"503": 1}


async def test_a_request_aiohttp_cannot_parse_is_a_400_and_one_debug_line_not_a_logged_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    """Any client could write an ERROR with a traceback into the router's log, once per connection, with one
    malformed header (helper-108)."""
    port = free_port()
    api = HttpApi(_FakeRouter(["a"]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024))
    assert await api.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Baton-Tenant: a\x01b\r\n\r\n")
            await writer.drain()
            status = await reader.readline()
            assert status.split()[1] == b"400", status
            await reader.read()  # aiohttp closes the connection after its answer: its log record is written by then
            writer.close()
    finally:
        await api.close()
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.DEBUG and r.exc_info is None for r in records)
    assert "400" in records[0].getMessage()


async def test_a_stream_whose_client_hangs_up_is_counted_and_traced_with_the_status_its_headers_went_out_with(
) -> None:
    """A stream answered 200, then hung up on, was counted in neither baton.router.http_responses nor its span's
    http.response.status_code (only a cut by the router's stop was, helper-206)."""
    ended = asyncio.Event()

    class _Endless(_FakeRouter):
        async def generate(self, *args, **kwargs) -> AsyncIterator[router_pb2.GenerateChunk]:  # type: ignore[override]
            yield router_pb2.GenerateChunk(request_id="r", text="a", index=0, node_id="n", model="m")
            await asyncio.Event().wait()  # a generation its client will not wait for
            yield router_pb2.GenerateChunk()  # (never reached)

    class _Told(InMemorySpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            result = super().export(spans)
            ended.set()
            return result

    spans, reader = _Told(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    port = free_port()
    api = HttpApi(_Endless([]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024),
                  tracer=provider.get_tracer("test"), meter=MeterProvider(metric_readers=[reader]).get_meter("test"))
    assert await api.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                    json={"model": "m", "prompt": "x", "stream": True}) as response:
                assert response.status == 200 and (await response.content.readline()).startswith(b"data: ")
                response.close()  # the client hangs up mid-stream
        await asyncio.wait_for(ended.wait(), 10)
    finally:
        await api.close()
    [span] = spans.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 200 and span.status.status_code != trace.StatusCode.ERROR
    assert _responses_by_status(reader) == {"200": 1}


async def test_a_whole_answer_whose_client_closes_once_it_has_it_is_still_answered_200() -> None:
    """The client read the body and closed the connection; aiohttp cancelled the handler while the router finished
    the stream, and the 200 went uncounted in baton.router.http_responses, its span without a status (helper-116)."""

    class _ClosedAfterTheAnswer(_FakeRouter):
        async def generate(self, *args, **kwargs) -> AsyncIterator[router_pb2.GenerateChunk]:  # type: ignore[override]
            async for chunk in super().generate(*args, **kwargs):
                yield chunk
            raise asyncio.CancelledError  # what the handler's cancellation brings while the stream ends

    writer = mock.Mock(write_headers=mock.AsyncMock(), write=mock.AsyncMock(), drain=mock.AsyncMock(),
                       write_eof=mock.AsyncMock())
    request = make_mocked_request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                                  payload=_body({"model": "m", "prompt": "x"}), writer=writer)
    api = HttpApi(_ClosedAfterTheAnswer(["a"]), "127.0.0.1:0", InputLimits(max_prompt_bytes=1024))
    response = await (await api.app.router.resolve(request)).handler(request)
    assert response.status == 200


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half a head"])
async def test_a_connection_that_sends_no_whole_request_head_within_the_read_timeout_is_closed(sent: bytes) -> None:
    """A client could hold a connection (a file descriptor, a parser's buffer) open for an hour by sending nothing,
    or its head a byte at a time: aiohttp's keep-alive timeout was 3,630 s, and before its 3.14 nothing timed the
    first head at all (the slowloris left out in the earlier notes)."""
    port = free_port()
    api = HttpApi(_FakeRouter(["a"]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024), read_timeout_s=0.2)
    assert await api.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        await writer.drain()
        # The server closes it: the read ends (an answer to a half-sent head would be no answer at all).
        assert await asyncio.wait_for(reader.read(), 30) == b""
        writer.close()
    finally:
        await api.close()


async def test_a_body_that_does_not_come_in_full_within_the_read_timeout_is_a_408_naming_it_and_closed() -> None:
    port = free_port()
    api = HttpApi(_FakeRouter(["a"]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024), read_timeout_s=0.2)
    assert await api.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": \"a\",")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)  # the answer, then the connection's end
        writer.close()
    finally:
        await api.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == b"408", head
    error = json.loads(body)["error"]
    assert error["param"] == "body" and error["type"] == "timeout_error", error
    assert "100 bytes" in error["message"] and "0.2 s" in error["message"], error



async def test_a_stream_and_a_kept_alive_connection_outlast_the_read_timeout_while_the_client_waits_for_answers(
) -> None:
    """The read timeout is for what the client sends: an answer that takes longer (a slow generation, then another
    request on the same connection) is not cut by it."""
    slow_s = 1.0

    class _Slow(_FakeRouter):
        async def generate(self, *args, **kwargs) -> AsyncIterator[router_pb2.GenerateChunk]:  # type: ignore[override]
            await asyncio.sleep(slow_s)  # a generation slower than the read timeout, not a synchronisation
            async for chunk in super().generate(*args, **kwargs):
                yield chunk

    port = free_port()
    api = HttpApi(_Slow(["a", "b"]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024), read_timeout_s=0.2)
    assert await api.start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            for stream in (True, False):
                async with session.post(f"http://127.0.0.1:{port}/v1/completions",
                                        json={"model": "a", "prompt": "x", "stream": stream}) as response:
                    assert response.status == 200
                    text = await response.text()
                    assert ("data: [DONE]" in text) if stream else (json.loads(text)["choices"][0]["text"] == "ab")
    finally:
        await api.close()


async def test_every_authorization_header_a_request_sends_reaches_the_key_check() -> None:
    """Two Authorization headers reach the router's key check joined, where --auth refuses them (test_auth); before,
    only the first did, and it decided (helper-164)."""
    seen: list[str | None] = []

    class _Recording(_FakeRouter):
        async def authorize(self, authorization: str | None) -> TenantRecord | None:
            seen.append(authorization)
            return None

        async def generate(self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                           authorization: str | None = None) -> AsyncIterator[router_pb2.GenerateChunk]:
            seen.append(authorization)
            async for chunk in super().generate(request, time_remaining, authorization):
                yield chunk

    http = TestClient(TestServer(HttpApi(_Recording(["a"]), "127.0.0.1:0", InputLimits(max_prompt_bytes=1024)).app))
    await http.start_server()
    try:
        headers = CIMultiDict([("Authorization", "Bearer bt_one"), ("Authorization", "Bearer bt_two")])
        assert (await http.get("/v1/models", headers=headers)).status == 200
        assert (await http.post("/v1/completions", json={"model": "a", "prompt": "x"}, headers=headers)).status == 200
    finally:
        await http.close()
    assert seen and all(value == "Bearer bt_one, Bearer bt_two" for value in seen), seen


async def test_every_answer_to_a_generation_names_its_request_id_as_openai_does() -> None:
    """No answer carried the request's id, so a failed call could not be found in the router's logs or traces, and
    the openai client's response._request_id was None (helper-166). x-request-id is the id the client set, or the
    one the router made."""
    router = _FakeRouter(["a"])
    http, client = await _client(router)
    try:
        whole = await client.completions.with_raw_response.create(model="a", prompt="x")
        made = whole.headers["x-request-id"]
        assert made and router.requests[-1].request_id == made  # the id the request runs under
        stream = await client.completions.with_raw_response.create(model="a", prompt="x", stream=True)
        assert stream.headers["x-request-id"] not in ("", made)
        mine = await http.post("/v1/completions", json={"model": "a", "prompt": "x"},
                               headers={"X-Baton-Request-Id": "job-7"})
        assert mine.headers["x-request-id"] == "job-7"
        router.texts, router.failure = [], Unavailable("no node")  # refused before its first chunk
        refused = await http.post("/v1/completions", json={"model": "a", "prompt": "x", "request_id": "job-8"})
        assert refused.status == 503 and refused.headers["x-request-id"] == "job-8"
        long_id = await http.post("/v1/completions", json={"model": "a", "prompt": "x", "request_id": "j" * 9000})
        assert "x-request-id" not in long_id.headers  # (helper-168: an 8 KB header made the answer unreadable)
        spaced = await http.post("/v1/completions", json={"model": "a", "prompt": "x", "request_id": " job-9"})
        assert "x-request-id" not in spaced.headers  # (its reader strips it: another id, "job-9", helper-197)
    finally:
        await client.close()
        await http.close()


async def test_a_body_with_a_number_too_long_to_read_is_refused_without_pythons_advice_to_its_programmer() -> None:
    """A 5,001-digit integer was refused quoting Python's "use sys.set_int_max_str_digits()" (helper-166)."""
    http, client = await _client(_FakeRouter(["a"]))
    try:
        response = await http.post("/v1/completions", data=b'{"model": "a", "prompt": "x", "seed": ' + b"9" * 5001
                                   + b"}", headers={"Content-Type": "application/json"})
        error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == "body"
        assert "not valid JSON: a number of more than 4300 digits" in error["message"], error
        assert "sys." not in error["message"]
    finally:
        await client.close()
        await http.close()


@pytest.mark.parametrize("size", [10**9, 20])
async def test_a_client_that_asks_before_sending_a_body_over_the_limit_is_refused_before_it_sends_it(size: int) -> None:
    """Told to continue, a client with `Expect: 100-continue` uploaded 8 MiB of a 1 GB body before its 413
    (helper-166). Now the 413 comes instead of the 100; a body within the limit is still asked for."""
    port = free_port()
    api = HttpApi(_FakeRouter(["a"]), f"127.0.0.1:{port}", InputLimits(max_prompt_bytes=1024))
    assert await api.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % size)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 30)
        body = b""
        if size > 1024:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = await asyncio.wait_for(reader.readexactly(length), 30)
        writer.close()
    finally:
        await api.close()
    assert status.split()[1] == (b"413" if size > 1024 else b"100"), status
    if size > 1024:
        assert json.loads(body)["error"]["param"] == "body"
