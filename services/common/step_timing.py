"""An engine's step-time model, in the form of ../shared/perf: what a node's profile carries. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingModel:
    """Coefficients of prefill and decode step time for one engine (gpu, model, tp)."""

    a_ms: float
    b_ms_per_tok: float
    c_ms_per_tok2: float
    prefill_floor_ms: float
    d_ms: float
    e_ms_per_seq: float
    f_ms_per_ctx_tok: float

    def prefill_ms(self, new_tokens_per_request: Sequence[int]) -> float:
        """Time of a prefill-only step: max(floor, a + b·Σn) + c·Σn²."""
        total = sum(new_tokens_per_request)
        squares = sum(n * n for n in new_tokens_per_request)
        return max(self.prefill_floor_ms, self.a_ms + self.b_ms_per_tok * total) + (
            self.c_ms_per_tok2 * squares
        )

    def decode_step_ms(self, num_seqs: int, num_context_tokens: int) -> float:
        """Time of a decode step: d + e·B + f·C."""
        return self.d_ms + self.e_ms_per_seq * num_seqs + self.f_ms_per_ctx_tok * num_context_tokens

    def step_ms(
        self,
        decode_seqs: int,
        decode_context_tokens: int,
        prefill_chunks: Sequence[int],
    ) -> float:
        """Time of a mixed step: decode step plus b·n + c·n² per prefill chunk."""
        if decode_seqs == 0:
            return self.prefill_ms(prefill_chunks) if prefill_chunks else 0.0
        # The decode step's fixed cost already covers the launch overhead `a`
        # and the floor, so chunks riding along only add their marginal cost.
        return self.decode_step_ms(decode_seqs, decode_context_tokens) + sum(map(self.riding_chunk_ms, prefill_chunks))

    def riding_chunk_ms(self, num_tokens: float) -> float:
        """What a prefill chunk of num_tokens adds to the decode step it rides in: b·n + c·n²."""
        return self.b_ms_per_tok * num_tokens + self.c_ms_per_tok2 * num_tokens * num_tokens
