"""Step-time model fitted to measured GPU data (see shared/perf/README.md)."""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass
from importlib import resources

from services.common.step_timing import TimingModel

__all__ = ["TimingModel", "known_gpus", "load_coefficients"]

_COEFFICIENTS_FILE = "coefficients.csv"


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
