"""The performance profile a node registers for each model it serves: what placement reads. Pure.

Its step-time coefficients are in the model form of ../shared/perf (prefill = max(floor, a + b·Σn)
+ c·Σn², decode = d + e·B + f·C), beside what bounds a step and a cache: the most tokens one step
computes, the KV block size and the number of KV blocks. The scheduler's policies, its admission
predictor and the simulator read these profiles only, never an engine's own tables.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.step_timing import TimingModel


class ProfileSource(enum.Enum):
    """Where a profile's coefficients come from."""

    CONFIGURED = "configured"  # given to the engine (the sim engine's fitted table)
    CALIBRATED = "calibrated"  # measured by the engine's start-up sweep
    ONLINE = "online"  # refined from the step times the engine has observed since


@dataclass(frozen=True)
class EngineProfile:
    """How fast one engine runs one model, and how large its steps and KV cache are."""

    timing: TimingModel
    max_num_batched_tokens: int
    kv_block_size: int
    num_kv_blocks: int
    source: ProfileSource
    # Step timings the coefficients were fitted to (0 for configured ones).
    num_samples: int = 0
    # Sequences one step runs at most; the rest wait for a running one to end (0: no limit known).
    max_num_seqs: int = 0

    def describe(self) -> str:
        """One line for `baton status`: the coefficients, and where they come from."""
        t = self.timing
        fitted = f", {self.num_samples} steps" if self.num_samples else ""
        seqs = f" and {self.max_num_seqs} sequences" if self.max_num_seqs else ""
        return (f"{self.source.value}{fitted}: prefill max({t.prefill_floor_ms:.3g}, {t.a_ms:.3g} + "
                f"{t.b_ms_per_tok:.3g}·Σn) + {t.c_ms_per_tok2:.3g}·Σn² ms; decode {t.d_ms:.3g} + "
                f"{t.e_ms_per_seq:.3g}·B + {t.f_ms_per_ctx_tok:.3g}·C ms; step ≤ {self.max_num_batched_tokens} "
                f"tokens{seqs}, {self.num_kv_blocks} KV blocks of {self.kv_block_size}")
