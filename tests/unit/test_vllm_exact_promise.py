"""A vLLM node promises exact resume only on the kind of CPU where it was measured to hold."""

from __future__ import annotations

from pathlib import Path

from services.node_agent.engines.vllm.engine import cpu_resumes_exactly


def _cpuinfo(tmp_path: Path, name: str, flags: str) -> str:
    path = tmp_path / name
    path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\n")
    return str(path)


def test_only_a_cpu_with_native_bf16_and_no_amx_is_promised_exact_resume(tmp_path: Path) -> None:
    # Measured exact: an AMD EPYC with AVX-512 bf16 and VNNI, no AMX.
    assert cpu_resumes_exactly(_cpuinfo(tmp_path, "epyc", "fpu sse2 avx512f avx512_bf16 avx512_vnni"))
    # Diverged: an Intel Xeon with AMX tiles; another with AVX-512 VNNI but no native bf16.
    assert not cpu_resumes_exactly(_cpuinfo(tmp_path, "amx", "fpu sse2 avx512f avx512_bf16 amx_bf16 amx_tile"))
    assert not cpu_resumes_exactly(_cpuinfo(tmp_path, "no-bf16", "fpu sse2 avx512f avx512_vnni"))
    assert not cpu_resumes_exactly(str(tmp_path / "absent"))  # unreadable: not promised
