"""The simulator's and benchmarks' flag types: each parses one flag's text or refuses it, naming the value.

Used as argparse `type=` functions, so a bad value ends the program with exit 2 and
"argument --flag: ..." before any run starts, rather than a traceback or a silently wrong result.
The checks that need two flags, or a trace file, are the `check_*` functions, given the parser's error.
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from services.node_agent.engines.sim.models import GPU_SPECS, SIM_MODELS
from services.scheduler.policies import POLICIES
from simulator import simulation
from simulator.workload import load_azure, load_mooncake

Refuse = Callable[[str], NoReturn]


def _refuse(text: str, why: str) -> NoReturn:
    raise argparse.ArgumentTypeError(f"{text!r}: {why}")


def _refuse_item(text: str, item: str, why: str) -> NoReturn:
    """Refuse text for one of its items ("'abc' is not a number"), naming the item where text has more than it."""
    if item == text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} {why}")
    _refuse(text, f"{item!r} {why}")


def _number(text: str, whole: str | None = None) -> float:
    """text as a finite number; refused as part of `whole` where it is one."""
    try:
        value = float(text)
    except ValueError:
        _refuse_item(whole or text, text, "is not a number")
    if not math.isfinite(value):
        _refuse_item(whole or text, text, "is not a finite number")
    return value


def _whole(text: str, whole: str | None = None) -> int:
    try:
        return int(text)
    except ValueError:
        _refuse_item(whole or text, text, "is not a whole number")


def positive_number(text: str, whole: str | None = None) -> float:
    """A finite number above 0 (a load, a prompt scale)."""
    value = _number(text, whole)
    if value <= 0:
        _refuse_item(whole or text, text, "must be above 0")
    return value


def _bounded(text: str, within: Callable[[float], bool], why: str) -> float:
    """text as a finite number that within() accepts; refused saying why otherwise."""
    value = _number(text)
    if not within(value):
        _refuse_item(text, text, why)
    return value


def non_negative_seconds(text: str) -> float:
    """A finite time of 0 s or more (an idle time before a model swap)."""
    return _bounded(text, lambda value: value >= 0, "must be 0 s or more")


def slo_seconds(text: str) -> float:
    """An SLO budget in seconds: finite, and at least the millisecond the budgets are kept in."""
    return _bounded(text, lambda value: value >= 0.001,
                    "must be at least 0.001 s (a budget of 0 or less no request can meet)")


def share(text: str) -> float:
    """A share in [0, 1]."""
    return _bounded(text, lambda value: 0 <= value <= 1, "must be between 0 and 1")


def timing_error(text: str) -> float:
    """The timing model's error e in [0, 1): engines run at a factor drawn from [1 - e, 1 + e], which must stay
    above 0."""
    return _bounded(text, lambda value: 0 <= value < 1,
                    "must be at least 0 and below 1 (the engines run at a factor from [1 - e, 1 + e])")


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a limit, max tokens)."""
    value = _whole(text)
    if value < 1:
        _refuse_item(text, text, "must be at least 1")
    return value


def non_negative_int(text: str, whole: str | None = None) -> int:
    """A whole number of at least 0 (requests to skip)."""
    value = _whole(text, whole)
    if value < 0:
        _refuse_item(whole or text, text, "must be at least 0")
    return value


def _items(text: str, what: str) -> list[str]:
    """The comma-separated items of text, stripped; none empty, at least one, no item twice."""
    items = [item.strip() for item in text.split(",")]
    if items == [""]:
        _refuse(text, f"no {what} given")
    if "" in items:
        _refuse(text, f"an empty {what} between commas")
    twice = sorted(item for item, count in Counter(items).items() if count > 1)
    if twice:
        _refuse(text, f"{', '.join(twice)} given twice")
    return items


# The range of a trace speed-up: past it, arrival times underflow or overflow (1e-320 made them infinite).
MIN_LOAD, MAX_LOAD = 0.001, 1000.0
# The most a prompt may be scaled (1e9 ran out of memory building its blocks).
MAX_PROMPT_SCALE = 100.0
# The most seeds one run of a study takes (each is a run).
MAX_SEEDS = 10_000


def load(text: str) -> float:
    """One trace speed-up, from MIN_LOAD to MAX_LOAD."""
    return _load(text, text)


def _load(text: str, whole: str) -> float:
    value = positive_number(text, whole)
    if not MIN_LOAD <= value <= MAX_LOAD:
        _refuse_item(whole, text, f"must be from {MIN_LOAD:g} to {MAX_LOAD:g}")
    return value


def prompt_scale(text: str) -> float:
    """A finite factor above 0 and at most MAX_PROMPT_SCALE."""
    value = positive_number(text)
    if value > MAX_PROMPT_SCALE:
        _refuse_item(text, text, f"must be at most {MAX_PROMPT_SCALE:g}")
    return value


def loads(text: str) -> tuple[float, ...]:
    """Comma-separated trace speed-ups, each a finite number from MIN_LOAD to MAX_LOAD, none twice."""
    values = [_load(item, text) for item in _items(text, "load")]
    if len(set(values)) < len(values):
        _refuse(text, "the same load given twice")
    return tuple(values)


_RANGE = re.compile(r"(\d+)-(\d+)")


def seeds(text: str) -> tuple[int, ...]:
    """Comma-separated whole seeds (0 or more) or ranges A-B (both ends included, e.g. 10-19), none twice."""
    values: list[int] = []
    for item in _items(text, "seed"):
        span = _RANGE.fullmatch(item)
        if span:
            first, last = int(span[1]), int(span[2])
            if first > last:
                _refuse(text, f"the range {item} runs backwards")
            if last - first + 1 + len(values) > MAX_SEEDS:
                _refuse(text, f"more than {MAX_SEEDS:,} seeds (each is a run)")
            values += range(first, last + 1)
        elif item == "...":
            _refuse(text, "write a run of seeds as a range, e.g. 10-19")
        else:
            try:
                value = int(item)
            except ValueError:
                _refuse_item(text, item, "is not a whole number or a range A-B")
            if value < 0:
                # Python's random draws seed -N as seed N: the run would repeat another seed's arrivals.
                _refuse_item(text, item, "is negative: a seed is 0 or more")
            values.append(value)
    twice = sorted(value for value, count in Counter(values).items() if count > 1)
    if twice:
        _refuse(text, f"seed {', '.join(map(str, twice))} given twice (each seed is one run)")
    return tuple(values)


def seeds_text(values: Sequence[int]) -> str:
    """Seeds as --seeds takes them, a run of three or more as a range: (10, ..., 19) -> '10-19'."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            run = values[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(v) for v in run]
            start = i
    return ",".join(parts)


def policy(text: str, whole: str | None = None) -> str:
    """A placement policy's name."""
    name = text.strip()
    if name not in POLICIES:
        _refuse_item(whole or text, name, f"is not a policy; known: {', '.join(POLICIES)}")
    return name


def policies(text: str) -> tuple[str, ...]:
    """Comma-separated policy names, none twice."""
    return tuple(policy(item, text) for item in _items(text, "policy"))


def sim_model(text: str, whole: str | None = None) -> str:
    """A simulated model's name."""
    name = text.strip()
    if name not in SIM_MODELS:
        _refuse_item(whole or text, name, f"is not a simulated model; known: {', '.join(sorted(SIM_MODELS))}")
    return name


def model_pair(text: str) -> tuple[str, str]:
    """Two distinct simulated models, A,B."""
    items = _items(text, "model")
    if len(items) != 2:
        _refuse(text, "give two models, A,B")
    first, second = (sim_model(item, text) for item in items)
    return first, second


def fleet(text: str) -> str:
    """A fleet, COUNTxGPU,... (e.g. 4xh100,4xa100,4xl4), checked as the simulator reads it; the text itself is kept."""
    try:
        simulation.fleet(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def kill(text: str) -> tuple[float, str]:
    """AT_S:NODE_ID: a node of the fleet fails at AT_S (finite, 0 or later) seconds of the run."""
    at, colon, node = text.partition(":")
    if not colon or not node.strip():
        _refuse(text, "not AT_S:NODE_ID, e.g. 600:h100-0")
    at_s = _number(at, text)
    if at_s < 0:
        _refuse(text, "the time must be 0 s or later")
    return at_s, node.strip()


def split(text: str) -> tuple[int, int]:
    """A,B: two whole numbers of at least 0."""
    items = [item.strip() for item in text.split(",")]
    if len(items) != 2:
        _refuse(text, "give two counts, A,B")
    first, second = (non_negative_int(item, text) for item in items)
    return first, second


def check_kills(refuse: Refuse, kills: Sequence[tuple[float, str]], fleet_spec: str) -> None:
    """Every --kill names a node of the fleet."""
    ids = [node.node_id for node in simulation.fleet(fleet_spec)]
    for at_s, node in kills:
        if node not in ids:
            refuse(f"argument --kill: '{at_s:g}:{node}': no node {node!r} in the fleet {fleet_spec!r}; "
                   f"its nodes: {', '.join(ids)}")


def check_trace(refuse: Refuse, folder: str, name: str, skip: int = 0) -> None:
    """The trace is in folder, reads as one, and holds more than skip requests (a garbled or empty one was a
    traceback, or a table of inf, once the runs were under way: helper-161, helper-163)."""
    path = Path(folder) / name
    if not path.is_file():
        refuse(f"argument --traces: no {name} in {folder}: the traces are expected in the folder `shared/traces` "
               f"beside the checkout; point --traces at the folder that holds them")
    try:
        num_requests = _num_requests(str(path), path.stat().st_mtime_ns)
    except (ValueError, KeyError, TypeError, IndexError, csv.Error, UnicodeDecodeError) as error:
        refuse(f"argument --traces: {path} does not read as a trace: {type(error).__name__}: {error}")
    if not num_requests:
        refuse(f"argument --traces: {path} holds no requests")
    if skip >= num_requests:
        refuse(f"argument --skip: {skip:,} is at or past the end of {name}, which has {num_requests:,} requests")


@functools.lru_cache(maxsize=8)
def _num_requests(path: str, mtime_ns: int) -> int:
    """The requests of the trace at path, read whole by its loader once (a benchmark checks one trace for each of its
    settings); mtime_ns: the file's, so that one written since is read again."""
    return len((load_azure if path.endswith(".csv") else load_mooncake)(Path(path)).requests)


def check_out(refuse: Refuse, folder: str) -> None:
    """--out is a folder this process can write in (made if it is missing): checked before the runs, whose results
    were lost when it was a file or could not be made (helper-161)."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".baton-write-check-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        refuse(f"argument --out: {folder!r}: not a folder results can be written in ({error.strerror or error})")
