"""Service config: flags beat env vars beat defaults; values are converted; bad values exit cleanly."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import doc, parse_config
from services.common.etcd_session import connect
from services.kvindex.config import KVIndexConfig
from services.node_agent.config import NodeAgentConfig
from services.node_agent.engines.factory import build_host, node_info
from services.router.config import RouterConfig
from services.scheduler.config import SchedulerConfig, parse_tenant_limits

PREFIX = "BATON_ROUTER"


@dataclass(frozen=True)
class FlagsConfig:
    """A config with one field of each converted type."""

    verbose: bool = doc("talk more", False)
    retries: int = doc("attempts", 3)
    ratio: float = doc("share", 0.5)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("BATON_ROUTER_", "BATON_TEST_")):
            monkeypatch.delenv(name)


def _exit_message(capsys: pytest.CaptureFixture[str], cls: type, prefix: str, argv: list[str]) -> str:
    """stderr of a parse_config that must exit with argparse's usage error."""
    with pytest.raises(SystemExit) as caught:
        parse_config(cls, prefix, argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_defaults_apply_without_flags_or_env() -> None:
    assert parse_config(RouterConfig, PREFIX, []) == RouterConfig()


def test_env_var_beats_default_and_flag_beats_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_ROUTER_LISTEN", "0.0.0.0:7000")
    monkeypatch.setenv("BATON_ROUTER_LEASE_TTL_S", "9")
    config = parse_config(RouterConfig, PREFIX, ["--lease-ttl-s", "11"])
    assert (config.listen, config.lease_ttl_s, config.etcd) == ("0.0.0.0:7000", 11, "127.0.0.1:2379")


def test_int_and_float_fields_are_converted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_ROUTER_DEFAULT_MAX_TOKENS", "64")
    config = parse_config(RouterConfig, PREFIX, ["--placement-timeout-s", "0.25"])
    assert config.default_max_tokens == 64
    assert config.placement_timeout_s == 0.25


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], FlagsConfig()),
        (
            {"BATON_TEST_VERBOSE": "yes", "BATON_TEST_RETRIES": "7", "BATON_TEST_RATIO": "1e-1"},
            [],
            FlagsConfig(True, 7, 0.1),
        ),
        ({"BATON_TEST_VERBOSE": "on"}, ["--verbose", "0"], FlagsConfig(verbose=False)),
        (
            {"BATON_TEST_VERBOSE": "off"},
            ["--verbose", "TRUE", "--retries", "-2", "--ratio", "2"],
            FlagsConfig(True, -2, 2.0),
        ),
    ],
)
def test_bool_int_float_conversion(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str], expected: FlagsConfig
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = parse_config(FlagsConfig, "BATON_TEST", argv)
    assert config == expected
    assert (type(config.verbose), type(config.retries), type(config.ratio)) == (bool, int, float)


def test_invalid_listen_flag_exits_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_message(capsys, RouterConfig, PREFIX, ["--listen", "nohost"])
    assert "--listen" in err and "'nohost'" in err


def test_invalid_listen_env_var_exits_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATON_ROUTER_LISTEN", "host:port")
    assert "--listen" in _exit_message(capsys, RouterConfig, PREFIX, [])


def test_the_connection_rate_limit_is_on_by_default_off_at_zero_and_checked(
        capsys: pytest.CaptureFixture[str]) -> None:
    rates = RouterConfig().connection_rates()
    assert rates is not None and (rates.rate_per_s, rates.burst) == (500.0, 1000)
    assert parse_config(RouterConfig, PREFIX, ["--max-requests-per-connection-per-s", "0"]).connection_rates() is None
    assert "--max-requests-per-connection-per-s" in _exit_message(
        capsys, RouterConfig, PREFIX, ["--max-requests-per-connection-per-s", "-1"])
    assert "--connection-request-burst" in _exit_message(
        capsys, RouterConfig, PREFIX, ["--connection-request-burst", "0"])


def test_max_migrations_stops_where_a_finished_notice_could_no_longer_name_every_node(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A request that moved 64 times ran on 65 nodes: the leader refused its Finished notice, which may name 64, and
    its cost was lost, its admission slot held until the sweep (helper-198)."""
    assert parse_config(RouterConfig, PREFIX, ["--max-migrations", "63"]).max_migrations == 63
    for value in ("64", "-1"):
        message = _exit_message(capsys, RouterConfig, PREFIX, ["--max-migrations", value])
        assert f"--max-migrations: must be 0 to 63 (a request runs on at most 64 nodes), got {value}" in message


def test_unconvertible_flag_exits_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--verbose" in _exit_message(capsys, FlagsConfig, "BATON_TEST", ["--verbose", "maybe"])
    assert "--retries" in _exit_message(capsys, FlagsConfig, "BATON_TEST", ["--retries", "1.5"])


@pytest.mark.parametrize(("cls", "flag"), [(NodeAgentConfig, "--heartbeat-interval-s"),
                                           (SchedulerConfig, "--load-timeout-s"),
                                           (RouterConfig, "--stream-interval-s")])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_float_flag_that_is_no_finite_number_exits_naming_it(
        capsys: pytest.CaptureFixture[str], cls: type, flag: str, value: str) -> None:
    """NaN passed every check written `x <= 0`: a node agent with --heartbeat-interval-s nan reported itself serving
    and failed every Generate, a scheduler with --load-timeout-s nan refused every request (helper-173)."""
    err = _exit_message(capsys, cls, "BATON_TEST", [f"{flag}={value}"])
    assert f"argument {flag}: not a finite number: '{value}'" in err
    assert f"argument {flag}: not a number: 'abc'" in _exit_message(capsys, cls, "BATON_TEST", [f"{flag}=abc"])


def test_unconvertible_env_var_exits_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATON_ROUTER_LEASE_TTL_S", "abc")
    # (Its reason was Python's "invalid literal for int() with base 10": helper-175.)
    assert "BATON_ROUTER_LEASE_TTL_S='abc': not an integer: 'abc'" in _exit_message(capsys, RouterConfig, PREFIX, [])
    monkeypatch.delenv("BATON_ROUTER_LEASE_TTL_S")
    assert "argument --lease-ttl-s: not an integer: '1.5'" in _exit_message(capsys, RouterConfig, PREFIX,
                                                                           ["--lease-ttl-s=1.5"])


def test_vllm_engine_needs_a_model_directory() -> None:
    from services.node_agent.config import NodeAgentConfig

    with pytest.raises(ValueError, match="--model-dir"):
        NodeAgentConfig(engine="vllm")
    with pytest.raises(ValueError, match="--block-size.*24"):
        NodeAgentConfig(engine="vllm", model_dir="/models/m", block_size=24)


def test_a_node_with_an_unknown_gpu_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """It was found only once the node was built: exit 1 with no usage line (helper-173)."""
    err = _exit_message(capsys, NodeAgentConfig, "BATON_NODE", ["--gpu", "tpu"])
    assert "--gpu: unknown GPU 'tpu'; known: a100, a10g, a40, h100, h200, l4" in err and "usage:" in err
    vllm = ["--engine", "vllm", "--model-dir", "/models/m", "--gpu", "l40s"]
    assert "--hbm-gb and --price-per-hour" in _exit_message(capsys, NodeAgentConfig, "BATON_NODE", vllm)
    # A vllm node on a GPU outside the catalogue, with what the catalogue would have said: a label (helper-174).
    given = parse_config(NodeAgentConfig, "BATON_NODE", [*vllm, "--hbm-gb", "48", "--price-per-hour", "1"])
    assert given.gpu == "l40s"


@pytest.mark.parametrize("price", [-1.0, float("nan"), float("inf"), 10_001.0])
def test_a_node_refuses_a_price_that_is_not_one(price: float) -> None:
    from services.node_agent.config import NodeAgentConfig

    with pytest.raises(ValueError, match=f"--price-per-hour: .*got {price}"):
        NodeAgentConfig(price_per_hour=price)


def test_vllm_node_refuses_a_directory_that_holds_no_model(tmp_path: Path) -> None:
    from services.node_agent.config import NodeAgentConfig
    from services.node_agent.engines.factory import build_host

    with pytest.raises(SystemExit, match=f"--model-dir: '{tmp_path}' is not a model directory"):
        build_host(NodeAgentConfig(engine="vllm", model_dir=str(tmp_path)))


def test_vllm_model_is_served_under_its_directory_name_unless_named() -> None:
    from services.node_agent.config import NodeAgentConfig
    from services.node_agent.engines.factory import vllm_model_name

    assert vllm_model_name(NodeAgentConfig(engine="vllm", model_dir="/models/tiny-llama")) == "tiny-llama"
    assert vllm_model_name(NodeAgentConfig(engine="vllm", model_dir="/models/x", model="chat")) == "chat"


def test_vllm_gpu_memory_share_reaches_the_engine_and_is_checked(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two vLLM engines share a GPU only with a lower share than vLLM's 0.9 (it checks it is free at start)."""
    from services.node_agent.config import NodeAgentConfig
    from services.node_agent.engines import factory
    from services.node_agent.engines.vllm import engine

    with pytest.raises(ValueError, match="--gpu-memory-utilization.*1.5"):
        NodeAgentConfig(engine="vllm", model_dir="/models/m", gpu_memory_utilization=1.5)
    started_with = []

    def fake_engine(name: str, settings: engine.VllmSettings) -> None:
        started_with.append(settings)
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(engine, "VllmEngine", fake_engine)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="vLLM failed to start"):
        factory.build_host(NodeAgentConfig(engine="vllm", model_dir=str(tmp_path), gpu_memory_utilization=0.3))
    assert [s.gpu_memory_utilization for s in started_with] == [0.3]


def test_a_node_registers_its_advertised_address_not_a_wildcard_listen() -> None:
    argv = ["--listen", "0.0.0.0:50400", "--advertise", "node-h100:50400"]
    config = parse_config(NodeAgentConfig, "BATON_NODE", argv)
    assert node_info(config, build_host(config)).address == "node-h100:50400"
    plain = parse_config(NodeAgentConfig, "BATON_NODE", ["--listen", "127.0.0.1:50401"])
    assert node_info(plain, build_host(plain)).address == "127.0.0.1:50401"


def test_a_bad_advertise_address_exits_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    message = _exit_message(capsys, RouterConfig, PREFIX, ["--advertise", "router-1"])
    assert "--advertise: expected host:port, got 'router-1'" in message


@pytest.mark.parametrize(("value", "named"), [
    ("127.0.0.1:2379,", "--etcd: expected host:port, got '' (in '127.0.0.1:2379,')"),
    ("a:2379,b", "--etcd: expected host:port, got 'b' (in 'a:2379,b')"),
    ("a:2379,a:2379", "--etcd: an endpoint is given twice, in 'a:2379,a:2379'"),
])
def test_a_bad_etcd_member_list_exits_naming_the_endpoint(value: str, named: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert named in _exit_message(capsys, RouterConfig, PREFIX, ["--etcd", value])


def test_an_etcd_member_list_is_taken_with_spaces_after_its_commas() -> None:
    config = parse_config(RouterConfig, PREFIX, ["--etcd", "etcd-0:2379, etcd-1:2379,etcd-2:2379"])
    assert connect(config.etcd).endpoints == ("etcd-0:2379", "etcd-1:2379", "etcd-2:2379")


@pytest.mark.parametrize("field", ["heartbeat_interval_s", "load_report_interval_s"])
def test_a_node_agents_report_intervals_must_be_positive(field: str) -> None:
    """At 0 the node agent's report loop would never wait, and starve its event loop."""
    with pytest.raises(ValueError, match=r"--heartbeat-interval-s and --load-report-interval-s must be positive.* 0"):
        NodeAgentConfig(**{field: 0.0})


@pytest.mark.parametrize("text", ['{"acme": {"weight": 0}}', '{"acme": {"weight": Infinity}}',
                                  '{"acme": {"weight": NaN}}'])
def test_a_tenant_weight_fair_share_cannot_divide_by_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=r"acme\.weight=.*: must be positive and finite"):
        parse_tenant_limits(text)


@pytest.mark.parametrize(("text", "named"), [
    # A quoted number failed every Place of the tenant with a TypeError; 0 refused its every request; NaN passed as
    # unlimited, 2.5 as 3 and true as 1 (helper-189). Checked as a tenant's record in etcd is.
    ('{"acme": {"max_concurrency": "2"}}', "acme.max_concurrency='2': must be at least 1"),
    ('{"acme": {"max_concurrency": 0}}', "acme.max_concurrency=0: must be at least 1"),
    ('{"acme": {"tokens_per_minute": NaN}}', "acme.tokens_per_minute=nan"),
    ('{"acme": {"max_concurrency": 2.5}}', "acme.max_concurrency=2.5"),
    ('{"acme": {"max_concurrency": true}}', "acme.max_concurrency=True"),
    ('{"acme": {"wieght": 2}}', "acme.wieght: unknown field; known: weight, max_concurrency, tokens_per_minute"),
    ('{"acme": 5}', "acme=5: expected an object of limits"),
])
def test_a_tenant_limit_a_record_could_not_hold_is_refused_at_start_naming_it(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        SchedulerConfig(tenant_limits=text)
    assert parse_tenant_limits('{"acme": {"weight": 2, "max_concurrency": 64}}')["acme"].max_concurrency == 64
    # Its limits only: without --auth a tenant is any name the routers take (helper-190).
    assert parse_tenant_limits('{"team/a": {"weight": 2}}')["team/a"].weight == 2


@pytest.mark.parametrize("node_id", ["", "gpu 1", "nœud-1", "a/b", "n\n", "n" * 129])
def test_a_node_id_that_cannot_travel_in_grpc_metadata_or_an_etcd_key_is_refused(node_id: str) -> None:
    """A node sends its id in a status's metadata (baton-stream-held): gRPC turns invalid metadata into INTERNAL,
    which its router took for the node failing."""
    with pytest.raises(ValueError, match="--node-id: 1 to 128 of letters"):
        NodeAgentConfig(node_id=node_id)
    assert NodeAgentConfig(node_id="h100-node_1.a:b@c").node_id == "h100-node_1.a:b@c"


@pytest.mark.parametrize("make", [RouterConfig, SchedulerConfig, KVIndexConfig])
@pytest.mark.parametrize("instance_id", ["", "router 1", "r/1", "r" * 129])
def test_an_instance_id_that_cannot_key_etcd_or_travel_as_router_id_is_refused(make: type, instance_id: str) -> None:
    """A router sends its --instance-id as router_id on every Place and Finished, which the leader bounds at 128
    characters: a longer one made every request a 400 naming router_id, a server's misconfiguration blamed on its
    clients (helper-101)."""
    with pytest.raises(ValueError, match="--instance-id: 1 to 128 of letters"):
        make(instance_id=instance_id)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_an_http_read_timeout_that_is_not_positive_and_finite_is_refused_naming_the_flag(value: float) -> None:
    with pytest.raises(ValueError, match="--http-read-timeout-s: must be positive"):
        RouterConfig(http_read_timeout_s=value)


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--max-stop-sequences", "257", "--max-stop-sequences: at most 256 (what a node agent takes), got 257"),
    ("--max-stop-bytes", "8193", "--max-stop-bytes: at most 8192 (what a node agent takes), got 8193"),
])
def test_a_router_lets_through_no_more_stop_sequences_than_a_node_takes(
        flag: str, value: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert named in _exit_message(capsys, RouterConfig, PREFIX, [flag, value])
