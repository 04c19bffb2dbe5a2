"""Deterministic token choice: a pure function of the context (and seed, position)."""

from __future__ import annotations

from collections.abc import Iterable

from services.node_agent.engines.sim.models import EOS_TOKEN_ID
from services.node_agent.engines.types import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_INITIAL_STATE = 0x6A09E667F3BCC908
_GREEDY_SALT = 0x243F6A8885A308D3

# One EOS per ~400 positions keeps most demo completions running to max_tokens
# while still exercising the STOP path.
_EOS_ONE_IN = 400
# Out of 1000: ~1 in 6 characters is a space (words average about 5 letters),
# with a sprinkle of punctuation.
_SPACE_PER_MILLE = 160
_COMMA_PER_MILLE = 12
_PERIOD_PER_MILLE = 8
# Above this temperature one character in ten comes from a wider alphabet.
_WIDE_ALPHABET_TEMPERATURE = 1.0

# Letters repeated roughly by English frequency so the output reads like text.
_LETTER_WEIGHTS = (
    ("e", 12), ("t", 9), ("a", 8), ("o", 8), ("i", 7), ("n", 7), ("s", 6), ("h", 6), ("r", 6),
    ("d", 4), ("l", 4), ("c", 3), ("u", 3), ("m", 2), ("w", 2), ("f", 2), ("g", 2), ("y", 2),
    ("p", 2), ("b", 1), ("v", 1), ("k", 1), ("j", 1), ("x", 1), ("q", 1), ("z", 1),
)  # fmt: skip
_LETTERS = bytes("".join(letter * weight for letter, weight in _LETTER_WEIGHTS), "ascii")
_WIDE = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit function of x."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class ContextHasher:
    """Rolling 64-bit digest of a token sequence; equal sequences give equal states."""

    __slots__ = ("state",)

    def __init__(self, state: int = _INITIAL_STATE) -> None:
        self.state = state

    @classmethod
    def from_tokens(cls, token_ids: Iterable[int]) -> ContextHasher:
        """Digest of token_ids from the empty context."""
        hasher = cls()
        for token_id in token_ids:
            hasher.extend(token_id)
        return hasher

    def extend(self, token_id: int) -> None:
        """Fold one more token into the digest."""
        self.state = _mix64(self.state ^ (((token_id + 1) * _GOLDEN) & _MASK64))

    @classmethod
    def after_block(cls, block_hash: int) -> ContextHasher:
        """Digest of a context that ends with the full block keyed block_hash.

        The block key already chains every earlier token, so a sequence's digest can restart
        from its last full block: O(block) work per token instead of O(context) per request.
        """
        return cls(_mix64(block_hash ^ _INITIAL_STATE))


def next_token(
    context_state: int,
    position: int,
    sampling: SamplingParams,
    eos_token_id: int = EOS_TOKEN_ID,
) -> int:
    """Token at absolute position `position` (prompt + completion index) after a context."""
    if sampling.temperature <= 0.0:
        # Greedy: the context alone decides, so any engine, batch or resume agrees.
        r = _mix64(context_state ^ _GREEDY_SALT)
    else:
        # Seeded: (seed, position, context); the router always assigns a seed.
        seed = sampling.seed if sampling.seed is not None else 0
        r = _mix64(context_state ^ _mix64(_mix64(seed & _MASK64) ^ (position & _MASK64)))
    if not sampling.ignore_eos and r % _EOS_ONE_IN == 0:
        return eos_token_id
    kind = (r >> 16) % 1000
    if kind < _SPACE_PER_MILLE:
        return ord(" ")
    kind -= _SPACE_PER_MILLE
    if kind < _COMMA_PER_MILLE:
        return ord(",")
    kind -= _COMMA_PER_MILLE
    if kind < _PERIOD_PER_MILLE:
        return ord(".")
    if sampling.temperature > _WIDE_ALPHABET_TEMPERATURE and (r >> 48) % 10 == 0:
        return _WIDE[(r >> 32) % len(_WIDE)]
    return _LETTERS[(r >> 32) % len(_LETTERS)]
