"""Tokenizers the router knows. Simulated models are byte-level: UTF-8 bytes are tokens; vllm models
register "hf:DIR", the Hugging Face tokenizer in their model directory."""

from __future__ import annotations

import codecs
import logging
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    #: The most UTF-8 bytes one token stands for: text longer than context × this cannot fit.
    max_bytes_per_token: int

    def encode(self, text: str) -> list[int]: ...

    def decoder(self) -> StreamDecoder: ...


class StreamDecoder(Protocol):
    def decode(self, token_ids: list[int], final: bool = False) -> str:
        """Text of these tokens, holding back an incomplete multi-byte character until the tokens that complete it
        come, or the last ones (final: what is held back comes out, an incomplete character as U+FFFD), so that a
        stream's text is its tokens decoded."""


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

    def decode(self, token_ids: list[int], final: bool = False) -> str:
        return self._utf8.decode(bytes(t for t in token_ids if t < 256), final=final)


class HfTokenizer:
    """A model's own tokenizer (DIR/tokenizer.json). Text is encoded without special tokens (no BOS is
    added, so stop strings encode as they appear in text); clients wanting BOS send token ids."""

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer as HfTokenizerFile

        self._tokenizer = HfTokenizerFile.from_file(str(Path(model_dir) / "tokenizer.json"))
        # The longest token's text in UTF-8 bytes: a prompt longer than context × this cannot fit.
        self.max_bytes_per_token = max(
            (len(self._tokenizer.decode([i]).encode()) for i in range(self._tokenizer.get_vocab_size())), default=1)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decoder(self) -> HfStreamDecoder:
        return HfStreamDecoder(self._tokenizer)


class HfStreamDecoder:
    """Incremental detokenization as vLLM does it: decode a short window of recent tokens and emit the
    text past what the window's older part decoded to, holding back an incomplete character.

    Only the character is held back: the text before it goes out (the window's offsets wait for the character, and
    _sent counts what went out past them). Holding back the whole window, as before, lost a chunk's every word when
    its tokens ended mid-character, and the stream's last chunk never gave them back: a greedy answer of 8 tokens
    came out as no text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._sent = 0  # characters sent past the window's prefix while a character was held back

    def decode(self, token_ids: list[int], final: bool = False) -> str:
        self._token_ids.extend(token_ids)
        ids = self._token_ids
        prefix = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        text = self._tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        start = len(prefix) + self._sent
        if text.endswith("\ufffd") and not final:  # an incomplete character (or bytes that never make one)
            ready = text.rstrip("\ufffd")[start:]
            self._sent += len(ready)
            return ready
        if len(text) <= len(prefix):
            return ""
        self._prefix_offset, self._read_offset, self._sent = self._read_offset, len(ids), 0
        return text[start:]


class TokenizerRegistry(dict[str, Tokenizer]):
    """Tokenizers by registered name; an "hf:DIR" one is loaded from DIR on first use."""

    def __missing__(self, name: str) -> Tokenizer:
        if not name.startswith("hf:"):
            raise KeyError(name)
        tokenizer = self[name] = HfTokenizer(name.removeprefix("hf:"))
        return tokenizer

    def get(self, name: str, default: Tokenizer | None = None) -> Tokenizer | None:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            return default
        except Exception as exc:  # no tokenizers package, or no usable tokenizer.json in DIR
            log.warning("tokenizer %s: cannot load it: %s", name, exc)
            return default


TOKENIZERS: TokenizerRegistry = TokenizerRegistry(byte=ByteTokenizer())
