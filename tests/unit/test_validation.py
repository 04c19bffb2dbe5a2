"""The router's request checks: what is refused, with which status and message, and what is filled in."""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from baton.v1 import router_pb2
from services.common.errors import BatonError, InvalidArgument, NotFound, Unavailable
from services.router.validation import ModelEntry, ValidRequest, validate

MODEL = ModelEntry(name="m", max_context_tokens=100, tokenizer="byte", vocab_size=257, num_warm_nodes=1)
MODELS = {MODEL.name: MODEL}
DEFAULT_MAX_TOKENS = 32


def _request(**fields: Any) -> router_pb2.GenerateRequest:
    """A valid greedy request for MODEL, with fields overridden; prompt=None leaves out the input."""
    if "prompt_token_ids" in fields:
        fields = {"prompt": None} | fields
        fields["prompt_token_ids"] = router_pb2.PromptTokens(ids=fields["prompt_token_ids"])
    fields = {"model": "m", "prompt": "hi"} | fields
    if fields["prompt"] is None:
        del fields["prompt"]
    return router_pb2.GenerateRequest(**fields)


def _validate(request: router_pb2.GenerateRequest, rng: random.Random | None = None) -> ValidRequest:
    return validate(request, MODELS, DEFAULT_MAX_TOKENS, rng or random.Random(0))


def _refusal(request: router_pb2.GenerateRequest) -> BatonError:
    with pytest.raises(BatonError) as caught:
        _validate(request)
    return caught.value


REJECTIONS = [
    ("missing model", {"model": ""}, "model=''"),
    ("no prompt", {"prompt": None}, "prompt='': required"),
    ("empty prompt", {"prompt": ""}, "prompt=''"),
    ("empty token ids", {"prompt_token_ids": []}, "prompt_token_ids=[]"),
    ("token above vocab", {"prompt_token_ids": [1, 2, 257]}, "prompt_token_ids[2]=257"),
    ("negative token", {"prompt_token_ids": [-1]}, "prompt_token_ids[0]=-1"),
    ("prompt fills context", {"prompt": "x" * 100}, "prompt='100 tokens'"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens=0"),
    ("max_tokens negative", {"max_tokens": -3}, "max_tokens=-3"),
    ("max_tokens beyond room", {"prompt": "x" * 90, "max_tokens": 11}, "max_tokens=11"),
    ("negative temperature", {"temperature": -0.5}, "temperature=-0.5"),
    ("nan temperature", {"temperature": float("nan")}, "temperature=nan"),
    ("top_p above one", {"top_p": 1.5}, "top_p=1.5"),
    ("empty stop string", {"stop": ["ok", ""]}, "stop[1]=''"),
    ("negative deadline", {"deadline_ms": -1}, "deadline_ms=-1"),
    ("deadline below the floor", {"deadline_ms": 1}, "deadline_ms=1: below the floor of 10 ms"),
    ("deadline just below the floor", {"deadline_ms": 9}, "deadline_ms=9: below the floor of 10 ms"),
    # The leader admitted a 7 ms TTFT budget, run late, and answered 5 ms with a retry hint (helper-115).
    ("TTFT budget below the floor", {"ttft_budget_ms": 7}, "ttft_budget_ms=7: below the floor of 10 ms"),
    ("step beyond total", {"step": 4, "total_steps": 3, "workflow_id": "w"}, "step=4"),
    ("step 0 of a workflow with steps", {"step": 0, "total_steps": 3, "workflow_id": "w"}, "step=0"),
    # Taken and ignored: the request counted as a task of one step (helper-176).
    ("step without a workflow", {"step": 2}, "step=2: needs a workflow_id"),
    ("total_steps without a workflow", {"total_steps": 3}, "total_steps=3: needs a workflow_id"),
    ("long request_id", {"request_id": "r" * 129}, "request_id='rrrr"),
    ("ESC in tenant", {"tenant": "a\x1b[2J"}, "tenant='a\\x1b[2J': control character '\\x1b' at 1: not allowed"),
    ("newline in request_id", {"request_id": "r\nINFO forged"}, "request_id='r\\nINFO forged': control character"),
    ("C1 in workflow_id", {"workflow_id": "w\x9b2J"}, "workflow_id='w\\x9b2J': control character"),
    # An HTTP header drops it: the openai client read x-request-id " ab " as "ab", which no log had (helper-188).
    ("spaces around request_id", {"request_id": " ab "}, "request_id=' ab ': must not begin or end with white space"),
    ("only a space as request_id", {"request_id": " "}, "request_id=' ': must not begin or end with white space"),
    ("space after tenant", {"tenant": "alice "}, "tenant='alice ': must not begin or end"),
]


@pytest.mark.parametrize(("fields", "names"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_rejection_is_invalid_argument_naming_field_and_value(fields: dict[str, Any], names: str) -> None:
    error = _refusal(_request(**fields))
    assert type(error) is InvalidArgument
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(error).startswith(names)


def test_unknown_model_is_not_found_naming_it() -> None:
    error = _refusal(_request(model="nope"))
    assert type(error) is NotFound
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert "model='nope'" in str(error)


def test_an_unknown_model_is_what_the_client_hears_of_whatever_else_is_wrong() -> None:
    error = _refusal(_request(model="typo", temperature=-1.0, max_tokens=0))
    assert type(error) is NotFound and "model='typo'" in str(error)


def test_a_model_while_none_is_served_is_unavailable_to_retry() -> None:
    """A router whose first listing of the nodes was empty (none registered yet), or whose nodes all went, answered
    NOT_FOUND, "not served by this cluster (served: none)": a code no client retries."""
    with pytest.raises(Unavailable, match="model='m': no model is served by this cluster now") as caught:
        validate(_request(), {}, DEFAULT_MAX_TOKENS, random.Random(0))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    # Bad fields are said first then: a retry could never serve them.
    with pytest.raises(InvalidArgument, match="temperature=-1.0"):
        validate(_request(temperature=-1.0), {}, DEFAULT_MAX_TOKENS, random.Random(0))


def test_a_model_whose_nodes_are_all_gone_is_unavailable_to_retry_unless_an_alternative_serves_it() -> None:
    """A model served lately whose every node went was NOT_FOUND, "not served by this cluster": a code no client
    retries, through an outage its nodes come back from; and a request that accepted another model, served now, was
    refused with it."""
    lost = ModelEntry("lost", 4096, "byte", 257, 0)
    gone = {"lost": lost}.get
    with pytest.raises(Unavailable, match="model='lost': served by this cluster lately, by no node now") as caught:
        validate(_request(model="lost"), MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    # Bad fields first: a retry would never serve them.
    with pytest.raises(InvalidArgument, match="temperature=-1.0"):
        validate(_request(model="lost", temperature=-1.0), MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)
    # With the served model accepted instead, it is valid, to be placed on that one.
    valid = validate(_request(model="lost", alternative_models=["m"]), MODELS, DEFAULT_MAX_TOKENS, random.Random(0),
                     gone=gone)
    assert (valid.model, valid.alternative_models, valid.prompt_token_ids) == (lost, ("m",), [104, 105])
    # A resume goes on with its own model only; an alternative that cannot hold the request serves nothing.
    for request, also in ((_request(model="lost", alternative_models=["m"], resume=router_pb2.Resume(token_ids=[1])),
                           "; retry"),
                          (_request(model="lost", alternative_models=["m"], prompt="x" * 100),
                           ", and no model of alternative_models that is served can hold it; retry")):
        with pytest.raises(Unavailable, match="model='lost': served by this cluster lately") as caught:
            validate(request, MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)
        assert str(caught.value).endswith(also)
    # A resend from before its first token (its router died) has nothing to go on with: an alternative takes it.
    valid = validate(_request(model="lost", alternative_models=["m"], resume=router_pb2.Resume(elapsed_ms=5)), MODELS,
                     DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)
    assert valid.alternative_models == ("m",)
    # What it could never serve is refused as it would be if it were served: a retry would not help (helper-153).
    small = ModelEntry("lost", 16, "byte", 257, 0)
    for request, field in ((_request(model="lost", prompt_token_ids=list(range(40))), "prompt_token_ids"),
                           (_request(model="lost", prompt_token_ids=[300]), r"prompt_token_ids\[0\]"),
                           (_request(model="lost", max_tokens=100), "max_tokens")):
        with pytest.raises(InvalidArgument, match=f"^{field}="):
            validate(request, MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone={"lost": small}.get)
    # An alternative gone for now is passed over: the request is served by its own model.
    valid = validate(_request(alternative_models=["lost"]), MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)
    assert (valid.model, valid.alternative_models) == (MODEL, ())
    # A model never served is still NOT_FOUND, and so is an alternative never served.
    with pytest.raises(NotFound, match="model='typo'"):
        validate(_request(model="typo"), MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)
    with pytest.raises(InvalidArgument, match=r"alternative_models\[0\]='typo'"):
        validate(_request(alternative_models=["typo"]), MODELS, DEFAULT_MAX_TOKENS, random.Random(0), gone=gone)


def test_a_deadline_at_the_floor_or_what_a_resent_request_has_left_is_accepted() -> None:
    assert _validate(_request(deadline_ms=10)).request_id
    assert _validate(_request(ttft_budget_ms=10)).request_id
    assert _validate(_request(deadline_ms=1, resume=router_pb2.Resume(elapsed_ms=900))).request_id


def test_max_tokens_up_to_the_room_left_is_accepted() -> None:
    assert _validate(_request(prompt="x" * 90, max_tokens=10)).sampling.max_tokens == 10


def test_default_max_tokens_is_capped_by_the_room_left() -> None:
    assert _validate(_request(prompt="x" * 10)).sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert _validate(_request(prompt="x" * 90)).sampling.max_tokens == 10


def test_prompt_text_is_tokenized_as_utf8_bytes() -> None:
    valid = _validate(_request(prompt="héllo"))
    assert valid.prompt_token_ids == [104, 0xC3, 0xA9, 108, 108, 111]
    assert valid.model is MODEL


def test_prompt_token_ids_are_taken_as_given() -> None:
    assert _validate(_request(prompt_token_ids=[0, 256, 7])).prompt_token_ids == [0, 256, 7]


def test_stop_strings_are_tokenized() -> None:
    stops = _validate(_request(stop=["\n", "é"])).sampling.stop
    assert [list(s.token_ids) for s in stops] == [[10], [0xC3, 0xA9]]


def test_sampled_request_without_seed_gets_one_from_rng_that_a_json_double_holds() -> None:
    """Its seed goes back to the client in the response (baton.seed); a 63-bit one came back rounded from jq or
    JavaScript, which read JSON numbers as doubles, and replayed other text (helper-108)."""
    for n in range(200):
        sampling = _validate(_request(temperature=0.7), rng=random.Random(n)).sampling
        assert sampling.HasField("seed") and sampling.seed == random.Random(n).getrandbits(53)
        assert float(sampling.seed) == sampling.seed


def test_client_seed_is_kept() -> None:
    assert _validate(_request(temperature=0.7, seed=0)).sampling.seed == 0


def test_greedy_request_has_no_seed_and_top_p_unset_means_one() -> None:
    sampling = _validate(_request()).sampling
    assert not sampling.HasField("seed")
    assert (sampling.temperature, sampling.top_p) == (0.0, 1.0)


def test_a_top_p_sent_as_zero_is_refused_not_taken_as_one() -> None:
    """A top_p a float32 holds as 0 (1e-50) reached the router as 0 and was taken as 1: every token sampled, where the
    client asked for the top one."""
    for sent in (0.0, 1e-50, -0.0):
        with pytest.raises(InvalidArgument, match=r"^top_p=-?0\.0: must be greater than 0 \(unset: 1\)"):
            _validate(_request(temperature=0.7, top_p=sent))
    # So is a JSON client's (grpcurl's) explicit 0: the field was documented as "0 means 1".
    sent_as_json = json_format.Parse('{"model": "m", "prompt": "hi", "temperature": 0.7, "top_p": 0}',
                                     router_pb2.GenerateRequest())
    with pytest.raises(InvalidArgument, match=r"^top_p=0\.0: must be greater than 0"):
        _validate(sent_as_json)
    assert _validate(_request(temperature=0.7, top_p=1e-30)).sampling.top_p == pytest.approx(1e-30)


def test_request_id_is_generated_when_empty_and_kept_when_given() -> None:
    first, second = _validate(_request()).request_id, _validate(_request()).request_id
    assert first and second and first != second
    assert _validate(_request(request_id="r" * 128)).request_id == "r" * 128


# -- alternative models ---------------------------------------------------------------------------

SMALL = ModelEntry(name="small", max_context_tokens=40, tokenizer="byte", vocab_size=257, num_warm_nodes=1)
OTHER = ModelEntry(name="other", max_context_tokens=100, tokenizer="llama", vocab_size=32000, num_warm_nodes=1)
BIG = ModelEntry(name="big", max_context_tokens=1000, tokenizer="byte", vocab_size=257, num_warm_nodes=0)
ALL = {m.name: m for m in (MODEL, SMALL, OTHER, BIG)}


def test_alternatives_that_can_hold_the_request_are_kept_in_order_once() -> None:
    request = _request(max_tokens=50, alternative_models=["big", "small", "m", "big"])
    assert validate(request, ALL, DEFAULT_MAX_TOKENS, random.Random(0)).alternative_models == ("big",)


@pytest.mark.parametrize(("name", "why"), [("nope", "not served"), ("other", "tokenizer 'llama'")])
def test_an_unusable_alternative_is_invalid_naming_its_position(name: str, why: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate(_request(alternative_models=["big", name]), ALL, DEFAULT_MAX_TOKENS, random.Random(0))
    assert "alternative_models[1]" in str(caught.value) and name in str(caught.value) and why in str(caught.value)


def test_more_alternatives_than_the_limit_are_refused_by_their_count() -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate(_request(alternative_models=["big"] * 17), ALL, DEFAULT_MAX_TOKENS, random.Random(0))
    assert str(caught.value) == "alternative_models='17 models': at most 16"


def test_a_resumed_request_keeps_to_its_model() -> None:
    request = _request(alternative_models=["big"], resume=router_pb2.Resume(token_ids=[97]))
    assert validate(request, ALL, DEFAULT_MAX_TOKENS, random.Random(0)).alternative_models == ()
