"""The etcd key layout (see docs/etcd.md)."""

PREFIX = "/baton/"
NODES = PREFIX + "nodes/"
SERVICES = PREFIX + "services/"
# Scheduler candidates queue here; the lowest create revision leads.
SCHEDULER_ELECTION = PREFIX + "election/scheduler/"
# What a scheduler leader hands its successor; written only under its leadership (fenced).
SCHEDULER_STATE = PREFIX + "scheduler/state"
# One JSON record per tenant: its API keys (hashed), limits, weight and cache group (services/common/auth.py).
TENANTS = PREFIX + "tenants/"


def node_key(node_id: str) -> str:
    return NODES + node_id


def service_prefix(kind: str) -> str:
    """Prefix under which every instance of a service kind ("scheduler", "kvindex", "router") registers."""
    return f"{SERVICES}{kind}/"


def service_key(kind: str, instance_id: str) -> str:
    return service_prefix(kind) + instance_id


def tenant_key(tenant: str) -> str:
    return TENANTS + tenant
