"""Tokenizers the router knows. Simulated models are byte-level: UTF-8 bytes are tokens."""

from __future__ import annotations

import codecs
from typing import Protocol


class Tokenizer(Protocol):
    #: The most UTF-8 bytes one token stands for: text longer than context × this cannot fit.
    max_bytes_per_token: int

    def encode(self, text: str) -> list[int]: ...

    def decoder(self) -> StreamDecoder: ...


class StreamDecoder(Protocol):
    def decode(self, token_ids: list[int]) -> str:
        """Text of these tokens, holding back an incomplete multi-byte character."""


class ByteTokenizer:
    """Token i < 256 is the byte i; larger ids (end-of-sequence) have no text."""

    max_bytes_per_token = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()


class ByteStreamDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: list[int]) -> str:
        return self._utf8.decode(bytes(t for t in token_ids if t < 256))


TOKENIZERS: dict[str, Tokenizer] = {"byte": ByteTokenizer()}
