"""The router's size checks: each edge refused with a status naming the field, before the work it would cost."""

from __future__ import annotations

import random

import grpc
import pytest

from baton.v1 import router_pb2
from services.common.errors import BatonError, InvalidArgument, NotFound
from services.router.tokenizer import TOKENIZERS, ByteTokenizer
from services.router.validation import DEFAULT_LIMITS, InputLimits, ModelEntry, validate

MODEL = ModelEntry(name="m", max_context_tokens=8192, tokenizer="byte", vocab_size=257, num_warm_nodes=1)
MODELS = {MODEL.name: MODEL}


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the characters it was asked to encode."""

    def __init__(self, max_bytes_per_token: int = 1) -> None:
        self.max_bytes_per_token = max_bytes_per_token
        self.num_encoded = 0

    def encode(self, text: str) -> list[int]:
        self.num_encoded += len(text)
        return super().encode(text)


@pytest.fixture
def tokenizer(monkeypatch: pytest.MonkeyPatch) -> CountingTokenizer:
    counting = CountingTokenizer()
    monkeypatch.setitem(TOKENIZERS, "byte", counting)
    return counting


def refusal(limits: InputLimits = DEFAULT_LIMITS, **fields: object) -> BatonError:
    request = router_pb2.GenerateRequest(**({"model": "m", "prompt": "hi"} | fields))
    with pytest.raises(BatonError) as caught:
        validate(request, MODELS, 16, random.Random(0), limits)
    return caught.value


def test_a_multi_megabyte_prompt_is_refused_before_it_is_tokenized(tokenizer: CountingTokenizer) -> None:
    error = refusal(prompt="x" * 3_900_000)
    assert isinstance(error, InvalidArgument) and error.field == "prompt"
    assert "longer than 1048576 bytes" in str(error)
    assert tokenizer.num_encoded == 0


def test_a_prompt_too_long_in_bytes_for_the_context_is_refused_before_it_is_tokenized(
        tokenizer: CountingTokenizer) -> None:
    error = refusal(prompt="é" * 5000)  # 10,000 bytes: 10,000 byte tokens cannot fit 8,192
    assert isinstance(error, InvalidArgument) and error.field == "prompt"
    assert "prompt='10000 bytes': does not fit the context window of 8192" in str(error)
    assert tokenizer.num_encoded == 0


def test_the_byte_cap_holds_whatever_a_token_may_span(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = CountingTokenizer(max_bytes_per_token=1000)
    monkeypatch.setitem(TOKENIZERS, "byte", wide)
    error = refusal(InputLimits(max_prompt_bytes=4096), prompt="y" * 5000)
    assert "prompt='5000 bytes': longer than 4096 bytes" in str(error)
    assert wide.num_encoded == 0


def test_token_ids_beyond_the_context_are_refused_by_count() -> None:
    request = router_pb2.GenerateRequest(model="m", prompt_token_ids=router_pb2.PromptTokens(ids=[7] * 1_000_000))
    with pytest.raises(InvalidArgument) as caught:
        validate(request, MODELS, 16, random.Random(0))
    assert str(caught.value) == "prompt_token_ids='1000000 tokens': does not fit the context window of 8192"


def test_stop_strings_are_bounded_in_total_bytes(tokenizer: CountingTokenizer) -> None:
    error = refusal(stop=["s" * 300] * 16)
    assert isinstance(error, InvalidArgument) and error.field == "stop"
    assert "at most 4096 bytes together" in str(error)
    assert tokenizer.num_encoded == 0
    assert "at most 64 bytes together" in str(refusal(InputLimits(max_stop_bytes=64), stop=["ab", "c" * 63]))
    assert "at most 2" in str(refusal(InputLimits(max_stop_sequences=2), stop=["a", "b", "c"]))


@pytest.mark.parametrize("field", ["tenant", "workflow_id", "request_id"])
def test_names_that_key_kept_state_are_bounded(field: str) -> None:
    error = refusal(**{field: "t" * 1_000_000})
    assert isinstance(error, InvalidArgument) and error.field == field
    assert str(error).startswith(f"{field}='tttt")
    assert "1000000 characters, longer than 128" in str(error)
    assert len(str(error)) < 300


def test_an_unknown_model_with_a_huge_name_is_not_found_and_echoed_cut_short() -> None:
    error = refusal(model="m" * 100_000 + "z")
    assert isinstance(error, NotFound) and error.code == grpc.StatusCode.NOT_FOUND
    assert str(error).startswith("model='mmmm") and "not served by this cluster (served: m)" in str(error)
    assert len(str(error)) < 300



class _Unread:
    """An item whose repr fails: showing a value must not read this far into it."""

    def __repr__(self) -> str:
        raise AssertionError("read past what a refusal shows")


@pytest.mark.parametrize(("value", "start"), [
    ([1] * 100 + [_Unread()], "metadata=[1, 1, 1"),
    ({f"k{i}": 1 for i in range(100)} | {"last": _Unread()}, "metadata={'k0': 1, 'k1': 1"),
    ([[1] * 100 + [_Unread()]], "metadata=[[1, 1, 1"),
], ids=["list", "object", "nested"])
def test_a_refused_container_is_shown_by_its_first_items_and_its_length_without_reading_the_rest(
        value: list[object] | dict[str, object], start: str) -> None:
    message = str(InvalidArgument("metadata", value, "not supported by Baton"))
    assert message.startswith(start)
    assert message.endswith(f"... ({len(value)} items): not supported by Baton")
