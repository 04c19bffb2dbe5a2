"""The profiles sim nodes register, for tests that build the scheduler's fleet view by hand."""

from __future__ import annotations

from services.common.engine_profile import EngineProfile
from services.node_agent.engines.sim.models import SIM_MODELS
from services.node_agent.engines.sim.profile import configured_profile


def sim_profiles(gpu: str, *models: str, num_kv_blocks: int = 25_000) -> dict[str, EngineProfile]:
    """What a sim node of gpu registers for each of models the sim table has fitted on that GPU."""
    profiles = {}
    for model in models:
        try:
            profiles[model] = configured_profile(gpu, SIM_MODELS[model], num_kv_blocks)
        except KeyError:  # not a sim model, or a GPU the table has not fitted: no profile
            continue
    return profiles
