"""Step-time model fitted to measured GPU data (see shared/perf/README.md)."""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

_COEFFICIENTS_FILE = "coefficients.csv"


@dataclass(frozen=True)
class TimingModel:
    """Coefficients of prefill and decode step time for one (gpu, model, tp)."""

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
        chunks_ms = sum(self.b_ms_per_tok * n + self.c_ms_per_tok2 * n * n for n in prefill_chunks)
        return self.decode_step_ms(decode_seqs, decode_context_tokens) + chunks_ms


@dataclass(frozen=True)
class _Row:
    gpu: str
    model: str
    tp: int
    timing: TimingModel


@functools.cache
def _rows() -> tuple[_Row, ...]:
    """Rows of the packaged CSV that carry both prefill and decode coefficients."""
    package = resources.files("services.node_agent.engines.sim")
    text = package.joinpath(_COEFFICIENTS_FILE).read_text(encoding="utf-8")
    rows: list[_Row] = []
    for record in csv.DictReader(io.StringIO(text)):
        # Prefill-only rows (Splitwise) cannot time a decode step.
        if not record["d_ms"].strip():
            continue
        timing = TimingModel(
            a_ms=float(record["a_ms"]),
            b_ms_per_tok=float(record["b_ms_per_tok"]),
            c_ms_per_tok2=float(record["c_ms_per_tok2"]),
            prefill_floor_ms=float(record["prefill_floor_ms"]),
            d_ms=float(record["d_ms"]),
            e_ms_per_seq=float(record["e_ms_per_seq"]),
            f_ms_per_ctx_tok=float(record["f_ms_per_ctx_tok"]),
        )
        rows.append(_Row(record["gpu"], record["model"], int(record["tp"]), timing))
    return tuple(rows)


def load_coefficients(gpu: str, model: str, tp: int = 1) -> TimingModel:
    """Timing model for (gpu, perf model, tensor-parallel size); KeyError if not fitted."""
    for row in _rows():
        if row.gpu == gpu.lower() and row.model == model and row.tp == tp:
            return row.timing
    known = ", ".join(f"{r.gpu}/{r.model}/tp{r.tp}" for r in _rows())
    raise KeyError(f"no timing coefficients for gpu={gpu!r} model={model!r} tp={tp}; known: {known}")


def known_gpus() -> tuple[str, ...]:
    """GPU names that have at least one usable row, sorted."""
    return tuple(sorted({row.gpu for row in _rows()}))
