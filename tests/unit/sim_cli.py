"""For tests of the simulator's and benchmarks' command lines: small traces, and a main that must refuse."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from simulator.report import TRACES


def write_traces(folder: Path, num_requests: int = 10) -> Path:
    """Every trace `baton sim` knows, in folder, of num_requests short requests each."""
    folder.mkdir(exist_ok=True)
    rows = [{"timestamp": 100 * j, "input_length": 64, "output_length": 4, "hash_ids": [j]}
            for j in range(num_requests)]
    start = datetime.datetime(2023, 11, 16, 18, 15)
    azure = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{start + datetime.timedelta(seconds=j / 10):%Y-%m-%d %H:%M:%S.%f}0,64,4\n" for j in range(num_requests))
    for name in TRACES.values():
        (folder / name).write_text(azure if name.endswith(".csv") else "".join(json.dumps(r) + "\n" for r in rows))
    return folder


def refused(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], int], argv: list[str]) -> str:
    """main's error message for argv, which it must refuse with exit 2 (argparse's) before running anything."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err
