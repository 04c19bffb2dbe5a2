"""Per-request state of the simulated engine: tokens, progress and block keys."""

from __future__ import annotations

from services.common.block_hash import ROOT_PARENT_HASH, hash_block, salted_root
from services.node_agent.engines.sim.kv_cache import KVBlock
from services.node_agent.engines.sim.tokens import ContextHasher
from services.node_agent.engines.types import EngineRequest, SamplingParams


class SimSequence:
    """One request's tokens (prompt then completion) and how far its KV has been computed."""

    def __init__(self, request: EngineRequest, block_size: int) -> None:
        self.request_id = request.request_id
        self.sampling: SamplingParams = request.sampling
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        # Where the completion began, counting tokens a resumed request generated before.
        self._completion_start = self.num_prompt_tokens - request.num_resumed_tokens
        self.block_size = block_size
        # Chained keys of every full block of token_ids, kept current as tokens arrive.
        self._cache_root = salted_root(request.cache_salt)
        if request.prompt_block_hashes is not None:
            self.block_hashes: list[int] = list(request.prompt_block_hashes)
        else:
            self.block_hashes = []
        # The same blocks' keys in the prefix cache: chained from the salt's root, so another salt's
        # blocks never match. Unsalted, the very same list. (Tokens follow the unsalted keys: the
        # output is a function of the context alone, whoever asks.)
        self.cache_keys: list[int] = self.block_hashes if self._cache_root == ROOT_PARENT_HASH else []
        self._extend_block_hashes()
        # The context's digest: from the last full block's key, then the tokens after it.
        self.hasher = self._hasher_from_last_block()
        for token_id in self.token_ids[len(self.block_hashes) * block_size :]:
            self.hasher.extend(token_id)
        # Tokens whose KV is in the cache; reset to 0 when the request is preempted.
        self.num_computed_tokens = 0
        # Modelled GPU time spent on this request so far (its share of each step).
        self.gpu_ms = 0.0
        # True from (re)admission until the step that computes its last token.
        self.is_prefilling = True
        # Prefix-cache hit on first admission; a preempted request keeps its first value.
        self.num_cached_tokens: int | None = None
        # The last prefix match while waiting: (cache version, matched blocks).
        self.prefix_match: tuple[int, list[KVBlock]] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion tokens so far."""
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        """Completion tokens emitted so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV still has to be computed."""
        return len(self.token_ids) - self.num_computed_tokens

    def ends_with(self, stop: tuple[int, ...]) -> bool:
        """Whether the completion ends with stop (a stop sequence never reaches into the prompt).

        For a resumed request the completion includes what it generated before it moved here.
        """
        num_completion = len(self.token_ids) - self._completion_start
        return 0 < len(stop) <= num_completion and tuple(self.token_ids[-len(stop) :]) == stop

    def append_token(self, token_id: int) -> None:
        """Add a generated token to the context."""
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self._extend_block_hashes()
            self.hasher = self._hasher_from_last_block()
        else:
            self.hasher.extend(token_id)

    def _hasher_from_last_block(self) -> ContextHasher:
        return ContextHasher.after_block(self.block_hashes[-1] if self.block_hashes else ROOT_PARENT_HASH)

    def _extend_block_hashes(self) -> None:
        """Hash any newly completed full blocks, chaining from the last known key."""
        size = self.block_size
        for start in range(len(self.block_hashes) * size, len(self.token_ids) - size + 1, size):
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_PARENT_HASH
            self.block_hashes.append(hash_block(parent, self.token_ids[start : start + size]))
        if self.cache_keys is self.block_hashes:
            return
        for start in range(len(self.cache_keys) * size, len(self.block_hashes) * size, size):
            parent = self.cache_keys[-1] if self.cache_keys else self._cache_root
            self.cache_keys.append(hash_block(parent, self.token_ids[start : start + size]))
