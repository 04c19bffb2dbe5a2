"""The `baton` command: up (a local cluster), generate (stream a completion), status, sim (the simulator)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import threading
from pathlib import Path

import grpc

from baton.client import BatonClient
from baton.cluster import ClusterSpec, LocalCluster, StartError, default_state_path
from baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.profile_proto import profile_from_proto
from services.node_agent.engines.sim.models import GPU_SPECS, SIM_MODELS
from services.scheduler.policies import POLICIES
from simulator.admission_study import main as admission_study_main
from simulator.model_study import main as model_study_main
from simulator.report import main as simulator_main

DEMO_PROMPT = "Explain in one paragraph why a generation should survive the death of the GPU serving it."
_SIM_MODEL = "sim-llama-3-8b"


def _load_state(args: argparse.Namespace) -> dict[str, str]:
    path = Path(args.state)
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def invalid_up_flag(args: argparse.Namespace) -> str | None:
    """What is wrong with `baton up`'s flags, named, before anything starts (None: nothing)."""
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    unknown = [g for g in gpus if g not in GPU_SPECS]
    if not gpus or unknown:
        return f"--gpus {args.gpus!r}: unknown GPU {', '.join(map(repr, unknown)) or '(none given)'}; " \
               f"known: {', '.join(GPU_SPECS)}"
    if args.policy not in POLICIES:
        return f"--policy {args.policy!r}: unknown; known: {', '.join(POLICIES)}"
    if args.engine == "sim":
        for flag, names in (("--model", [args.model]), ("--cold-models", args.cold_models.split(","))):
            bad = [m for m in names if m.strip() and m.strip() not in SIM_MODELS]
            if bad:
                return f"{flag} {', '.join(map(repr, bad))}: not a simulated model; known: {', '.join(SIM_MODELS)}"
    for flag in ("nodes", "schedulers", "kvindexes"):
        if getattr(args, flag) < 1:
            return f"--{flag} {getattr(args, flag)}: must be at least 1"
    return None


def cmd_up(args: argparse.Namespace) -> int:
    problem = invalid_up_flag(args)
    if problem is not None:
        print(f"baton up: {problem}", file=sys.stderr)
        return 2
    node_args: tuple[str, ...] = (f"--cold-models={args.cold_models}",) if args.cold_models else ()
    model = args.model
    if args.engine == "vllm":
        if not args.model_dir:
            print("baton up: --model-dir is required with --engine vllm", file=sys.stderr)
            return 2
        if model == _SIM_MODEL:  # not named: served under its directory's name
            model = Path(args.model_dir).resolve().name
        node_args += (f"--kv-cache-bytes={args.kv_cache_bytes}", f"--block-size={args.block_size}",
                      f"--max-model-len={args.max_model_len}")
    spec = ClusterSpec(
        num_nodes=args.nodes,
        num_schedulers=args.schedulers,
        num_kvindexes=args.kvindexes,
        gpus=tuple(g.strip() for g in args.gpus.split(",") if g.strip()),
        model=model,
        engine=args.engine,
        model_dir=str(Path(args.model_dir).resolve()) if args.model_dir else "",
        router_port=args.router_port,
        speed=args.speed,
        lease_ttl_s=args.lease_ttl_s,
        otel_exporter=args.otel_exporter,
        node_args=node_args,
        scheduler_args=(f"--policy={args.policy}",),
    )
    timeout_s = args.timeout_s or (300.0 if args.engine == "vllm" else 60.0)
    cluster = LocalCluster(spec, Path(args.workdir) if args.workdir else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start(timeout_s=timeout_s)
    except StartError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 1
    try:
        cluster.write_state(Path(args.state))
        assert cluster.router is not None and cluster.scheduler is not None
        print(f"Baton is up: router {cluster.router.address}  (etcd {cluster.etcd_endpoint}, "
              f"logs in {cluster.workdir})")
        for process in [*cluster.schedulers, *cluster.kvindexes, *cluster.nodes]:
            print(f"  {process.name}: {process.address}")
        baton = sys.argv[0]
        print(f"Try: {baton} generate --router {cluster.router.address} 'Hello'   |   {baton} status")
        if args.demo:
            asyncio.run(_demo(cluster.router.address, spec.model))
        print("Ctrl-C stops the cluster.", flush=True)
        stop.wait()
    finally:
        # With piped output whose reader is gone (`make run | tee` and Ctrl-C) a print raises
        # BrokenPipeError; it must not skip the ordered shutdown.
        with contextlib.suppress(BrokenPipeError):
            print("stopping...", flush=True)
        cluster.stop()
        Path(args.state).unlink(missing_ok=True)
    return 0


async def _demo(router: str, model: str) -> None:
    if model.startswith("sim-"):
        print("\n(The sim engine computes no language: its tokens are a deterministic function of the context, "
              "so the text below reads as noise. Timing, caching and resume are what it models.)")
    async with BatonClient(router) as client:
        for attempt in ("first", "repeated (now served from the prefix cache)"):
            print(f"\n--- demo: {attempt} request: {DEMO_PROMPT!r}")
            node = ""
            async for chunk in client.generate(model, DEMO_PROMPT, max_tokens=120):
                node = chunk.node_id or node
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason:
                    usage = chunk.usage
                    reason = common_pb2.FinishReason.Name(chunk.finish_reason)
                    print(f"\n[node {node}; {reason}; prompt {usage.prompt_tokens}, "
                          f"cached {usage.cached_tokens}, completion {usage.completion_tokens} tokens; "
                          f"GPU time {usage.gpu_ms:.1f} ms]")
    print("\n(`baton status` shows why each request went where it did, and the cost per successful task.)")


def cmd_generate(args: argparse.Namespace) -> int:
    router = args.router or _load_state(args).get("router")
    if not router:
        print("baton generate: no --router given and no running `baton up` found", file=sys.stderr)
        return 2
    return asyncio.run(_generate(router, args))


async def _generate(router: str, args: argparse.Namespace) -> int:
    fields: dict[str, object] = {"temperature": args.temperature}
    if args.max_tokens is not None:
        fields["max_tokens"] = args.max_tokens
    if args.seed is not None:
        fields["seed"] = args.seed
    async with BatonClient(router) as client:
        try:
            async for chunk in client.generate(args.model, args.prompt, **fields):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    usage = chunk.usage
                    print(f"\n[{chunk.request_id} on {chunk.node_id}: "
                          f"{common_pb2.FinishReason.Name(chunk.finish_reason)}; prompt {usage.prompt_tokens}, "
                          f"cached {usage.cached_tokens}, completion {usage.completion_tokens}; "
                          f"GPU time {usage.gpu_ms:.1f} ms]", file=sys.stderr)
        except grpc.aio.AioRpcError as exc:
            print(f"\nbaton generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state_file = _load_state(args)
    addresses = [args.scheduler] if args.scheduler else state_file.get("schedulers", [])
    if not addresses:
        print("baton status: no --scheduler given and no running `baton up` found", file=sys.stderr)
        return 2
    state, errors = None, []
    for address in addresses:  # any replica answers: each keeps the whole view
        try:
            with grpc.insecure_channel(address) as channel:
                state = scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                    scheduler_pb2.GetClusterStateRequest(), timeout=3.0
                )
            break
        except grpc.RpcError as exc:
            errors.append(f"{address}: {exc.code().name}")
    if state is None:
        print(f"baton status: no scheduler answered ({'; '.join(errors)})", file=sys.stderr)
        return 1
    if state.leader_address and state.leader_address != address:  # the KPI and model actions are the leader's
        try:
            with grpc.insecure_channel(state.leader_address) as channel:
                state = scheduler_pb2_grpc.SchedulerStub(channel).GetClusterState(
                    scheduler_pb2.GetClusterStateRequest(), timeout=3.0)
            address = state.leader_address
        except grpc.RpcError:
            pass
    leader = f"{state.leader_id} at {state.leader_address}" if state.leader_id else "none elected"
    print(f"scheduler leader: {leader} (asked {state.scheduler_id}); {len(state.nodes)} nodes")
    print(f"{'node':<10} {'gpu':<6} {'engine':<6} {'address':<22} {'models':<18} {'run':>4} {'wait':>4} "
          f"{'kv used/total':>16} {'kv%':>5} {'$/h':>6} {'seen':>7}")
    for node in state.nodes:
        info, load = node.info, node.load
        models = ",".join(m.name + _STATE_MARKS.get(m.state, "") for m in info.models
                          if m.state != common_pb2.MODEL_STATE_COLD) or "-"
        cold = sum(m.state == common_pb2.MODEL_STATE_COLD for m in info.models)
        models += f" +{cold} cold" if cold else ""
        pct = 100.0 * load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
        seen = f"{node.load_age_ms}ms" if node.load_age_ms >= 0 else "never"
        print(f"{info.node_id:<10} {info.gpu:<6} {info.engine or 'sim':<6} {info.address:<22} {models:<18} "
              f"{load.num_running:>4} {load.num_waiting:>4} {f'{load.kv_blocks_used}/{load.kv_blocks_total}':>16} "
              f"{pct:>5.1f} {info.price_per_hour:>6.2f} {seen:>7}")
        for model in info.models:  # what placement reads of this node (docs/placement.md, "Engine profiles")
            profile = profile_from_proto(model)
            described = profile.describe() if profile else "none registered (placed by the policy's fallback)"
            print(f"{'':<10} profile {model.name}: {described}")
    if state.HasField("tasks"):
        tasks = state.tasks
        fleet = f"${tasks.fleet_cost_per_successful_task_usd:.6f}" if tasks.tasks_succeeded else "n/a"
        busy = f"${tasks.cost_per_successful_task_usd:.6f}" if tasks.tasks_succeeded else "n/a"
        print(f"tasks: {tasks.tasks_succeeded} succeeded, {tasks.tasks_failed} failed, {tasks.tasks_open} open; "
              f"whole fleet ${tasks.fleet_cost_usd:.6f}; busy GPU time ${tasks.ended_cost_usd:.6f} "
              f"+ ${tasks.model_load_cost_usd:.6f} of model loads")
        print(f"cost per successful task: {fleet} for the whole fleet (idle GPUs included), {busy} busy time only")
    for action in state.model_actions[:5]:
        print(f"  model {action.kind} {action.model} on {action.node_id}: {action.result} ({action.reason})")
    _print_recent_decisions(address)
    return 0


_STATE_MARKS = {common_pb2.MODEL_STATE_LOADING: " (loading)"}


def _print_recent_decisions(scheduler: str, limit: int = 5) -> None:
    try:
        with grpc.insecure_channel(scheduler) as channel:
            recent = scheduler_pb2_grpc.SchedulerStub(channel).GetRecentDecisions(
                scheduler_pb2.GetRecentDecisionsRequest(limit=limit), timeout=3.0)
    except grpc.RpcError:
        return
    if not recent.decisions:
        return
    print(f"recent placements (policy {recent.policy}), newest first:")
    for d in recent.decisions:
        why = ", ".join(f"{c.node_id}: ttft {c.predicted_ttft_ms:.0f} ms, p {c.success:.2f}, ${c.cost:.5f}"
                        + ("" if c.warm else f", cold: {c.load_ms / 1000:.0f} s load") for c in d.candidates)
        print(f"  {d.request_id[:12]:<12} -> {d.node_id:<8} score {d.score:.6g}" + (f"  [{why}]" if why else ""))
        if d.fallback:
            print(f"  {'':<12}    fallback: {d.fallback}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    parser.add_argument("--state", default=str(default_state_path()),
                        help="where `baton up` records the cluster's addresses")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start etcd and the whole mesh on 127.0.0.1")
    up.add_argument("--nodes", type=int, default=3, help="number of node agents")
    up.add_argument("--schedulers", type=int, default=1, help="scheduler replicas (one leads, elected in etcd)")
    up.add_argument("--kvindexes", type=int, default=1, help="kvindex replicas (all active)")
    up.add_argument("--gpus", default="h100", help="GPU generations, cycled over the nodes (default: h100; "
                    f"known: {', '.join(GPU_SPECS)})")
    up.add_argument("--model", default=_SIM_MODEL, help="simulated model every node serves; with --engine vllm "
                    "the name its model is served under (default: the --model-dir's name)")
    up.add_argument("--engine", choices=("sim", "vllm"), default="sim", help="every node's engine")
    up.add_argument("--model-dir", default="", help="vllm engine: the Hugging Face model directory to serve "
                    "(python -m services.node_agent.engines.vllm.tiny_model DIR makes a tiny one)")
    up.add_argument("--kv-cache-bytes", type=int, default=64 << 20,
                    help="vllm engine: KV cache per node in bytes (0: vLLM sizes it from free memory)")
    up.add_argument("--block-size", type=int, default=32, help="vllm engine: tokens per KV block (32 on a CPU)")
    up.add_argument("--max-model-len", type=int, default=2048, help="vllm engine: longest context (0: the model's)")
    up.add_argument("--cold-models", default="", help="models every node also has on disk, cold (comma-separated)")
    up.add_argument("--policy", default="baton", help="the scheduler's placement policy (baton, dynamo, ...)")
    up.add_argument("--router-port", type=int, default=50051, help="router port (0: any free port)")
    up.add_argument("--speed", type=float, default=1.0, help="sim engine time scale (0: no timing)")
    up.add_argument("--lease-ttl-s", type=int, default=3, help="etcd lease TTL of every service")
    up.add_argument("--otel-exporter", default="none", help="span exporter: none, console or file:PATH")
    up.add_argument("--workdir", default="", help="where logs and etcd data go (default: a temp dir)")
    up.add_argument("--timeout-s", type=float, default=0.0,
                    help="how long to wait for readiness (0: 60 s, or 300 s with --engine vllm)")
    up.add_argument("--demo", action="store_true", help="send a demo request once the cluster is up")
    up.set_defaults(func=cmd_up)

    gen = commands.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--router", default="", help="router host:port (default: the running `baton up`)")
    gen.add_argument("--model", default="sim-llama-3-8b")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    # `baton sim ...` is handed whole to the simulator's own parser (see main).
    commands.add_parser("sim", help="replay a trace in the discrete-event simulator (baton sim --help)")
    commands.add_parser("sim-admission", help="admission study in the simulator (baton sim-admission --help)")
    commands.add_parser("sim-models", help="model placement under a demand shift (baton sim-models --help)")

    status = commands.add_parser("status", help="nodes, models, load and KV usage")
    status.add_argument("--scheduler", default="", help="scheduler host:port (default: the running `baton up`)")
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:
        return simulator_main(argv[1:])
    if argv[:1] == ["sim-admission"]:
        return admission_study_main(argv[1:])
    if argv[:1] == ["sim-models"]:
        return model_study_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
