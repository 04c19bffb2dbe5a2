"""OpenAI's HTTP API in Baton's terms. Pure: no sockets and no clock of its own.

Request bodies become the GenerateRequest the gRPC API takes (the router's own validation then
checks them, as it checks every request); GenerateChunks become OpenAI's response objects; a
BatonError becomes OpenAI's error JSON with the HTTP status of its gRPC code.

Only what a GenerateRequest cannot even hold is refused here: a JSON value of the wrong type, a
number outside its field's wire range, text that is not Unicode, a field OpenAI has and Baton does
not serve, and a list longer than the router would take (counted before its items are converted, so
that a body's size in items costs nothing). Every refusal names the field as the client spelled it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from baton.v1 import common_pb2, router_pb2
from services.common.errors import BatonError, InvalidArgument, ResourceExhausted, shown
from services.router.chat_template import ChatMessage, ChatTemplate
from services.router.validation import DEFAULT_LIMITS, InputLimits

COMPLETIONS = "text_completion"
CHAT = "chat.completion"

_INT32 = (-(1 << 31), (1 << 31) - 1)
_UINT64 = (0, (1 << 64) - 1)
# The largest finite float32 (temperature, top_p): past it the field would hold inf, not the value sent.
_FLOAT32_MAX = 3.4028234663852886e38
# A header's integer: ASCII digits only (int() also takes "1_0" and other scripts' digits).
_HEADER_INT = re.compile(r"[+-]?[0-9]+")

# OpenAI's defaults where they differ from a GenerateRequest's zero value.
DEFAULT_TEMPERATURE = 1.0

# Baton's own fields, taken from the body (the openai client's extra_body) or from a header:
# name -> (type, header). A body field wins over its header.
BATON_FIELDS: dict[str, tuple[str, str]] = {
    "request_id": ("str", "X-Baton-Request-Id"),
    "priority": ("int32", "X-Baton-Priority"),
    "ttft_budget_ms": ("int32", "X-Baton-Ttft-Budget-Ms"),
    "tpot_budget_ms": ("int32", "X-Baton-Tpot-Budget-Ms"),
    "deadline_ms": ("int32", "X-Baton-Deadline-Ms"),
    "workflow_id": ("str", "X-Baton-Workflow-Id"),
    "step": ("int32", "X-Baton-Step"),
    "total_steps": ("int32", "X-Baton-Total-Steps"),
    "alternative_models": ("list", "X-Baton-Alternative-Models"),
    "ignore_eos": ("bool", "X-Baton-Ignore-Eos"),
}
# Those of them that a GenerateRequest takes as unset when 0.
_BUDGETS = frozenset({"ttft_budget_ms", "tpot_budget_ms", "deadline_ms"})
# The tenant is not among them: who a request is for is decided in one place (http_api.tenant_for).
TENANT_FIELD, TENANT_HEADER = "tenant", "X-Baton-Tenant"

_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
           TENANT_FIELD, *BATON_FIELDS}
_FIELDS = {
    COMPLETIONS: _COMMON | {"prompt"},
    CHAT: _COMMON | {"messages", "max_completion_tokens"},
}
# OpenAI fields Baton does not serve, by endpoint: accepted only with a value that asks for nothing, of the type
# OpenAI gives the field (compared by == alone, `best_of: true` and `presence_penalty: false` passed).
_NEUTRAL_PENALTIES: dict[str, tuple[object, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
_NEUTRAL: dict[str, dict[str, tuple[object, ...]]] = {
    COMPLETIONS: {
        **_NEUTRAL_PENALTIES,
        "logprobs": (None,),  # (0 asks for the sampled token's logprob, in OpenAI's API and vLLM's)
        "echo": (None, False),
        "best_of": (None, 1),
        "suffix": (None, ""),
    },
    CHAT: {
        **_NEUTRAL_PENALTIES,
        "logprobs": (None, False),
        "top_logprobs": (None, 0),
        "tools": (None, []),
        "tool_choice": (None, "none"),
        "parallel_tool_calls": (None, True, False),
        "response_format": (None, {"type": "text"}),
        "store": (None, False),
        "metadata": (None, {}),
        "service_tier": (None, "auto", "default"),
    },
}


def _asks_nothing(value: object, neutral: tuple[object, ...]) -> bool:
    return any(type(value) is type(allowed) and value == allowed for allowed in neutral)
_ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME = re.compile(r"[A-Za-z_][\w-]{0,63}")
# A chat message's name: OpenAI's rule. It goes into the prompt's role header (<|user name=NAME|>), where "|>" or
# a newline would end the header and forge another message's role.
_MESSAGE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ParsedRequest:
    """An OpenAI request as Baton runs it."""

    kind: str
    request: router_pb2.GenerateRequest
    stream: bool
    include_usage: bool
    # The client's name for each GenerateRequest field it spelled differently (prompt -> messages).
    names: dict[str, str] = field(default_factory=dict)


def text_value(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(name, value, f"must be a string, not {_json_type(value)}")
    try:
        value.encode()
    except UnicodeEncodeError:
        # A header's bytes that are no UTF-8 come as escaped surrogates (U+DC80..U+DCFF); JSON's "\ud800" as itself.
        raise InvalidArgument(name, value, "is not valid UTF-8" if name.startswith("X-") and any(
            "\udc80" <= c <= "\udcff" for c in value) else "is not valid Unicode (a lone surrogate)") from None
    return value


# How much of an unknown key a refusal shows.
_KEY_SHOWN = 80


def _key(prefix: str, key: str) -> str:
    """An unknown key as a field name: itself when it reads as one, else JSON-quoted ("", "a b"); cut after
    _KEY_SHOWN characters, as a value is (a 900 KB key came back whole, twice: helper-179)."""
    if len(key) > _KEY_SHOWN:
        key = f"{key[:_KEY_SHOWN]}... ({len(key)} characters)"
    return prefix + (key if _NAME.fullmatch(key) else json.dumps(key))


def _int(name: str, value: object, bounds: tuple[int, int] = _INT32) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "a number with a fraction" if isinstance(value, float) else _json_type(value)  # (not "a number")
        raise InvalidArgument(name, value, f"must be an integer, not {kind}")
    low, high = bounds
    if not low <= value <= high:  # (the side it is out on: "[-2147483648, ...]" read oddly for max_tokens=2^40)
        raise InvalidArgument(name, value, f"out of range: at most {high}" if value > high
                              else f"out of range: at least {low}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(name, value, f"must be a number, not {_json_type(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        raise InvalidArgument(name, value, "out of range") from None
    if math.isfinite(number) and abs(number) > _FLOAT32_MAX:  # (nan and inf the router refuses as they are)
        raise InvalidArgument(name, value, f"out of range: at most {_FLOAT32_MAX:g} in magnitude (a 32-bit float)")
    return number


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(name, value, f"must be true or false, not {_json_type(value)}")
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _strings(name: str, value: object, max_items: int, unit: str) -> list[str]:
    if not isinstance(value, list):
        raise InvalidArgument(name, value, f"must be an array of strings, not {_json_type(value)}")
    if len(value) > max_items:
        raise InvalidArgument(name, f"{len(value)} {unit}", f"at most {max_items}")
    return [text_value(f"{name}[{i}]", item) for i, item in enumerate(value)]


def _from_header(name: str, kind: str, header: str, raw: str) -> object:
    """A header's text as the value of its field."""
    if kind == "str":
        return raw
    if kind == "list":
        return [part.strip() for part in raw.split(",") if part.strip()]
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered not in ("true", "false", "1", "0"):
            raise InvalidArgument(header, raw, "must be true or false")
        return lowered in ("true", "1")
    if not _HEADER_INT.fullmatch(raw.strip()):
        raise InvalidArgument(header, raw, "must be an integer (ASCII digits)")
    return int(raw.strip())


def parse_request(kind: str, body: object, headers: Mapping[str, str],
                  template_for_model: Callable[[str], ChatTemplate], context_for_model: Callable[[str], int],
                  limits: InputLimits = DEFAULT_LIMITS) -> ParsedRequest:
    """The GenerateRequest for an OpenAI completions (kind COMPLETIONS) or chat (CHAT) body;
    InvalidArgument naming the client's field otherwise. The tenant is left to the caller.
    context_for_model: a model's context window in tokens (NotFound for a model not served), which
    bounds a prompt of token ids."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", body, f"must be a JSON object, not {_json_type(body)}")
    neutral = _NEUTRAL[kind]
    for key in body:
        if key not in _FIELDS[kind] and key not in neutral:
            raise InvalidArgument(_key("", key), body[key], "unknown field")
        if key in neutral and not _asks_nothing(body[key], neutral[key]):
            raise InvalidArgument(key, body[key], "not supported by Baton")
    request = router_pb2.GenerateRequest()
    names: dict[str, str] = {}
    if body.get("model") is None:
        raise InvalidArgument("model", None, "required")
    request.model = text_value("model", body["model"])

    if body.get("n") is not None and _int("n", body["n"]) != 1:
        raise InvalidArgument("n", body["n"], "only 1 is supported")
    stream = body.get("stream") is not None and _bool("stream", body["stream"])
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidArgument("stream_options", options, f"must be an object, not {_json_type(options)}")
        if options and not stream:  # as vLLM refuses it: it would be silently ignored
            raise InvalidArgument("stream_options", options, "only allowed when stream is true")
        for key in options:
            if key not in ("include_usage", "include_obfuscation"):
                raise InvalidArgument(_key("stream_options.", key), options[key], "unknown field")
        if options.get("include_usage") is not None:
            include_usage = _bool("stream_options.include_usage", options["include_usage"])
        if options.get("include_obfuscation") is not None:
            # OpenAI pads each chunk against a side channel unless told false; Baton pads none, so either value asks
            # for what it gives (the openai client offers the field: false was refused, helper-188).
            _bool("stream_options.include_obfuscation", options["include_obfuscation"])

    limit_name = "max_tokens"
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        limit_name = "max_completion_tokens"  # OpenAI's newer name wins over the deprecated one
        if body.get("max_tokens") is not None and _int("max_tokens", body["max_tokens"]) <= 0:
            # Checked as if it counted, as OpenAI and vLLM check it (helper-166: -5 beside it was taken).
            raise InvalidArgument("max_tokens", body["max_tokens"], "must be positive")
    if body.get(limit_name) is not None:
        request.max_tokens = _int(limit_name, body[limit_name])
        names["max_tokens"] = limit_name
    temperature = body.get("temperature")
    request.temperature = DEFAULT_TEMPERATURE if temperature is None else _number("temperature", temperature)
    if body.get("top_p") is not None:
        request.top_p = _number("top_p", body["top_p"])
        # (Judged as sent, not as the 32-bit field holds it: the router would name 1e-50 as 0.0.)
        if request.top_p == 0 or not 0 < body["top_p"] <= 1:
            raise InvalidArgument("top_p", body["top_p"], "must be greater than 0 and at most 1, as vLLM asks (for the "
                                  "likeliest token only, set temperature to 0)")
    if body.get("seed") is not None:
        request.seed = _int("seed", body["seed"], _UINT64)
    stop = body.get("stop")
    if isinstance(stop, str):
        request.stop.append(text_value("stop", stop))
        names["stop[0]"] = "stop"
    elif stop is not None:
        request.stop.extend(_strings("stop", stop, limits.max_stop_sequences, "sequences"))
    if body.get("user") is not None:
        text_value("user", body["user"])

    for name, (type_name, header) in BATON_FIELDS.items():
        value = body.get(name)
        if value is None and header in headers:
            value = _from_header(name, type_name, header, headers[header])
            names[name] = header
        if value is None:
            continue
        spelled = names.get(name, name)
        if type_name == "str":
            setattr(request, name, text_value(spelled, value))
        elif type_name == "int32":
            number = _int(spelled, value)
            if number == 0 and name in _BUDGETS:
                # The request's field takes 0 as unset (the cluster's default, or no deadline): a client that sent
                # 0 asked for the tightest, and got none (helper-157).
                raise InvalidArgument(spelled, value, "must be positive; leave it out for " + (
                    "no deadline" if name == "deadline_ms" else "the cluster's default"))
            setattr(request, name, number)
        elif type_name == "bool":
            setattr(request, name, _bool(spelled, value))
        else:
            request.alternative_models.extend(_strings(spelled, value, limits.max_alternative_models, "models"))

    if kind == COMPLETIONS:
        _set_prompt(request, body.get("prompt"), names, context_for_model, limits.max_prompt_bytes)
    else:
        messages = _messages(body.get("messages"), limits.max_messages, limits.max_prompt_bytes)
        request.prompt = template_for_model(request.model).render(messages)
        names["prompt"] = "messages"
    return ParsedRequest(kind=kind, request=request, stream=stream, include_usage=include_usage, names=names)


def _set_prompt(request: router_pb2.GenerateRequest, prompt: object, names: dict[str, str],
                context_for_model: Callable[[str], int], max_tokens: int) -> None:
    """A completions prompt: text, token ids, or a batch of one of either."""
    if prompt is None:
        raise InvalidArgument("prompt", None, "required")
    # A batch opens with a prompt; token ids with an id (only the first item is looked at: a list is as
    # long as the body allows, and a batch of more than one is refused whatever it holds).
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise InvalidArgument("prompt", f"{len(prompt)} prompts", "only one prompt per request is supported")
        prompt = prompt[0]
        names["prompt"] = names["prompt_token_ids"] = "prompt[0]"
    if isinstance(prompt, str):
        request.prompt = text_value(names.get("prompt", "prompt"), prompt)
        return
    spelled = names.setdefault("prompt_token_ids", "prompt")
    if not isinstance(prompt, list):
        raise InvalidArgument(spelled, prompt, f"must be a string or an array of token ids, not {_json_type(prompt)}")
    if len(prompt) > max_tokens:
        # Whatever the model's context, which is not known while the router serves no model (3.9 million ids were
        # each converted, then answered 503 to retry, helper-188): as many as a text prompt can have, a token
        # being a byte at least.
        raise InvalidArgument(spelled, f"{len(prompt)} tokens", f"more than {max_tokens}, the most a text prompt "
                              "within --max-prompt-bytes can have")
    context = context_for_model(request.model)
    if len(prompt) >= context:  # as the router's validation refuses it, but before a single id is converted
        raise InvalidArgument(spelled, f"{len(prompt)} tokens", f"does not fit the context window of {context}")
    request.prompt_token_ids.ids.extend(_int(f"{spelled}[{i}]", t, (0, _INT32[1])) for i, t in enumerate(prompt))
    if not prompt:
        request.prompt_token_ids.SetInParent()


def _messages(value: object, max_messages: int, max_prompt_bytes: int) -> list[ChatMessage]:
    """The chat's messages, refused by their content's size before the template renders them: rendering costs time in
    proportion to it (one 7 MB body held the router 3 s, every stream beside it stalled, helper-188), and only adds
    to it (headers, escapes), so content over the prompt's limit is a prompt over it."""
    if value is None:
        raise InvalidArgument("messages", None, "required")
    if not isinstance(value, list):
        raise InvalidArgument("messages", value, f"must be an array of messages, not {_json_type(value)}")
    if not value:
        raise InvalidArgument("messages", value, "must not be empty")
    if len(value) > max_messages:
        raise InvalidArgument("messages", f"{len(value)} messages", f"at most {max_messages}")
    num_parts = 0
    num_characters = 0  # (characters bound a text's UTF-8 bytes from below)
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument(where, message, f"must be an object, not {_json_type(message)}")
        for key in message:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id", "refusal"):
                raise InvalidArgument(_key(f"{where}.", key), message[key], "unknown field")
            if key in ("tool_calls", "refusal") and message[key] not in (None, [], ""):
                raise InvalidArgument(f"{where}.{key}", message[key], "not supported by Baton")
        role = text_value(f"{where}.role", message.get("role"))
        if role not in _ROLES:
            raise InvalidArgument(f"{where}.role", role, f"must be one of {', '.join(_ROLES)}")
        # A tool's answer names the call it answers, as OpenAI's API asks (a tool message with its id was refused and
        # one without served, helper-188); the id itself is not rendered, as no call of Baton's made it.
        call_id = message.get("tool_call_id")
        if role == "tool":
            if call_id is None or call_id == "":
                raise InvalidArgument(f"{where}.tool_call_id", call_id, "required for a tool message")
            text_value(f"{where}.tool_call_id", call_id)
        elif call_id not in (None, ""):
            raise InvalidArgument(f"{where}.tool_call_id", call_id, "only a tool message has one")
        name = "" if message.get("name") is None else text_value(f"{where}.name", message["name"])
        if name and not _MESSAGE_NAME.fullmatch(name):
            raise InvalidArgument(f"{where}.name", name, "must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'")
        if message.get("content") is None and role != "assistant":  # only an assistant's may be null (OpenAI's API)
            raise InvalidArgument(f"{where}.content", None, f"required for a {role} message")
        content = message.get("content")
        if isinstance(content, list):
            num_parts += len(content)
            if num_parts > max_messages:
                raise InvalidArgument(f"{where}.content", f"{len(content)} parts",
                                      f"more than {max_messages} content parts in all messages")
        text = _content(where, content)
        num_characters += len(text)
        if num_characters > max_prompt_bytes:
            raise InvalidArgument("messages", f"{num_characters}+ characters of content",
                                  f"longer than {max_prompt_bytes} bytes, the most a prompt may have")
        messages.append(ChatMessage(role=role, content=text, name=name))
    return messages


def _content(where: str, content: object) -> str:
    """A message's text: a string, or text parts (joined with newlines, as vLLM joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return text_value(f"{where}.content", content)
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content", content,
                              f"must be a string or an array of parts, not {_json_type(content)}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidArgument(at, part, f"must be an object, not {_json_type(part)}")
        if part.get("type") != "text":
            raise InvalidArgument(f"{at}.type", part.get("type"), "only text parts are supported")
        for key in part:
            if key not in ("type", "text"):
                raise InvalidArgument(_key(f"{at}.", key), part[key], "unknown field")
        texts.append(text_value(f"{at}.text", part.get("text")))
    return "\n".join(texts)


# --- responses ------------------------------------------------------------------------------

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class StopTrimmer:
    """Text as OpenAI returns it: without the stop string that ended it (Baton's own streams keep
    it). While streaming, as many characters as the longest stop string are held back until the
    next text shows they are not the stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = sorted(stops, key=len, reverse=True)
        self._hold = len(self._stops[0]) if self._stops else 0
        self._pending = ""

    def feed(self, text: str, finish_reason: int) -> str:
        """The text to send now, given the next chunk's text and its finish reason (0: not finished)."""
        self._pending += text
        if not finish_reason:
            cut = max(0, len(self._pending) - self._hold)
            out, self._pending = self._pending[:cut], self._pending[cut:]
            return out
        out, self._pending = self._pending, ""
        if finish_reason == common_pb2.FINISH_REASON_STOP:
            for stop in self._stops:
                if out.endswith(stop):
                    return out[:-len(stop)]
        return out

    def held(self) -> str:
        """The text held back, now given up: the stream ends without a finish (an error), so no stop completed."""
        out, self._pending = self._pending, ""
        return out


def usage_json(usage: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def baton_json(chunk: router_pb2.GenerateChunk, seed: int | None, node_ids: list[str]) -> dict[str, Any]:
    """What Baton adds to a finished response: how the request ran (the openai client keeps
    unknown fields; read them with `response.model_extra["baton"]`)."""
    return {
        "request_id": chunk.request_id,
        "seed": seed,
        "node_ids": node_ids,
        "num_migrations": chunk.usage.num_migrations,
        "recomputed_tokens": chunk.usage.recomputed_tokens,
        "gpu_ms": chunk.usage.gpu_ms,
        "inexact": chunk.inexact,
    }


class ResponseBuilder:
    """OpenAI objects, streamed chunks or one whole response, from one request's GenerateChunks."""

    def __init__(self, parsed: ParsedRequest, created: int) -> None:
        self._kind = parsed.kind
        self._include_usage = parsed.include_usage
        self._created = created
        self._trimmer = StopTrimmer(list(parsed.request.stop))
        self._text: list[str] = []
        self._seed: int | None = None
        self._node_ids: list[str] = []
        self._id = ""
        self._model = parsed.request.model
        self.finish_reason = ""
        self.last: router_pb2.GenerateChunk | None = None

    def _note(self, chunk: router_pb2.GenerateChunk) -> str:
        """Record chunk; the text it adds to the response."""
        if not self._id:
            self._id = ("cmpl-" if self._kind == COMPLETIONS else "chatcmpl-") + chunk.request_id
        if chunk.model:
            self._model = chunk.model
        if chunk.HasField("seed"):
            self._seed = chunk.seed
        if chunk.node_id and (not self._node_ids or self._node_ids[-1] != chunk.node_id):
            self._node_ids.append(chunk.node_id)
        self.last = chunk
        if chunk.finish_reason:
            self.finish_reason = _FINISH_REASONS.get(chunk.finish_reason, "stop")
        return self._trimmer.feed(chunk.text, chunk.finish_reason)

    def _envelope(self, streamed: bool) -> dict[str, Any]:
        kind = self._kind + (".chunk" if streamed and self._kind == CHAT else "")
        return {"id": self._id, "object": kind, "created": self._created, "model": self._model}

    def stream_events(self, chunk: router_pb2.GenerateChunk) -> list[dict[str, Any]]:
        """The stream's events for chunk (the chat stream's first one opens with the role)."""
        is_first = not self._id
        text = self._note(chunk)
        events = []
        finish = self.finish_reason or None
        if self._kind == CHAT:
            if is_first:
                events.append(self._chunk_event({"role": "assistant", "content": ""}, None))
            if text or finish:
                events.append(self._chunk_event({"content": text} if text else {}, finish))
        elif text or finish:
            events.append(self._chunk_event(text, finish))
        if finish:
            events[-1]["baton"] = baton_json(chunk, self._seed, self._node_ids)
            if self._include_usage:
                events.append({**self._envelope(True), "choices": [], "usage": usage_json(chunk.usage)})
        return events

    def held_events(self) -> list[dict[str, Any]]:
        """The event of the text held back for a stop string, for a stream that ends with an error event instead of a
        finish: what was generated before the failure is sent before it (helper-182: up to the longest stop's
        length was lost, where the same request without stop got its text)."""
        text = self._trimmer.held()
        if not text or not self._id:
            return []
        return [self._chunk_event({"content": text} if self._kind == CHAT else text, None)]

    def _chunk_event(self, delta: dict[str, Any] | str, finish: str | None) -> dict[str, Any]:
        if self._kind == CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        event = {**self._envelope(True), "choices": [choice]}
        if self._include_usage:
            event["usage"] = None
        return event

    def add(self, chunk: router_pb2.GenerateChunk) -> None:
        """Take chunk into the whole response."""
        self._text.append(self._note(chunk))

    def response(self) -> dict[str, Any]:
        """The whole response, once the last chunk was added."""
        assert self.last is not None
        text = "".join(self._text)
        if self._kind == CHAT:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
        return {**self._envelope(False), "choices": [choice], "usage": usage_json(self.last.usage),
                "baton": baton_json(self.last, self._seed, self._node_ids)}


def models_json(models: Sequence[router_pb2.ServedModel]) -> dict[str, Any]:
    return {"object": "list", "data": [model_json(m) for m in models]}


def model_json(model: router_pb2.ServedModel) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "baton",
            "max_model_len": model.max_context_tokens, "num_warm_nodes": model.num_warm_nodes}


# --- errors ---------------------------------------------------------------------------------

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    # The request's own deadline_ms passed: the client's limit, not the server failing.
    grpc.StatusCode.DEADLINE_EXCEEDED: 408,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
}
# A status message that begins with what it refuses: "field=value: reason".
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]-]*)=")


# The openai SDK sends a request again on a 408, 409, 429 or 5xx, twice by default, unless the response says
# `x-should-retry: false` (its own header, not a standard one); every error response here says true or false.
SHOULD_RETRY_HEADER = "x-should-retry"


def http_status(code: grpc.StatusCode) -> int:
    return _HTTP_STATUS.get(code, 500)


def is_worth_retrying(status: int, retry_after_ms: int | None = None) -> bool:
    """Whether the same request sent again may succeed: a 429 that says when to come back, or a 5xx but 501 (no node
    or leader for now, a failure). Not a 408 (its deadline_ms passed, and would again), a 409 (its id runs already,
    or a newer request of its id took over: a retry would race them), nor any other refusal of the request as sent."""
    if status == 429:
        return retry_after_ms is not None
    return status >= 500 and status != 501


# When to send a 503 again: a scheduler failover, a node's start or a model's load takes seconds, and without a hint
# the openai SDK's two retries came 0.5 and 1 s apart, both spent within 1.3 s of the refusal (helper-166).
UNAVAILABLE_RETRY_AFTER_MS = 2000


def retry_headers(status: int, retry_after_ms: int | None = None) -> dict[str, str]:
    """The headers that tell a client whether, and when, to send a refused request again: a 429's hint, or
    UNAVAILABLE_RETRY_AFTER_MS for a 503."""
    if status == 503 and retry_after_ms is None:
        retry_after_ms = UNAVAILABLE_RETRY_AFTER_MS
    headers = {SHOULD_RETRY_HEADER: "true" if is_worth_retrying(status, retry_after_ms) else "false"}
    if retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(retry_after_ms)
    return headers


def error_json(status: int, message: str, param: str | None, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(error: BatonError, names: Mapping[str, str] | None = None
                   ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, OpenAI error JSON, headers) for error; the field it names spelled as the client
    spelled it (names: GenerateRequest field -> the client's)."""
    status = http_status(error.code)
    message = str(error)
    param = None
    if isinstance(error, InvalidArgument):
        param = error.field
    elif match := _FIELD_PREFIX.match(message):
        param = match.group(1)
    if param is not None:
        spelled = _client_name(param, names or {})
        if spelled != param:
            message = spelled + message[len(param):]
            param = spelled
    headers = retry_headers(status, error.retry_after_ms if isinstance(error, ResourceExhausted) else None)
    if status == 401:  # as RFC 7235 asks of every 401 (and docs/security.md said it did; helper-125)
        headers["WWW-Authenticate"] = 'Bearer realm="baton"'
    return status, error_json(status, message, param, error.code.name.lower()), headers


def _client_name(field_path: str, names: Mapping[str, str]) -> str:
    """field_path ("prompt_token_ids[3]") in the client's spelling ("prompt[3]")."""
    if field_path in names:
        return names[field_path]
    head, bracket, rest = field_path.partition("[")
    if bracket and head in names:
        return f"{names[head]}[{rest}"
    return field_path


def refusal(field_name: str, value: object, reason: str, status: int = 400) -> dict[str, Any]:
    """The error JSON for a refusal before any GenerateRequest exists (the body itself)."""
    return error_json(status, f"{field_name}={shown(value)}: {reason}", field_name, "invalid_argument")
