"""Workloads for the simulator: real traces (Mooncake, Azure) and generated ones. Pure but for file reads.

A request's prompt is described, not stored: Mooncake's `hash_ids` name 512-token blocks, and two
requests sharing a hash id share those tokens exactly, so the simulator's prefix caching is real.
Token ids and chained 16-token block keys are built on demand (and the keys memoised per shared
prefix) so that a 12k-request trace with 12k-token prompts fits in memory and time.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common.block_hash import ROOT_PARENT_HASH, hash_block

TRACE_BLOCK = 512  # tokens per Mooncake hash id
KV_BLOCK = 16
# A follow-up turn must share more than the opening block (a system prompt most requests share).
MIN_SESSION_BLOCKS = 2


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    # Seconds from the start: when it arrives (open loop) or the earliest it may (closed loop).
    arrival_s: float
    hash_ids: tuple[int, ...]
    prompt_len: int
    output_len: int
    task_id: str
    step: int = 1
    total_steps: int = 1
    # Closed loop: this step is sent think_s after the task's previous step finishes.
    think_s: float | None = None
    tenant: str = "default"
    priority: int = 0
    # The model it asks for ("": the simulation's model).
    model: str = ""
    # Its own SLO, as a client sets it in GenerateRequest (0: the run's default).
    ttft_budget_ms: int = 0
    tpot_budget_ms: int = 0
    deadline_ms: int = 0


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    # task id -> its requests in step order
    tasks: dict[str, list[SimRequest]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tasks:
            for request in self.requests:
                self.tasks.setdefault(request.task_id, []).append(request)
            for steps in self.tasks.values():
                steps.sort(key=lambda r: r.step)


class TokenBook:
    """Token ids and block keys of prompts made of 512-token trace blocks."""

    def __init__(self) -> None:
        # (parent key, hash id) -> the 32 chained 16-token block keys of that 512-token block
        self._chains: dict[tuple[int, int], tuple[int, ...]] = {}

    @staticmethod
    def block_tokens(hash_id: int) -> bytes:
        """The 512 byte-tokens that hash id stands for."""
        return random.Random(hash_id).randbytes(TRACE_BLOCK)

    def tokens(self, request: SimRequest) -> list[int]:
        return list(b"".join(self.block_tokens(h) for h in request.hash_ids)[: request.prompt_len])

    def block_hashes(self, request: SimRequest, tokens: Sequence[int] | None = None) -> tuple[int, ...]:
        """Chained keys of the prompt's full 16-token blocks, memoised per shared 512-token block."""
        keys: list[int] = []
        parent = ROOT_PARENT_HASH
        num_full_trace_blocks = request.prompt_len // TRACE_BLOCK
        for hash_id in request.hash_ids[:num_full_trace_blocks]:
            chain = self._chains.get((parent, hash_id))
            if chain is None:
                data = self.block_tokens(hash_id)
                chain_keys = []
                key = parent
                for start in range(0, TRACE_BLOCK, KV_BLOCK):
                    key = hash_block(key, data[start : start + KV_BLOCK])
                    chain_keys.append(key)
                chain = self._chains[(parent, hash_id)] = tuple(chain_keys)
            keys.extend(chain)
            parent = chain[-1]
        tail_start = num_full_trace_blocks * TRACE_BLOCK
        tail_full = (request.prompt_len - tail_start) // KV_BLOCK * KV_BLOCK
        if tail_full:
            if tokens is None:
                tokens = self.tokens(request)
            for start in range(tail_start, tail_start + tail_full, KV_BLOCK):
                parent = hash_block(parent, tokens[start : start + KV_BLOCK])
                keys.append(parent)
        return tuple(keys)


def _sessions(rows: Sequence[tuple[int, ...]], prompt_lens: Sequence[int]) -> list[tuple[str, int]]:
    """(task id, step) per request: a request extending an earlier one's full-block prefix continues its task."""
    latest: dict[tuple[int, ...], int] = {}
    task_of: list[tuple[str, int]] = []
    for j, hash_ids in enumerate(rows):
        found = None
        for k in range(len(hash_ids) - 1, MIN_SESSION_BLOCKS - 1, -1):
            found = latest.get(hash_ids[:k])
            if found is not None:
                break
        if found is None:
            task_of.append((f"t{j}", 1))
        else:
            task, step = task_of[found]
            task_of.append((task, step + 1))
        num_full = prompt_lens[j] // TRACE_BLOCK
        if num_full >= MIN_SESSION_BLOCKS:
            latest[hash_ids[:num_full]] = j
    return task_of


def trace_length(path: Path) -> int:
    """The number of requests in a Mooncake (JSON lines) or Azure (CSV) trace."""
    with open(path) as trace:
        if path.suffix == ".csv":
            return sum(1 for _ in csv.DictReader(trace))
        return sum(1 for line in trace if line.strip())


def _check_window(speedup: float, prompt_scale: float, limit: int | None, skip: int) -> None:
    """ValueError for a window of a trace that would replay nothing, or replay it wrong (negative or
    infinite arrival times)."""
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"speedup must be a finite number above 0, not {speedup}")
    if not (math.isfinite(prompt_scale) and prompt_scale > 0):
        raise ValueError(f"prompt_scale must be a finite number above 0, not {prompt_scale}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1 request, not {limit}")
    if skip < 0:
        raise ValueError(f"skip must be at least 0, not {skip}")


def _past_the_end(path: Path, skip: int, num_requests: int) -> ValueError:
    return ValueError(f"skip {skip:,} is at or past the end of {path.name}, which has {num_requests:,} requests")


def load_mooncake(path: Path, speedup: float = 1.0, prompt_scale: float = 1.0,
                  limit: int | None = None, skip: int = 0) -> Workload:
    """A Mooncake trace (timestamp ms, input_length, output_length, hash_ids); sessions become tasks.

    skip: start after the trace's first skip requests (a window disjoint from the first, to tune on)."""
    _check_window(speedup, prompt_scale, limit, skip)
    rows = []
    num_read = 0
    with open(path) as trace:
        for j, line in enumerate(trace):
            num_read = j + 1
            if j < skip:
                continue
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    if skip and not rows:
        raise _past_the_end(path, skip, num_read)
    # Scaled up, each block of a prompt stands for the last trace block its tokens come from, as the k-th of those
    # that do (so prompts that shared a prefix share it scaled): the prompts were cut to the row's blocks, and
    # --prompt-scale 2 and 10 gave the same ones (helper-161). (Built from ceil(scale) copies of every block, a scale
    # of 1.01 made a prompt of the first half of its row's blocks, and prompts that differed later were one,
    # helper-163.)
    hash_rows = [tuple(r["hash_ids"]) if prompt_scale <= 1 else _scaled_blocks(r["hash_ids"], prompt_scale)
                 for r in rows]
    prompt_lens = [max(1, min(int(r["input_length"] * prompt_scale), TRACE_BLOCK * len(hashes)))
                   for r, hashes in zip(rows, hash_rows, strict=True)]
    # The trace's conversations, whatever the scale (its full blocks moved them: 193 at 1, 194 at 0.5, 17 at 1.5).
    sessions = _sessions([tuple(r["hash_ids"]) for r in rows],
                         [max(1, min(int(r["input_length"]), TRACE_BLOCK * len(r["hash_ids"]))) for r in rows])
    start = rows[0]["timestamp"] if rows else 0
    requests = []
    for j, row in enumerate(rows):
        task, step = sessions[j]
        requests.append(SimRequest(
            request_id=f"r{j}", arrival_s=(row["timestamp"] - start) / 1000.0 / speedup, hash_ids=hash_rows[j],
            prompt_len=prompt_lens[j], output_len=max(1, int(row["output_length"])), task_id=task, step=step,
        ))
    workload = Workload(name=path.stem, requests=requests)
    for steps in workload.tasks.values():
        for request in steps:
            object.__setattr__(request, "total_steps", len(steps))
    return workload


def load_azure(path: Path, speedup: float = 1.0, prompt_scale: float = 1.0, limit: int | None = None,
               skip: int = 0) -> Workload:
    """An Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens): no shared prefixes."""
    _check_window(speedup, prompt_scale, limit, skip)
    requests: list[SimRequest] = []
    next_hash = 10**9  # far from any id a real trace uses: every prompt is unique
    num_read = 0
    with open(path) as trace:
        start = None
        for j, row in enumerate(csv.DictReader(trace)):
            num_read = j + 1
            if j < skip:
                continue
            if limit is not None and j >= skip + limit:
                break
            stamp = datetime.datetime.fromisoformat(row["TIMESTAMP"][:26])
            start = start or stamp
            prompt_len = max(1, int(int(row["ContextTokens"]) * prompt_scale))
            num_blocks = -(-prompt_len // TRACE_BLOCK)
            hash_ids = tuple(range(next_hash, next_hash + num_blocks))
            next_hash += num_blocks
            requests.append(SimRequest(
                request_id=f"r{j}", arrival_s=(stamp - start).total_seconds() / speedup, hash_ids=hash_ids,
                prompt_len=prompt_len, output_len=max(1, int(row["GeneratedTokens"])), task_id=f"t{j}",
            ))
    if skip and not requests:
        raise _past_the_end(path, skip, num_read)
    return Workload(name=path.stem, requests=requests)


def _scaled_blocks(hash_ids: Sequence[int], scale: float) -> tuple[int, ...]:
    """The blocks of a prompt scale times as long as hash_ids's: the j-th stands for the last trace block its tokens
    come from (two prompts share it only if they share that block, and so every one before it), told apart from the
    others that stand for the same block by how many came before it."""
    copies = math.ceil(scale)  # the most blocks that stand for one trace block
    blocks: list[int] = []
    previous, nth = -1, 0
    for j in range(math.ceil(len(hash_ids) * scale)):
        source = min(math.ceil(round((j + 1) / scale, 9)) - 1, len(hash_ids) - 1)
        nth = nth + 1 if source == previous else 0
        previous = source
        blocks.append(hash_ids[source] * copies + min(nth, copies - 1))
    return tuple(blocks)


def _unique_ids(first: int) -> Iterator[int]:
    n = first
    while True:
        yield n
        n += 1


def shared_prefix_groups(num_groups: int, per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                         rate_per_s: float, seed: int = 0) -> Workload:
    """Groups of requests sharing a long prefix (a system prompt, a document), Poisson arrivals."""
    rng = random.Random(seed)
    ids = _unique_ids(2 * 10**9)
    prefixes = [tuple(next(ids) for _ in range(-(-prefix_len // TRACE_BLOCK))) for _ in range(num_groups)]
    requests, t = [], 0.0
    for j in range(num_groups * per_group):
        t += rng.expovariate(rate_per_s)
        group = rng.randrange(num_groups)
        full = prefix_len // TRACE_BLOCK * TRACE_BLOCK
        suffix = tuple(next(ids) for _ in range(-(-(prefix_len - full + suffix_len) // TRACE_BLOCK)))
        hash_ids = prefixes[group][: prefix_len // TRACE_BLOCK] + suffix
        requests.append(SimRequest(f"r{j}", t, hash_ids, prefix_len + suffix_len, output_len,
                                   task_id=f"t{j}"))
    return Workload(name="shared-prefix", requests=requests)


def agentic_workflows(num_tasks: int, steps: int, system_len: int, step_len: int, output_len: int,
                      think_s: float, rate_per_s: float, seed: int = 0) -> Workload:
    """Agents of several dependent steps: each step's prompt is the previous context plus new text, sent
    think_s after the previous step finished (closed loop)."""
    rng = random.Random(seed)
    ids = _unique_ids(3 * 10**9)
    requests, t = [], 0.0
    for task in range(num_tasks):
        t += rng.expovariate(rate_per_s)
        hash_ids: tuple[int, ...] = tuple(next(ids) for _ in range(-(-system_len // TRACE_BLOCK)))
        length = system_len
        for step in range(1, steps + 1):
            length += step_len
            while len(hash_ids) * TRACE_BLOCK < length:
                hash_ids += (next(ids),)
            requests.append(SimRequest(f"r{task}.{step}", t, hash_ids, length, output_len, task_id=f"t{task}",
                                       step=step, total_steps=steps, think_s=None if step == 1 else think_s))
            length += output_len
    return Workload(name="agentic", requests=requests)


def assign_classes(workload: Workload, seed: int = 0) -> Workload:
    """Tenants and priority bands for an admission study, whole tasks at a time: a tenant sending half
    the traffic and two sending a quarter each; 20 % interactive (priority 1), 60 % standard (0),
    20 % batch (-1, sheddable)."""
    rng = random.Random(seed)
    classes = {}
    for task in workload.tasks:
        tenant = rng.choices(["flood", "acme", "globex"], weights=[2, 1, 1])[0]
        priority = rng.choices([1, 0, -1], weights=[2, 6, 2])[0]
        classes[task] = (tenant, priority)
    requests = [replace(r, tenant=classes[r.task_id][0], priority=classes[r.task_id][1]) for r in workload.requests]
    return Workload(name=workload.name, requests=requests)


@dataclass(frozen=True)
class SloClass:
    """A share of a workload's tasks that set their own budgets (a tenant of one kind of client)."""

    name: str
    share: float
    ttft_budget_ms: int
    tpot_budget_ms: int


def parse_slo_mix(text: str) -> tuple[SloClass, ...]:
    """`share:ttft_s:tpot_s,...`, e.g. 0.3:1:0.03,0.7:30:0.2 — the shares must add up to 1."""
    classes = []
    for i, part in enumerate(p for p in text.split(",") if p.strip()):
        try:
            share, ttft_s, tpot_s = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"{part!r} is not share:ttft_s:tpot_s") from None
        if not all(math.isfinite(x) for x in (share, ttft_s, tpot_s)):
            raise ValueError(f"{part!r} needs finite numbers")
        if share <= 0 or ttft_s < 0.001 or tpot_s < 0.001:
            # (A budget under 1 ms was kept as 0, which reads as unset: the cluster's 5 s, helper-161.)
            raise ValueError(f"{part!r} needs a positive share and budgets of at least 0.001 s")
        classes.append(SloClass(f"class{i}", share, round(ttft_s * 1000), round(tpot_s * 1000)))
    if not classes or abs(sum(c.share for c in classes) - 1.0) > 1e-6:
        raise ValueError(f"the shares of {text!r} must add up to 1")
    return tuple(classes)


def with_slo_mix(workload: Workload, classes: Sequence[SloClass], seed: int = 0) -> Workload:
    """The workload with each task drawn into one SLO class (every step of a task alike): its requests
    carry the class's budgets, and the class's name as their tenant."""
    draw = random.Random(f"slo-mix:{seed}")
    chosen: dict[str, SloClass] = {}
    for task_id in workload.tasks:  # in first-arrival order, so the draw is the same whatever the policy
        pick, edge = draw.random(), 0.0
        for slo_class in classes:
            edge += slo_class.share
            if pick < edge:
                break
        chosen[task_id] = slo_class
    requests = [replace(r, tenant=chosen[r.task_id].name, ttft_budget_ms=chosen[r.task_id].ttft_budget_ms,
                        tpot_budget_ms=chosen[r.task_id].tpot_budget_ms) for r in workload.requests]
    return Workload(name=workload.name, requests=requests)
