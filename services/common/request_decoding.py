"""Requests that cannot be decoded get INVALID_ARGUMENT naming the field, like any other bad input.

gRPC decodes a request before the servicer runs; when that fails (a string field that is not
UTF-8, or bytes that are no protobuf at all) it answers UNKNOWN with no Baton metadata, which a
client reads as the transport failing — the SDK would fail over to another router and send the same
bytes again. This interceptor makes the failure a status of Baton's own.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from services.common.errors import BatonError, InvalidArgument, abort

# Wire types of the protobuf encoding.
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class _Undecodable:
    """What the tolerant deserializer hands the handler in place of a request it could not decode."""

    def __init__(self, error: BatonError) -> None:
        self.error = error


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def bad_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> tuple[str, bytes, int] | None:
    """The first string field of the encoded message that is not UTF-8: its path (e.g. "stop[1]"),
    its bytes and the offset of the first bad byte; None if there is none or data is malformed."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == _VARINT:
                _, pos = _varint(data, pos)
            elif wire_type == _FIXED64:
                pos += 8
            elif wire_type == _FIXED32:
                pos += 4
            elif wire_type == _LENGTH_DELIMITED:
                length, pos = _varint(data, pos)
                value, pos = data[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                path = prefix + field.name
                if field.is_repeated:
                    counts[number] = counts.get(number, 0) + 1
                    path += f"[{counts[number] - 1}]"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        return path, value, exc.start
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = bad_utf8_field(value, field.message_type, path + ".")
                    if found is not None:
                        return found
            else:  # groups: not in Baton's protos
                return None
    except IndexError:
        return None
    return None


def _explain(data: bytes, deserialize: Callable[[bytes], Any], exc: Exception) -> BatonError:
    message_type = getattr(deserialize, "__self__", None)
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    if isinstance(descriptor, Descriptor):
        found = bad_utf8_field(data, descriptor)
        if found is not None:
            path, value, offset = found
            return InvalidArgument(path, value, f"not valid UTF-8 (byte {offset} of {len(value)}); text fields "
                                   "must be UTF-8")
        name = descriptor.full_name
    else:
        name = "the request message"
    return InvalidArgument("request", f"{len(data)} bytes", f"cannot be decoded as {name}: {exc}")


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's bad input
            return _Undecodable(_explain(data, deserialize, exc))

    return decode


def _guard_unary_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await abort(context, request.error)
        return await behavior(request, context)

    return handle


def _guard_unary_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await abort(context, request.error)
            async for response in behavior(request, context):
                yield response

        return stream
    return _guard_unary_unary(behavior)  # a coroutine that writes its responses with context.write


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """Undecodable requests to services named with prefix get INVALID_ARGUMENT with Baton's metadata."""

    def __init__(self, prefix: str = "/baton.") -> None:
        self._prefix = prefix

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(self._prefix)
                or handler.request_streaming or handler.request_deserializer is None):
            return handler
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=deserializer,
                                    unary_unary=_guard_unary_unary(handler.unary_unary))
        if handler.unary_stream is not None:
            return handler._replace(request_deserializer=deserializer,
                                    unary_stream=_guard_unary_stream(handler.unary_stream))
        return handler
