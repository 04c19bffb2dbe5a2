"""The timing model against the packaged coefficients and the perf README's checks."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from services.node_agent.engines.sim import timing as timing_module
from services.node_agent.engines.sim.timing import TimingModel, known_gpus, load_coefficients

_CSV = Path(timing_module.__file__).parent / "coefficients.csv"


def _row(gpu: str, model: str, tp: int = 1) -> dict[str, float]:
    with _CSV.open(encoding="utf-8") as f:
        for record in csv.DictReader(f):
            if record["gpu"] == gpu and record["model"] == model and int(record["tp"]) == tp:
                names = ("a_ms", "b_ms_per_tok", "c_ms_per_tok2", "prefill_floor_ms", "d_ms")
                names += ("e_ms_per_seq", "f_ms_per_ctx_tok")
                return {name: float(record[name]) for name in names}
    raise AssertionError(f"no row {gpu}/{model}/{tp}")


def test_decode_step_matches_csv_row() -> None:
    row = _row("h100", "Meta-Llama-3-8B")
    model = load_coefficients("h100", "Meta-Llama-3-8B")
    expected = row["d_ms"] + row["e_ms_per_seq"] * 10 + row["f_ms_per_ctx_tok"] * 10000
    assert model.decode_step_ms(10, 10000) == pytest.approx(expected, rel=1e-12)


def test_prefill_matches_csv_row() -> None:
    row = _row("h100", "Meta-Llama-3-8B")
    model = load_coefficients("h100", "Meta-Llama-3-8B")
    linear = row["a_ms"] + row["b_ms_per_tok"] * 1000
    expected = max(row["prefill_floor_ms"], linear) + row["c_ms_per_tok2"] * 1e6
    assert model.prefill_ms([1000]) == pytest.approx(expected, rel=1e-12)


def test_prefill_squares_are_per_request() -> None:
    model = load_coefficients("a100", "Meta-Llama-3-8B")
    # Two 500-token prompts attend within themselves: c·(500² + 500²), not c·1000².
    linear = model.a_ms + model.b_ms_per_tok * 1000
    expected = max(model.prefill_floor_ms, linear) + model.c_ms_per_tok2 * 500_000
    assert model.prefill_ms([500, 500]) == pytest.approx(expected)


def test_prefill_floor_applies_to_short_prompts() -> None:
    model = load_coefficients("a10g", "Meta-Llama-3-8B")
    assert model.prefill_ms([10]) == pytest.approx(model.prefill_floor_ms + model.c_ms_per_tok2 * 100)


@pytest.mark.parametrize(("gpu", "measured_ms"), [("a100", 11.4), ("h100", 7.5)])
def test_llama3_small_batch_decode_matches_vllm_measurements(gpu: str, measured_ms: float) -> None:
    model = load_coefficients(gpu, "Meta-Llama-3-8B")
    # Ten sequences of 100 tokens: the README's "≤10 sequences" check.
    assert model.decode_step_ms(10, 1000) == pytest.approx(measured_ms, abs=0.1)


def test_mixed_step_is_decode_plus_marginal_chunk_cost() -> None:
    model = TimingModel(
        a_ms=5.0,
        b_ms_per_tok=0.02,
        c_ms_per_tok2=1e-6,
        prefill_floor_ms=6.0,
        d_ms=7.0,
        e_ms_per_seq=0.01,
        f_ms_per_ctx_tok=1e-4,
    )
    assert model.step_ms(4, 2000, [512, 100]) == pytest.approx(
        7.0 + 0.04 + 0.2 + (0.02 * 512 + 1e-6 * 512**2) + (0.02 * 100 + 1e-6 * 100**2)
    )
    assert model.step_ms(0, 0, [512, 100]) == model.prefill_ms([512, 100])
    assert model.step_ms(3, 300, []) == model.decode_step_ms(3, 300)
    assert model.step_ms(0, 0, []) == 0.0


def test_tensor_parallel_rows_load_and_prefill_only_rows_are_skipped() -> None:
    tp2 = load_coefficients("a100", "Llama-2-70b-hf", tp=2)
    assert tp2.d_ms == pytest.approx(55.36)
    with pytest.raises(KeyError) as excinfo:
        load_coefficients("a100", "Llama-2-70b (Splitwise e2e, prefill only)", tp=2)
    # Rows without decode coefficients cannot time a step, so they are not offered either.
    known = str(excinfo.value).split("known:", 1)[1]
    assert "Splitwise" not in known


def test_unknown_pair_names_known_pairs() -> None:
    with pytest.raises(KeyError, match=r"h100/Meta-Llama-3-8B/tp1"):
        load_coefficients("tpu-v5", "Meta-Llama-3-8B")


def test_gpu_name_is_case_insensitive() -> None:
    assert load_coefficients("H100", "Meta-Llama-3-8B") == load_coefficients("h100", "Meta-Llama-3-8B")


def test_known_gpus() -> None:
    assert known_gpus() == ("a100", "a10g", "a40", "h100", "h200", "l4")
