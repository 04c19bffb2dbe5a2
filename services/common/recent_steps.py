"""The mean time of an engine's latest decode steps, as a node reports it (Load.recent_decode_step_ms). Pure.

A decode step's time includes the prefill chunks that ride in it, so on a node taking a burst of prompts
its steps run far slower than its batch alone would make them: what a request decoding there now sees,
which a prediction from the batch and a rate of arriving prompts can miss (a burst younger than the rate's
window). Both engines feed it: the sim engine each step's modelled time once the step has run, the vLLM
engine the time between outputs of its oldest decoding request (one reading per output, covering as many
steps as it brought tokens). When the engine stops decoding the mean stays as it was, and the next run of
decoding starts afresh.
"""

from __future__ import annotations

import math
from collections import deque

# How much of the latest decode steps' time the mean covers: about the last second of decoding.
WINDOW_MS = 1000.0
# At most this many readings are kept, however short (back-to-back outputs can read 0 ms).
MAX_READINGS = 4096


class RecentSteps:
    """The mean time of the latest decode steps whose times add up to at least window_ms (all of them until
    they do); 0 before any."""

    def __init__(self, window_ms: float = WINDOW_MS) -> None:
        if not window_ms > 0:
            raise ValueError(f"window_ms={window_ms} must be positive")
        self._window_ms = window_ms
        self._readings: deque[tuple[float, int]] = deque()  # (their time in ms, how many steps)
        self._total_ms = 0.0
        self._count = 0
        self._stopped = False

    def note(self, step_ms: float, steps: int = 1) -> None:
        """steps decode steps that took step_ms in all."""
        if not (math.isfinite(step_ms) and step_ms >= 0) or steps < 1:
            raise ValueError(f"step_ms={step_ms} must be finite and not negative, steps={steps} at least 1")
        if self._stopped:
            self._readings.clear()
            self._total_ms, self._count, self._stopped = 0.0, 0, False
        self._readings.append((step_ms, steps))
        self._total_ms += step_ms
        self._count += steps
        while len(self._readings) > 1 and (len(self._readings) > MAX_READINGS
                                           or self._total_ms - self._readings[0][0] >= self._window_ms):
            old_ms, old_steps = self._readings.popleft()
            self._total_ms -= old_ms
            self._count -= old_steps

    def stopped(self) -> None:
        """The engine has stopped decoding: the mean stays until the next reading, which starts afresh."""
        self._stopped = True

    @property
    def mean_ms(self) -> float:
        return self._total_ms / self._count if self._count else 0.0
