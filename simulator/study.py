"""What the simulator's studies share: their common flags, running jobs on every core, writing results."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from simulator import flags

Job = TypeVar("Job")
Row = TypeVar("Row")


def study_parser(prog: str, description: str | None, *, fleet: str, policy: str, loads: str, limit: int | None,
                 out: str) -> argparse.ArgumentParser:
    """A parser with the flags every study has; a study adds its own."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--traces", default=str(Path(__file__).resolve().parents[2] / "shared" / "traces"),
                        help="folder of the traces (../shared/traces)")
    parser.add_argument("--fleet", type=flags.fleet, default=fleet, help="e.g. 16xh100 or 4xh100,4xa100,4xl4")
    parser.add_argument("--policy", type=flags.policy, default=policy, help="placement policy")
    parser.add_argument("--loads", type=flags.loads, default=flags.loads(loads),
                        help="comma-separated trace speed-ups")
    parser.add_argument("--limit", type=flags.positive_int, default=limit, help="first N requests of the trace")
    parser.add_argument("--ttft-slo", type=flags.slo_seconds, default=5.0, help="seconds")
    parser.add_argument("--tpot-slo", type=flags.slo_seconds, default=0.1, help="seconds per output token")
    parser.add_argument("--timing-error", type=flags.timing_error, default=0.3,
                        help="each GPU generation runs its timing model scaled by a factor drawn from [1-e, 1+e]; "
                        "e in [0, 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the timing-error draw (one run per load)")
    parser.add_argument("--jobs", type=flags.positive_int, default=os.cpu_count() or 1, help="runs in parallel")
    parser.add_argument("--out", default=out, help="folder for table.md and results.json")
    return parser


def worker_pool(num_workers: int) -> ProcessPoolExecutor:
    """num_workers processes that start clean, from a fork server: a plain fork of a process that has
    run gRPC clients or servers (the test suite does) can spin for ever in the child, in gRPC's
    clean-up of the objects it inherited (seen in CI: a one-job run hung 20 minutes at full CPU)."""
    return ProcessPoolExecutor(max_workers=max(1, num_workers), mp_context=multiprocessing.get_context("forkserver"))


def run_all(run_one: Callable[[Job], Row], jobs: Iterable[Job], num_workers: int) -> list[Row]:
    """Every job, in order, num_workers processes at a time (one: in this process). Stopped (SIGTERM, SIGINT), the
    workers are stopped too: a SIGTERM left them running their jobs to the end, orphaned (helper-161)."""
    if num_workers <= 1:
        return [run_one(job) for job in jobs]
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stopped) if in_main_thread else None
    try:
        with worker_pool(num_workers) as pool:
            try:
                return list(pool.map(run_one, jobs))
            except BaseException:
                for process in list(pool._processes.values()):  # (the executor offers no way to stop them)
                    process.terminate()
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def results_json(results: Any, default: Callable[[Any], Any] | None = None) -> str:
    """results as JSON that every reader takes: a figure a run does not have (a percentile of no values, the cost
    per success of a run with none: nan or inf) is null, where json.dumps would write NaN or Infinity, which
    are not JSON (jq, JavaScript and most parsers refuse them)."""
    return json.dumps(_finite(results), indent=1, allow_nan=False, default=default)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(inner) for key, inner in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(inner) for inner in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _finite(dataclasses.asdict(value))
    return value


def write_results(out: str, table: str, results: Any) -> None:
    """table.md and results.json under out; the table to stdout."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "table.md").write_text(table + "\n")
    (folder / "results.json").write_text(results_json(results))
    print(table)
    print(f"wrote {folder / 'table.md'} and {folder / 'results.json'}", file=sys.stderr)
