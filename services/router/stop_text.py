"""Stop strings found in a completion's text, whatever its tokenization. Pure.

A node matches a stop by the token ids of the stop string encoded alone, which a byte-level BPE model rarely
generates: the string comes inside one token (" bef" for "be") or across a token boundary ("e i" for "be if").
The router decodes the completion token by token and ends it where a stop string first ends in the text.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.tokenizer import StreamDecoder


class StopText:
    """Where a completion's text first contains one of its stop strings.

    The relay feeds it each chunk's tokens (find); the stop counts at the token that brings its last character.
    Only text this stream generates can end it: a resumed request's own tokens are looked back into, as vLLM looks
    back a stop's length, so a stop that began among them is found, but one wholly among them does not end it again.
    The servicer then cuts the client's text where the stop ends (clip): the token that completed it may carry more.
    """

    def __init__(self, stops: Sequence[str], decoder: StreamDecoder, resumed_token_ids: Sequence[int] = ()) -> None:
        self._stops = [stop for stop in stops if stop]
        # A stop that ends in new text begins at most this many characters before it.
        self._lookback = max((len(stop) for stop in self._stops), default=1) - 1
        self._decoder = decoder
        resumed = decoder.decode(list(resumed_token_ids))
        # A stop among the tokens its client already has: the stream ended there (its router died before the
        # finish reached the client), and an uninterrupted one would have generated nothing more.
        self.in_resumed = any(stop in resumed for stop in self._stops)
        self._tail = self._last_chars(resumed)
        self._num_chars = 0  # characters of text generated since the resumed tokens, before the tail's end
        # Characters of that text through the end of the stop found; None until one is (0 when it was among the
        # resumed tokens: nothing more is sent, not even a character they leave incomplete).
        self.num_chars_through_stop: int | None = 0 if self.in_resumed else None
        self._num_chars_clipped = 0  # characters clip has handed out

    def find(self, token_ids: Sequence[int]) -> int | None:
        """How many of token_ids, the completion's next tokens, to keep: those through the one whose text completes
        a stop string; None when none does (not called again once one did)."""
        for i, token_id in enumerate(token_ids):
            text = self._decoder.decode([token_id])
            if not text:  # no character yet (end of sequence, or part of a multi-byte one)
                continue
            window = self._tail + text
            end = self._first_end(window, len(self._tail))
            if end is not None:
                self.num_chars_through_stop = self._num_chars + end - len(self._tail)
                return i + 1
            self._num_chars += len(text)
            self._tail = self._last_chars(window)
        return None

    def clip(self, text: str) -> str:
        """text, the next part of the completion's text as the client is sent it (decoded from the same tokens),
        without whatever follows the stop found."""
        if self.num_chars_through_stop is not None:
            text = text[:max(0, self.num_chars_through_stop - self._num_chars_clipped)]
        self._num_chars_clipped += len(text)
        return text

    def _first_end(self, window: str, num_old: int) -> int | None:
        """Where in window the first stop to end after its first num_old characters ends; None if none does."""
        ends = []
        for stop in self._stops:
            start = window.find(stop, max(0, num_old - len(stop) + 1))
            if start >= 0:
                ends.append(start + len(stop))
        return min(ends, default=None)

    def _last_chars(self, text: str) -> str:
        return text[-self._lookback:] if self._lookback else ""
