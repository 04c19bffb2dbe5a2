"""`baton up` refuses a bad flag value by name before it starts anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import cli

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(("flags", "named"), [
    (["--gpus", "h100,rtx4090"], "--gpus 'h100,rtx4090': unknown GPU 'rtx4090'; known: "),
    (["--model", "gpt-9"], "--model 'gpt-9': not a simulated model; known: "),
    (["--cold-models", "sim-llama-2-7b,nope"], "--cold-models 'nope': not a simulated model"),
    (["--policy", "fastest"], "--policy 'fastest': unknown; known: round_robin"),
    (["--nodes", "0"], "--nodes 0: must be at least 1"),
])
def test_a_bad_flag_is_refused_by_name_before_anything_starts(
        flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cluster(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster was started with a bad flag")

    monkeypatch.setattr(cli, "LocalCluster", no_cluster)
    assert cli.main(["--state", str(tmp_path / "state.json"), "up", *flags]) == 2
    assert named in capsys.readouterr().err


def test_sim_without_the_traces_says_where_they_are_expected(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sim", "--traces", str(tmp_path), "--workload", "azure-code"]) == 2
    err = capsys.readouterr().err
    assert f"no AzureLLMInferenceTrace_code.csv in {tmp_path}" in err and "--traces" in err
