"""A steady load for fault tests: clients streaming requests back to back until stopped."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from baton.client import BatonClient
from baton.v1 import common_pb2
from tests.integration.conftest import MODEL


class SteadyLoad:
    """Clients streaming requests back to back through routers until stopped; every failure kept.

    A request fails unless it completes with all num_tokens tokens; with forbid_migrations, also
    if it moved off its first node (the fault should not have touched healthy nodes).
    """

    def __init__(self, addresses: Sequence[str], num_workers: int = 4, num_tokens: int = 24,
                 forbid_migrations: bool = False) -> None:
        self._addresses = list(addresses)
        self._num_workers = num_workers
        self._num_tokens = num_tokens
        self._forbid_migrations = forbid_migrations
        self._stop = asyncio.Event()
        self.num_completed = 0
        self.failures: list[str] = []
        self.prompts: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def _worker(self, worker: int) -> None:
        async with BatonClient(self._addresses) as client:
            number = 0
            while not self._stop.is_set():
                prompt = f"worker {worker} request {number % 5}: a prompt that repeats now and then"
                number += 1
                try:
                    result = await client.complete(MODEL, prompt, max_tokens=self._num_tokens, ignore_eos=True,
                                                   timeout_s=30)
                except grpc.aio.AioRpcError as error:
                    self.failures.append(f"{error.code().name}: {error.details()}")
                    continue
                if (result.finish_reason != common_pb2.FINISH_REASON_LENGTH
                        or len(result.token_ids) != self._num_tokens):
                    self.failures.append(f"incomplete: {result.finish_reason} {len(result.token_ids)} tokens")
                elif self._forbid_migrations and result.usage.num_migrations:
                    self.failures.append(f"moved off a healthy node: {result.node_ids}")
                self.prompts.append(prompt)
                self.num_completed += 1

    def start(self) -> None:
        async def run() -> None:
            await asyncio.gather(*(self._worker(i) for i in range(self._num_workers)))

        self._task = asyncio.create_task(run())

    async def wait_completed(self, count: int, timeout_s: float = 30) -> None:
        """Until count more requests have completed."""
        target = self.num_completed + count
        async with asyncio.timeout(timeout_s):
            while self.num_completed < target:
                assert self._task is not None and not self._task.done(), "the load stopped"
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task
