"""A router's wait for the tenant keys, within what is left of a call."""

from __future__ import annotations

import aetcd
import pytest

from services.common.errors import Unavailable
from services.common.tenant_directory import TenantDirectory

pytestmark = pytest.mark.timeout(10)


async def test_keys_read_long_ago_serve_a_call_with_no_time_left_to_wait() -> None:
    """The wait is bounded by what is left of the call: with nothing left, keys read long ago refused the call as
    if unread, "tenant keys not read from etcd within 0.0 s" (helper-140)."""
    directory = TenantDirectory(aetcd.Client(host="127.0.0.1", port=1))
    with pytest.raises(Unavailable, match="tenant keys not read from etcd within 0.0 s"):
        await directory.ready(0.0)  # not read yet
    directory._view.synced.set()  # as its first listing does
    await directory.ready(0.0)
