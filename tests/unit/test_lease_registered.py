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


async def _keep_alive_waits(session: LeaseSession, monkeypatch: pytest.MonkeyPatch, rounds: int) -> list[float]:
    """The waits of session's keep-alive over rounds rounds: it is stopped as the wait after the last begins."""
    waits: list[float] = []

    async def counted(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) > rounds:
            raise asyncio.CancelledError

    monkeypatch.setattr(etcd_session.asyncio, "sleep", counted)
    with pytest.raises(asyncio.CancelledError):
        await session.keep_alive()
    return waits


async def test_a_registration_whose_first_write_failed_after_its_grant_counts_once_keep_alive_writes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_alive wrote the key again and the node was in the fleet, but `registered` stayed unset, so its health (and
    its compose container) said NOT_SERVING for good (helper-177)."""
    etcd = _Etcd()
    session = LeaseSession(etcd, ttl_s=3)  # type: ignore[arg-type]
    await session.put("/baton/nodes/n1", b"{}")
    assert etcd.puts == 1 and not session.registered.is_set()
    await _keep_alive_waits(session, monkeypatch, rounds=1)
    assert etcd.puts == 2 and session.registered.is_set()


class _UnreadableEtcd(_Etcd):
    """Takes every put and keeps the lease alive, but answers no read."""

    async def put(self, key: bytes, value: bytes, lease: int) -> None:
        self.puts += 1

    async def get(self, key: bytes) -> None:
        raise ConnectionError("etcd read timed out")


async def test_keys_that_could_not_be_checked_while_the_lease_lives_are_not_a_keep_alive_failure(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each keep-alive reads the session's keys back (a process that took one over may have gone). A read that
    failed while the refresh worked was said as "keep-alive failed", and the live lease was refreshed every 0.2 s
    (helper-198): it is said as what it is, and checked again at the next keep-alive, a third of the TTL on."""
    session = LeaseSession(_UnreadableEtcd(), ttl_s=3)  # type: ignore[arg-type]
    await session.put("/baton/nodes/n1", b"{}")
    with caplog.at_level("WARNING"):
        waits = await _keep_alive_waits(session, monkeypatch, rounds=3)
    assert waits == [1.0, 1.0, 1.0, 1.0]
    said = [r.getMessage() for r in caplog.records]
    assert any("kept alive, but its keys could not be checked" in m for m in said)
    assert not any("keep-alive failed" in m for m in said)


class _DeletedEtcd(_UnreadableEtcd):
    """Reads answer that the session's key was deleted; its first put back fails."""

    transactions = types.SimpleNamespace(put=lambda *args, **kwargs: None)

    def __init__(self) -> None:
        super().__init__()
        self.put_backs = 0

    async def get(self, key: bytes) -> None:
        return None

    async def transaction(self, compare: object, success: object, failure: object) -> tuple[bool, None]:
        self.put_backs += 1
        if self.put_backs == 1:
            raise ConnectionError("etcd write timed out")
        return True, None


async def test_a_key_whose_put_back_fails_is_put_back_again_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the reads of the check are not the keep-alive's failure: a key another process deleted, whose put back
    failed, was retried a third of the TTL later, out of the fleet meanwhile (helper-204)."""
    monkeypatch.setattr(etcd_session, "_LeaseOf", lambda key: types.SimpleNamespace(__eq__=lambda self, other: True))
    etcd = _DeletedEtcd()
    session = LeaseSession(etcd, ttl_s=9)  # type: ignore[arg-type]
    await session.put("/baton/nodes/n1", b"{}")
    waits = await _keep_alive_waits(session, monkeypatch, rounds=2)
    assert waits == [3.0, etcd_session.QUICK_RETRY_S, 3.0] and etcd.put_backs == 2
