"""The generated code under baton/v1 is what `make protos` makes from protos/ today."""

from __future__ import annotations

from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    status = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"-I{include}",
        f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos,
    ])
    assert status == 0
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.py*") if p.is_file()}
    committed = {p.relative_to(ROOT): p.read_text() for p in (ROOT / "baton" / "v1").glob("*_pb2*.py*")}
    assert sorted(map(str, fresh)) == sorted(map(str, committed)), "run `make protos`"
    stale = [str(path) for path, text in fresh.items() if committed[path] != text]
    assert not stale, f"stale generated code, run `make protos`: {stale}"
