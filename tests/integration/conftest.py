"""Fixtures that start real etcd and real service processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess, start_etcd
from baton.v1 import router_pb2, router_pb2_grpc

MODEL = "sim-llama-3-8b"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test shows the end of each of its clusters' process logs: CI keeps nothing else."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, LocalCluster):
            for process in value.processes:
                report.sections.append((f"log of {process.name} ({process.log_path})", process.log_tail(40)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with a locally trained tokenizer, for the vllm engine (no hub here).

    vLLM's and torch's compile caches go to a folder of the test session unless `make test` set them.
    """
    from services.node_agent.engines.vllm.tiny_model import build_tiny_model

    caches = tmp_path_factory.mktemp("caches")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(caches / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(caches / "inductor"))
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, trace_file: Path) -> Iterator[LocalCluster]:
    """Three node agents on mixed GPUs, the sim engine 20x faster than real time, spans to a file."""
    spec = ClusterSpec(num_nodes=3, gpus=("h100", "a100", "l4"), speed=20.0,
                       otel_exporter=f"file:{trace_file}")
    with LocalCluster(spec, tmp_path_factory.mktemp("cluster")) as started:
        yield started


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[ManagedProcess]:
    """One real etcd of the test's own."""
    process = start_etcd(tmp_path)
    try:
        yield process
    finally:
        process.stop()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Re-check predicate until it holds; fail naming what was awaited after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


async def eventually(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    """wait_until for async tests: predicate may be a coroutine function; blocking ones run in a thread,
    so the test's own tasks (a steady load) keep running meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        if inspect.iscoroutinefunction(predicate):
            result = await predicate()
        else:
            result = await asyncio.to_thread(predicate)
            if inspect.isawaitable(result):
                raise TypeError(f"{what}: pass the coroutine function itself (functools.partial), not a lambda")
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def wait_router_serves(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Until the router completes a request: it knows the model, and a scheduler leader is elected."""
    assert cluster.router is not None
    with grpc.insecure_channel(cluster.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        def serves() -> bool:
            try:
                list(stub.Generate(router_pb2.GenerateRequest(model=MODEL, prompt="hi", max_tokens=1), timeout=10))
                return True
            except grpc.RpcError:
                return False

        wait_until(serves, timeout_s, "the router to serve a request")
