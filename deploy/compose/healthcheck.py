"""Container health check: exit 0 when this container's Baton service reports SERVING over gRPC health.

A router, node agent or kvindex is asked of its own gRPC service, which serves once it is in the cluster (a router
once it has read the nodes from etcd, a node agent or kvindex once it is registered there): asked of "" (the process
is up), a container that never reached etcd showed healthy (helper-175). A scheduler is asked of "": a standby's own
service does not serve, by design, and the standby is healthy.

The port is the one in the container's BATON_<SERVICE>_LISTEN; an address given as the first
argument overrides it. When the service serves TLS (BATON_<SERVICE>_TLS_CERT), the check speaks TLS
too: it checks the service's certificate against BATON_<SERVICE>_TLS_CA, by the host of
BATON_<SERVICE>_ADVERTISE when set (else 127.0.0.1), and shows the service's own certificate, which
an internal port with mutual TLS requires.
"""

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICES = ("ROUTER", "SCHEDULER", "KVINDEX", "NODE")
# The gRPC health name each is asked of.
CHECKED = {"ROUTER": "baton.v1.Router", "SCHEDULER": "", "KVINDEX": "baton.v1.KVIndex", "NODE": "baton.v1.NodeAgent"}


def own_prefix() -> str | None:
    """BATON_<SERVICE>_ of the service this container runs (the one whose --listen is set)."""
    return next((f"BATON_{service}_" for service in SERVICES if f"BATON_{service}_LISTEN" in os.environ), None)


def channel(address: str, prefix: str | None) -> grpc.Channel:
    """Plaintext, or TLS as the service's own BATON_<SERVICE>_TLS_* settings say."""
    setting = {name: os.environ.get(f"{prefix}{name}", "") if prefix else "" for name in ("TLS_CERT", "TLS_KEY",
                                                                                          "TLS_CA")}
    if not setting["TLS_CERT"]:
        return grpc.insecure_channel(address)
    ca = Path(setting["TLS_CA"]).read_bytes() if setting["TLS_CA"] else None
    key = Path(setting["TLS_KEY"]).read_bytes() if setting["TLS_KEY"] else None
    credentials = grpc.ssl_channel_credentials(ca, key, Path(setting["TLS_CERT"]).read_bytes() if key else None)
    advertised_host = os.environ.get(f"{prefix}ADVERTISE", "").rpartition(":")[0]
    options = [("grpc.ssl_target_name_override", advertised_host)] if advertised_host else []
    return grpc.secure_channel(address, credentials, options=options)


def main() -> int:
    prefix = own_prefix()
    if len(sys.argv) > 1:
        address = sys.argv[1]
    elif prefix is None:
        sys.exit("no BATON_<SERVICE>_LISTEN in the environment and no address given")
    else:
        address = "127.0.0.1:" + os.environ[f"{prefix}LISTEN"].rpartition(":")[2]
    with channel(address, prefix) as opened:
        try:
            checked = CHECKED[prefix.split("_")[1]] if prefix else ""
            reply = health_pb2_grpc.HealthStub(opened).Check(health_pb2.HealthCheckRequest(service=checked),
                                                             timeout=2)
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name} {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
