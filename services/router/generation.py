"""A generation as the router holds it: everything needed to resume it on another node. Pure."""

from __future__ import annotations

import array
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from baton.v1 import common_pb2, node_agent_pb2
from services.common.block_hash import block_hashes, salted_root
from services.common.errors import Unavailable
from services.common.failure_cause import FailureCause
from services.router.stop_text import StopText


class NodeFailure(Exception):
    """A node stopped serving this generation; it may continue elsewhere."""

    def __init__(self, node_id: str, cause: FailureCause, detail: str = "", heard: bool = True,
                 node_is_well: bool = False) -> None:
        super().__init__(f"node {node_id}: {cause.value}{': ' + detail if detail else ''}")
        self.node_id = node_id
        self.cause = cause
        # Whether the node said anything on the stream (it had the request): if not, the next node's prefill
        # computes nothing again.
        self.heard = heard
        # The node dropped the stream because this router did not answer its pings (frozen, or cut off): the
        # generation moves, but no placement need avoid the node.
        self.node_is_well = node_is_well


class TakeoverRefused(Exception):
    """A node runs another stream of this request's id (a frozen router's, say) that this attempt cannot take over:
    the node is well, and the generation may run elsewhere, with no move counted."""

    def __init__(self, node_id: str, detail: str) -> None:
        super().__init__(f"node {node_id}: {detail}")
        self.node_id = node_id
        self.detail = detail


@dataclass
class Generation:
    """One request's prompt, sampling and every completion token received so far."""

    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    generated: list[int] = field(default_factory=list)
    failures: list[NodeFailure] = field(default_factory=list)
    # Nodes that run another stream of its id and would not give it up to this one: avoided by this generation only.
    refusals: list[TakeoverRefused] = field(default_factory=list)
    # Context tokens prefilled again on the nodes this generation moved to.
    recomputed_tokens: int = 0
    # False once any node said its resumed run may differ from an uninterrupted one.
    is_exact: bool = True
    # GPU time spent on each node by the attempts that have ended (as of their last checkpoint).
    gpu_ms_by_node: dict[str, float] = field(default_factory=dict)
    # Models accepted instead of `model` until the first placement settles which one runs it.
    alternative_models: tuple[str, ...] = ()
    # The prefix-cache namespace of the request's tenant (empty: shared); see block_hash.salted_root.
    cache_salt: str = ""
    # Its client sent it again (the request carries `resume`): a node still running it gives it that stream's place.
    resent: bool = False
    # A node has taken it (the scheduler placed it at least once): the router's live reports name its tenant.
    placed: bool = False
    # Its stop strings, looked for in its text as it comes (None: it has none): the relay ends it at the first.
    stop_text: StopText | None = None
    # Since when (the event loop's clock) its placement has waited for a scheduler leader that answers, while it
    # waits between calls; None otherwise. A deadline that passes meanwhile names the wait (it cancels the
    # placement, so this stays).
    leader_wait_since: float | None = None

    def settle_model(self, model: str) -> None:
        """The scheduler chose model (empty: the request's own); every later attempt keeps to it."""
        if model:
            self.model = model
        self.alternative_models = ()

    @functools.cached_property
    def prompt_digest(self) -> int:
        """A digest of its own prompt's tokens and its cache salt, never 0: a resend of its id through any router
        (the same tokenizer makes the same tokens) has the same one, another request under that id another."""
        data = array.array("q", self.prompt_token_ids).tobytes() + b"\0" + self.cache_salt.encode()
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") or 1

    @property
    def context(self) -> list[int]:
        """What a node prefills to continue: the prompt and the completion so far."""
        return self.prompt_token_ids + self.generated

    @property
    def num_remaining(self) -> int:
        return self.sampling.max_tokens - len(self.generated)

    @property
    def num_migrations(self) -> int:
        return len(self.failures)

    def excluded_nodes(self, stalled_before: bool = True, stalled_last: bool = True) -> list[str]:
        """The nodes its next placement avoids: those that failed it and those that run another stream of its id and
        would not give it up. Without stalled_before, not a node that only stalled before its last failure (paused a
        moment, or slow on a loaded host: it may serve again); a node a failure of another cause left (its process
        gone, say) stays avoided. Without stalled_last too, not the node whose stall was its last failure either,
        if that was its first stall there.
        Failures of a frozen router (the node well) avoid nothing."""
        failures = [failure for failure in self.failures if not failure.node_is_well]
        if not stalled_before:
            earlier = [failure for failure in failures[:-1] if failure.cause is not FailureCause.STALLED]
            last = failures[-1:]
            if not stalled_last and last and last[0].cause is FailureCause.STALLED and sum(
                    f.node_id == last[0].node_id and f.cause is FailureCause.STALLED for f in failures) == 1:
                # Its first stall there: a node that stalled it twice (cut off, or dead but still listed, for up to
                # the leader's --load-timeout-s) is not given it a third time (helper-168).
                last = []
            failures = earlier + last
        return sorted({failure.node_id for failure in failures} | {refusal.node_id for refusal in self.refusals})

    def placement_asks(self, suspects: Iterable[str]) -> list[set[str]]:
        """The node sets its next placement excludes, in the order to ask while none is left: every node it avoids
        and the router's suspects (nodes that failed any stream lately); without the suspects; without the nodes
        that only stalled it before its last failure; without the one whose stall was its last failure (its first stall
        there). A later ask
        is worth making only when it adds a node. The last: a pause of a second or two of the only node serving its
        model (or the last one alive) ended every stream on it, the node healthy again half a second later
        (helper-167); each return to it is a move, within --max-migrations."""
        excluded = set(self.excluded_nodes())
        return [excluded | set(suspects), excluded, set(self.excluded_nodes(stalled_before=False)),
                set(self.excluded_nodes(stalled_before=False, stalled_last=False))]

    def failed_on(self, node_id: str) -> bool:
        """Whether node_id failed it before (not for a frozen router's sake)."""
        return any(failure.node_id == node_id and not failure.node_is_well for failure in self.failures)

    def context_block_hashes(self) -> list[int]:
        return block_hashes(self.context, parent_hash=salted_root(self.cache_salt))

    def node_request(self, taking_back: bool = False) -> node_agent_pb2.NodeGenerateRequest:
        """The request a node runs to continue from here (the whole request when nothing came yet). taking_back: the
        node failed it before, and may still hold that stream (frozen when it was given up): it gives this one its
        place, as to a resend."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_tokens = self.num_remaining
        return node_agent_pb2.NodeGenerateRequest(
            request_id=self.request_id,
            model=self.model,
            prompt_token_ids=self.context,
            sampling=sampling,
            num_resumed_tokens=len(self.generated),
            cache_salt=self.cache_salt,
            resent=self.resent or taking_back,
        )

    def record_failure(self, failure: NodeFailure, max_migrations: int) -> None:
        """Note a failed node; Unavailable, saying why, once the request may not move again."""
        self.failures.append(failure)
        if self.num_migrations > max_migrations:
            history = "; ".join(str(f) for f in self.failures)
            raise Unavailable(
                f"request {self.request_id}: migration limit of {max_migrations} reached ({history})"
            )

    def usage(self, node_usage: common_pb2.Usage) -> common_pb2.Usage:
        """The whole request's usage, given the finishing node's view of its part (every attempt's GPU
        time, the finishing one's included, already added with add_gpu_ms).

        cached_tokens is what that node found cached of the original prompt; recomputed_tokens
        what the nodes of every move prefilled again of the context they resumed from (added by the
        relay as each move's node reports it); gpu_ms is the GPU time on every
        node, failed attempts included (to their last checkpoint).
        """
        num_prompt = len(self.prompt_token_ids)
        return common_pb2.Usage(
            prompt_tokens=num_prompt,
            cached_tokens=min(node_usage.cached_tokens, num_prompt),
            completion_tokens=len(self.generated),
            num_migrations=self.num_migrations,
            recomputed_tokens=self.recomputed_tokens,
            gpu_ms=sum(self.gpu_ms_by_node.values()),
        )

    def add_gpu_ms(self, node_id: str, gpu_ms: float) -> None:
        """An attempt on node_id ended having used gpu_ms."""
        if gpu_ms:
            self.gpu_ms_by_node[node_id] = self.gpu_ms_by_node.get(node_id, 0.0) + gpu_ms
