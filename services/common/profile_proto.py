"""EngineProfile ⇄ its protobuf message: how nodes register profiles and the scheduler reads them."""

from __future__ import annotations

import math

from baton.v1 import common_pb2
from services.common.engine_profile import EngineProfile, ProfileSource
from services.common.step_timing import TimingModel

_SOURCES = {
    ProfileSource.CONFIGURED: common_pb2.PROFILE_SOURCE_CONFIGURED,
    ProfileSource.CALIBRATED: common_pb2.PROFILE_SOURCE_CALIBRATED,
    ProfileSource.ONLINE: common_pb2.PROFILE_SOURCE_ONLINE,
}
_FROM_PROTO = {value: source for source, value in _SOURCES.items()}
_COEFFICIENTS = ("a_ms", "b_ms_per_tok", "c_ms_per_tok2", "prefill_floor_ms", "d_ms", "e_ms_per_seq",
                 "f_ms_per_ctx_tok")


def profile_to_proto(profile: EngineProfile) -> common_pb2.EngineProfile:
    t = profile.timing
    return common_pb2.EngineProfile(
        a_ms=t.a_ms, b_ms_per_tok=t.b_ms_per_tok, c_ms_per_tok2=t.c_ms_per_tok2,
        prefill_floor_ms=t.prefill_floor_ms, d_ms=t.d_ms, e_ms_per_seq=t.e_ms_per_seq,
        f_ms_per_ctx_tok=t.f_ms_per_ctx_tok, max_num_batched_tokens=profile.max_num_batched_tokens,
        kv_block_size=profile.kv_block_size, num_kv_blocks=profile.num_kv_blocks,
        source=_SOURCES[profile.source], num_samples=profile.num_samples,
        max_num_seqs=profile.max_num_seqs)


def profile_problem(profile: common_pb2.EngineProfile) -> str:
    """Why a registered profile cannot be used ("" when it can): an unknown source, no step budget, or a coefficient
    or size no engine measures (a NaN or negative one took every placement, helper-181)."""
    if profile.source not in _FROM_PROTO:
        return f"source={profile.source}: unknown"
    if profile.max_num_batched_tokens <= 0:
        return f"max_num_batched_tokens={profile.max_num_batched_tokens}: not positive"
    for name in _COEFFICIENTS:
        value = getattr(profile, name)
        if not (math.isfinite(value) and value >= 0):
            return f"{name}={value}: not a finite time of 0 or more"
    for name in ("kv_block_size", "num_kv_blocks"):
        if getattr(profile, name) < 0:
            return f"{name}={getattr(profile, name)}: negative"
    return ""


def profile_from_proto(model: common_pb2.ModelInfo) -> EngineProfile | None:
    """The profile model registered; None when it has none, or one that cannot be used (profile_problem)."""
    if not model.HasField("profile") or profile_problem(model.profile):
        return None
    p = model.profile
    source = _FROM_PROTO[p.source]
    timing = TimingModel(a_ms=p.a_ms, b_ms_per_tok=p.b_ms_per_tok, c_ms_per_tok2=p.c_ms_per_tok2,
                         prefill_floor_ms=p.prefill_floor_ms, d_ms=p.d_ms, e_ms_per_seq=p.e_ms_per_seq,
                         f_ms_per_ctx_tok=p.f_ms_per_ctx_tok)
    return EngineProfile(timing, max_num_batched_tokens=p.max_num_batched_tokens, kv_block_size=p.kv_block_size,
                         num_kv_blocks=p.num_kv_blocks, source=source, num_samples=p.num_samples,
                         max_num_seqs=max(0, p.max_num_seqs))
