"""Service configuration: frozen dataclasses whose fields become CLI flags defaulting from env vars."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _converter(annotation: Any):
    """The str -> value function for a field's type (int, float, str, bool)."""
    if annotation in (bool, "bool"):
        return _parse_bool
    if annotation in (int, "int"):
        return int
    if annotation in (float, "float"):
        return float
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


@dataclass(frozen=True)
class ServiceConfig:
    """Fields every service has; subclasses override `listen`'s default and add their own."""

    listen: str = doc("host:port to serve gRPC on", "127.0.0.1:0")
    advertise: str = doc("host:port other services dial this one at, as registered in etcd (empty: --listen); "
                         "set it when --listen is a wildcard such as 0.0.0.0:PORT, e.g. in a container", "")
    etcd: str = doc("etcd endpoint host:port", "127.0.0.1:2379")
    lease_ttl_s: int = doc("etcd lease TTL in seconds; a dead process leaves the cluster within it", 3)
    otel_exporter: str = doc("span exporter: none, console or file:PATH", "none")
    log_level: str = doc("logging level", "INFO")

    @property
    def address(self) -> str:
        """Where other services dial this one: --advertise, else --listen."""
        return self.advertise or self.listen

    def __post_init__(self) -> None:
        check_listen("listen", self.listen)
        check_listen("etcd", self.etcd)
        if self.advertise:
            check_listen("advertise", self.advertise)
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl-s: must be at least 1, got {self.lease_ttl_s}")


def check_listen(name: str, value: str) -> None:
    """Raise ValueError unless value looks like host:port."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--{name.replace('_', '-')}: expected host:port, got {value!r}")
