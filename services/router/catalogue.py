"""The models the cluster serves, derived from node registrations."""

from __future__ import annotations

import logging

from google.protobuf import json_format

from baton.v1 import common_pb2
from services.router.validation import ModelEntry

log = logging.getLogger(__name__)


def models_from_registrations(items: dict[str, bytes], lapsed: frozenset[str] = frozenset()) -> dict[str, ModelEntry]:
    """One entry per model name, counting the nodes where it is warm; lapsed registrations (held
    for their grace period) and draining nodes keep a model served but count no warm node."""
    entries: dict[str, ModelEntry] = {}
    for key, value in items.items():
        try:
            info = json_format.Parse(value, common_pb2.NodeInfo())
        except json_format.ParseError:
            log.warning("malformed node registration at %s", key)
            continue
        for model in info.models:
            known = entries.get(model.name)
            counts = model.is_warm and key not in lapsed and not info.draining
            warm = (known.num_warm_nodes if known else 0) + int(counts)
            entries[model.name] = ModelEntry(
                name=model.name,
                max_context_tokens=model.max_context_tokens,
                tokenizer=model.tokenizer,
                vocab_size=model.vocab_size,
                num_warm_nodes=warm,
            )
    return entries


def gpus_from_registrations(items: dict[str, bytes]) -> dict[str, str]:
    """Each registered node's GPU generation, by node id."""
    gpus: dict[str, str] = {}
    for value in items.values():
        try:
            info = json_format.Parse(value, common_pb2.NodeInfo())
        except json_format.ParseError:
            continue  # models_from_registrations logs it
        gpus[info.node_id] = info.gpu
    return gpus
