"""`baton generate` without --model runs the model the cluster serves: on a vllm-only cluster the sim model's name,
its old default, got NOT_FOUND, though `baton up` suggests the bare command (helper-114)."""

from __future__ import annotations

import grpc
import pytest

from baton.cli import _SIM_MODEL, default_model
from baton.v1 import router_pb2


class _Client:
    def __init__(self, *served: str, error: bool = False) -> None:
        self.served, self.error = served, error

    async def list_models(self) -> list[router_pb2.ServedModel]:
        if self.error:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "no router answered")
        return [router_pb2.ServedModel(name=name) for name in self.served]


@pytest.mark.parametrize(("served", "model"), [
    (("tiny-llama",), "tiny-llama"),  # a vllm-only cluster
    ((_SIM_MODEL, "tiny-llama"), _SIM_MODEL),  # a mixed fleet: the sim model, as before
    (("b-model", "a-model"), "a-model"),
    ((), _SIM_MODEL),
])
async def test_without_model_it_runs_what_the_cluster_serves(served: tuple[str, ...], model: str) -> None:
    assert await default_model(_Client(*served)) == model  # type: ignore[arg-type]


async def test_with_no_router_answering_it_names_the_sim_model_and_the_call_says_why() -> None:
    assert await default_model(_Client(error=True)) == _SIM_MODEL  # type: ignore[arg-type]
