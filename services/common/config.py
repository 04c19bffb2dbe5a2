"""Service configuration: frozen dataclasses whose fields become CLI flags defaulting from env vars."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc

from services.common.etcd_client import split_endpoints
from services.common.tls import TlsFiles, channel_credentials, server_credentials

# A service's or node's id keys its etcd records, labels metrics and travels in gRPC metadata and messages (a node's in
# baton-stream-held, a router's as router_id): printable ASCII with no space or slash, at most MAX_INSTANCE_ID_LEN.
MAX_INSTANCE_ID_LEN = 128
# The most nodes one request may run on, and one Finished notice charge: its first node and one per move, so a
# router's --max-migrations is at most one less.
MAX_NODES_OF_A_REQUEST = 64
_INSTANCE_ID = re.compile(r"[A-Za-z0-9._:@-]{1,%d}" % MAX_INSTANCE_ID_LEN)


def check_instance_id(flag: str, value: str) -> None:
    """ValueError naming flag unless value is 1 to MAX_INSTANCE_ID_LEN of letters, digits and . _ : @ -."""
    if not _INSTANCE_ID.fullmatch(value):
        raise ValueError(f"--{flag}: 1 to {MAX_INSTANCE_ID_LEN} of letters, digits and . _ : @ -, got {value!r}")

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _parse_finite(text: str) -> float:
    """A float flag's value: a finite number. NaN passed every check written `x <= 0` (a node agent took
    `--heartbeat-interval-s nan`, reported itself serving, then failed every Generate; a scheduler with
    `--load-timeout-s nan` refused every request while its status showed live nodes: helper-173), and inf
    stood for no limit where none was meant."""
    try:
        value = float(text)
    except ValueError:  # (else argparse names this function: "invalid _parse_finite value")
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _parse_int(text: str) -> int:
    """An int flag's value (Python's "invalid literal for int() with base 10" was the reason given: helper-175)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _converter(annotation: Any):
    """The str -> value function for a field's type (int, float, str, bool)."""
    if annotation in (bool, "bool"):
        return _parse_bool
    if annotation in (int, "int"):
        return _parse_int
    if annotation in (float, "float"):
        return _parse_finite
    return str


def parse_config(cls: type[T], env_prefix: str, argv: Sequence[str] | None = None) -> T:
    """Build cls from `--field-name` flags, each defaulting from `<env_prefix>_FIELD_NAME`.

    A field's docstring is its `help` metadata; its dataclass default applies when
    neither flag nor env var is given.
    """
    parser = argparse.ArgumentParser(prog=cls.__module__.rsplit(".", 1)[0], description=cls.__doc__)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        env_name = f"{env_prefix}_{field.name.upper()}"
        convert = _converter(hints[field.name])
        if env_name in os.environ:
            raw = os.environ[env_name]
            try:
                default = convert(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{env_name}={raw!r}: {exc}")
        elif field.default is not dataclasses.MISSING:
            default = field.default
        else:
            default = None
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            type=convert,
            default=default,
            required=default is None and field.default is dataclasses.MISSING,
            help=f"{field.metadata.get('help', '')} [env {env_name}; default {default!r}]",
        )
    args = parser.parse_args(argv)
    try:
        return cls(**vars(args))
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def doc(text: str, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with a one-line help text."""
    return dataclasses.field(default=default, metadata={"help": text})


# The highest price per GPU-hour (USD) Baton takes, from a flag or a message: a whole 8-GPU host costs about 100.
# A notice's GPU time at a price near the float's limit made the cost per task infinite for good (helper-179).
MAX_PRICE_PER_HOUR = 10_000.0


@dataclass(frozen=True)
class ServiceConfig:
    """Fields every service has; subclasses override `listen`'s default and add their own."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:0")
    advertise: str = doc("host:port other services dial this one at, as registered in etcd (empty: --listen); "
                         "set it when --listen is a wildcard such as 0.0.0.0:PORT, e.g. in a container", "")
    etcd: str = doc("etcd endpoint host:port, or the members of an etcd cluster as host:port,host:port,...: this "
                    "process talks to one member and moves to the next when a call to it fails", "127.0.0.1:2379")
    lease_ttl_s: int = doc("etcd lease TTL in seconds; a dead process leaves the cluster within it", 3)
    shutdown_grace_s: float = doc("on SIGTERM, how long calls in flight may run on before they are cut; a node agent "
                                  "hands the streams still running a moment before (its router moves them, cause "
                                  "drained)", 10.0)
    otel_exporter: str = doc("where spans (and metrics) go: none, console, file:PATH (spans as JSON lines) or "
                             "otlp:HOST:PORT (an OTLP gRPC collector: spans and metrics)", "none")
    metrics_port: int = doc("port to serve Prometheus metrics on at /metrics, on --listen's host (0: off)", 0)
    log_level: str = doc("logging level", "INFO")
    tls_cert: str = doc("PEM certificate this process serves (and shows when it calls another service with "
                        "--tls-ca); empty: plaintext", "")
    tls_key: str = doc("PEM private key of --tls-cert", "")
    tls_ca: str = doc("PEM CA that peers' certificates chain to: calls to other services go over TLS, and an "
                      "internal service (not the router) refuses clients without a certificate it signed", "")

    etcd_ca: str = doc("PEM CA of etcd's certificate: the etcd connection goes over TLS, showing --tls-cert "
                       "when given (for etcd's --client-cert-auth); empty: plaintext", "")

    # Whether this service's port demands client certificates when it has a CA (mutual TLS).
    requires_client_cert: ClassVar[bool] = True

    @property
    def address(self) -> str:
        """Where other services dial this one: --advertise, else --listen."""
        return self.advertise or self.listen

    def __post_init__(self) -> None:
        TlsFiles(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)  # ValueError naming a bad TLS flag
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: a service shows its own certificate")
        TlsFiles(ca=self.etcd_ca)  # ValueError when the file is missing
        check_listen("listen", self.listen)
        check_etcd("etcd", self.etcd)
        if self.advertise:
            check_listen("advertise", self.advertise)
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s: must be at least 1, got {self.lease_ttl_s}")
        if not 0 <= self.shutdown_grace_s <= 86_400:
            raise ValueError(f"--shutdown-grace-s: must be 0 to 86400, got {self.shutdown_grace_s}")
        check_otel_exporter(self.otel_exporter)
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port: expected 0 (off) to 65535, got {self.metrics_port}")

    @property
    def metrics_listen(self) -> str:
        """host:port of the Prometheus endpoint (--listen's host), or "" when it is off."""
        if not self.metrics_port:
            return ""
        return f"{self.listen.rpartition(':')[0]}:{self.metrics_port}"

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """What this service listens with (None: plaintext)."""
        return server_credentials(self.tls, self.requires_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """What this service calls the others with (None: plaintext)."""
        return channel_credentials(self.tls)

    def etcd_credentials(self) -> grpc.ChannelCredentials | None:
        """What this service talks to etcd with (None: plaintext)."""
        return channel_credentials(TlsFiles(cert=self.tls_cert, key=self.tls_key, ca=self.etcd_ca))


def check_otel_exporter(value: str) -> None:
    """Raise ValueError unless value is none, console, file:PATH (a file this process can append to) or
    otlp:HOST:PORT. A file in a directory that did not exist was taken, and every span batch then logged a traceback
    while its spans were lost (helper-158)."""
    if value in ("none", "console"):
        return
    if value.startswith("file:") and len(value) > len("file:"):
        path = value.removeprefix("file:")
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ValueError(f"--otel-exporter: cannot append to file:{path}: {exc.strerror or exc}") from None
        return
    if value.startswith("otlp:"):
        # As every address flag is checked: port 99999 was taken, and the exporter sent to 34463 (helper-192).
        endpoint = value.removeprefix("otlp:")
        check_listen("otel_exporter", endpoint)
        host, _, port = endpoint.rpartition(":")
        # "otlp:http://x:4317" dialled http://http://x:4317; "::1:4317" could not be resolved (helper-193).
        if "/" in host or "@" in host or "?" in host or any(c.isspace() for c in host) \
                or (":" in host and not (host.startswith("[") and host.endswith("]"))):
            raise ValueError(f"--otel-exporter: the host in {value!r} must be a host name or address (an IPv6 one in "
                             "brackets, [::1]), not a URL")
        if int(port) == 0:
            raise ValueError(f"--otel-exporter: port 0 in {value!r} names no collector")
        return
    raise ValueError(f"--otel-exporter: expected none, console, file:PATH or otlp:HOST:PORT, got {value!r}")


def check_etcd(name: str, value: str) -> None:
    """Raise ValueError unless value is host:port or several, comma-separated, naming the one that is not."""
    endpoints = split_endpoints(value)
    for endpoint in endpoints:
        try:
            check_listen(name, endpoint)
        except ValueError as exc:
            raise ValueError(f"{exc}{f' (in {value!r})' if len(endpoints) > 1 else ''}") from None
    if len(set(endpoints)) < len(endpoints):
        raise ValueError(f"--{name.replace('_', '-')}: an endpoint is given twice, in {value!r}")


def check_listen(name: str, value: str) -> None:
    """Raise ValueError unless value looks like host:port."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()):  # (int() reads other scripts' digits)
        raise ValueError(f"--{name.replace('_', '-')}: expected host:port, got {value!r}")
    if not host.isprintable():  # a control character, or a non-UTF-8 argument's lone surrogate (helper-182)
        raise ValueError(f"--{name.replace('_', '-')}: the host in {value!r} is not printable UTF-8")
    if int(port) > 65535:  # (gRPC took 99999 for 34463, helper-161)
        raise ValueError(f"--{name.replace('_', '-')}: port {port} is past 65535, in {value!r}")
