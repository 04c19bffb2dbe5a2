"""The mean time of an engine's latest decode steps, as a node reports it (Load.recent_decode_step_ms). Pure.

A decode step's time includes the prefill chunks that ride in it, so on a node taking a burst of prompts
its steps run far slower than its batch alone would make them: what a request decoding there now sees,
which a prediction from the batch and a rate of arriving prompts can miss (a burst younger than the rate's
window). Both engines feed it: the sim engine each step's modelled time, the vLLM engine the time between
outputs of its oldest decoding request (one reading a step). Reported to the scheduler, exported as a
metric and shown by `baton status`; Baton's placement does not read it (a variant that did failed the
adoption rule: docs/evaluation.md, the ninth round).
"""

from __future__ import annotations

from collections import deque

# How much of the latest decode steps' time the mean covers: about the last second of decoding.
WINDOW_MS = 1000.0


class RecentSteps:
    """The mean time of the latest decode steps whose times add up to at least window_ms (all of them until
    they do); 0 before any."""

    def __init__(self, window_ms: float = WINDOW_MS) -> None:
        if window_ms <= 0:
            raise ValueError(f"window_ms={window_ms} must be positive")
        self._window_ms = window_ms
        self._steps: deque[tuple[float, int]] = deque()  # (their time in ms, how many steps)
        self._total_ms = 0.0
        self._count = 0

    def note(self, step_ms: float, steps: int = 1) -> None:
        """steps decode steps that took step_ms in all."""
        if steps < 1 or step_ms < 0:
            return
        self._steps.append((step_ms, steps))
        self._total_ms += step_ms
        self._count += steps
        while len(self._steps) > 1 and self._total_ms - self._steps[0][0] >= self._window_ms:
            old_ms, old_steps = self._steps.popleft()
            self._total_ms -= old_ms
            self._count -= old_steps

    @property
    def mean_ms(self) -> float:
        return self._total_ms / self._count if self._count else 0.0
