"""A vLLM node promises exact resume only on a CPU where it was seen to hold: not on one with AMX."""

from __future__ import annotations

from pathlib import Path

from services.node_agent.engines.vllm.engine import cpu_has_amx


def test_a_cpu_with_amx_tiles_is_told_apart_from_one_without(tmp_path: Path) -> None:
    with_amx = tmp_path / "with"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\n")
    without = tmp_path / "without"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n\n")
    assert cpu_has_amx(str(with_amx))
    assert not cpu_has_amx(str(without))
    assert not cpu_has_amx(str(tmp_path / "absent"))  # unreadable: no AMX assumed, as before this check
