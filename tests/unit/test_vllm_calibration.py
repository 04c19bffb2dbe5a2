"""The vllm engine's readings of clean steps and its calibration sweep's limits (calibration.py's pure parts)."""

from __future__ import annotations

import pytest

from services.common.profile_fit import StepSample
from services.node_agent.engines.vllm.calibration import StepObserver, Sweep

pytestmark = pytest.mark.timeout(10)


def test_a_prefill_is_read_only_from_a_request_alone_in_the_engine() -> None:
    observer = StepObserver()
    observer.admitted("a", num_in_flight=1, now=10.0)
    sample = observer.first_token("a", num_new_tokens=1, num_computed=480, now=10.05)
    assert sample == StepSample(0, 0, (480,), pytest.approx(50.0))
    observer.admitted("b", num_in_flight=1, now=11.0)
    observer.admitted("c", num_in_flight=2, now=11.01)  # b is no longer alone
    assert observer.first_token("b", 1, 480, now=11.05) is None
    assert observer.first_token("c", 1, 480, now=11.06) is None


def test_a_decode_is_read_only_when_no_prompt_is_prefilled_beside_it() -> None:
    assert StepObserver.decode(0.02, 2, num_decoding=4, num_context_tokens=800, num_prefilling=0) == (
        StepSample(4, 800, (), pytest.approx(10.0)))
    assert StepObserver.decode(0.02, 2, num_decoding=4, num_context_tokens=800, num_prefilling=1) is None


def test_the_sweep_keeps_within_the_engines_limits() -> None:
    sweep = Sweep().fitted_to(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=4)
    assert max(sweep.prefill_sizes) == 256 and len(set(sweep.prefill_sizes)) == len(sweep.prefill_sizes)
    assert sweep.decode_batches == (1, 4) and max(sweep.decode_prompt_tokens) <= 512 - sweep.decode_steps - 2
