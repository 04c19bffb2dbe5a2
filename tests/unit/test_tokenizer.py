"""The stream decoders: whole characters only, the text before an incomplete one sent, end-of-sequence has no text."""

from __future__ import annotations

from services.router.tokenizer import TOKENIZERS, ByteStreamDecoder, HfStreamDecoder

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


class _ByteBpe:
    """A byte-level BPE vocabulary as a Hugging Face tokenizer decodes it: each token is some bytes, and the text of
    a run of tokens is their bytes as UTF-8, each incomplete or invalid sequence a U+FFFD."""

    def __init__(self, vocab: list[bytes]) -> None:
        self.vocab = vocab

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


SMILE = "🙂".encode()  # four bytes
BPE = _ByteBpe([b"Hello", b" world", b",", b" fine ", SMILE[:2], SMILE[2:], b"\x87", b"old", "é".encode()[:1],
                "é".encode()[1:]])


def _stream(ids: list[int], chunks: list[int]) -> list[str]:
    """The text of each chunk of ids (sizes chunks), the last one final."""
    decoder, texts, at = HfStreamDecoder(BPE), [], 0
    for n, size in enumerate(chunks):
        texts.append(decoder.decode(ids[at:at + size], final=n == len(chunks) - 1))
        at += size
    return texts


def test_a_chunk_ending_mid_character_sends_its_words_and_holds_back_only_the_character() -> None:
    """Held back whole, the chunk's words were lost with the character when the stream ended there: a greedy answer
    cut by max_tokens inside an emoji came out as no text (helper-110, on vLLM)."""
    assert _stream([0, 1, 2, 3, 4], [5]) == ["Hello world, fine \ufffd"]  # its last token: all of it, cut emoji too
    assert _stream([0, 1, 2, 3, 4, 5], [5, 1]) == ["Hello world, fine ", "🙂"]
    assert _stream([0, 1, 2, 3, 4, 5, 1], [1, 1, 1, 1, 1, 1, 1]) == ["Hello", " world", ",", " fine ", "", "🙂",
                                                                         " world"]
    assert _stream([0, 8, 9, 1], [2, 2]) == ["Hello", "é world"]


def test_every_chunking_of_a_stream_gives_its_tokens_decoded() -> None:
    """Bytes that never make a character (a random model's, say) wait only for the next complete text or the end."""
    ids = [0, 6, 7, 6, 6, 1, 4, 5, 3, 8, 9, 2, 4]
    whole = BPE.decode(ids)
    for size in range(1, len(ids) + 1):
        chunks = [size] * (len(ids) // size) + ([len(ids) % size] if len(ids) % size else [])
        assert "".join(_stream(ids, chunks)) == whole, size


def test_the_byte_decoder_ends_an_incomplete_character_as_a_replacement() -> None:
    decoder = ByteStreamDecoder()
    assert decoder.decode([ord("o"), ord("k"), 0xF0, 0x9F]) == "ok"
    assert decoder.decode([0x99], final=True) == "\ufffd"
