"""vLLM's side of position-keyed sampling: a v1 logits processor and a worker probe, both loaded by
vLLM in its worker process.

A request sampled this way reaches vLLM as a greedy request (temperature 0) whose extra_args carry
Baton's seed, temperature, top_p and the position of its first generated token. The processor
chooses each token with `keyed_sampling.choose_token` and leaves only that token finite in the
request's logits row, so vLLM's greedy argmax emits it. Requests without those extra_args are
left to vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from services.node_agent.engines.vllm.keyed_sampling import choose_token

#: The key of SamplingParams.extra_args that asks for position-keyed sampling.
EXTRA_ARGS_KEY = "baton_keyed_sampling"


def keyed_extra_args(seed: int, temperature: float, top_p: float, first_position: int) -> dict[str, Any]:
    """The extra_args of a request sampled by (seed, position); first_position is its prompt's length
    (a resumed request's prompt ends with what it generated before, so positions line up)."""
    return {EXTRA_ARGS_KEY: {"seed": seed, "temperature": temperature, "top_p": top_p,
                             "first_position": first_position}}


@dataclass
class _KeyedRow:
    seed: int
    temperature: float
    top_p: float
    first_position: int
    # vLLM's live list of the request's generated tokens (it appends to it).
    output_token_ids: list[int]

    @property
    def position(self) -> int:
        """The absolute position of the token about to be chosen."""
        return self.first_position + len(self.output_token_ids)


class PositionKeyedSampler(LogitsProcessor):
    """Chooses the next token of each keyed request from (seed, position) and its logits."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _KeyedRow] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        args = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return
        if args["temperature"] <= 0 or not 0 < args["top_p"] <= 1 or args["first_position"] < 0:
            raise ValueError(f"{EXTRA_ARGS_KEY}: temperature must be > 0, top_p in (0, 1] and "
                             f"first_position >= 0, got {args}")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must apply it to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)

    @staticmethod
    def _new_row(params: Any, prompt_token_ids: list[int] | None, output_token_ids: list[int]) -> _KeyedRow | None:
        args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        return _KeyedRow(seed=args["seed"], temperature=args["temperature"], top_p=args["top_p"],
                         first_position=args["first_position"], output_token_ids=output_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, row in self._rows.items():
            values = logits[index].detach().to("cpu", torch.float64).numpy()
            token = choose_token(values, row.temperature, row.top_p, row.seed, row.position)
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits


class WorkerProbe:
    """Mixed into vLLM's worker class (`worker_extension_cls`): what the engine asks its workers."""

    def baton_num_threads(self) -> int:
        """Threads of the worker's CPU kernels (1: their results do not depend on how work is split)."""
        return torch.get_num_threads()
