"""Check a client's GenerateRequest and turn it into what the node agent needs. Pure.

Sizes are checked before anything costs memory or time in proportion to them (tokenizing, copying
token lists): a request is refused on its lengths alone when they cannot be served.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from baton.protocol import MAX_ALTERNATIVE_MODELS
from baton.v1 import common_pb2, router_pb2
from services.common.errors import InvalidArgument, NotFound, Unavailable, shown
from services.common.request_context import check_context
from services.common.sampling_checks import check_temperature_top_p, check_vocabulary
from services.router.tokenizer import TOKENIZERS


@dataclass(frozen=True)
class InputLimits:
    """Bounds on what one request may carry, beyond its model's context window."""

    # UTF-8 bytes of a text prompt, whatever the model's context.
    max_prompt_bytes: int = 1 << 20
    max_stop_sequences: int = 16
    # UTF-8 bytes of all stop strings together.
    max_stop_bytes: int = 4096
    # Characters of request_id, tenant and workflow_id (each keys state kept per request, tenant, task).
    max_id_len: int = 128
    # Models a request may accept instead of its own.
    max_alternative_models: int = MAX_ALTERNATIVE_MODELS
    # Messages of an HTTP chat request, and their content parts in all.
    max_messages: int = 4096


DEFAULT_LIMITS = InputLimits()

# Unicode's control characters (category Cc): C0, DEL and C1.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")

# How far past resume.elapsed_ms a resent request's first or last token may lie and still be taken as a client's
# rounding (its two clock reads truncated apart): accepted as elapsed_ms. Further off, the timeline is refused.
RESUME_ROUNDING_MS = 1000

# The shortest deadline_ms a fresh request may ask for. No answer comes sooner than the router's own path (the
# leader's placement, then the node's first step through a second hop: 7 to 8 ms at p50 and p99 in
# docs/benchmarks.md), so a shorter deadline can only pass: refused here, before the timer starts, it gets one answer
# rather than 408 (the router's timer) or 400 (the leader's floor), whichever came first. A ttft_budget_ms under it
# likewise: the leader, which sees only the node's part, admitted a 7 ms budget and the request ran late, a failed
# task, or answered a 5 ms one 429 with a retry hint, and every retry failed as well.
MIN_DEADLINE_MS = 10


@dataclass(frozen=True)
class ModelEntry:
    """A model as the cluster's registrations describe it."""

    name: str
    max_context_tokens: int
    tokenizer: str
    vocab_size: int
    num_warm_nodes: int


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    model: ModelEntry
    prompt_token_ids: list[int]
    # Whole-request sampling: max_tokens counts the resumed tokens too.
    sampling: common_pb2.SamplingParams
    # Completion tokens the client already has (a resumed request).
    resume_token_ids: list[int]
    # Models accepted instead of `model` that can hold the request (none for a resumed one).
    alternative_models: tuple[str, ...] = ()


def find_model(name: str, models: Mapping[str, ModelEntry], gone: ModelEntry | None = None,
               also: str = "") -> ModelEntry:
    """The served model called name; NotFound naming it otherwise, or Unavailable while no model is served at all or
    while name is one served lately (gone: its entry then) whose nodes are all gone (also: what else the client
    should know then)."""
    model = models.get(name)
    if model is None and not models:
        # No node serves anything: none has registered yet (a router or cluster just started, registrations late), or
        # every one is gone. Either passes, and NOT_FOUND is a code no client retries.
        raise Unavailable(f"model={shown(name)}: no model is served by this cluster now: no node that serves one is "
                          "registered (starting, or all gone); retry")
    if model is None and gone is not None:
        # Its nodes died, drained or restart: an outage to retry through, not a name the client got wrong.
        raise Unavailable(f"model={shown(name)}: served by this cluster lately, by no node now (its nodes are gone or "
                          f"restarting){also}; retry")
    if model is None:
        known = ", ".join(sorted(models)) or "none"
        if len(known) > 400:
            known = known[:397] + "..."
        raise NotFound(f"model={shown(name)}: not served by this cluster (served: {known})")
    return model


def validate(
    request: router_pb2.GenerateRequest,
    models: dict[str, ModelEntry],
    default_max_tokens: int,
    rng: random.Random,
    limits: InputLimits = DEFAULT_LIMITS,
    gone: Callable[[str], ModelEntry | None] = lambda _: None,
) -> ValidRequest:
    """The checked request; InvalidArgument or NotFound naming the field and value otherwise, Unavailable for a model
    served by no node now (none at all, or gone(name) names it: served lately) unless an alternative serves it."""
    if not request.model:
        raise InvalidArgument("model", request.model, "required")
    # The model first: a mistyped name is what the client is told of, whatever else is wrong (helper-145). But while
    # no model is served at all that is UNAVAILABLE, to retry: bad fields first then, never worth a retry
    # (helper-147). A model gone for now (gone: served lately) is checked as it was served, and refused UNAVAILABLE
    # only after every check (a request it could never serve gets the 400, not a retry for an hour: helper-153),
    # unless a model of its alternative_models that is served can hold it.
    num_bytes = check_fields(request, limits) if not models else None
    earlier = gone(request.model) if request.model not in models else None
    model = earlier if earlier is not None else find_model(request.model, models)
    tokenizer = TOKENIZERS.get(model.tokenizer)
    if tokenizer is None:
        raise InvalidArgument("model", request.model, f"tokenizer {model.tokenizer!r} unsupported by this router")
    if num_bytes is None:
        num_bytes = check_fields(request, limits)

    context = model.max_context_tokens
    if request.WhichOneof("input") == "prompt":
        if num_bytes > context * tokenizer.max_bytes_per_token:
            raise InvalidArgument("prompt", f"{num_bytes} bytes", f"does not fit the context window of {context} "
                                  f"(at most {context * tokenizer.max_bytes_per_token} bytes)")
        prompt = tokenizer.encode(request.prompt)
    else:
        if len(request.prompt_token_ids.ids) >= context:
            raise InvalidArgument("prompt_token_ids", f"{len(request.prompt_token_ids.ids)} tokens",
                                  f"does not fit the context window of {context}")
        prompt = list(request.prompt_token_ids.ids)
        check_vocabulary("prompt_token_ids", prompt, model.vocab_size)
    if len(request.resume.token_ids) >= context:
        raise InvalidArgument("resume.token_ids", f"{len(request.resume.token_ids)} tokens",
                              f"does not fit the context window of {context}")
    resumed = list(request.resume.token_ids)
    check_vocabulary("resume.token_ids", resumed, model.vocab_size)

    if len(prompt) >= context:
        raise InvalidArgument("prompt", f"{len(prompt)} tokens", f"does not fit the context window of {context}")
    room = context - len(prompt)
    if request.HasField("max_tokens"):
        if request.max_tokens > room:
            raise InvalidArgument(
                "max_tokens", request.max_tokens,
                f"prompt ({len(prompt)} tokens) + max_tokens exceeds the context window of {context}",
            )
        max_tokens = request.max_tokens
    else:
        max_tokens = min(default_max_tokens, room)
    if len(resumed) > max_tokens:
        raise InvalidArgument("resume.token_ids", f"{len(resumed)} tokens", f"more than max_tokens={max_tokens}")

    sampling = common_pb2.SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p if request.HasField("top_p") else 1.0,
        max_tokens=max_tokens,
        stop=[common_pb2.TokenSequence(token_ids=tokenizer.encode(s)) for s in request.stop],
        ignore_eos=request.ignore_eos,
    )
    if request.HasField("seed"):
        sampling.seed = request.seed
    elif request.temperature > 0:
        # A sampled request gets a seed here, so that any replay of it is exact: of 53 bits, so that every JSON
        # client holds it exactly (a 63-bit one, read as a double by jq or JavaScript, came back rounded and
        # replayed other text).
        sampling.seed = rng.getrandbits(53)
    # A resume goes on with its own model's tokens only (one resent before its first token may move).
    offered = bool(request.alternative_models and models and not resumed)
    alternatives = _alternatives(request, models, model, len(prompt) + max_tokens, gone) if offered else ()
    if earlier is not None and not alternatives:  # raises: the model is gone, and no alternative takes it
        find_model(request.model, models, earlier,
                   ", and no model of alternative_models that is served can hold it" if offered else "")
    return ValidRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        model=model,
        prompt_token_ids=prompt,
        sampling=sampling,
        resume_token_ids=resumed,
        alternative_models=alternatives,
    )


def check_fields(request: router_pb2.GenerateRequest, limits: InputLimits = DEFAULT_LIMITS) -> int:
    """What validate checks of a request without its model: InvalidArgument naming the field and value. A router that
    has not read the served models yet refuses bad input with it at once, not after its wait for them. Returns a text
    prompt's UTF-8 bytes (0 for token ids), which validate judges against the model's context."""
    if not request.model:
        raise InvalidArgument("model", request.model, "required")
    for field in ("request_id", "tenant", "workflow_id"):
        if len(getattr(request, field)) > limits.max_id_len:
            raise InvalidArgument(field, getattr(request, field),
                                  f"{len(getattr(request, field))} characters, longer than {limits.max_id_len}")
        # They reach logs and `baton status` as they are: an escape sequence there would act on an operator's terminal.
        if bad := _CONTROL.search(getattr(request, field)):
            raise InvalidArgument(field, getattr(request, field),
                                  f"control character {bad.group()!r} at {bad.start()}: not allowed")
        if getattr(request, field) != getattr(request, field).strip():
            # An HTTP header drops it: the openai client read x-request-id " ab " as "ab", an id no log had
            # (helper-188); and " alice" would be a tenant of its own.
            raise InvalidArgument(field, getattr(request, field), "must not begin or end with white space")
    _check_stop_sizes(request, limits)
    if len(request.alternative_models) > limits.max_alternative_models:
        raise InvalidArgument("alternative_models", f"{len(request.alternative_models)} models",
                              f"at most {limits.max_alternative_models}")
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidArgument("prompt", "", "required (prompt or prompt_token_ids)")
    num_bytes = 0
    if kind == "prompt":
        if not request.prompt:
            raise InvalidArgument("prompt", request.prompt, "must not be empty")
        # Lengths first: characters bound the UTF-8 bytes from below, so a huge prompt is refused without encoding it.
        prompt = request.prompt
        num_bytes = len(prompt) if len(prompt) > limits.max_prompt_bytes else len(prompt.encode())
        if num_bytes > limits.max_prompt_bytes:
            raise InvalidArgument("prompt", f"{num_bytes} bytes", f"longer than {limits.max_prompt_bytes} bytes")
    elif not request.prompt_token_ids.ids:
        raise InvalidArgument("prompt_token_ids", [], "must not be empty")
    resumed = request.resume.token_ids
    if request.resume.elapsed_ms < 0:
        raise InvalidArgument("resume.elapsed_ms", request.resume.elapsed_ms, "must not be negative")
    # (A first token up to RESUME_ROUNDING_MS later than elapsed_ms, a client's rounding, is taken as elapsed_ms.)
    latest_ms = request.resume.elapsed_ms + RESUME_ROUNDING_MS
    if request.resume.HasField("first_token_ms") and not (resumed and 0 <= request.resume.first_token_ms <= latest_ms):
        raise InvalidArgument("resume.first_token_ms", request.resume.first_token_ms,
                              f"must not be negative or later than resume.elapsed_ms ({request.resume.elapsed_ms}) "
                              f"by more than {RESUME_ROUNDING_MS} ms, and comes with resume.token_ids")
    # (Nor a last one before the first token, or after elapsed_ms, within as much: taken as the nearer of the two.)
    if request.resume.HasField("last_token_ms"):
        last_ms = request.resume.last_token_ms
        if not request.resume.HasField("first_token_ms"):
            raise InvalidArgument("resume.last_token_ms", last_ms, "comes with resume.first_token_ms")
        first_ms = min(request.resume.first_token_ms, request.resume.elapsed_ms)  # as it is taken
        if not max(0, first_ms - RESUME_ROUNDING_MS) <= last_ms <= latest_ms:
            raise InvalidArgument("resume.last_token_ms", last_ms,
                                  f"must lie between the first token ({first_ms} ms) and resume.elapsed_ms "
                                  f"({request.resume.elapsed_ms}), within {RESUME_ROUNDING_MS} ms, and not below 0")
    if request.HasField("max_tokens") and request.max_tokens <= 0:
        raise InvalidArgument("max_tokens", request.max_tokens, "must be positive")
    check_temperature_top_p(request.temperature, request.top_p)
    if request.HasField("top_p") and request.top_p == 0:
        # Sent, 0 would be taken as unset (1: every token) where the client asked for the fewest: the top token only.
        raise InvalidArgument("top_p", request.top_p, "must be greater than 0 (unset: 1); a value float32 holds as "
                                                      "0 is 0")
    check_context(request)
    # A resent request's deadline_ms is what its client had left (its own arithmetic): however little, it is timed.
    for name, budget_ms in (("deadline_ms", request.deadline_ms), ("ttft_budget_ms", request.ttft_budget_ms)):
        if 0 < budget_ms < MIN_DEADLINE_MS and not request.HasField("resume"):
            raise InvalidArgument(name, budget_ms, f"below the floor of {MIN_DEADLINE_MS} ms: no answer comes sooner "
                                  "than a placement and a node's first step (ask for more, or none)")
    if resumed and request.temperature > 0 and not request.HasField("seed"):
        raise InvalidArgument("seed", None, "required to resume a sampled request (the first chunk carried it)")
    return num_bytes


def _alternatives(request: router_pb2.GenerateRequest, models: dict[str, ModelEntry], model: ModelEntry,
                  num_tokens: int, gone: Callable[[str], ModelEntry | None]) -> tuple[str, ...]:
    """The alternative models that could serve the request: served, same tokenizer, context large enough. One served
    lately and by no node now (gone) is passed over: the request may be served without it."""
    accepted = []
    for i, name in enumerate(request.alternative_models):
        alternative = models.get(name)
        if alternative is None and gone(name) is not None:
            continue
        if alternative is None:
            raise InvalidArgument(f"alternative_models[{i}]", name, f"not served by this cluster "
                                  f"(served: {', '.join(sorted(models))})")
        if alternative.tokenizer != model.tokenizer:
            raise InvalidArgument(f"alternative_models[{i}]", name, f"tokenizer {alternative.tokenizer!r} differs "
                                  f"from {model.name}'s {model.tokenizer!r}")
        if alternative.max_context_tokens >= num_tokens and name != model.name and name not in accepted:
            accepted.append(name)
    return tuple(accepted)


def _check_stop_sizes(request: router_pb2.GenerateRequest, limits: InputLimits) -> None:
    """Stop strings: how many, none empty, and their UTF-8 bytes together (counted before encoding)."""
    if len(request.stop) > limits.max_stop_sequences:
        raise InvalidArgument("stop", f"{len(request.stop)} sequences", f"at most {limits.max_stop_sequences}")
    total = 0
    for i, stop in enumerate(request.stop):
        if not stop:
            raise InvalidArgument(f"stop[{i}]", stop, "must not be empty")
        total += len(stop) if len(stop) > limits.max_stop_bytes else len(stop.encode())
        if total > limits.max_stop_bytes:
            raise InvalidArgument("stop", f"{total}+ bytes in {len(request.stop)} sequences",
                                  f"at most {limits.max_stop_bytes} bytes together")
