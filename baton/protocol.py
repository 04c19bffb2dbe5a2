"""Conventions of Baton's wire contract beyond the protos: metadata keys clients rely on."""

import grpc

# Trailing metadata on every status a Baton service returns on purpose. A client that gets a
# failure without it knows the failure came from the transport (e.g. a router that died).
ORIGIN_KEY = "baton-origin"
# Trailing metadata on RESOURCE_EXHAUSTED: milliseconds after which a retry may succeed.
RETRY_AFTER_KEY = "retry-after-ms"
# Trailing metadata on a standby scheduler's refusal: the leader's address.
LEADER_KEY = "baton-leader"
# Trailing metadata on a node's UNAVAILABLE for a resume of a request id it runs in another stream, one that resume
# cannot take over (docs/resume.md): the node's id. The node has not failed, and the resume may run on another node.
STREAM_HELD_KEY = "baton-stream-held"
# Trailing metadata on a node's UNAVAILABLE for a stream it hands on as its shutdown grace ends (SIGTERM, draining;
# --shutdown-grace-s): the node's id. Its router moves the stream with the cause "drained", not "stream_broken".
DRAINED_KEY = "baton-drained"
# Most request ids a router sends in one Scheduler/ReportLiveRequests (it splits a longer list over several): well
# under gRPC's 4 MiB message limit at 257 characters each (a tenant's name and its request id, each at most the
# routers' --max-id-len of 128). The scheduler's --max-live-ids is at least this.
LIVE_IDS_PER_REPORT = 10_000
# The tenant of a request that names none, as admission counts it and the routers report it.
DEFAULT_TENANT = "default"
# Most models a request may accept instead of its own (GenerateRequest and PlaceRequest alternative_models).
MAX_ALTERNATIVE_MODELS = 16


def is_baton_status(error: grpc.aio.AioRpcError) -> bool:
    """The status is one a Baton service returned on purpose (it says so in ORIGIN_KEY)."""
    return any(key == ORIGIN_KEY for key, _ in (error.trailing_metadata() or ()))


def is_transport_failure(error: grpc.aio.AioRpcError) -> bool:
    """The peer went away (crash, network) rather than answering with a status of its own."""
    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                            grpc.StatusCode.INTERNAL):
        return False
    return not is_baton_status(error)
# Request metadata carrying a tenant's API key, as HTTP carries it: "authorization: Bearer <key>".
AUTHORIZATION_KEY = "authorization"
