"""A process is registered once a key of its lease session is written, however the write came about."""

from __future__ import annotations

import asyncio
import types

import pytest

from services.common import etcd_session
from services.common.etcd_session import LeaseSession


class _Etcd:
    """A lease is granted; the first put fails (etcd went away between the two), later ones are taken."""

    def __init__(self) -> None:
        self.puts = 0

    async def lease(self, ttl_s: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(id=7)

    async def put(self, key: bytes, value: bytes, lease: int) -> None:
        self.puts += 1
        if self.puts == 1:
            raise ConnectionError("etcd went away")

    async def refresh_lease(self, lease_id: int, ttl_s: float | None = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(TTL=3)


async def test_a_registration_whose_first_write_failed_after_its_grant_counts_once_keep_alive_writes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_alive wrote the key again and the node was in the fleet, but `registered` stayed unset, so its health (and
    its compose container) said NOT_SERVING for good (helper-177)."""
    etcd = _Etcd()
    session = LeaseSession(etcd, ttl_s=3)  # type: ignore[arg-type]
    await session.put("/baton/nodes/n1", b"{}")
    assert etcd.puts == 1 and not session.registered.is_set()
    rounds = 0

    async def one_round(seconds: float) -> None:
        nonlocal rounds
        rounds += 1
        if rounds > 1:
            raise asyncio.CancelledError

    monkeypatch.setattr(etcd_session.asyncio, "sleep", one_round)
    with pytest.raises(asyncio.CancelledError):
        await session.keep_alive()
    assert etcd.puts == 2 and session.registered.is_set()
