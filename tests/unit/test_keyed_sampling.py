"""Sampling keyed by (seed, position): the token at a position depends on nothing but the seed, the
position and the logits, and it is a sample of softmax(logits / T) within the top_p nucleus."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from services.node_agent.engines.vllm.keyed_sampling import choose_token, gumbel_noise, top_p_mask

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03]))
NUM_DRAWS = 20_000


def frequencies(logits: np.ndarray, temperature: float, top_p: float, seed: int = 11) -> np.ndarray:
    """How often each token is chosen at positions 0..NUM_DRAWS-1 of one seed's generation."""
    counts = np.bincount([choose_token(logits, temperature, top_p, seed, position) for position in range(NUM_DRAWS)],
                         minlength=logits.size)
    return counts / NUM_DRAWS


def test_the_noise_is_a_fixed_function_of_seed_and_position() -> None:
    """Pinned values: a node on another version or machine must choose the same tokens on resume."""
    assert gumbel_noise(7, 80, 4) == pytest.approx(
        [-0.06792238827189682, -0.4159857689607264, 0.17048837261932775, 0.269000792972167], rel=1e-12)
    assert gumbel_noise(2**64 - 1, 0, 2) == pytest.approx([1.1724150479885391, -0.5706580533849435], rel=1e-12)
    assert not np.array_equal(gumbel_noise(7, 80, 64), gumbel_noise(7, 81, 64))
    assert not np.array_equal(gumbel_noise(7, 80, 64), gumbel_noise(8, 80, 64))


def test_another_process_with_other_thread_settings_draws_the_same_tokens() -> None:
    script = ("import numpy as np; from services.node_agent.engines.vllm.keyed_sampling import choose_token;"
              "logits = np.linspace(0, 3, 1000);"
              "print([choose_token(logits, 0.8, 0.9, 42, p) for p in range(200)])")
    env = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", PYTHONHASHSEED="123")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env,
                           timeout=60)
    here = [choose_token(np.linspace(0, 3, 1000), 0.8, 0.9, 42, p) for p in range(200)]
    assert other.stdout.strip() == str(here)


def test_tokens_follow_the_softmax_of_the_logits() -> None:
    assert frequencies(LOGITS, 1.0, 1.0) == pytest.approx([0.5, 0.25, 0.15, 0.07, 0.03], abs=0.01)


def test_temperature_scales_the_logits_before_the_choice() -> None:
    tempered = np.exp(LOGITS / 0.5) / np.exp(LOGITS / 0.5).sum()
    assert frequencies(LOGITS, 0.5, 1.0) == pytest.approx(tempered, abs=0.01)


def test_top_p_keeps_the_nucleus_and_renormalises_it() -> None:
    """top_p 0.8: 0.5 and 0.25 come before 0.8, the 0.15 token completes it; the rest never appear."""
    assert frequencies(LOGITS, 1.0, 0.8) == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0], abs=0.01)
    assert np.isneginf(top_p_mask(LOGITS, 0.8)[3:]).all()
    assert top_p_mask(LOGITS, 0.01)[0] == LOGITS[0]  # the most probable token always stays


def test_masked_tokens_are_never_chosen() -> None:
    logits = np.array([0.0, -np.inf, 0.0, -np.inf])
    assert {choose_token(logits, 1.0, 1.0, 3, position) for position in range(200)} == {0, 2}


def test_the_same_seed_and_position_choose_the_same_token_whatever_came_before() -> None:
    """Nothing but (seed, position) and the logits: no generator state carried from earlier tokens."""
    logits = np.random.default_rng(0).normal(size=32000)
    first = [choose_token(logits, 1.0, 0.95, 5, position) for position in range(100, 140)]
    again = [choose_token(logits, 1.0, 0.95, 5, position) for position in range(120, 140)]
    assert again == first[20:]
    assert len(set(first)) > 20  # sampled, not the argmax


def test_vllms_logits_processor_leaves_only_the_keyed_choice_for_its_requests() -> None:
    """In vLLM's worker: a keyed request's row keeps one finite logit (vLLM's greedy path emits it),
    at the position prompt + tokens generated so far; other requests' rows are left alone."""
    pytest.importorskip("vllm")
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from services.node_agent.engines.vllm.keyed_sampler import PositionKeyedSampler, keyed_extra_args

    vocab = 1000
    logits = torch.from_numpy(np.random.default_rng(1).normal(size=(2, vocab)).astype(np.float32))
    generated: list[int] = []
    keyed = SamplingParams(temperature=0.0, extra_args=keyed_extra_args(9, 0.7, 0.9, first_position=80))
    processor = PositionKeyedSampler(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                       added=[(0, keyed, [1] * 80, generated), (1, SamplingParams(), [2] * 5, [])]))

    def chosen(row: int) -> int:
        result = processor.apply(logits.clone())
        assert torch.equal(result[1 - row], logits[1 - row])  # the unkeyed request: untouched
        assert torch.isfinite(result[row]).sum() == 1
        return int(result[row].argmax())

    expected = [choose_token(logits[0].double().numpy(), 0.7, 0.9, 9, position) for position in (80, 81)]
    assert expected[0] != expected[1]  # so that a position not counted would be seen
    assert chosen(0) == expected[0]
    generated.append(expected[0])  # vLLM appends what it sampled to the list it handed over
    assert chosen(0) == expected[1]
    logits = logits.flip(0)  # the batch is reordered: the keyed request moves to row 1
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=[],
                                       moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert chosen(1) == expected[1]
    processor.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert torch.equal(processor.apply(logits.clone()), logits)
