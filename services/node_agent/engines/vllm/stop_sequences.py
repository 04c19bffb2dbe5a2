"""Stop sequences of token ids, checked as tokens arrive. Pure, no I/O.

vLLM stops on single token ids or on strings; Baton's router sends stop sequences already
tokenized (several ids each), so the vllm engine checks them itself on the token stream.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop sequence the completion ends with; a stop never reaches into the prompt."""

    def __init__(self, stops: Sequence[Sequence[int]], resumed_token_ids: Sequence[int] = ()) -> None:
        self._stops = [tuple(stop) for stop in stops if stop]
        self._longest = max((len(stop) for stop in self._stops), default=0)
        # The completion's last tokens: a resumed request's earlier tokens count as completion.
        self._tail: list[int] = list(resumed_token_ids)[-self._longest:] if self._longest else []

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """How many of token_ids to keep when one completes a stop (the stop included); None if none does."""
        if not self._stops:
            return None
        for i, token in enumerate(token_ids):
            self._tail.append(token)
            del self._tail[:-self._longest]
            if any(len(stop) <= len(self._tail) and tuple(self._tail[-len(stop):]) == stop for stop in self._stops):
                return i + 1
        return None
