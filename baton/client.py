"""A small Python client for Baton's router, over the generated stubs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from baton.v1 import router_pb2, router_pb2_grpc


class BatonClient:
    """Streams completions from a router."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(
        self,
        model: str,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        timeout_s: float | None = None,
        **fields: object,
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        """Chunks as the router relays them; other GenerateRequest fields go in **fields."""
        request = router_pb2.GenerateRequest(model=model, **fields)
        if prompt is not None:
            request.prompt = prompt
        if prompt_token_ids is not None:
            request.prompt_token_ids.ids.extend(prompt_token_ids)
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def complete(self, model: str, prompt: str | None = None, **kwargs: object) -> Completion:
        """The whole completion at once."""
        result = Completion()
        async for chunk in self.generate(model, prompt, **kwargs):
            result.add(chunk)
        return result

    async def list_models(self) -> list[router_pb2.ServedModel]:
        reply = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=5.0)
        return list(reply.models)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> BatonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Completion:
    """A whole streamed completion, assembled from its chunks."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.node_ids: list[str] = []
        self.finish_reason = 0
        self.usage = router_pb2.GenerateChunk().usage
        self.num_chunks = 0

    def add(self, chunk: router_pb2.GenerateChunk) -> None:
        if chunk.index != len(self.token_ids):
            raise ValueError(f"chunk index {chunk.index} but {len(self.token_ids)} tokens received")
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.num_chunks += 1
        if chunk.node_id and (not self.node_ids or self.node_ids[-1] != chunk.node_id):
            self.node_ids.append(chunk.node_id)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage
