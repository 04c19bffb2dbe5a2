"""Least-squares fits of an engine's step-time coefficients to observed step times. Pure, no I/O.

Every step is one sample: the decode sequences it ran (B) and their context tokens (C), the prefill
chunks it computed (n_i), and how long it took. The model is ../shared/perf's: a prefill-only step
takes a + b·Σn + c·Σn², a step with decodes d + e·B + f·C plus b·n + c·n² per chunk riding along
(the floor of max(floor, a + b·Σn) is a GPU's kernel-launch bound, not fitted: it is kept from the
prior, else 0). One linear fit over the six coefficients (a, d, b, c, e, f), each held at 0 or more.

A calibration (fit_timing) is ordinary least squares. An online refit (refit_timing) moves the
calibration only as far as the window's readings pin it down, and only where they do. A window holds
what traffic brought (often only short prompts, or single-sequence decodes), so what its readings
cannot tell apart (is a slow 40-token prefill the intercept, or a quadratic term worth minutes at
2,048 tokens?) is left to the calibration. Everything is measured in the calibration's own units, never
the window's spread: a reading's residual as a fraction of the calibration's time for that step, and a
coefficient's change as a fraction of the calibration's time at the anchor step (prefills of 16 tokens
to the step budget, decode batches of 1 to 64 at short and long contexts: the range the scheduler
predicts) where that coefficient weighs most; each coefficient is held to the calibration as if by
prior_weight readings. So short prefills move the intercept a, hardly b, and c not at all. A reading
off the fit by more than ROBUST_SCALE counts less the further off it is (Huber's loss): a few readings
slowed by a neighbour cannot carry the fit. Last, the refit is drawn back towards the calibration until
no anchor step is predicted more than MAX_DRIFT times slower or faster than the calibration predicts it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.step_timing import TimingModel

_NAMES = ("a_ms", "d_ms", "b_ms_per_tok", "c_ms_per_tok2", "e_ms_per_seq", "f_ms_per_ctx_tok")
_PREFILL = (0, 2, 3)  # a, b, c: the coefficients a lone prefill's time reads
_DECODE = (1, 4, 5)  # d, e, f: a decode step's
# A coefficient no sample constrains stays 0.
_OLS_RIDGE = 1e-9
_INTERCEPTS = (0, 1)
_INTERCEPT_RIDGE = 1e-3

# Where the calibration holds a refit: lone prefills of these sizes (and of the step budget), decode batches
# of these sizes (at most max_num_seqs) at these contexts per sequence (at most the KV cache).
ANCHOR_PREFILL_TOKENS = (16, 64, 256, 1024)
ANCHOR_DECODE_BATCHES = (1, 8, 64)
ANCHOR_CONTEXT_PER_SEQ = (128, 2048)
# A reading off the refit by more than this fraction of the calibration's time for it counts less (Huber).
ROBUST_SCALE = 0.5
# A refit predicts every anchor step within this factor of the calibration's time for it.
MAX_DRIFT = 4.0
_ROBUST_ITERATIONS = 8
_MIN_UNIT_MS = 1e-3


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


def _fit_nonnegative(rows: Sequence[Sequence[float]], targets: Sequence[float],
                     weights: Sequence[float]) -> list[float]:
    """The coefficients (each ≥ 0) minimising Σ weight·(row·coefficients − target)², with a ridge of
    _OLS_RIDGE towards 0 so that a coefficient no row constrains stays 0."""
    size = len(_NAMES)
    total_weight = sum(weights)
    # Each feature scaled to unit (weighted) mean square: the ridge means the same for every coefficient.
    scales = [math.sqrt(sum(w * r[j] ** 2 for r, w in zip(rows, weights, strict=True)) / total_weight) or 1.0
              for j in range(size)]
    scaled = [[r[j] / scales[j] for j in range(size)] for r in rows]
    # The intercepts (a, d) are all but free of the ridge: it only settles a coefficient nothing constrains.
    ridges = [_OLS_RIDGE * _INTERCEPT_RIDGE if j in _INTERCEPTS else _OLS_RIDGE for j in range(size)]
    normal = [[sum(w * x[i] * x[j] for x, w in zip(scaled, weights, strict=True)) + (ridges[i] if i == j else 0.0)
               for j in range(size)] for i in range(size)]
    moments = [sum(w * x[i] * y for x, y, w in zip(scaled, targets, weights, strict=True)) for i in range(size)]
    active = list(range(size))
    solution = [0.0] * size
    while active:  # active set: a coefficient fitted negative is held at 0 and the rest refitted
        fitted = _solve([[normal[i][j] for j in active] for i in active], [moments[i] for i in active])
        negative = [i for i, value in zip(active, fitted, strict=True) if value < 0]
        if not negative:
            for i, value in zip(active, fitted, strict=True):
                solution[i] = value
            break
        active = [i for i in active if i not in negative]
    return [solution[j] / scales[j] for j in range(size)]


def _timing(values: Sequence[float], prefill_floor_ms: float) -> TimingModel:
    return TimingModel(prefill_floor_ms=prefill_floor_ms, **dict(zip(_NAMES, values, strict=True)))


def fit_timing(samples: Sequence[StepSample]) -> TimingModel:
    """The coefficients (each ≥ 0) that best fit samples' step times by least squares (a calibration:
    no prior; online refinement is refit_timing). ValueError without samples."""
    usable = [s for s in samples if s.ms > 0 and math.isfinite(s.ms)]
    if not usable:
        raise ValueError("samples: no step with a positive, finite time to fit")
    values = _fit_nonnegative([s.features() for s in usable], [s.ms for s in usable], [1.0] * len(usable))
    return _timing(values, 0.0)


def _linear_ms(values: Sequence[float], features: Sequence[float]) -> float:
    """A step's time as the linear model gives it (the prefill floor left out, as in the fit)."""
    return sum(v * x for v, x in zip(values, features, strict=True))


def _anchors(profile: EngineProfile) -> list[tuple[float, ...]]:
    """The features of the steps a refit is held to the calibration at: lone prefills from 16 tokens to the
    step budget, and decode batches of 1 to 64 sequences (at most max_num_seqs) with short and long contexts
    (at most the KV cache). They span what the scheduler predicts, not what the window happened to hold."""
    budget = max(1, profile.max_num_batched_tokens)
    sizes = sorted({min(n, budget) for n in ANCHOR_PREFILL_TOKENS} | {budget})
    capacity = max(1, profile.num_kv_blocks * profile.kv_block_size)
    batches = sorted({min(b, profile.max_num_seqs) if profile.max_num_seqs else b for b in ANCHOR_DECODE_BATCHES})
    shapes = {(b, min(b * c, capacity)) for b in batches for c in ANCHOR_CONTEXT_PER_SEQ}
    return ([StepSample(0, 0, (n,), 0.0).features() for n in sizes]
            + [StepSample(b, c, (), 0.0).features() for b, c in sorted(shapes)])


def _toward_prior(prior: Sequence[float], fitted: Sequence[float],
                  anchors: Sequence[Sequence[float]]) -> list[float]:
    """fitted moved back towards prior, prefill and decode coefficients each as little as it takes for every
    anchor step of theirs to take between 1/MAX_DRIFT and MAX_DRIFT times the prior's time."""
    values = list(fitted)
    for group, intercept in ((_PREFILL, 0), (_DECODE, 1)):
        share = 1.0
        for x in (x for x in anchors if x[intercept]):
            before = _linear_ms(prior, x)
            change = _linear_ms(fitted, x) - before
            if before <= 0 or change == 0:
                continue
            room = (MAX_DRIFT - 1) * before if change > 0 else (1 - 1 / MAX_DRIFT) * before
            share = min(share, room / abs(change))
        for j in group:
            values[j] = prior[j] + share * (fitted[j] - prior[j])
    return values


def refit_timing(samples: Sequence[StepSample], calibrated: EngineProfile, prior_weight: float) -> TimingModel:
    """calibrated's timing refitted to samples (see the module docstring): a robust least-squares fit in units
    of the calibration's own step times, each coefficient held to the calibration as if by prior_weight
    readings at the anchor step it weighs most in, bounded within MAX_DRIFT of it. ValueError without samples."""
    usable = [s for s in samples if s.ms > 0 and math.isfinite(s.ms)]
    if not usable:
        raise ValueError("samples: no step with a positive, finite time to fit")
    prior = [getattr(calibrated.timing, name) for name in _NAMES]
    anchors = _anchors(calibrated)
    rows = [s.features() for s in usable]
    targets = [s.ms for s in usable]
    # Every residual in units of the calibration's time for that step: a reading 50 % off counts the same
    # for a 5 ms decode as for a 500 ms prefill, whatever else the window holds.
    base = [1.0 / max(_linear_ms(prior, x), _MIN_UNIT_MS) ** 2 for x in rows]
    # The prior, one pseudo-reading per coefficient: moving b by u_b costs as much as prior_weight readings
    # 100 % off, u_b being what would double the calibration's time at the anchor where b weighs most
    # (the step budget's prefill). A window of short prefills moves a, hardly b, and c not at all.
    for j in range(len(_NAMES)):
        unit = min(max(_linear_ms(prior, x), _MIN_UNIT_MS) / x[j] for x in anchors if x[j] > 0)
        rows.append(tuple(1.0 if k == j else 0.0 for k in range(len(_NAMES))))
        targets.append(prior[j])
        base.append(prior_weight / unit ** 2)
    values = prior
    for _ in range(_ROBUST_ITERATIONS):  # Huber's loss by reweighting: a reading far off the fit counts less
        weights = list(base)
        for i in range(len(usable)):
            off = abs(_linear_ms(values, rows[i]) - targets[i]) * math.sqrt(base[i])
            if off > ROBUST_SCALE:
                weights[i] *= ROBUST_SCALE / off
        fitted = _fit_nonnegative(rows, targets, weights)
        settled = all(abs(_linear_ms(fitted, x) - _linear_ms(values, x)) <= 1e-3 * _linear_ms(prior, x)
                      for x in anchors)
        values = fitted
        if settled:
            break
    return _timing(_toward_prior(prior, values, anchors), calibrated.timing.prefill_floor_ms)


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
    re-registered: not more often than that) by refit_timing, each coefficient held to the calibration as
    if by prior_weight readings (see the module docstring). Time is passed in."""

    def __init__(self, calibrated: EngineProfile, window: int = 512, refit_every: int = 64,
                 min_interval_s: float = 30.0, prior_weight: float = 4.0) -> None:
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
        timing = refit_timing(self._window, self._calibrated, self._prior_weight)
        self.profile = replace(self._calibrated, timing=timing, source=ProfileSource.ONLINE,
                               num_samples=self._calibrated.num_samples + self._num_observed)
        return self.profile
