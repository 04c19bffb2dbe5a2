"""The reconnect backoff of every channel Baton opens: to etcd and to its peers."""

from __future__ import annotations

# etcd and every Baton service come back at the address they had: a channel reconnects within about
# a second of its peer answering again, not after gRPC's default backoff, which grows 1.6-fold to two
# minutes. Only the backoff is shortened. grpc.min_reconnect_backoff_ms, despite its name, is the
# time one connection attempt may take (20 s by default); at 200 ms, a TLS handshake with a peer on
# a busy host could time out on every attempt and never connect.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
