"""An aetcd client that talks to etcd over TLS (aetcd 1.0.0 builds only plaintext channels)."""

from __future__ import annotations

from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from services.common.timeouts import within


class TlsEtcdClient(aetcd.Client):
    """aetcd.Client whose channel is a TLS one: etcd's certificate checked against a CA, and a client
    certificate shown when etcd runs with --client-cert-auth.

    connect() is aetcd 1.0.0's own (pinned in pyproject.toml) with a secure channel in place of the
    plaintext one, and without username/password authentication, which Baton does not use.
    """

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await within(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = grpc.aio.secure_channel(target, self._credentials, options=list(self._options.items()))
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False
