"""Server bootstrap shared by every service: health, reflection, tracing, signals, ordered shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from services.common.change_signal import ChangeSignal
from services.common.reconnect import SERVER_KEEPALIVE_OPTIONS
from services.common.request_decoding import RequestDecodingInterceptor
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)


class MethodAwarePool:
    """The descriptor pool server reflection reads, that also finds the file of a method's full name
    (`baton.v1.Router.Generate`): protobuf's pool finds services and messages only, so `grpcurl describe` of a
    method failed with "Symbol not found". Everything else is the pool's own."""

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:  # noqa: N802 (the pool's own name)
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service_name, _, method = symbol.rpartition(".")
            with contextlib.suppress(KeyError):
                service = self._pool.FindServiceByName(service_name)
                if method in service.methods_by_name:
                    return service.file
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


# grpcio-reflection serves only grpc.reflection.v1alpha; clients such as `buf curl` and newer grpcurl ask for v1
# first. The two protocols are the same messages under another package, so v1 is served by the same servicer.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Put grpc/reflection/v1/reflection.proto in pool (v1alpha's file under v1's package), so that reflection
    can describe its own v1 service; a no-op when it is there."""
    alpha = reflection_pb2.DESCRIPTOR
    with contextlib.suppress(KeyError):
        pool.FindFileByName("grpc/reflection/v1/reflection.proto")
        return
    proto = descriptor_pb2.FileDescriptorProto()
    alpha.CopyToProto(proto)
    old, new = f".{alpha.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:  # set only on message fields (an empty one would count as set)
                field.type_name = field.type_name.replace(old, new, 1)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new, 1)
        method.output_type = method.output_type.replace(old, new, 1)
    pool.Add(proto)


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Server reflection, v1 and v1alpha, over the default pool (the same wire messages answer both)."""
    pool = descriptor_pool.Default()
    _add_reflection_v1_descriptor(pool)
    servicer = reflection.aio.ReflectionServicer(
        (*service_names, reflection.SERVICE_NAME, REFLECTION_V1), pool=MethodAwarePool(pool))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
    }),))


class ServingNames:
    """Which of a service's gRPC names serve now, beyond its process being up (what the name "" says): `serve`
    publishes them on gRPC health, SERVING or NOT_SERVING, as they change. A name never set serves."""

    def __init__(self, not_serving: Sequence[str] = ()) -> None:
        self._not_serving = set(not_serving)
        self.changed = ChangeSignal()

    def serving(self, name: str) -> bool:
        return name not in self._not_serving

    def set(self, name: str, serving: bool) -> None:
        if serving != self.serving(name):
            (self._not_serving.discard if serving else self._not_serving.add)(name)
            self.changed.notify()


async def serve_once(health: ServingNames, name: str, *ready: asyncio.Event) -> None:
    """Publish name as serving once every one of ready is set (a node agent's first registration in etcd; a
    kvindex's, and its catch-up on the nodes: a container that never reached etcd showed healthy, helper-175)."""
    for event in ready:
        await event.wait()
    health.set(name, True)


class Service(Protocol):
    """What a process plugs into `serve`."""

    #: Full gRPC service names, for health and reflection, e.g. "baton.v1.Router".
    service_names: Sequence[str]
    #: Which of service_names serve now (a scheduler's, only while it leads).
    health: ServingNames

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicers to server."""

    def background(self) -> Sequence[Coroutine[Any, Any, None]]:
        """Loops that run while the server serves; one dying stops the process."""

    async def before_stop(self) -> None:
        """Stop taking new work (deregister, resign); in-flight RPCs still run after this."""

    async def close(self) -> None:
        """Release clients and channels, after the server has stopped."""


class _CrossContextDetach(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" for a token made in another context: the gRPC
    instrumentation's span of a streaming call ends in the task that closes the stream (a client gone, a stream moved
    on), not the one that began it. Nothing is lost by it, yet it logged an ERROR with a traceback on normal
    cancellations, which hid real errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.msg == "Failed to detach context" and isinstance(error, ValueError)
                    and "different Context" in str(error))


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("opentelemetry.context").addFilter(_CrossContextDetach())


async def _publish_health(health_servicer: health.aio.HealthServicer, service: Service) -> None:
    for name in service.service_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING if service.health.serving(name)
                                  else health_pb2.HealthCheckResponse.NOT_SERVING)


async def _keep_health(health_servicer: health.aio.HealthServicer, service: Service, changed: asyncio.Event) -> None:
    """Publish service's names again at each change, from changed (taken before the last publishing) on."""
    while True:
        await changed.wait()
        changed = service.health.changed.since_now()
        await _publish_health(health_servicer, service)


async def serve(
    service: Service,
    listen: str,
    telemetry: Telemetry,
    grace_s: float = 10.0,
    started: asyncio.Event | None = None,
    credentials: grpc.ServerCredentials | None = None,
    options: Sequence[tuple[str, int]] = (),
) -> int:
    """Serve until SIGTERM/SIGINT, then shut down in order; returns the process exit code.

    With credentials the port speaks TLS only (ServiceConfig.server_credentials), else plaintext; options are the
    gRPC server's own, beside Baton's keepalive policy."""
    # Decoding innermost: the trace records the INVALID_ARGUMENT an undecodable request gets.
    # No SO_REUSEPORT (gRPC's default): a second process on a port in use must fail, not silently
    # take half of the first one's connections.
    server = grpc.aio.server(interceptors=[*telemetry.server_interceptors(), RequestDecodingInterceptor()],
                             options=[("grpc.so_reuseport", 0), *SERVER_KEEPALIVE_OPTIONS, *options])
    service.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (*service.service_names, health.SERVICE_NAME))
    try:
        port = server.add_secure_port(listen, credentials) if credentials is not None \
            else server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        log.error("cannot bind %s: the address is in use or not this host's", listen)
        await service.close()
        return 2
    try:
        telemetry.serve_metrics()
    except OSError as exc:
        log.error("cannot serve metrics on %s: %s", telemetry.metrics_listen, exc)
        await service.close()
        telemetry.shutdown()
        return 2
    await server.start()

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    exit_code = 0
    try:
        async with asyncio.TaskGroup() as tasks:
            loops = [tasks.create_task(coro) for coro in service.background()]
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            changed = service.health.changed.since_now()
            await _publish_health(health_servicer, service)
            loops.append(tasks.create_task(_keep_health(health_servicer, service, changed)))
            log.info("serving %s on %s", ", ".join(service.service_names), listen)
            if telemetry.metrics_listen:
                log.info("Prometheus metrics on http://%s/metrics", telemetry.metrics_listen)
            if started is not None:
                started.set()
            await stopping.wait()
            log.info("shutting down")
            await health_servicer.enter_graceful_shutdown()
            await service.before_stop()
            await server.stop(grace_s)
            for task in loops:
                task.cancel()
    except* Exception:
        log.exception("a background loop failed; stopping")
        exit_code = 1
        await server.stop(0)
    finally:
        await service.close()
        telemetry.shutdown()
    return exit_code
