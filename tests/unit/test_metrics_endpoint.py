"""--metrics-port and --otel-exporter: what each service accepts, and a /metrics port that is taken."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from services.common.config import parse_config
from services.common.server import serve
from services.common.telemetry import Telemetry
from services.node_agent.config import NodeAgentConfig
from services.router.config import RouterConfig
from tests.unit.test_server_port import _Idle

pytestmark = pytest.mark.timeout(20)


def test_metrics_are_off_unless_a_port_is_given() -> None:
    assert RouterConfig().metrics_port == 0
    assert RouterConfig().metrics_listen == ""


def test_the_metrics_endpoint_binds_the_grpc_listen_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_NODE_METRICS_PORT", "9400")
    config = parse_config(NodeAgentConfig, "BATON_NODE", ["--listen", "0.0.0.0:50200"])
    assert config.metrics_listen == "0.0.0.0:9400"


@pytest.mark.parametrize(("argv", "message"), [
    (["--metrics-port", "70000"], "--metrics-port: expected 0 (off) to 65535, got 70000"),
    (["--otel-exporter", "otlp:collector"], "--otel-exporter: expected host:port, got 'collector'"),
    # Taken, 99999 sent to 34463, and a URL dialled http://http://x:4317 (helper-192).
    (["--otel-exporter", "otlp:127.0.0.1:99999"], "--otel-exporter: port 99999 is past 65535, in '127.0.0.1:99999'"),
    (["--otel-exporter", "otlp:http://x:4317"], "--otel-exporter: the host in 'otlp:http://x:4317' must be a host "
                                                "name or address"),
    (["--otel-exporter", "otlp: :4317"], "must be a host name or address"),
    (["--otel-exporter", "otlp:::1:4317"], "an IPv6 one in brackets, [::1]"),  # gRPC could not resolve it
    (["--otel-exporter", "otlp:x:\u0664\u0663\u0661\u0667"], "--otel-exporter: expected host:port"),
    (["--otel-exporter", "otlp:127.0.0.1:0"], "port 0 in 'otlp:127.0.0.1:0' names no collector"),
    (["--otel-exporter", "jaeger"], "got 'jaeger'"),
    (["--shutdown-grace-s", "-1"], "--shutdown-grace-s: must be 0 to 86400, got -1.0"),
    (["--listen", "127.0.0.1:99999"], "--listen: port 99999 is past 65535, in '127.0.0.1:99999'"),
    # Taken, it logged a traceback for each span batch, and the spans were lost (helper-158).
    (["--otel-exporter", "file:/nonexistent-dir/spans.jsonl"],
     "--otel-exporter: cannot append to file:/nonexistent-dir/spans.jsonl: No such file or directory"),
])
def test_bad_values_exit_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        parse_config(RouterConfig, "BATON_ROUTER_TEST", argv)
    assert message in capsys.readouterr().err


async def test_a_service_whose_metrics_port_is_taken_exits(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        service = _Idle()
        telemetry = Telemetry("idle/test", "none", metrics_listen=f"127.0.0.1:{port}")
        with caplog.at_level(logging.ERROR):
            code = await asyncio.wait_for(serve(service, "127.0.0.1:0", telemetry), 10)
    assert code == 2
    assert service.closed
    assert f"cannot serve metrics on 127.0.0.1:{port}" in caplog.text
