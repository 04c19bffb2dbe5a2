"""Checks of how a request samples, shared by the router (what clients send) and the node agent (what any caller
of its internal Generate sends): each refuses with InvalidArgument naming the field and its value. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

from baton.v1 import common_pb2
from services.common.errors import InvalidArgument


# The most stop sequences, and stop tokens in all, a node takes in one request: its engine checks each against every
# token it generates, so 780,000 of them (3.9 MB, sent straight to a node) slowed every request on that node 30-fold
# (helper-179). The router's own limits (--max-stop-sequences, --max-stop-bytes) are held below these.
NODE_MAX_STOP_SEQUENCES = 256
NODE_MAX_STOP_TOKENS = 16_384


def check_temperature_top_p(temperature: float, top_p: float, prefix: str = "") -> None:
    """temperature finite and 0 (greedy) or more; top_p in [0, 1] (0 is 1 in a node's request, where the router puts
    1 for a top_p left unset; the router refuses a client's 0 itself). prefix: where the fields sit ("sampling." in a
    node's request)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"{prefix}temperature", temperature, "must be 0 (greedy) or positive")
    if not math.isfinite(top_p) or not 0 <= top_p <= 1:
        raise InvalidArgument(f"{prefix}top_p", top_p, "must be in (0, 1]")


def check_vocabulary(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every token id in [0, vocab_size), else the first that is not, by its index."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):  # C-speed first: lists are long
        i, token = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
        raise InvalidArgument(f"{field}[{i}]", token, f"outside the vocabulary [0, {vocab_size})")


def check_node_sampling(sampling: common_pb2.SamplingParams, vocab_size: int) -> None:
    """A node request's sampling as the router would have made it: the router's temperature and top_p checks, and
    its stop strings tokenized (none empty, every id in the model's vocabulary, no more than a node takes)."""
    check_temperature_top_p(sampling.temperature, sampling.top_p, "sampling.")
    if len(sampling.stop) > NODE_MAX_STOP_SEQUENCES:
        raise InvalidArgument("sampling.stop", f"{len(sampling.stop)} sequences", f"at most {NODE_MAX_STOP_SEQUENCES}")
    if (tokens := sum(len(stop.token_ids) for stop in sampling.stop)) > NODE_MAX_STOP_TOKENS:
        raise InvalidArgument("sampling.stop", f"{tokens} tokens in all", f"at most {NODE_MAX_STOP_TOKENS}")
    for i, stop in enumerate(sampling.stop):
        if not stop.token_ids:
            raise InvalidArgument(f"sampling.stop[{i}]", [], "must not be empty")
        check_vocabulary(f"sampling.stop[{i}].token_ids", stop.token_ids, vocab_size)
