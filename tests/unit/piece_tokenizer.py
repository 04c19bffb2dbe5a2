"""A fake of the router's Tokenizer whose tokens are several bytes, as a byte-level BPE model's are: a stop string
comes inside one token or across a token boundary, and a multi-byte character may be split between tokens."""

from __future__ import annotations

from services.router.tokenizer import ByteStreamDecoder

# Token i is PIECES[i]; longest pieces first, so encode's greedy match takes them.
PIECES: tuple[bytes, ...] = (
    b" be", b" if", b"e i", b"caf", b"\xc3", b"\xa9!", b"be", b"if", b" ", b"b", b"e", b"i", b"f", b"!",
)
EOS = len(PIECES)  # no text
VOCAB_SIZE = EOS + 1


class PieceTokenizer:
    """Greedy longest-piece encoding of UTF-8 bytes; decoding as the byte tokenizer's, a piece's bytes at a time."""

    max_bytes_per_token = max(len(piece) for piece in PIECES)

    def encode(self, text: str) -> list[int]:
        data, ids = text.encode(), []
        while data:
            token_id = max((i for i, piece in enumerate(PIECES) if data.startswith(piece)),
                           key=lambda i: len(PIECES[i]))
            ids.append(token_id)
            data = data[len(PIECES[token_id]):]
        return ids

    def decoder(self) -> PieceStreamDecoder:
        return PieceStreamDecoder()


class PieceStreamDecoder:
    def __init__(self) -> None:
        self._bytes = ByteStreamDecoder()

    def decode(self, token_ids: list[int], final: bool = False) -> str:
        return self._bytes.decode([b for t in token_ids if t != EOS for b in PIECES[t]], final=final)


def token_ids(*pieces: bytes) -> list[int]:
    """The ids of these pieces, one token each."""
    return [PIECES.index(piece) for piece in pieces]
