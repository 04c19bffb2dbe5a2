"""The router's OpenAI-compatible HTTP API (--http-listen): a thin front end over the same
generate() the gRPC Generate serves, so validation, placement and resumption are the router's own.

GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions (streamed
as server-sent events, or whole), GET /health. See docs/http-api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any, Protocol

from aiohttp import web, web_urldispatcher
from aiohttp.http_exceptions import HttpProcessingError
from opentelemetry import propagate, trace
from opentelemetry.metrics import Meter

from baton.v1 import router_pb2
from services.common.auth import TenantRecord, joined_authorization
from services.common.errors import BatonError, InvalidArgument, Unavailable
from services.router import openai_schema as schema
from services.router.chat_template import PLAIN, ChatTemplate, template_for
from services.router.request_scope import cluster_request_id
from services.router.validation import InputLimits, ModelEntry, check_fields, find_model

log = logging.getLogger(__name__)


class _UnparsedQuietly(logging.Filter):
    """aiohttp logs a request it cannot parse (a control byte in a header, a wrong Content-Length: the client's fault,
    answered 400) at ERROR with a traceback, once per connection, so that any client could fill the router's log with
    them. Such a record becomes one DEBUG line, as aiohttp logs non-HTTP traffic; errors of the handlers stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            record.msg, record.args = f"{record.getMessage()}: {error}", ()
            record.levelno, record.levelname, record.exc_info, record.exc_text = logging.DEBUG, "DEBUG", None, None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# JSON escapes make a body longer than the text it carries (up to 6 bytes per character, "\u00e9").
_BODY_BYTES_PER_PROMPT_BYTE = 8
# A request body's Content-Encoding -> zlib's wbits for it. aiohttp's own decoding is off: it answers a body that
# does not decode with a 500 and a logged traceback, and br or zstd (their libraries not installed) in plain text.
_ZLIB_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# The most gzip members a body may hold (a client that compresses a body writes one; concatenated files, a few).
_MAX_GZIP_MEMBERS = 16
# How the app is served beyond aiohttp's defaults (tests serve HttpApi.app with these too): bodies reach it as sent,
# for _decoded to decode.
RUNNER_OPTIONS: dict[str, Any] = {"auto_decompress": False}
# How long a client may take to send a request's head, and then its body (--http-read-timeout-s).
DEFAULT_READ_TIMEOUT_S = 30.0


# A request's key for the status of the answer written when its handler was cancelled (the router's stop cut it, or a
# stream's client hung up after its headers), which ends past the spans' and the metrics' usual accounting.
_CUT_STATUS = web.RequestKey("baton.cut_status", int)
# The id the router made for a completion call, said in x-request-id by an answer that carries none of its own: a
# refusal of the call itself (no valid key, a body that is no JSON, a field of the wrong type), as OpenAI's API says
# one in every answer. The call's span carries it (baton.request_id) until the request's own id replaces it.
_CALL_ID = web.RequestKey("baton.call_id", str)


class _Refused(Exception):
    """A refusal whose HTTP status no gRPC code has (413, 415): the middleware answers it as it is."""

    def __init__(self, status: int, body: dict[str, Any], close: bool = False) -> None:
        super().__init__(body["error"]["message"])
        self.status = status
        self.body = body
        self.close = close  # end the connection after the answer (the rest of a body that came too slowly)


class GenerateService(Protocol):
    """What the HTTP API needs of the router: its served models and its one generate path."""

    @property
    def models(self) -> Mapping[str, ModelEntry]: ...

    def served_models(self) -> list[router_pb2.ServedModel]: ...

    def gone_model(self, name: str) -> ModelEntry | None: ...

    async def authorize(self, authorization: str | None) -> TenantRecord | None: ...

    def has_read_nodes(self) -> bool: ...

    async def nodes_read(self) -> None: ...

    def generate(self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                 authorization: str | None = None) -> AsyncIterator[router_pb2.GenerateChunk]: ...


def tenant_for(request: web.Request, body: Mapping[str, Any]) -> str:
    """The tenant a request asks to be served for, decided here and nowhere else: the body's `tenant`
    (extra_body), else the X-Baton-Tenant header, else none. With --auth the router's generate
    replaces it by the tenant of the `Authorization: Bearer <key>` header."""
    if body.get(schema.TENANT_FIELD) is not None:
        return schema.text_value(schema.TENANT_FIELD, body[schema.TENANT_FIELD])
    return schema.text_value(schema.TENANT_HEADER, request.headers.get(schema.TENANT_HEADER, ""))


def _json_response(status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> web.Response:
    """A JSON response; an error says whether to retry it (aiohttp's own refusals and a 500 too)."""
    headers = dict(headers or {})
    if status >= 400 and schema.SHOULD_RETRY_HEADER not in headers:
        headers.update(schema.retry_headers(status))
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


def _error(error: BatonError, names: Mapping[str, str] | None = None,
           extra_headers: Mapping[str, str] | None = None) -> web.Response:
    status, body, headers = schema.error_response(error, names)
    return _json_response(status, body, {**headers, **(extra_headers or {})})


def _id_header(parsed: schema.ParsedRequest, max_len: int) -> dict[str, str]:
    """x-request-id: the request's id; none when the id is one a header cannot carry, or longer than an id may be
    (refused as a bad field: an 8 KB one made the refusal unreadable to aiohttp's client, helper-168)."""
    request_id = parsed.request.request_id
    # (Nor one with white space at either end, which a header's reader strips: read as another id, helper-197.)
    fits = (len(request_id) <= max_len and request_id.isascii() and request_id.isprintable()
            and request_id == request_id.strip())
    return {"x-request-id": request_id} if fits else {}


@web.middleware
async def _openai_errors(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every failure in OpenAI's error shape: a refusal with its status, aiohttp's own (404, 405,
    413) too; anything else is a bug, logged, and 500."""
    try:
        response = await handler(request)
    except BatonError as error:
        response = _error(error)
    except _Refused as refused:
        response = _json_response(refused.status, refused.body)
        if refused.close:
            response.force_close()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _http_error(request, exc)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("HTTP %s %s failed", request.method, request.path)
        response = _json_response(500, schema.error_json(500, "internal error", None, "internal"))
    if (call_id := request.get(_CALL_ID)) is not None and not response.prepared \
            and "x-request-id" not in response.headers:
        response.headers["x-request-id"] = call_id
    return response


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own refusal (404, 405, 413, ...) in OpenAI's error shape."""
    if exc.status == 413:
        size = "a chunked body" if request.content_length is None else f"{request.content_length} bytes"
        return _json_response(413, schema.refusal("body", size, f"longer than {request.client_max_size} bytes", 413))
    param = "path" if exc.status in (404, 405) else None
    message = f"{request.method} {request.path}: {exc.reason}"
    code = exc.reason.lower().replace(" ", "_")
    # A 405 says which methods the path takes (HTTP requires the header; aiohttp's own exception has it).
    allow = {"Allow": exc.headers["Allow"]} if exc.status == 405 and "Allow" in exc.headers else None
    if allow:
        message += f" (allowed: {allow['Allow']})"
    return _json_response(exc.status, schema.error_json(exc.status, message, param, code), allow)


async def _expect_within_limit(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue` with a body over the limit is refused 413 before the body is sent: told to continue,
    a client uploaded 8 MiB of a 1 GB body before its 413 (helper-166). Else aiohttp's own answer (100 Continue)."""
    if request.content_length is not None and request.content_length > request.client_max_size:
        response = _json_response(413, schema.refusal("body", f"{request.content_length} bytes",
                                                      f"longer than {request.client_max_size} bytes", 413))
        response.force_close()
        return response
    await web_urldispatcher._default_expect_handler(request)
    return None


def _counted(meter: Meter) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Each response by its route (the path's pattern, "unmatched" for none: no client-chosen path becomes a label)
    and HTTP status: refusals the HTTP layer makes itself (a parameter Baton does not take, a body that is no JSON)
    never reach the Generate count."""
    responses = meter.create_counter("baton.router.http_responses",
                                     description="HTTP API responses, by route and status code")

    @web.middleware
    async def counted(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            if (status := request.get(_CUT_STATUS)) is not None:  # its answer (or a stream's headers) written
                responses.add(1, {"route": route, "status": str(status)})
            raise
        responses.add(1, {"route": route, "status": str(response.status)})
        return response

    return counted


def connection_of(request: web.Request) -> str:
    """The TCP connection a request came on, by its peer's address and port: each connection (not
    each client host) has its own request rate."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"http:{peer[0]}:{peer[1]}"
    return f"http:{request.remote or 'unknown'}"


def _rate_per_connection(check: Callable[[str], None]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware counting each /v1/ request against its connection's rate (check raises
    ResourceExhausted, a 429 with Retry-After, when it is over); /health is not counted."""

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            check(connection_of(request))
        return await handler(request)

    return middleware


class HttpApi:
    """The aiohttp application, bound to --http-listen, in the router's event loop."""

    def __init__(self, service: GenerateService, listen: str, limits: InputLimits,
                 check_connection_rate: Callable[[str], None] | None = None,
                 shutdown_timeout_s: float = 10.0, ssl_context: ssl.SSLContext | None = None,
                 tracer: trace.Tracer | None = None, meter: Meter | None = None,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self._service = service
        self._limits = limits
        # A request's server span, parent of its calls to the leader and the nodes (one trace per request, as the
        # gRPC API's interceptor makes it); a client's `traceparent` header makes it part of the client's trace.
        self._tracer = tracer or trace.get_tracer(__name__)
        self._listen = listen
        self._ssl_context = ssl_context  # None: plaintext HTTP
        # The handlers under way, to end at close: aiohttp waits shutdown_timeout_s for them, then only fails their
        # request bodies and waits as long again, so a stream went on for twice the grace (20 s against the gRPC
        # API's 10), and a router stopping with the leader away outlived baton up's window before SIGKILL.
        self._shutdown_timeout_s = shutdown_timeout_s
        self._read_timeout_s = read_timeout_s
        self._in_flight: set[asyncio.Task[Any]] = set()

        @web.middleware
        async def tracked(request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
            task = asyncio.current_task()
            if task is not None:
                self._in_flight.add(task)
            try:
                return await handler(request)
            finally:
                self._in_flight.discard(task)  # type: ignore[arg-type]

        middlewares = [tracked, *([_counted(meter)] if meter is not None else []), _openai_errors]
        if check_connection_rate is not None:
            middlewares.append(_rate_per_connection(check_connection_rate))
        self.app = app = web.Application(middlewares=middlewares,
                                         client_max_size=limits.max_prompt_bytes * _BODY_BYTES_PER_PROMPT_BYTE
                                         + (64 << 10))
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{model:.+}", self._get_model)
        app.router.add_post("/v1/completions", self._completions, expect_handler=_expect_within_limit)
        app.router.add_post("/v1/chat/completions", self._chat_completions, expect_handler=_expect_within_limit)
        # Handler cancellation: a client that hangs up cancels its generation (freeing the node).
        # A connection that has not sent a whole request head read_timeout_s after it opened (or after its last
        # answer) is closed: aiohttp's keep-alive timer runs from the connection's start and while it waits for a
        # head, so a client that sends its head a byte at a time (slowloris) cannot hold a connection for long.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=shutdown_timeout_s, keepalive_timeout=read_timeout_s,
                                     **RUNNER_OPTIONS)
        self._closing: asyncio.Task[None] | None = None
        self._cutting = False  # the grace has ended: the handlers still running are cut, not hung up on

    async def start(self) -> bool:
        """Bind and serve; False (logged) when the address cannot be bound."""
        server_log = logging.getLogger("aiohttp.server")
        if not any(isinstance(f, _UnparsedQuietly) for f in server_log.filters):
            server_log.addFilter(_UnparsedQuietly())
        host, _, port = self._listen.rpartition(":")
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host.strip("[]"), int(port), reuse_port=False,
                              ssl_context=self._ssl_context).start()
        except OSError as exc:
            log.error("cannot bind the HTTP API to %s: %s", self._listen, exc)
            return False
        log.info("serving the OpenAI-compatible HTTP API on %s://%s", "https" if self._ssl_context else "http",
                 self._listen)
        return True

    def stop_accepting(self) -> None:
        """Stop taking connections; requests in flight run on for the shutdown timeout, then are cancelled (a
        stream ends cut, its generation cancelled as when its client hangs up)."""
        if self._closing is None:
            loop = asyncio.get_running_loop()
            self._closing = loop.create_task(self._runner.cleanup())
            loop.call_later(self._shutdown_timeout_s, self._cancel_in_flight)

    def _cancel_in_flight(self) -> None:
        self._cutting = True
        for task in list(self._in_flight):
            task.cancel()

    async def close(self) -> None:
        self.stop_accepting()
        assert self._closing is not None
        await self._closing

    async def _health(self, request: web.Request) -> web.Response:
        return _json_response(200, {"status": "serving"})

    async def _list_models(self, request: web.Request) -> web.Response:
        try:
            await self._service.authorize(_authorization(request))
            await self._service.nodes_read()
        except BatonError as error:
            return _error(error)
        return _json_response(200, schema.models_json(self._service.served_models()))

    async def _get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            await self._service.authorize(_authorization(request))
            await self._service.nodes_read()
            # A 404 naming the served ones; a 503 while none is served, or this one is gone for now.
            find_model(name, self._service.models, self._service.gone_model(name))
        except BatonError as error:
            return _error(error)
        return _json_response(200, schema.model_json(next(m for m in self._service.served_models() if m.name == name)))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, schema.COMPLETIONS)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, schema.CHAT)

    def _entry(self, model: str) -> ModelEntry | None:
        """The model's entry, served or gone for now (an alternative may serve a request for it)."""
        return self._service.models.get(model) or self._service.gone_model(model)

    def _template_for_model(self, model: str) -> ChatTemplate:
        entry = self._entry(model)
        return PLAIN if entry is None else template_for(entry.tokenizer)

    def _context_for_model(self, model: str) -> int:
        entry = self._entry(model)
        return find_model(model, self._service.models).max_context_tokens if entry is None else entry.max_context_tokens

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        request[_CALL_ID] = uuid.uuid4().hex
        with self._tracer.start_as_current_span(
                f"{request.method} {request.path}", context=propagate.extract(request.headers),
                kind=trace.SpanKind.SERVER,
                attributes={"http.request.method": request.method, "url.path": request.path,
                            "baton.request_id": request[_CALL_ID]},
                record_exception=False, set_status_on_exception=False) as span:
            try:
                response = await self._generate_in_span(request, kind)
            except asyncio.CancelledError:
                if (status := request.get(_CUT_STATUS)) is not None:  # its answer was written: its status is that
                    _end_span(span, status, None if status < 500 else _cut("request"))
                raise
            except Exception as exc:  # answered by the middleware: a refusal its status, anything else 500
                # (A 413, 415 or 408 of the body's reading is a _Refused: traced as a 500, an error, helper-197.)
                status = (schema.http_status(exc.code) if isinstance(exc, BatonError)
                          else exc.status if isinstance(exc, (web.HTTPException, _Refused)) else 500)
                _end_span(span, status, exc)
                raise
            _end_span(span, response.status)
            return response

    async def _generate_in_span(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            # The key first, before anything is said of the request or done with its body (read, decompressed,
            # parsed): a caller without one is not told which models are served (a token-id prompt's context window
            # named them, helper-148) and costs the router nothing more (helper-150). The router's generate, which
            # checks it again, puts the key's tenant in the request's place.
            key_record = await self._service.authorize(_authorization(request))
        except BatonError as error:
            return _error(error)
        body = await _read_json(request, self._read_timeout_s)
        # Its id, as the client set it (request_id, X-Baton-Request-Id) or the one made for the call: said in every
        # answer's x-request-id, as OpenAI's API says its own, so that a failed call can be found in the cluster's
        # logs and traces (helper-166: no answer carried one).
        made_id = request[_CALL_ID]

        def parse(template_for_model: Callable[[str], ChatTemplate],
                  context_for_model: Callable[[str], int]) -> schema.ParsedRequest:
            parsed = schema.parse_request(kind, body, request.headers, template_for_model, context_for_model,
                                          self._limits)
            parsed.request.tenant = tenant_for(request, body)
            parsed.request.request_id = parsed.request.request_id or made_id
            # Parsed, the request is known by its own id, which every later answer says (one a header cannot carry,
            # none), and its span names as the router's generate will, where it runs (helper-193: a refusal before
            # that said the client's id while the span kept the call's).
            said = _id_header(parsed, self._limits.max_id_len).get("x-request-id")
            if said is None:
                request.pop(_CALL_ID, None)
            else:
                request[_CALL_ID] = said
            own = parsed.request.request_id
            trace.get_current_span().set_attribute(
                "baton.request_id", cluster_request_id(key_record.tenant, own) if key_record is not None else own)
            if isinstance(body, dict) and body.get(schema.TENANT_FIELD) is None:  # named as the client spelt it
                parsed.names[schema.TENANT_FIELD] = schema.TENANT_HEADER
            return parsed

        early = None
        if not self._service.has_read_nodes() or not self._service.models:
            # The model's context and template come from the nodes' registrations, which this router waits for, and
            # while none is served there are none. A request's own fields are checked first, without them: bad input
            # is refused at once, not after the wait, nor answered the 503 that says to retry it.
            early = parse(lambda _: PLAIN, lambda _: sys.maxsize)
            if kind == schema.CHAT:  # its size is the model's template's rendering, not known yet (helper-145)
                early.request.prompt = " "
            try:
                if key_record is not None:
                    early.request.tenant = key_record.tenant
                    # As generate checks it: a priority over the tenant's was answered 503 to retry (helper-190).
                    key_record.check_priority(early.request.priority)
                check_fields(early.request, self._limits)
            except BatonError as error:
                return _error(error, early.names, _id_header(early, self._limits.max_id_len))
        await self._service.nodes_read()
        if early is not None and not self._service.models:
            try:
                find_model(early.request.model, self._service.models)  # none served: the 503, to retry
            except BatonError as error:
                return _error(error, early.names, _id_header(early, self._limits.max_id_len))
        parsed = parse(self._template_for_model, self._context_for_model)
        id_header = _id_header(parsed, self._limits.max_id_len)
        builder = schema.ResponseBuilder(parsed, created=int(time.time()))
        async with aclosing(self._service.generate(parsed.request, lambda: None,
                                                   _authorization(request))) as chunks:
            try:
                # Refusals (validation, admission, no node) come before the first chunk: they get
                # their own HTTP status, streamed or not; so does a failure before a whole answer's end.
                first = await anext(chunks)
                if not parsed.stream:
                    builder.add(first)
                    if not first.finish_reason:
                        async for chunk in chunks:
                            builder.add(chunk)
                            if chunk.finish_reason:
                                break
            except BatonError as error:
                return _error(error, parsed.names, id_header)
            except asyncio.CancelledError:
                if self._cutting:  # (else its client hung up: there is no one to tell)
                    await _answer_cut(request, parsed, id_header)
                raise
            if not parsed.stream:
                # The router counts an answer delivered once it is asked for more after its last reply, so the
                # response is written first: a client gone by then (the write fails, as a stream's does) did
                # not get its answer, and the stream is closed unread.
                response = _json_response(200, builder.response(), id_header)
                await response.prepare(request)
                await response.write_eof()
                try:
                    await anext(chunks)
                except (StopAsyncIteration, BatonError):  # the answer is out: nothing more to say
                    pass
                except asyncio.CancelledError:
                    # The client closed its connection once it had the answer (aiohttp cancels the handler): the
                    # 200 is still counted and its span ended (a cancellation here skipped both, helper-116).
                    pass
                except Exception:  # a bug, but not one to answer: the client has its response
                    log.exception("HTTP %s %s failed after its answer was written", request.method, request.path)
                return response
            response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **id_header})
            await response.prepare(request)
            try:
                await _send_events(response, builder.stream_events(first))
                async for chunk in chunks:
                    await _send_events(response, builder.stream_events(chunk))
            except BatonError as error:
                # Past the headers a failure can only be an event; the openai client raises it.
                _, error_body, _ = schema.error_response(error, parsed.names)
                await _send_events(response, [*builder.held_events(), error_body])
            except asyncio.CancelledError:
                if self._cutting:  # (else its client hung up: there is no one to tell)
                    await _end_cut(request, response, parsed, builder)
                else:  # its client hung up: its headers went out, and it is counted and traced with their status
                    request[_CUT_STATUS] = response.status  # (it was neither, helper-206)
                raise
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response


def _cut(what: str) -> Unavailable:
    return Unavailable(f"the router is stopping: the {what} was cut at the end of its grace (--shutdown-grace-s); "
                       "send the request again")


async def _say_cut(request: web.Request, status: int, say: Callable[[], Awaitable[None]]) -> None:
    """say() to the client of a request the router's stop cut, within a second whatever the client (a client gone is
    told nothing); the request's status, status, is counted and traced as its answer's (_CUT_STATUS)."""
    request[_CUT_STATUS] = status
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            await say()


async def _end_cut(request: web.Request, response: web.StreamResponse, parsed: schema.ParsedRequest,
                   builder: schema.ResponseBuilder) -> None:
    """A stream the router's stop cuts at the end of its grace ends with an error event and [DONE], as a failure does:
    cut without one, the client saw a broken connection, and over HTTP/1.0 a stream that looked whole but for its
    missing [DONE] (helper-166)."""
    _, error_body, _ = schema.error_response(_cut("stream"), parsed.names)

    async def say() -> None:
        await _send_events(response, [*builder.held_events(), error_body])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    await _say_cut(request, response.status, say)


async def _answer_cut(request: web.Request, parsed: schema.ParsedRequest, id_header: Mapping[str, str]) -> None:
    """A request the router's stop cuts at the end of its grace before its answer (a whole one, or a stream's first
    chunk) is answered 503, to send again: its client got no response at all, "Remote end closed connection without
    response" (helper-173)."""
    response = _error(_cut("request"), parsed.names, id_header)

    async def say() -> None:
        await response.prepare(request)
        await response.write_eof()

    await _say_cut(request, response.status, say)


def _end_span(span: trace.Span, status: int, error: BaseException | None = None) -> None:
    """An HTTP server span's status code; an error only for a 5xx (a client's mistake is not the server's)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        if error is not None:
            span.record_exception(error)
        span.set_status(trace.StatusCode.ERROR)


async def _send_events(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    if events:
        await response.write(b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n"
                                      for e in events))


def _authorization(request: web.Request) -> str | None:
    """The request's `Authorization` header; sent several times, its values joined (and refused with --auth)."""
    return joined_authorization(request.headers.items())


async def _read_json(request: web.Request, timeout_s: float) -> object:
    """The request's JSON body; InvalidArgument naming "body" when it is none, 408 (and the connection closed) when
    it does not come in full within the read timeout."""
    try:
        async with asyncio.timeout(timeout_s):
            body = await request.read()
    except TimeoutError:
        size = "a chunked body" if request.content_length is None else f"{request.content_length} bytes"
        message = f"body={schema.shown(size)}: not received in full within {timeout_s:g} s (--http-read-timeout-s)"
        raise _Refused(408, schema.error_json(408, message, "body", "request_timeout"), close=True) from None
    raw = _decoded(request, body)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = str(exc)
        if "integer string conversion" in reason:  # Python's limit, and its advice to the server's programmer
            reason = f"a number of more than {sys.get_int_max_str_digits()} digits"
        raise InvalidArgument("body", raw[:40].decode(errors="replace"), f"not valid JSON: {reason}") from None


def _decoded(request: web.Request, raw: bytes) -> bytes:
    """The body as its Content-Encoding (none, identity, gzip or deflate; a list naming one of them beside identity)
    says to decode it, no longer than the body limit once decoded; refused naming the header or the body otherwise.
    A gzip body may hold several members, one after another, as RFC 1952 allows (helper-150: refused before), up to
    _MAX_GZIP_MEMBERS: each member's decoding copied what was decoded and what was left, so 360,000 tiny members
    (8 MB) held the router's event loop for 84 s, every other request with it (helper-179)."""
    header = request.headers.get("Content-Encoding", "")
    codings = [c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity"]
    if not codings:
        return raw
    encoding = codings[0]
    wbits = _ZLIB_WBITS.get(encoding)
    if wbits is None or len(codings) > 1:
        raise _Refused(415, schema.refusal("Content-Encoding", header, "not supported: send the body as identity, "
                                           "gzip or deflate (one of them)", 415))
    if encoding == "deflate" and raw and raw[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # a raw deflate stream without zlib's header, which clients send too
    limit = request.client_max_size
    pieces: list[bytes] = []
    size = 0
    rest = raw
    for _ in range(_MAX_GZIP_MEMBERS):
        decompressor = zlib.decompressobj(wbits)
        try:
            pieces.append(decompressor.decompress(rest, limit + 1 - size))
        except zlib.error as exc:
            raise InvalidArgument("body", f"{len(raw)} bytes", f"not valid {encoding} data (Content-Encoding: "
                                  f"{encoding}): {exc}") from None
        size += len(pieces[-1])
        if size > limit:
            raise _Refused(413, schema.refusal("body", f"{len(raw)} bytes {encoding}-encoded",
                                               f"longer than {limit} bytes once decoded", 413))
        rest = decompressor.unused_data
        if not decompressor.eof or not rest or wbits != _ZLIB_WBITS["gzip"]:
            break
    else:  # a whole member each time, and more after the last
        raise InvalidArgument("body", f"{len(raw)} bytes", f"more than {_MAX_GZIP_MEMBERS} gzip members "
                              f"(Content-Encoding: {encoding}): send it as one")
    if not decompressor.eof or rest:
        raise InvalidArgument("body", f"{len(raw)} bytes", f"not valid {encoding} data (Content-Encoding: "
                              f"{encoding}): {'it is cut short' if not decompressor.eof else 'data after its end'}")
    return b"".join(pieces)
