"""The cluster's tenants as etcd holds them, kept current by a watch: what routers and schedulers
authenticate against (revoking a key takes effect as soon as the watch delivers it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import aetcd

from services.common import etcd_keys
from services.common.auth import TenantKeys, TenantRecord
from services.common.errors import Unavailable, shown
from services.common.etcd_session import PrefixView
from services.common.timeouts import within

log = logging.getLogger(__name__)


class TenantDirectory:
    """A live TenantKeys over /baton/tenants/; run() keeps it current."""

    def __init__(self, client: aetcd.Client,
                 on_change: Callable[[TenantKeys], None] | None = None) -> None:
        self.keys = TenantKeys()
        self._on_change = on_change
        self._view = PrefixView(client, etcd_keys.TENANTS, self._changed)

    async def run(self) -> None:
        await self._view.run()

    def _changed(self, items: dict[str, bytes]) -> None:
        self.keys = TenantKeys.from_etcd_items(items)
        skipped = sorted(key for key in items if key.removeprefix(etcd_keys.TENANTS) not in self.keys.records)
        if skipped:  # named, as `baton tenants list` names them with why (a count alone said which to no one)
            log.warning("%d records under %s are not tenant records at their own key, and their keys are refused: "
                        "%s (`baton tenants list` says why)", len(skipped), etcd_keys.TENANTS,
                        ", ".join(shown(key) for key in skipped[:5]) + (", ..." if len(skipped) > 5 else ""))
        if self._on_change is not None:
            self._on_change(self.keys)

    async def ready(self, timeout_s: float) -> None:
        """Return once the records have been read from etcd; Unavailable after timeout_s (a key checked
        against no records would be refused as unknown)."""
        if self._view.synced.is_set():  # read long ago: no wait, whatever is left of the call
            return
        try:
            await within(self._view.synced.wait(), timeout_s)
        except TimeoutError:
            raise Unavailable(f"tenant keys not read from etcd within {timeout_s:.1f} s; retry") from None

    def tenant_from_key(self, key: str) -> TenantRecord:
        """The tenant of a valid API key; Unauthenticated naming what is wrong (never echoing the key)."""
        return self.keys.tenant_from_key(key)

    def tenant_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> TenantRecord:
        """The tenant of a gRPC call, from its `authorization: Bearer <key>` metadata."""
        return self.keys.tenant_from_metadata(metadata)

    def tenant_from_authorization(self, value: str | None) -> TenantRecord:
        """For an HTTP front end: the `Authorization` header's value -> the tenant (Unauthenticated: 401)."""
        return self.keys.tenant_from_authorization(value)
