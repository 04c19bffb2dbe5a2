"""Where `baton up` records each running cluster, and how `baton generate` and `status` find one.

One JSON file per cluster in a per-user directory ($BATON_STATE_DIR, default $TMPDIR/baton-$UID),
named after the cluster (`baton up --name`, default its first router's port). A record whose
`baton up` process is gone is stale: it is reported with how to clean it, never used.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

STATE_DIR_ENV = "BATON_STATE_DIR"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class StateError(Exception):
    """No usable cluster record; the message says why and what to do."""


def default_state_dir() -> Path:
    configured = os.environ.get(STATE_DIR_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"baton-{os.getuid()}"


def is_valid_name(name: str) -> bool:
    """A cluster name is a file name: letters, digits, '.', '_', '-'."""
    return _NAME.fullmatch(name) is not None


def record_path(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.json"


def is_process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


@dataclass(frozen=True)
class ClusterRecord:
    """What `baton up` wrote about one cluster."""

    name: str
    path: Path
    # The `baton up` process that owns the cluster (0: not recorded, an older baton's file).
    pid: int
    routers: tuple[str, ...]
    schedulers: tuple[str, ...]
    etcd: str = ""
    workdir: str = ""
    # With `baton up --auth`: the administrator's API key; with --tls: the CA and an operator's
    # client certificate and key (paths). The file is its owner's alone (mode 0600).
    api_key: str = ""
    tls: dict[str, str] | None = None
    # With `baton up --metrics`: each service's Prometheus endpoint, by process name.
    metrics: dict[str, str] | None = None

    @property
    def is_live(self) -> bool:
        return is_process_alive(self.pid)

    def stale_reason(self) -> str:
        """Why this record cannot be used, and how to clean it."""
        owner = f"its `baton up` (pid {self.pid}) is no longer running" if self.pid else \
            "it names no `baton up` process (an older baton wrote it)"
        return (f"cluster {self.name!r} is stale: {owner}, so its services are most likely gone; "
                f"remove the record with: rm {self.path}")


def write_record(path: Path, record: ClusterRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    # Readable by its owner alone from the start: with auth it holds the administrator's key.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({
            "name": record.name,
            "pid": record.pid,
            "router": record.routers[0],
            "routers": list(record.routers),
            "scheduler": record.schedulers[0],
            "schedulers": list(record.schedulers),
            "etcd": record.etcd,
            "workdir": record.workdir,
            **({"api_key": record.api_key} if record.api_key else {}),
            **({"tls": record.tls} if record.tls else {}),
            **({"metrics": record.metrics} if record.metrics else {}),
        }, indent=1))
    temporary.replace(path)  # readers never see half a file


def read_record(path: Path) -> ClusterRecord:
    try:
        data = json.loads(path.read_text())
        routers = data.get("routers") or [data["router"]]
        schedulers = data.get("schedulers") or [data["scheduler"]]
        return ClusterRecord(name=str(data.get("name") or path.stem), path=path, pid=int(data.get("pid", 0)),
                             routers=tuple(routers), schedulers=tuple(schedulers),
                             etcd=str(data.get("etcd", "")), workdir=str(data.get("workdir", "")),
                             api_key=str(data.get("api_key", "")), tls=data.get("tls") or None,
                             metrics=data.get("metrics") or None)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(f"cluster record {path} is unreadable ({exc}); remove it with: rm {path}") from exc


def remove_record(path: Path, pid: int) -> None:
    """Delete the record at path if it is still the one process pid wrote (not a newer cluster's)."""
    try:
        if read_record(path).pid == pid:
            path.unlink(missing_ok=True)
    except (FileNotFoundError, StateError):
        pass


def list_records(state_dir: Path) -> list[ClusterRecord]:
    """Every readable record in state_dir, by name."""
    records = []
    for path in sorted(state_dir.glob("*.json")):
        try:
            records.append(read_record(path))
        except (FileNotFoundError, StateError):
            continue
    return records


def _describe(record: ClusterRecord) -> str:
    return f"{record.name} (router{'s' if len(record.routers) > 1 else ''} {', '.join(record.routers)})"


def find_cluster(state_dir: Path, name: str = "", state_file: Path | None = None) -> ClusterRecord:
    """The live cluster named, or at state_file, or the only live one; StateError saying why not."""
    if state_file is not None or name:
        path = state_file if state_file is not None else record_path(state_dir, name)
        try:
            record = read_record(path)
        except FileNotFoundError:
            live = [r for r in list_records(state_dir) if r.is_live]
            running = f"; running: {', '.join(map(_describe, live))}" if live else "; no cluster is running"
            what = f"no state file {path}" if state_file is not None else f"no cluster named {name!r} in {state_dir}"
            raise StateError(what + running) from None
        if not record.is_live:
            raise StateError(record.stale_reason())
        return record
    records = list_records(state_dir)
    live = [r for r in records if r.is_live]
    if len(live) == 1:
        return live[0]
    if live:
        raise StateError(f"{len(live)} clusters are running: {'; '.join(map(_describe, live))}; "
                         f"pick one with --cluster NAME")
    stale = "".join(f"\n  {r.stale_reason()}" for r in records)
    raise StateError(f"no running `baton up` found in {state_dir}{stale}")
