"""Stop strings found in a completion's text whatever its tokenization: inside one token, across tokens and chunks,
split characters, and a resumed request's own text (looked back into; a stop wholly in it ended the stream there)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.router.stop_text import StopText
from services.router.tokenizer import HfTokenizer
from tests.unit.piece_tokenizer import EOS, PieceStreamDecoder, PieceTokenizer, token_ids


def _stop_text(*stops: str, resumed: list[int] | None = None) -> StopText:
    return StopText(stops, PieceStreamDecoder(), resumed or [])


def test_a_stop_inside_one_token_ends_the_completion_at_that_token() -> None:
    stop_text = _stop_text("be")
    assert PieceTokenizer().encode("be") == token_ids(b"be")  # what a node would look for, never generated below
    assert stop_text.find(token_ids(b" if", b" be", b" if")) == 2
    assert stop_text.clip(" if be") == " if be"


def test_a_stop_across_a_token_boundary_ends_at_the_token_that_completes_it_and_the_text_after_it_is_clipped() -> None:
    stop_text = _stop_text("e i")
    assert stop_text.find(token_ids(b" be", b" if", b" be")) == 2
    assert stop_text.num_chars_through_stop == 5
    assert stop_text.clip(" be if") == " be i"


def test_a_stop_across_chunks_is_found_and_clipped_across_them() -> None:
    stop_text = _stop_text("if be")
    assert stop_text.find(token_ids(b" be", b" if")) is None
    assert stop_text.find([EOS, *token_ids(b" be", b" if")]) == 2
    assert [stop_text.clip(text) for text in (" be i", "f", " be", "")] == [" be i", "f", " be", ""]


def test_the_stop_that_ends_first_ends_the_completion() -> None:
    stop_text = _stop_text("if be", "f", " if")  # " if" and "f" both end in the second token; "f" ends at its end
    assert stop_text.find(token_ids(b" be", b" if", b" be")) == 2
    assert stop_text.clip(" be if be") == " be if"
    stop_text = _stop_text(" if", "e i")
    assert stop_text.find(token_ids(b" be", b" if")) == 2
    assert stop_text.clip(" be if") == " be i"


def test_a_character_split_between_tokens_completes_a_stop_in_the_token_that_completes_it() -> None:
    stop_text = _stop_text("é")
    assert stop_text.find(token_ids(b"caf", b"\xc3")) is None
    assert stop_text.find(token_ids(b"\xa9!", b" be")) == 1
    assert stop_text.clip("café!") == "café"


def test_a_stop_that_began_among_the_resumed_tokens_is_found_and_one_wholly_among_them_is_not() -> None:
    stop_text = _stop_text("be", "e if", resumed=token_ids(b" if", b" be"))
    assert stop_text.find(token_ids(b" if")) == 1
    assert stop_text.num_chars_through_stop == 3  # of the new text: " if", the end of the stop "e if"
    assert stop_text.clip(" if") == " if"
    assert not _stop_text("e if", resumed=token_ids(b" if", b" be")).in_resumed
    stop_text = _stop_text("be", resumed=token_ids(b" if", b" be"))
    assert stop_text.in_resumed  # the stream ended among them: the relay ends it at once (find is not asked)
    ended = _stop_text("be", resumed=token_ids(b" be", b"\xc3"))
    assert ended.in_resumed and ended.clip("\ufffd") == ""  # the last chunk's flush of the incomplete "é" is not sent
    assert stop_text.find(token_ids(b" if", b"b")) is None
    assert stop_text.find(token_ids(b"e")) == 1


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    """A byte-level BPE tokenizer as a vLLM model ships it (tokenizer.json), trained here on English-like lines."""
    tokenizers = pytest.importorskip("tokenizers")
    words = "the a of to and in is it that for on with as was by at be this from or an are not if cache block".split()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(500)]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.train_from_iterator(lines, tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    return HfTokenizer(str(directory))


@pytest.mark.parametrize("stop", ["be", "e i", "if be", "che bl", "é", "é. t"])
def test_with_a_byte_level_bpe_tokenizer_the_completion_ends_where_the_stop_first_ends_in_its_text(
        hf_tokenizer: HfTokenizer, stop: str) -> None:
    text = " be if be if the cache block café. the"
    tokens = hf_tokenizer.encode(text)
    stop_text = StopText([stop], hf_tokenizer.decoder())
    num_kept = stop_text.find(tokens)
    assert num_kept is not None
    through_stop = text[:text.index(stop) + len(stop)]
    assert stop not in hf_tokenizer.decoder().decode(tokens[:num_kept - 1])
    assert stop_text.clip(hf_tokenizer.decoder().decode(tokens)) == through_stop


def test_with_a_byte_level_bpe_tokenizer_the_text_holds_stops_the_nodes_token_match_misses(
        hf_tokenizer: HfTokenizer) -> None:
    """Why the router looks in the text: the stop's own tokens are not among the completion's."""
    tokens = hf_tokenizer.encode(" be if be if")
    for stop in ("be", "e i", "if"):
        own = hf_tokenizer.encode(stop)
        assert not any(tokens[i:i + len(own)] == own for i in range(len(tokens)))
