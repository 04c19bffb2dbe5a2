"""Sampling keyed by (seed, position): the token chosen at a position is a pure function of the seed,
the position and the logits there, so a generation resumed on any node continues exactly as the
uninterrupted run did (given the same logits).

Gumbel-max: argmax(logits / T + G) is a sample of softmax(logits / T) when the G are independent
standard Gumbel variables. Here G is not drawn from a generator that advances token by token (what
vLLM does, and why its seeded runs cannot be resumed) but hashed from (seed, position, token id)
with splitmix64 in wrapping uint64 arithmetic and mapped to float64: the same bits in every process,
on every thread count. Pure numpy, no vLLM.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (scalar keys)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (numpy wraps array arithmetic modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MUL1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MUL2)
    return x ^ (x >> np.uint64(31))


def gumbel_noise(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Standard Gumbel noise for every token id at one position of one seed's generation."""
    key = _mix(_mix(seed ^ _GOLDEN) ^ position)
    counters = np.arange(vocab_size, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
    bits = _mix_array(counters)
    # The top 53 bits, centred in their interval: uniform on (0, 1), never 0 or 1.
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(-np.log(uniform))


def top_p_mask(scaled_logits: np.ndarray, top_p: float) -> np.ndarray:
    """The logits with every token outside the nucleus at -inf: the most probable tokens whose
    probability before them adds up to less than top_p (so at least the most probable one)."""
    order = np.argsort(-scaled_logits, kind="stable")
    ordered = scaled_logits[order]
    probs = np.exp(ordered - ordered[0])
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    keep = order[mass_before < top_p]
    masked = np.full_like(scaled_logits, -np.inf)
    masked[keep] = scaled_logits[keep]
    return masked


def choose_token(logits: np.ndarray, temperature: float, top_p: float, seed: int, position: int) -> int:
    """The token at position: Gumbel-max over logits / temperature, within the top_p nucleus.
    temperature must be positive (greedy is a plain argmax and needs no key)."""
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    if not np.isfinite(scaled).any():  # nothing allowed at all: leave the choice to the argmax
        return int(np.argmax(logits))
    if top_p < 1.0:
        scaled = top_p_mask(scaled, top_p)
    return int(np.argmax(scaled + gumbel_noise(seed, position, scaled.size)))
