"""Conventions of Baton's wire contract beyond the protos: metadata keys clients rely on."""

# Trailing metadata on every status a Baton service returns on purpose. A client that gets a
# failure without it knows the failure came from the transport (e.g. a router that died).
ORIGIN_KEY = "baton-origin"
# Trailing metadata on RESOURCE_EXHAUSTED: milliseconds after which a retry may succeed.
RETRY_AFTER_KEY = "retry-after-ms"
