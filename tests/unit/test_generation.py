"""The router's view of one generation: what a node is asked to continue, when it may move, its usage."""

from __future__ import annotations

import grpc
import pytest

from baton.v1 import common_pb2
from services.common.errors import BatonError, Unavailable
from services.router.generation import FailureCause, Generation, NodeFailure

PROMPT = [10, 11, 12, 13, 14]


def _sampling(**fields: object) -> common_pb2.SamplingParams:
    """Seeded sampling of 8 tokens with one stop sequence, fields overridden."""
    fields = {
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 1234,
        "max_tokens": 8,
        "stop": [common_pb2.TokenSequence(token_ids=[33, 34])],
        "ignore_eos": True,
    } | fields
    return common_pb2.SamplingParams(**fields)


def _generation(generated: list[int] | None = None, **sampling: object) -> Generation:
    return Generation(
        request_id="req-1",
        model="m",
        prompt_token_ids=list(PROMPT),
        sampling=_sampling(**sampling),
        generated=list(generated or []),
    )


# --- context and the node request --------------------------------------------------------------


def test_context_is_the_prompt_then_the_tokens_received() -> None:
    generation = _generation([97, 98, 99])
    assert generation.context == PROMPT + [97, 98, 99]
    assert generation.num_remaining == 5


def test_a_fresh_generation_asks_a_node_for_the_whole_request() -> None:
    generation = _generation()
    request = generation.node_request()
    assert (request.request_id, request.model) == ("req-1", "m")
    assert list(request.prompt_token_ids) == PROMPT
    assert request.sampling == _sampling()
    assert request.num_resumed_tokens == 0


def test_a_resumed_node_request_carries_the_context_and_only_the_remaining_tokens() -> None:
    generation = _generation([97, 98, 99])
    request = generation.node_request()
    assert list(request.prompt_token_ids) == PROMPT + [97, 98, 99]
    assert request.num_resumed_tokens == 3
    assert request.sampling.max_tokens == 5
    # Everything else that decides the tokens is unchanged, so the continuation is identical.
    assert request.sampling.HasField("seed")
    assert request.sampling.seed == 1234
    assert request.sampling.temperature == pytest.approx(0.7)
    assert request.sampling.top_p == pytest.approx(0.9)
    assert [list(stop.token_ids) for stop in request.sampling.stop] == [[33, 34]]
    assert request.sampling.ignore_eos


def test_node_request_leaves_the_generations_own_sampling_alone() -> None:
    generation = _generation([97, 98, 99])
    request = generation.node_request()
    request.sampling.max_tokens = 1
    request.sampling.stop.add(token_ids=[1])
    assert generation.sampling == _sampling()
    assert generation.sampling.max_tokens == 8


def test_greedy_node_request_stays_unseeded() -> None:
    generation = Generation("r", "m", list(PROMPT), common_pb2.SamplingParams(max_tokens=4), [97])
    request = generation.node_request()
    assert not request.sampling.HasField("seed")
    assert request.sampling.max_tokens == 3


# --- failures and migrations --------------------------------------------------------------------


def test_failures_within_the_limit_are_recorded_without_error() -> None:
    generation = _generation([97])
    generation.record_failure(NodeFailure("n1", FailureCause.STALLED), max_migrations=2)
    generation.record_failure(NodeFailure("n2", FailureCause.STREAM_BROKEN), max_migrations=2)
    assert generation.num_migrations == 2


def test_one_failure_beyond_the_limit_is_unavailable_naming_the_limit_and_each_failure() -> None:
    generation = _generation([97])
    generation.record_failure(NodeFailure("n1", FailureCause.STALLED, "after 0.20s silent"), max_migrations=1)
    with pytest.raises(Unavailable) as caught:
        generation.record_failure(NodeFailure("n2", FailureCause.LEASE_EXPIRED), max_migrations=1)
    error = caught.value
    assert isinstance(error, BatonError)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    message = str(error)
    assert "req-1" in message
    assert "migration limit of 1" in message
    assert "node n1: stalled: after 0.20s silent" in message
    assert "node n2: lease_expired" in message


def test_with_no_migrations_allowed_the_first_failure_is_unavailable() -> None:
    generation = _generation()
    with pytest.raises(Unavailable, match="migration limit of 0") as caught:
        generation.record_failure(NodeFailure("n1", FailureCause.CONNECT_FAILED), max_migrations=0)
    assert "node n1: connect_failed" in str(caught.value)


def test_excluded_nodes_lists_each_failed_node_once() -> None:
    generation = _generation()
    assert generation.excluded_nodes() == []
    for node_id in ("n2", "n1", "n2"):
        generation.record_failure(NodeFailure(node_id, FailureCause.STREAM_BROKEN), max_migrations=5)
    assert sorted(generation.excluded_nodes()) == ["n1", "n2"]
    assert len(generation.excluded_nodes()) == 2


def test_the_last_asks_of_a_move_avoid_only_the_nodes_whose_stream_broke_and_the_last_failed_one_unless_it_stalled(
) -> None:
    """Its placement asks: every avoided node and the suspects, then without the suspects, then without the nodes
    that only stalled it before its last failure, then without the one whose stall was its last failure. A frozen
    router's failure (the node well) is no node's: the one that failed it before that stays avoided (helper-155)."""
    generation = _generation()
    for node_id, cause, well in (("a", FailureCause.STALLED, False), ("b", FailureCause.STREAM_BROKEN, False),
                                 ("c", FailureCause.STALLED, False), ("d", FailureCause.STALLED, True)):
        generation.record_failure(NodeFailure(node_id, cause, node_is_well=well), max_migrations=5)
    assert generation.placement_asks({"s"}) == [{"a", "b", "c", "s"}, {"a", "b", "c"}, {"b", "c"}, {"b"}]
    assert generation.failed_on("a") and not generation.failed_on("d")
    generation.record_failure(NodeFailure("a", FailureCause.STREAM_BROKEN), max_migrations=5)
    assert generation.placement_asks(set())[2:] == [{"a", "b"}, {"a", "b"}]  # its last failure no stall: avoided


def test_a_node_that_stalled_a_stream_twice_is_not_given_it_back_a_third_time() -> None:
    """A node cut off, or dead but still listed by the leader (up to its --load-timeout-s), stalls every stream
    given back to it: each return is a move and a unit of the cluster's retry budget (helper-168)."""
    generation = _generation()
    generation.record_failure(NodeFailure("a", FailureCause.STALLED), max_migrations=5)
    assert generation.placement_asks(set())[-1] == set()  # its first stall there: it may take it back
    generation.record_failure(NodeFailure("a", FailureCause.STALLED), max_migrations=5)
    assert generation.placement_asks(set())[-1] == {"a"}


# --- usage --------------------------------------------------------------------------------------


def test_usage_counts_the_original_prompt_and_every_generated_token() -> None:
    generation = _generation([97, 98, 99, 100])
    generation.record_failure(NodeFailure("n1", FailureCause.STALLED), max_migrations=3)
    generation.recomputed_tokens = 6
    generation.add_gpu_ms("n1", 30.0)  # the failed attempt, to its last checkpoint
    generation.add_gpu_ms("n2", 12.5)  # the finishing one
    # The finishing node saw the context as its prompt and only its own part of the completion.
    node_usage = common_pb2.Usage(prompt_tokens=8, cached_tokens=4, completion_tokens=1, gpu_ms=12.5)
    usage = generation.usage(node_usage)
    assert usage == common_pb2.Usage(
        prompt_tokens=5, cached_tokens=4, completion_tokens=4, num_migrations=1, recomputed_tokens=6, gpu_ms=42.5
    )


def test_usage_caps_cached_tokens_at_the_original_prompt() -> None:
    generation = _generation([97, 98, 99, 100])
    # The node found the whole prompt and part of the earlier completion cached.
    usage = generation.usage(common_pb2.Usage(prompt_tokens=9, cached_tokens=8, completion_tokens=1))
    assert usage.cached_tokens == len(PROMPT)
    assert usage.prompt_tokens == len(PROMPT)


def test_usage_of_an_unmoved_generation_is_the_nodes_own() -> None:
    generation = _generation([97, 98])
    usage = generation.usage(common_pb2.Usage(prompt_tokens=5, cached_tokens=0, completion_tokens=2))
    assert usage == common_pb2.Usage(prompt_tokens=5, cached_tokens=0, completion_tokens=2)
