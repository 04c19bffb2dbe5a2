"""A request for an id the node agent is running, one condition at a time: a resume the engine will take as surely as
it took the running stream takes that stream's place (which ends ABORTED); a fresh request, or a resume that cannot
be that request (another prompt, another cache salt), is refused ALREADY_EXISTS; any other resume is refused
UNAVAILABLE with STREAM_HELD_KEY naming the node (well, not failed: its router places
the resume elsewhere), and the running stream goes on."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from baton.protocol import ORIGIN_KEY, STREAM_HELD_KEY
from baton.v1 import common_pb2, node_agent_pb2
from services.node_agent.servicer import NodeAgentService
from tests.unit.test_node_agent_stream import MODEL, _node

pytestmark = pytest.mark.timeout(30)

PROMPT = [97] * 40
MAX_TOKENS = 400  # the running stream is still decoding whenever a test looks (the engine takes a step a loop turn)
VOCAB_SIZE = 257  # sim-llama-3-8b's


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: dict[str, str]) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


class _Context:
    """The part of a servicer context that Generate uses: abort, keeping the status and its trailing metadata."""

    async def abort(self, code: grpc.StatusCode, details: str,
                    trailing_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        raise _Refused(code, details, dict(trailing_metadata))


def _ask(context: list[int], max_tokens: int, **fields: object) -> node_agent_pb2.NodeGenerateRequest:
    return node_agent_pb2.NodeGenerateRequest(
        request_id="r", model=MODEL, prompt_token_ids=context,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True), **fields)  # type: ignore[arg-type]


def _generate(node: NodeAgentService,
              request: node_agent_pb2.NodeGenerateRequest) -> AsyncIterator[node_agent_pb2.NodeGenerateChunk]:
    return node.Generate(request, _Context())  # type: ignore[arg-type]


async def _refusal(stream: AsyncIterator[node_agent_pb2.NodeGenerateChunk]) -> _Refused:
    with pytest.raises(_Refused) as refused:
        async for _ in stream:
            pass
    return refused.value


async def _next_tokens(stream: AsyncIterator[node_agent_pb2.NodeGenerateChunk]) -> list[int]:
    """The tokens of the stream's next chunk that has any."""
    while not (chunk := await anext(stream)).token_ids:
        pass
    return list(chunk.token_ids)


@contextlib.asynccontextmanager
async def _running() -> AsyncIterator[tuple[NodeAgentService, AsyncIterator[node_agent_pb2.NodeGenerateChunk],
                                             list[int]]]:
    """A node running request "r" (PROMPT, MAX_TOKENS), its stream, and the tokens it has sent so far."""
    async with _node() as node:
        old = _generate(node, _ask(PROMPT, MAX_TOKENS))
        async with contextlib.aclosing(old):
            yield node, old, await _next_tokens(old)


@pytest.mark.parametrize("resend", ["with its tokens", "before a token came"])
async def test_a_resume_the_engine_will_take_takes_the_running_streams_place(resend: str) -> None:
    async with _running() as (node, old, tokens):
        # Asking for every token that stream had left, no more: the engine takes it as surely as it took that one.
        if resend == "with its tokens":
            resume = _ask(PROMPT + tokens, MAX_TOKENS - len(tokens), num_resumed_tokens=len(tokens))
        else:  # its router froze in the prefill: no tokens to resume, but its client sent it again
            resume = _ask(PROMPT, MAX_TOKENS, resent=True)
        chunks = [chunk async for chunk in _generate(node, resume)]
        assert sum(len(c.token_ids) for c in chunks) == resume.sampling.max_tokens and chunks[-1].finish_reason
        ended = await _refusal(old)
    assert ended.code == grpc.StatusCode.ABORTED and "a resume of it took this stream's place" in ended.details


async def test_a_fresh_request_for_the_running_id_is_refused_already_exists_and_the_stream_goes_on() -> None:
    async with _running() as (node, old, _):
        duplicate = await _refusal(_generate(node, _ask(PROMPT, MAX_TOKENS)))
        assert await _next_tokens(old)
    assert duplicate.code == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id='r': is already running on node n0" in duplicate.details
    assert STREAM_HELD_KEY not in duplicate.trailing_metadata  # its router passes it to the client, as it is


Resume = Callable[[list[int]], node_agent_pb2.NodeGenerateRequest]

NOT_TAKEN_OVER: list[tuple[str, Resume, str]] = [
    ("a prompt shorter than the running one",
     lambda tokens: _ask(PROMPT[:-1], 4, num_resumed_tokens=1),
     "its prompt does not begin with that stream's"),
    ("a token outside the vocabulary",
     lambda tokens: _ask(PROMPT + tokens + [VOCAB_SIZE], 4, num_resumed_tokens=len(tokens) + 1),
     "its prompt's tokens past that stream's are not all in the vocabulary [0, 257)"),
    ("every prompt token resumed",
     lambda tokens: _ask(PROMPT + tokens, 4, num_resumed_tokens=len(PROMPT + tokens)),
     "is not 0 or more and below its prompt's length"),
    ("a negative number resumed",
     lambda tokens: _ask(PROMPT + tokens, 4, num_resumed_tokens=-1),
     "num_resumed_tokens=-1 is not 0 or more"),
    ("no token asked for",
     lambda tokens: _ask(PROMPT + tokens, 0, num_resumed_tokens=len(tokens)),
     "sampling.max_tokens=0 asks for no token"),
    ("one token more than the running stream had left",
     lambda tokens: _ask(PROMPT + tokens, MAX_TOKENS - len(tokens) + 1, num_resumed_tokens=len(tokens)),
     f"past the {len(PROMPT) + MAX_TOKENS} that stream could reach"),
    ("a resend asking for one token more than the running stream",
     lambda tokens: _ask(PROMPT, MAX_TOKENS + 1, resent=True),
     f"past the {len(PROMPT) + MAX_TOKENS} that stream could reach"),
]


@pytest.mark.parametrize(("resume", "why"), [case[1:] for case in NOT_TAKEN_OVER],
                         ids=[case[0] for case in NOT_TAKEN_OVER])
async def test_a_resume_the_engine_might_refuse_is_unavailable_naming_the_node_that_holds_the_stream(
        resume: Resume, why: str) -> None:
    """Taking over for such a resume would end the running stream for one the engine may then refuse (helper-93).
    The refusal says, in trailing metadata, that the node holds another stream of the id: its router places the
    resume elsewhere without taking this node for failed (before, the same UNAVAILABLE made it a suspect for every
    other placement of that router, and counted a move)."""
    async with _running() as (node, old, tokens):
        refused = await _refusal(_generate(node, resume(tokens)))
        assert await _next_tokens(old), "the running stream was ended by a resume that did not take its place"
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert refused.trailing_metadata.get(STREAM_HELD_KEY) == "n0" and ORIGIN_KEY in refused.trailing_metadata
    assert why in refused.details
    assert refused.details.startswith("request_id='r': an earlier stream of it still runs on node n0, which this "
                                      "resume cannot take over: ")


ANOTHER_REQUEST: list[tuple[str, Resume, str]] = [
    ("a prompt that changes the running one's",
     lambda tokens: _ask([98] + PROMPT[1:] + tokens, 4, num_resumed_tokens=len(tokens)),
     "its prompt does not begin with that stream's"),
    ("a resend with another prompt", lambda tokens: _ask([98] * 10, 4, resent=True),
     "its prompt does not begin with that stream's"),
    ("another cache salt",
     lambda tokens: _ask(PROMPT + tokens, 4, num_resumed_tokens=len(tokens), cache_salt="tenant-b"),
     "its cache salt (its tenant's prefix-cache namespace) is not that stream's"),
]


@pytest.mark.parametrize(("resume", "why"), [case[1:] for case in ANOTHER_REQUEST],
                         ids=[case[0] for case in ANOTHER_REQUEST])
async def test_a_resume_that_cannot_be_the_running_request_is_refused_already_exists(resume: Resume,
                                                                                        why: str) -> None:
    """Refused as a stream the node holds, it was placed on another node and ran beside the running one on their one
    admission slot: a tenant at its concurrency limit ran a stream per node under one id (helper-114). Its router
    passes ALREADY_EXISTS to its client, as for a fresh duplicate."""
    async with _running() as (node, old, tokens):
        refused = await _refusal(_generate(node, resume(tokens)))
        assert await _next_tokens(old)
    assert refused.code == grpc.StatusCode.ALREADY_EXISTS and STREAM_HELD_KEY not in refused.trailing_metadata
    assert refused.details.startswith("request_id='r': is already running on node n0, as another request: ")
    assert why in refused.details
