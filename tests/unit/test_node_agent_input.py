"""The node agent's internal Generate checks sampling as the router does, and names a bad field once."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from baton.v1 import common_pb2, node_agent_pb2
from tests.unit.test_node_agent_stream import MODEL, _node
from tests.unit.test_place_during_election import FakeContext, Refused

pytestmark = pytest.mark.timeout(30)

NAN, INF = float("nan"), float("inf")


def _request(request_id: str, **fields: object) -> node_agent_pb2.NodeGenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=4, seed=1, **fields)  # type: ignore[arg-type]
    return node_agent_pb2.NodeGenerateRequest(request_id=request_id, model=MODEL, prompt_token_ids=[72, 105],
                                              sampling=sampling)


async def _refusal(request: node_agent_pb2.NodeGenerateRequest) -> Refused:
    async with _node() as node:
        before = await node.GetLoad(node_agent_pb2.GetLoadRequest(), FakeContext())  # type: ignore[arg-type]
        received = before.num_received
        stream = node.Generate(request, FakeContext())  # type: ignore[arg-type]
        async with contextlib.aclosing(stream):
            with pytest.raises(Refused) as refused:
                async for _ in stream:
                    pass
        # Counted as received, as every request the node was sent: the leader stops counting its placements by it.
        load = await node.GetLoad(node_agent_pb2.GetLoadRequest(), FakeContext())  # type: ignore[arg-type]
        assert load.num_received == received + 1
        # The node serves the next request as before.
        good = [c async for c in node.Generate(_request("next"), FakeContext())]  # type: ignore[arg-type]
        assert good[-1].finish_reason
    return refused.value


@pytest.mark.parametrize(("fields", "named"), [
    ({"temperature": NAN}, "sampling.temperature=nan: must be 0 (greedy) or positive"),
    ({"temperature": INF}, "sampling.temperature=inf: must be 0 (greedy) or positive"),
    ({"temperature": -0.5}, "sampling.temperature=-0.5: must be 0 (greedy) or positive"),
    ({"temperature": 1.0, "top_p": -1.0}, "sampling.top_p=-1.0: must be in (0, 1]"),
    ({"top_p": NAN}, "sampling.top_p=nan: must be in (0, 1]"),
    ({"stop": [common_pb2.TokenSequence()]}, "sampling.stop[0]=[]: must not be empty"),
    ({"stop": [common_pb2.TokenSequence(token_ids=[1]), common_pb2.TokenSequence(token_ids=[5, -7])]},
     "sampling.stop[1].token_ids[1]=-7: outside the vocabulary"),
    # Checked against every token generated: 780,000 slowed every request on the node 30-fold (helper-179).
    ({"stop": [common_pb2.TokenSequence(token_ids=[1])] * 257}, "sampling.stop='257 sequences': at most 256"),
    ({"stop": [common_pb2.TokenSequence(token_ids=[1] * 8193)] * 2},
     "sampling.stop='16386 tokens in all': at most 16384"),
])
async def test_sampling_the_router_would_refuse_is_refused_by_the_node_naming_the_field(
        fields: dict, named: str) -> None:
    refused = await _refusal(_request("ng", **fields))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert named in str(refused)


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt_token_ids": []}, "prompt_token_ids=[]: must not be empty"),
    ({"prompt_token_ids": [72, 999_999]}, "prompt_token_ids[1]=999999: outside the vocabulary [0, "),
    ({"num_resumed_tokens": 50}, "num_resumed_tokens=50: must be 0 or more and below the prompt length 2"),
    ({"num_resumed_tokens": -1}, "num_resumed_tokens=-1: must be 0 or more and below the prompt length 2"),
    ({"prompt_token_ids": [65] * 10_000}, "prompt_token_ids='10000 tokens': prompt (10000 tokens) + max_tokens"),
])
async def test_a_request_the_engine_cannot_serve_is_named_by_its_field_once(fields: dict, message: str) -> None:
    """The sim engine's refusals named the request twice and the field not at all ("request='ng1': request 'ng1':
    prompt_token_ids is empty")."""
    request = _request("ng1")
    for name, value in fields.items():
        field = getattr(request, name)
        if isinstance(value, list):
            del field[:]
            field.extend(value)
        else:
            setattr(request, name, value)
    refused = await _refusal(request)
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(refused) and "ng1" not in str(refused)
