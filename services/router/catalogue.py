"""The models the cluster serves, derived from node registrations."""

from __future__ import annotations

from baton.v1 import common_pb2
from services.common.node_registration import parse_node_info
from services.router.validation import ModelEntry


def models_from_registrations(items: dict[str, bytes], lapsed: frozenset[str] = frozenset()) -> dict[str, ModelEntry]:
    """One entry per model name, counting the nodes where it is warm; lapsed registrations (held
    for their grace period) and draining nodes keep a model served but count no warm node. Its context is the
    largest any node registers, as the scheduler takes it (one node registering 0 made the router refuse every
    request for the model, helper-181); its tokenizer and vocabulary the first node's, in node-id order."""
    entries: dict[str, ModelEntry] = {}
    for key, value in sorted(items.items()):
        info = parse_node_info(key, value)
        if info is None:
            continue
        for model in info.models:
            known = entries.get(model.name)
            counts = model.is_warm and key not in lapsed and not info.draining
            warm = (known.num_warm_nodes if known else 0) + int(counts)
            entries[model.name] = ModelEntry(
                name=model.name,
                max_context_tokens=max(model.max_context_tokens, known.max_context_tokens if known else 0),
                tokenizer=known.tokenizer if known else model.tokenizer,
                vocab_size=known.vocab_size if known else model.vocab_size,
                num_warm_nodes=warm,
            )
    return entries


def registrations(items: dict[str, bytes]) -> dict[str, common_pb2.NodeInfo]:
    """Each registered node's registration (its GPU generation, its price), by node id."""
    infos: dict[str, common_pb2.NodeInfo] = {}
    for key, value in items.items():
        info = parse_node_info(key, value, quiet=True)  # models_from_registrations logs it
        if info is not None:
            infos[info.node_id] = info
    return infos
