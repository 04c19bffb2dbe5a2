"""The router's checks of a resumed request: the tokens the client already has, and the seed it needs."""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest

from baton.v1 import router_pb2
from services.common.errors import BatonError, InvalidArgument
from services.router.validation import ModelEntry, ValidRequest, validate

MODEL = ModelEntry(name="m", max_context_tokens=100, tokenizer="byte", vocab_size=257, num_warm_nodes=1)
MODELS = {MODEL.name: MODEL}
DEFAULT_MAX_TOKENS = 32


def _request(resume: list[int] | None = None, **fields: Any) -> router_pb2.GenerateRequest:
    """A valid greedy request for MODEL resuming after `resume`, with fields overridden."""
    fields = {"model": "m", "prompt": "hi", "request_id": "r1"} | fields
    if resume is not None:
        fields["resume"] = router_pb2.Resume(token_ids=resume)
    return router_pb2.GenerateRequest(**fields)


def _validate(request: router_pb2.GenerateRequest) -> ValidRequest:
    return validate(request, MODELS, DEFAULT_MAX_TOKENS, random.Random(0))


def _refusal(request: router_pb2.GenerateRequest) -> InvalidArgument:
    with pytest.raises(BatonError) as caught:
        _validate(request)
    assert type(caught.value) is InvalidArgument
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value


def test_a_plain_request_resumes_nothing() -> None:
    assert _validate(_request()).resume_token_ids == []


def test_resume_tokens_come_back_as_given() -> None:
    valid = _validate(_request([104, 0, 256], max_tokens=10))
    assert valid.resume_token_ids == [104, 0, 256]
    # max_tokens counts the whole completion, the resumed tokens included.
    assert valid.sampling.max_tokens == 10
    assert valid.prompt_token_ids == [104, 105]


@pytest.mark.parametrize(
    ("resume", "named"), [([1, 2, 257], "resume.token_ids[2]=257"), ([-1], "resume.token_ids[0]=-1")]
)
def test_a_resume_token_outside_the_vocabulary_is_refused_naming_it(resume: list[int], named: str) -> None:
    error = _refusal(_request(resume, max_tokens=10))
    assert str(error).startswith(named)
    assert error.field == named.split("=")[0]


def test_as_many_resume_tokens_as_max_tokens_is_accepted() -> None:
    assert len(_validate(_request([97] * 5, max_tokens=5)).resume_token_ids) == 5


def test_more_resume_tokens_than_max_tokens_is_refused() -> None:
    error = _refusal(_request([97] * 6, max_tokens=5))
    assert error.field == "resume.token_ids"
    assert "max_tokens=5" in str(error)


def test_more_resume_tokens_than_the_default_max_tokens_is_refused() -> None:
    error = _refusal(_request([97] * (DEFAULT_MAX_TOKENS + 1)))
    assert error.field == "resume.token_ids"
    assert f"max_tokens={DEFAULT_MAX_TOKENS}" in str(error)


def test_resuming_a_sampled_request_without_its_seed_is_refused() -> None:
    error = _refusal(_request([97, 98], temperature=0.7, max_tokens=10))
    assert error.field == "seed"
    assert str(error).startswith("seed=")


def test_resuming_a_sampled_request_with_its_seed_keeps_the_seed() -> None:
    valid = _validate(_request([97, 98], temperature=0.7, seed=77, max_tokens=10))
    assert valid.resume_token_ids == [97, 98]
    assert valid.sampling.HasField("seed")
    assert valid.sampling.seed == 77


def test_resuming_with_seed_zero_keeps_seed_zero() -> None:
    valid = _validate(_request([97], temperature=0.7, seed=0, max_tokens=10))
    assert valid.sampling.HasField("seed")
    assert valid.sampling.seed == 0


def test_resuming_a_greedy_request_needs_no_seed() -> None:
    valid = _validate(_request([97, 98], max_tokens=10))
    assert valid.resume_token_ids == [97, 98]
    assert not valid.sampling.HasField("seed")


@pytest.mark.parametrize(("resume", "named"), [
    (router_pb2.Resume(elapsed_ms=-5), "resume.elapsed_ms=-5"),
    (router_pb2.Resume(token_ids=[97], elapsed_ms=100, first_token_ms=-1), "resume.first_token_ms=-1"),
    (router_pb2.Resume(elapsed_ms=100, first_token_ms=50), "resume.first_token_ms=50"),  # a first token, but none kept
    (router_pb2.Resume(token_ids=[97], elapsed_ms=100, first_token_ms=10, last_token_ms=-1), "resume.last_token_ms=-1"),
    (router_pb2.Resume(token_ids=[97], elapsed_ms=100, last_token_ms=50), "resume.last_token_ms=50"),  # no first token
    # Past elapsed_ms by more than a rounding: a timeline in another unit, or a clock the client did not share.
    (router_pb2.Resume(token_ids=[97], elapsed_ms=100, first_token_ms=1101), "resume.first_token_ms=1101"),
    (router_pb2.Resume(token_ids=[97], elapsed_ms=100, first_token_ms=10, last_token_ms=1101),
     "resume.last_token_ms=1101"),
    (router_pb2.Resume(token_ids=[97], elapsed_ms=5000, first_token_ms=3000, last_token_ms=1999),
     "resume.last_token_ms=1999"),  # long before its first token
])
def test_a_resume_timeline_that_cannot_be_is_refused_naming_the_field(resume: router_pb2.Resume, named: str) -> None:
    error = _refusal(router_pb2.GenerateRequest(model="m", prompt="hi", request_id="r1", max_tokens=10, resume=resume))
    assert str(error).startswith(named)


# A first or last token a little after elapsed_ms, or a last one a little before the first (taken as at most
# elapsed_ms): a client's rounding.
@pytest.mark.parametrize(("first_token_ms", "last_token_ms"),
                         [(3000, None), (3501, None), (4500, 4500), (3000, 2000), (4500, 2500)])
def test_a_resume_timeline_is_accepted(first_token_ms: int, last_token_ms: int | None) -> None:
    resume = router_pb2.Resume(token_ids=[97], elapsed_ms=3500, first_token_ms=first_token_ms,
                               last_token_ms=last_token_ms)
    valid = _validate(router_pb2.GenerateRequest(model="m", prompt="hi", request_id="r1", max_tokens=10, resume=resume))
    assert valid.resume_token_ids == [97]
