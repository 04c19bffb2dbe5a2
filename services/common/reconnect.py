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

# A client's streams through a router: HTTP/2 pings while a call is open, so a router that is frozen (SIGSTOP, a
# paused VM) or cut off without a reset fails its calls within about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS and the
# client resumes through another router; without them it waited as long as the freeze. A live process answers
# pings in gRPC's transport, whatever its Python code is doing (a router holding the GIL for 15 s was not failed over).
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 4000
CLIENT_KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    # A ping of gRPC's own (its flow-control probe) unanswered by a frozen router held back every keepalive ping, so
    # the keepalive timeout never ran: any ping unanswered for that long fails the connection.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
# A client's connection attempts to a router: one to a frozen router (its kernel accepts the connection, its gRPC
# never answers) took gRPC's 20 s default before it failed and the client tried the next router, so a call to a
# healthy second router waited 20 s behind a frozen first one (helper-176). Given up as a frozen open connection
# is, within about KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS. (grpc.min_reconnect_backoff_ms is the time one
# attempt may take: RECONNECT_OPTIONS.)
CLIENT_CONNECT_OPTIONS = (
    ("grpc.min_reconnect_backoff_ms", KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS),
)
# What a Baton server lets its clients ping that often while it sends nothing: by default gRPC's servers take pings
# more often than every 5 minutes without data as abuse and answer with GOAWAY (too_many_pings), which failed a
# stream quiet for 12 s (a long prefill, a wait in the admission queue) at about 6 s. More often is still abuse.
SERVER_KEEPALIVE_OPTIONS = (
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
)

# A node agent pings its callers too, while a call is open: a router frozen or cut off without a reset kept its
# streams' generations running on the GPU (its client resumed through another router within about 6 s, and when
# the resume landed on another node both ran, until the frozen router woke or the generation ended). Within about
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS of the freeze the node now drops the connection, which cancels them.
SERVER_PINGS_CALLERS_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # a stream quiet in a long prefill is pinged too
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
