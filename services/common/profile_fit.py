"""Least-squares fits of an engine's step-time coefficients to observed step times. Pure, no I/O.

Every step is one sample: the decode sequences it ran (B) and their context tokens (C), the prefill
chunks it computed (n_i), and how long it took. The model is ../shared/perf's: a prefill-only step
takes a + b·Σn + c·Σn², a step with decodes d + e·B + f·C plus b·n + c·n² per chunk riding along
(the floor of max(floor, a + b·Σn) is a GPU's kernel-launch bound, not fitted: it is kept from the
prior, else 0). One linear fit over the six coefficients (a, d, b, c, e, f), each held at 0 or more,
ridge-regularised towards a prior: without one (calibration) the fit is ordinary least squares; with
one (online refinement) a window of recent steps moves the coefficients only as far as its data
pins them down (the intercepts a and d move freely), so a window of single-sequence decodes cannot make
up a batch coefficient.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.step_timing import TimingModel

_NAMES = ("a_ms", "d_ms", "b_ms_per_tok", "c_ms_per_tok2", "e_ms_per_seq", "f_ms_per_ctx_tok")
# Without a prior the fit is ordinary least squares, but a coefficient no sample constrains stays 0.
_OLS_RIDGE = 1e-9
_INTERCEPTS = (0, 1)
_INTERCEPT_RIDGE = 1e-3


@dataclass(frozen=True)
class StepSample:
    """One engine step as observed."""

    num_decode_seqs: int
    num_context_tokens: int
    prefill_chunks: tuple[int, ...]
    ms: float

    def features(self) -> tuple[float, ...]:
        """The step's multipliers of (a, d, b, c, e, f)."""
        total = float(sum(self.prefill_chunks))
        squares = float(sum(n * n for n in self.prefill_chunks))
        has_decode = self.num_decode_seqs > 0
        return (0.0 if has_decode else 1.0, 1.0 if has_decode else 0.0, total, squares,
                float(self.num_decode_seqs), float(self.num_context_tokens))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; matrix is symmetric positive definite here."""
    size = len(rhs)
    rows = [row[:] + [value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        if rows[col][col] == 0.0:
            continue
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            if factor:
                for k in range(col, size + 1):
                    rows[r][k] -= factor * rows[col][k]
    solution = [0.0] * size
    for col in reversed(range(size)):
        if rows[col][col] == 0.0:
            continue
        known = sum(rows[col][k] * solution[k] for k in range(col + 1, size))
        solution[col] = (rows[col][size] - known) / rows[col][col]
    return solution


def fit_timing(samples: Sequence[StepSample], prior: TimingModel | None = None,
               prior_weight: float = 0.0) -> TimingModel:
    """The coefficients (each ≥ 0) that best fit samples' step times; with a prior, ridge-regularised
    towards it with the weight of prior_weight samples per coefficient. ValueError without samples."""
    usable = [s for s in samples if s.ms > 0 and math.isfinite(s.ms)]
    if not usable:
        raise ValueError("samples: no step with a positive, finite time to fit")
    rows = [s.features() for s in usable]
    targets = [s.ms for s in usable]
    size = len(_NAMES)
    # Each feature scaled to unit mean square: a ridge weight means the same for every coefficient.
    scales = [math.sqrt(sum(r[j] ** 2 for r in rows) / len(rows)) or 1.0 for j in range(size)]
    scaled = [[r[j] / scales[j] for j in range(size)] for r in rows]
    prior_values = [getattr(prior, name) * scales[j] for j, name in enumerate(_NAMES)] if prior else [0.0] * size
    weight = prior_weight if prior is not None and prior_weight > 0 else _OLS_RIDGE
    # The intercepts (a, d) are all but free: a shift of every step's time (another process on the
    # machine, say) moves them, and the slopes move only as far as the window's spread pins them.
    ridges = [weight * _INTERCEPT_RIDGE if j in _INTERCEPTS else weight for j in range(size)]
    active = list(range(size))
    solution = [0.0] * size
    while True:  # active set: a coefficient fitted negative is held at 0 and the rest refitted
        matrix = [[sum(x[i] * x[j] for x in scaled) + (ridges[i] if i == j else 0.0) for j in active] for i in active]
        rhs = [sum(x[i] * (y - sum(x[k] * solution[k] for k in range(size) if k not in active))
                   for x, y in zip(scaled, targets, strict=True)) + ridges[i] * prior_values[i] for i in active]
        fitted = _solve(matrix, rhs)
        negative = [i for i, value in zip(active, fitted, strict=True) if value < 0]
        if not negative:
            for i, value in zip(active, fitted, strict=True):
                solution[i] = value
            break
        for i in negative:
            active.remove(i)
            solution[i] = 0.0
        if not active:
            break
    values = {name: solution[j] / scales[j] for j, name in enumerate(_NAMES)}
    return TimingModel(prefill_floor_ms=prior.prefill_floor_ms if prior else 0.0, **values)


def relative_error(timing: TimingModel, samples: Sequence[StepSample]) -> float:
    """Mean |predicted − measured| / measured of the steps in samples (for benchmarks and logs)."""
    usable = [s for s in samples if s.ms > 0]
    if not usable:
        return 0.0
    return sum(abs(timing.step_ms(s.num_decode_seqs, s.num_context_tokens, s.prefill_chunks) - s.ms) / s.ms
               for s in usable) / len(usable)


class ProfileRefiner:
    """Online refinement of a calibrated profile: the latest `window` observed steps, refitted once
    `refit_every` new ones came and `min_interval_s` passed since the last refit (each new profile is
    re-registered: not more often than that), ridge-regularised towards the calibration, which counts
    as prior_weight steps. Time is passed in."""

    def __init__(self, calibrated: EngineProfile, window: int = 512, refit_every: int = 64,
                 min_interval_s: float = 30.0, prior_weight: float = 16.0) -> None:
        self._calibrated = calibrated
        self._window: deque[StepSample] = deque(maxlen=window)
        self._refit_every = refit_every
        self._min_interval_s = min_interval_s
        self._prior_weight = prior_weight
        self._num_new = 0
        self._num_observed = 0
        self._last_refit: float | None = None
        self.profile = calibrated

    @property
    def num_observed(self) -> int:
        """Steps of real traffic observed since the calibration."""
        return self._num_observed

    def observe(self, sample: StepSample) -> None:
        if sample.ms > 0 and (sample.num_decode_seqs or sample.prefill_chunks):
            self._window.append(sample)
            self._num_new += 1
            self._num_observed += 1

    def refit(self, now: float) -> EngineProfile | None:
        """A new profile when one is due (see the class docstring); None otherwise."""
        if self._num_new < self._refit_every:
            return None
        if self._last_refit is not None and now - self._last_refit < self._min_interval_s:
            return None
        self._num_new = 0
        self._last_refit = now
        timing = fit_timing(self._window, prior=self._calibrated.timing, prior_weight=self._prior_weight)
        self.profile = replace(self._calibrated, timing=timing, source=ProfileSource.ONLINE,
                               num_samples=self._calibrated.num_samples + self._num_observed)
        return self.profile
