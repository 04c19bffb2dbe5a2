"""The `baton` command's flags: refused by name before anything starts, defaults shown, clusters found."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from baton import cli
from baton.client import Completion, FinishReason
from baton.cluster import StartError, free_port
from baton.state_files import ClusterRecord, read_record, record_path, remove_record, write_record
from baton.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.timeout(10)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory of this test's own: the user's real clusters are never seen."""
    directory = tmp_path / "state"
    monkeypatch.setenv("BATON_STATE_DIR", str(directory))
    return directory


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster was started with a bad flag")

    monkeypatch.setattr(cli, "LocalCluster", refuse)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def record(state_dir: Path, name: str, pid: int, routers: Sequence[str] = ("127.0.0.1:1",)) -> Path:
    path = record_path(state_dir, name)
    write_record(path, ClusterRecord(name=name, path=path, pid=pid, routers=tuple(routers),
                                     schedulers=("127.0.0.1:2",)))
    return path


@pytest.mark.parametrize(("flags", "named"), [
    (["--gpus", "h100,rtx4090"], "--gpus 'h100,rtx4090': unknown GPU 'rtx4090'; known: "),
    (["--gpus", "h100,,l4"], "--gpus 'h100,,l4': an empty entry between commas"),
    (["--engines", "sim,"], "--engines 'sim,': an empty entry between commas"),
    (["--model", "gpt-9"], "--model 'gpt-9': not a simulated model; known: "),
    (["--cold-models", "sim-llama-2-7b,nope"], "--cold-models 'nope': not a simulated model"),
    (["--policy", "fastest"], "--policy 'fastest': unknown; known: round_robin"),
    (["--nodes", "0"], "--nodes 0: must be at least 1"),
    (["--routers", "0"], "--routers 0: must be at least 1"),
    (["--etcd-members", "0"], "--etcd-members 0: must be at least 1"),
    (["--engines", "sim,tpu"], "--engines 'sim,tpu': unknown engine 'tpu'; known: sim, vllm"),
    (["--engines", "sim,vllm"], "--model-dir: required when a node runs --engine vllm"),
    (["--engine", "sim", "--engines", "sim,vllm"], "--engine 'sim' and --engines 'sim,vllm': give one"),
    (["--name", "../x"], "--name '../x': use letters"),
    (["--speed", "nan"], "--speed nan: must be finite, 0 or more"),
    (["--speed", "inf"], "--speed inf: must be finite, 0 or more"),
    (["--timeout-s", "-1"], "--timeout-s -1.0: must be finite, 0 or more"),
    (["--router-port", "-7"], "--router-port -7: must be a port, 0 to 65535"),
    (["--lease-ttl-s", "0"], "--lease-ttl-s 0: must be at least 1"),
    # Each left to the services, refused only after etcd had started (helper-161).
    (["--router-port", "49900", "--http-port", "49900"], "--http-port 49900: a router's gRPC port too"),
    (["--otel-exporter", "bogus"], "--otel-exporter: expected none, console, file:PATH or otlp:HOST:PORT"),
])
def test_a_bad_flag_is_refused_by_name_before_anything_starts(
        flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_cluster: None) -> None:
    assert cli.main(["--state", str(tmp_path / "state.json"), "up", *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


def test_vllm_nodes_are_refused_where_vllm_is_not_installed(
        model_dir: Path, capsys: pytest.CaptureFixture[str], no_cluster: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "is_vllm_installed", lambda: False)
    assert cli.main(["up", "--engines", "sim,vllm", "--model-dir", str(model_dir)]) == 2
    assert "--engine vllm: vLLM is not installed here" in capsys.readouterr().err


class NotStarted:
    """LocalCluster's interface for a test that only reads the spec `baton up` builds: it never starts."""

    specs: list[object] = []

    def __init__(self, spec: object, workdir: object) -> None:
        NotStarted.specs.append(spec)

    def start(self, timeout_s: float) -> None:
        raise StartError("not started: this test only reads the spec")


@pytest.fixture
def not_started(monkeypatch: pytest.MonkeyPatch) -> type[NotStarted]:
    NotStarted.specs = []
    monkeypatch.setattr(cli, "LocalCluster", NotStarted)
    return NotStarted


def test_a_mixed_fleet_cycles_its_engines_over_the_nodes(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, not_started: type[NotStarted]) -> None:
    monkeypatch.setattr(cli, "is_vllm_installed", lambda: True)
    assert cli.main(["up", "--engines", "sim,vllm", "--nodes", "3", "--model-dir", str(model_dir),
                     "--cold-models", "sim-llama-2-7b"]) == 1
    [spec] = not_started.specs
    nodes = [dict(flag.removeprefix("--").split("=", 1) for flag in flags) for flags in spec.per_node_args]
    assert [node["engine"] for node in nodes] == ["sim", "vllm", "sim"]
    assert nodes[1]["model"] == "tiny-llama" and nodes[1]["model-dir"] == str(model_dir.resolve())
    assert nodes[0]["model"] == "sim-llama-3-8b" and nodes[0]["cold-models"] == "sim-llama-2-7b"
    assert "model-dir" not in nodes[0] and "cold-models" not in nodes[1]


def test_up_gives_back_the_signal_handlers_it_took_once_it_returns(not_started: type[NotStarted]) -> None:
    # It takes Ctrl-C, SIGTERM and SIGHUP to stop its cluster; kept after it returned, a later Ctrl-C in the same
    # process (a test, or a program calling it) went to its list and was lost.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = [signal.getsignal(sig) for sig in signals]
    assert cli.main(["up", "--nodes", "1"]) == 1
    assert [signal.getsignal(sig) for sig in signals] == before


@pytest.mark.parametrize(("command", "positional"), [("up", []), ("generate", ["hi"]), ("status", [])])
def test_every_flag_help_shows_its_real_default(command: str, positional: list[str]) -> None:
    parser = cli.build_parser()
    subparser = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    defaults = parser.parse_args([command, *positional])
    formatter = subparser._get_formatter()
    for action in subparser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        text = formatter._expand_help(action)
        value = getattr(defaults, action.dest)
        assert "default" in text, f"{action.option_strings[0]}: {text!r}"
        if value not in (None, False, "", []):
            assert str(value) in text, f"{action.option_strings[0]} defaults to {value!r}: {text!r}"


@pytest.mark.parametrize("after", [False, True])
def test_the_state_flag_works_before_or_after_the_subcommand(
        after: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "elsewhere.json"
    pid = dead_pid()
    write_record(path, ClusterRecord(name="lab", path=path, pid=pid, routers=("127.0.0.1:1",),
                                     schedulers=("127.0.0.1:2",)))
    argv = ["status", "--state", str(path)] if after else ["--state", str(path), "status"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"cluster 'lab' is stale: its `baton up` (pid {pid}) is no longer running" in err
    assert f"rm {path}" in err


def test_a_stale_cluster_is_named_and_how_to_clean_it_said(
        state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pid = dead_pid()
    path = record(state_dir, "old", pid)
    assert cli.main(["generate", "hi", "--cluster", "old"]) == 2
    assert f"cluster 'old' is stale: its `baton up` (pid {pid}) is no longer running" in capsys.readouterr().err
    assert cli.main(["generate", "hi"]) == 2  # no live cluster: the stale one is explained
    err = capsys.readouterr().err
    assert f"no running `baton up` found in {state_dir}" in err and f"rm {path}" in err


def test_several_running_clusters_are_named_and_one_must_be_picked(
        state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record(state_dir, "50051", os.getpid(), ["127.0.0.1:50051"])
    record(state_dir, "lab", os.getpid(), ["127.0.0.1:6000"])
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err
    assert "2 clusters are running: 50051 (router 127.0.0.1:50051); lab (router 127.0.0.1:6000)" in err
    assert "pick one with --cluster NAME" in err
    assert cli.main(["status", "--cluster", "nope"]) == 2
    assert "no cluster named 'nope'" in capsys.readouterr().err


class FakeClient:
    """BatonClient's interface: records what it was asked, streams two chunks."""

    calls: list[tuple[list[str], str, str, dict[str, object]]] = []

    def __init__(self, addresses: Sequence[str], **options: object) -> None:
        self.addresses = list(addresses)

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def list_models(self) -> list[router_pb2.ServedModel]:
        return [router_pb2.ServedModel(name="sim-llama-3-8b")]

    async def generate(self, model: str, prompt: str, **fields: object) -> AsyncIterator[router_pb2.GenerateChunk]:
        FakeClient.calls.append((self.addresses, model, prompt, fields))
        yield router_pb2.GenerateChunk(request_id="r1", token_ids=[104], text="h", node_id="node-0")
        last = router_pb2.GenerateChunk(request_id="r1", token_ids=[105], text="i", index=1, node_id="node-0",
                                        finish_reason=common_pb2.FINISH_REASON_LENGTH)
        last.usage.completion_tokens = 2
        yield last


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> type[FakeClient]:
    FakeClient.calls = []
    monkeypatch.setattr(cli, "BatonClient", FakeClient)
    return FakeClient


def test_generate_uses_the_one_running_cluster_and_sends_every_flag(
        state_dir: Path, fake_client: type[FakeClient]) -> None:
    record(state_dir, "old", dead_pid(), ["127.0.0.1:1"])
    record(state_dir, "lab", os.getpid(), ["127.0.0.1:50051", "127.0.0.1:50052"])
    assert cli.main(["generate", "hi", "--top-p", "0.5", "--stop", "ab", "--stop", "cd", "--tenant", "acme",
                     "--priority", "2", "--max-tokens", "2"]) == 0
    [(routers, model, prompt, fields)] = fake_client.calls
    assert routers == ["127.0.0.1:50051", "127.0.0.1:50052"]  # both routers: the client fails over
    assert fields["top_p"] == 0.5 and fields["stop"] == ["ab", "cd"] and fields["tenant"] == "acme"
    assert fields["priority"] == 2 and fields["max_tokens"] == 2
    router_pb2.GenerateRequest(model=model, prompt=prompt, **fields)  # every field is the proto's


def test_generate_json_prints_one_object_per_chunk(
        state_dir: Path, fake_client: type[FakeClient], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "hi", "--router", "127.0.0.1:1", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == ["h", "i"]
    assert lines[-1]["finish_reason"] == "FINISH_REASON_LENGTH" and lines[-1]["usage"]["completion_tokens"] == 2


def test_ctrl_c_mid_stream_ends_generate_quietly(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Before, a KeyboardInterrupt traceback; now a newline and the shell's exit status for SIGINT. Python's own
    # SIGINT handler, as in a terminal: a run started in the background inherits SIGINT ignored, and asyncio.run
    # then leaves it so.
    class InterruptedClient(FakeClient):
        async def generate(self, model: str, prompt: str, **fields: object) -> AsyncIterator[router_pb2.GenerateChunk]:
            yield router_pb2.GenerateChunk(request_id="r1", token_ids=[104], text="h", node_id="node-0")
            signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, while the stream waits for more
            await asyncio.Event().wait()

    monkeypatch.setattr(cli, "BatonClient", InterruptedClient)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(["generate", "hi", "--router", "127.0.0.1:1"]) == 130
    except KeyboardInterrupt:  # escaped, it would stop the whole test run
        pytest.fail("Ctrl-C escaped baton generate as KeyboardInterrupt")
    finally:
        signal.signal(signal.SIGINT, previous)
    captured = capsys.readouterr()
    assert captured.out == "h" and "Traceback" not in captured.err


@pytest.mark.parametrize(("elsewhere", "by_file"), [(False, False), (True, False), (True, True)])
def test_the_commands_up_suggests_find_its_cluster(
        elsewhere: bool, by_file: bool, state_dir: Path, tmp_path: Path, fake_client: type[FakeClient]) -> None:
    # Recorded outside the default state directory (--state-dir, or --state), the suggested commands must say
    # where: before, `baton status` as suggested found no cluster.
    directory = tmp_path / "other" if elsewhere else state_dir
    path = tmp_path / "lab.json" if by_file else record_path(directory, "lab")
    write_record(path, ClusterRecord(name="lab", path=path, pid=os.getpid(), routers=("127.0.0.1:6000",),
                                     schedulers=("127.0.0.1:6001",)))
    hint = cli.try_hint("baton", "lab", False, directory, path if by_file else None)
    generate = shlex.split(hint.split("|")[0])[2:]  # after "Try: baton"
    assert generate[0] == "generate"
    assert cli.main(generate) == 0
    [(routers, _, prompt, _)] = fake_client.calls
    assert routers == ["127.0.0.1:6000"] and prompt == "Hello"


def test_generate_names_the_routers_that_did_not_answer(
        state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    path = record(state_dir, "lab", os.getpid(), [f"127.0.0.1:{port}"])
    assert cli.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert f"UNAVAILABLE: no router answered at 127.0.0.1:{port} (cluster 'lab', recorded in {path})" in err


def test_up_refuses_a_name_a_running_cluster_holds(
        state_dir: Path, capsys: pytest.CaptureFixture[str], no_cluster: None) -> None:
    record(state_dir, "lab", os.getpid())
    assert cli.main(["up", "--name", "lab"]) == 2
    assert "cluster 'lab' is already running" in capsys.readouterr().err


def test_a_cluster_exiting_removes_only_its_own_record(tmp_path: Path) -> None:
    path = record(tmp_path, "50051", os.getpid())
    remove_record(path, dead_pid())  # an earlier cluster of the same name exits late
    assert read_record(path).pid == os.getpid()
    remove_record(path, os.getpid())
    assert not path.exists()


def test_the_client_reports_finish_reason_by_name() -> None:
    completion = Completion()
    completion.add(router_pb2.GenerateChunk(token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP))
    assert completion.finish_reason is FinishReason.STOP and str(completion.finish_reason) == "stop"
    assert {reason.value for reason in FinishReason} == set(common_pb2.FinishReason.values())


def test_sim_without_the_traces_says_where_they_are_expected(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's refusal of a flag: exit 2
        cli.main(["sim", "--traces", str(tmp_path), "--workload", "azure-code"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"no AzureLLMInferenceTrace_code.csv in {tmp_path}" in err and "--traces" in err


@pytest.mark.parametrize(("argv", "named"), [
    (["generate", "hi", "--seed", "-1"], "argument --seed: '-1': must be an integer in [0, 18446744073709551615]"),
    (["generate", "hi", "--seed", "18446744073709551616"], "argument --seed: '18446744073709551616'"),
    (["generate", "hi", "--max-tokens", "99999999999"], "argument --max-tokens: '99999999999': must be an integer"),
    (["generate", "hi", "--priority", "99999999999"], "argument --priority: '99999999999'"),
    (["generate", "hi", "--priority", "1_0"], "argument --priority: '1_0'"),
    # 0, or what a 32-bit float holds as 0, is "unset" in the request: it sampled from every token (helper-150).
    (["generate", "hi", "--top-p", "0"], "argument --top-p: '0': must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1e-50"], "argument --top-p: '1e-50': must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "argument --top-p: '1.5'"),
    (["generate", "hi", "--top-p", "nan"], "argument --top-p: 'nan'"),
    (["tenants", "add", "acme", "--weight", "inf"], "argument --weight: 'inf': must be a finite number above 0"),
    (["tenants", "add", "acme", "--weight", "nan"], "argument --weight: 'nan'"),
    (["tenants", "add", "acme", "--max-concurrency", "99999999999999999999"],
     "argument --max-concurrency: '99999999999999999999': must be an integer in [1, 9223372036854775807]"),
    (["tenants", "add", "acme", "--tokens-per-minute", "0"], "argument --tokens-per-minute: '0'"),
])
def test_a_value_its_field_cannot_hold_is_refused_by_the_flags_name(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    # Port 99999 dialled 34463; "," and the days were tracebacks, and --days 0 wrote certificates expired as written
    # (helper-161).
    (["generate", "--router", "127.0.0.1:99999", "hi"], "baton generate: --router: port 99999 is past 65535"),
    (["generate", "--router", ",", "hi"], "baton generate: --router: expected host:port, got ','"),
    # ("no scheduler answered (bogus: UNAVAILABLE)", exit 1, where generate named its flag: helper-173.)
    (["status", "--scheduler", "bogus"], "baton status: --scheduler: expected host:port, got 'bogus'"),
    (["certs", "--days", "0", "OUT"], "baton certs: --days 0: must be 1 to 3650"),
    (["certs", "--days=-5", "OUT"], "baton certs: --days -5: must be 1 to 3650"),
])
def test_a_bad_value_is_refused_naming_the_flag_before_anything_is_done(
        argv: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    assert cli.main([str(out) if a == "OUT" else a for a in argv]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("silent", [False, True])
def test_tenants_says_etcd_did_not_answer_instead_of_a_traceback(
        silent: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused, or taken and never answered (a timeout): each was a traceback (helper-161, helper-163)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if silent:
            listener.listen()
        etcd = f"127.0.0.1:{listener.getsockname()[1]}"
        assert cli.main(["tenants", "--etcd", etcd, "list"]) == 1
    assert f"baton tenants list: etcd at {etcd} did not answer" in capsys.readouterr().err



@pytest.mark.parametrize(("command", "replaced"), [(["status", "--scheduler", "127.0.0.1:1"], "cmd_status"),
                                                   (["sim"], "simulator_main")])
def test_a_reader_gone_from_the_pipe_ends_the_command_quietly(command: list[str], replaced: str) -> None:
    """`baton status | head` ended with a BrokenPipeError traceback (helper-173), and so did `baton sim`
    (helper-174)."""
    flood = ("import sys\nfrom baton import cli\n"
             "def flood(args):\n    for i in range(100_000):\n        print(f'node-{i}')\n    return 0\n"
             f"cli.{replaced} = flood\nsys.exit(cli.main({command!r}))\n")
    read, write = os.pipe()
    os.close(read)  # the reader is gone
    try:
        ended = subprocess.run([sys.executable, "-c", flood], stdout=write, stderr=subprocess.PIPE, text=True,
                               timeout=60, cwd=Path(__file__).resolve().parents[2])
    finally:
        os.close(write)
    assert (ended.returncode, ended.stderr) == (141, "")


def test_generate_names_each_of_several_routers_that_did_not_answer_once(
        state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ports = [free_port(), free_port()]  # nothing listens there
    path = record(state_dir, "lab", os.getpid(), [f"127.0.0.1:{port}" for port in ports])
    assert cli.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert f"UNAVAILABLE: no router answered (cluster 'lab', recorded in {path}): 127.0.0.1:{ports[0]}: " in err
    assert f"; 127.0.0.1:{ports[1]}: UNAVAILABLE" in err and err.count("no router answered") == 1, err


def test_a_broken_pipe_not_of_its_output_is_said_not_taken_for_the_reader_gone(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Any BrokenPipeError ended the command quietly with 141, as if `| head` had closed its output: one from a
    socket the command wrote to was lost without a word."""
    def writes_to_a_closed_socket(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_status", writes_to_a_closed_socket)
    assert cli.main(["status", "--scheduler", "127.0.0.1:1"]) == 1
    assert "baton: [Errno 32] Broken pipe" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [
    (["caf\udce9"], "prompt='caf\\udce9'"), (["--model", "caf\udce9", "hi"], "model='caf\\udce9'"),
    (["--stop", "caf\udce9", "hi"], "stop=['caf\\udce9']"), (["--tenant", "caf\udce9", "hi"], "tenant='caf\\udce9'"),
])
def test_generate_refuses_an_argument_that_is_not_utf8_naming_it(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A Latin-1 terminal's "café" printed a traceback (three chained ones for --stop and --tenant: helper-182)."""
    assert cli.main(["generate", "--router", f"127.0.0.1:{free_port()}", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"baton generate: {named}: ") and "Traceback" not in err, err


def test_generate_refuses_a_router_address_that_is_not_utf8(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--router", "caf\udce9:1", "hi"]) == 2
    assert "--router: the host in 'caf\\udce9:1' is not printable UTF-8" in capsys.readouterr().err
