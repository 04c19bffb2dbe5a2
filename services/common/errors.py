"""Domain errors, mapped to gRPC status codes once, at the servicer boundary."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from baton.protocol import DRAINED_KEY, ORIGIN_KEY, RETRY_AFTER_KEY, STREAM_HELD_KEY

# Longest status message sent: a status travels in trailing metadata, whose size gRPC limits (8 KiB
# by default); past that the client gets RESOURCE_EXHAUSTED in place of the real status.
MAX_MESSAGE_CHARS = 2000


def shown(value: Any, limit: int = 80) -> str:
    """repr(value), cut to about limit characters: for echoing client input in a message. A null or a boolean in
    JSON's spelling (null, true, false), as a client wrote it in JSON or protobuf's JSON form."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    text = _short_repr(value, limit)
    if len(text) <= limit:
        return text
    if isinstance(value, str | bytes):
        size = f"{len(value)} {'bytes' if isinstance(value, bytes) else 'characters'}"
    elif isinstance(value, list | tuple | dict):
        size = f"{len(value)} items"
    else:
        size = f"{len(text)} characters"
    return f"{text[:limit - 3]}... ({size})"


def _short_repr(value: Any, room: int) -> str:
    """repr(value) up to a little past room characters, reading no more of value than that needs: a container
    as long as a request body allows would otherwise cost its whole repr to show its first items."""
    if isinstance(value, str | bytes):
        return repr(value[:room + 1])
    if not isinstance(value, list | tuple | dict) or not value:
        return repr(value)
    parts: list[str] = []
    used = 0
    items = value.items() if isinstance(value, dict) else value
    for item in items:
        if used > room:
            parts.append("...")
            break
        if isinstance(value, dict):
            key, inner = item
            part = f"{_short_repr(key, room - used)}: {_short_repr(inner, room - used)}"
        else:
            part = _short_repr(item, room - used)
        parts.append(part)
        used += len(part) + 2
    joined = ", ".join(parts)
    if isinstance(value, dict):
        return "{" + joined + "}"
    if isinstance(value, list):
        return "[" + joined + "]"
    return "(" + joined + ("," if len(value) == 1 else "") + ")"


class BatonError(Exception):
    """An error with a gRPC status code and a message naming what was wrong."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # Trailing metadata its status carries besides the origin: what a caller reads without parsing the message.
    metadata: tuple[tuple[str, str], ...] = ()


class InvalidArgument(BatonError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, value: Any, reason: str) -> None:
        super().__init__(f"{field}={shown(value)}: {reason}")
        self.field = field


class NotFound(BatonError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(BatonError):
    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.metadata = metadata


class Unavailable(BatonError):
    code = grpc.StatusCode.UNAVAILABLE


class StreamHeld(Unavailable):
    """A resume of a request id that a node runs in another stream, one the resume cannot take over: the node has
    not failed, and the resume may run on another node. STREAM_HELD_KEY names the node, for a router to tell this
    from a node's failure without reading the message (UNAVAILABLE all the same: an older router places it
    elsewhere too)."""

    def __init__(self, message: str, node_id: str) -> None:
        super().__init__(message)
        self.metadata = ((STREAM_HELD_KEY, node_id),)


class Drained(Unavailable):
    """A stream a node shutting down hands on as its grace ends: its router moves it (cause "drained"), telling
    it from a crash by DRAINED_KEY, which names the node."""

    def __init__(self, message: str, node_id: str) -> None:
        super().__init__(message)
        self.metadata = ((DRAINED_KEY, node_id),)


class AlreadyExists(BatonError):
    """A request id that is already running where it was sent."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(BatonError):
    """Ended by a newer request of the same id (e.g. a stream superseded by its own resume)."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(BatonError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(BatonError):
    """No valid API key; the message says what is wrong with it and never echoes the key."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(BatonError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(BatonError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(f"{message}; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


async def abort(context: grpc.aio.ServicerContext, error: BatonError) -> NoReturn:
    """End the RPC with error's status; raises, like context.abort."""
    metadata = [(ORIGIN_KEY, "baton")]
    if isinstance(error, ResourceExhausted):
        metadata.append((RETRY_AFTER_KEY, str(error.retry_after_ms)))
    metadata.extend(error.metadata)
    message = str(error)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS - 3] + "..."
    await context.abort(error.code, message, trailing_metadata=tuple(metadata))
    raise AssertionError("unreachable: context.abort raises")


def from_rpc_error(error: grpc.aio.AioRpcError) -> BatonError:
    """Carry a downstream status through to our caller, keeping its code, message and retry hint."""
    metadata = dict(error.trailing_metadata() or ())
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and RETRY_AFTER_KEY in metadata:
        exhausted = ResourceExhausted("", int(metadata[RETRY_AFTER_KEY]))
        exhausted.args = (error.details() or "",)
        return exhausted
    result = BatonError(error.details() or error.code().name)
    result.code = error.code()
    return result
