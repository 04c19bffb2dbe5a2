"""The byte tokenizer's stream decoder: whole characters only, end-of-sequence has no text."""

from __future__ import annotations

from services.router.tokenizer import TOKENIZERS, ByteStreamDecoder

EOS = 256


def test_multibyte_character_split_across_calls_comes_out_whole() -> None:
    decoder = ByteStreamDecoder()
    assert decoder.decode([ord("h"), 0xC3]) == "h"
    assert decoder.decode([0xA9]) == "é"
    euro = list("€".encode())
    assert [decoder.decode([b]) for b in euro] == ["", "", "€"]


def test_eos_produces_no_text() -> None:
    decoder = ByteStreamDecoder()
    assert decoder.decode([EOS]) == ""
    assert decoder.decode([ord("o"), ord("k"), EOS]) == "ok"


def test_byte_tokenizer_round_trips_text() -> None:
    tokenizer = TOKENIZERS["byte"]
    tokens = tokenizer.encode("héllo, 世界")
    assert tokenizer.decoder().decode(tokens) == "héllo, 世界"
