"""Container health check: exit 0 when this container's Baton service reports SERVING over gRPC health.

The port is the one in the container's BATON_<SERVICE>_LISTEN; an address given as the first
argument overrides it.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def own_address() -> str:
    for name, value in os.environ.items():
        if name.startswith("BATON_") and name.endswith("_LISTEN"):
            return "127.0.0.1:" + value.rpartition(":")[2]
    sys.exit("no BATON_<SERVICE>_LISTEN in the environment and no address given")


def main() -> int:
    address = sys.argv[1] if len(sys.argv) > 1 else own_address()
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as error:
            print(f"{address}: {error.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
