"""Bytes that do not parse as the method's request message get INVALID_ARGUMENT.

By default grpc.aio answers a request whose deserialization raises with UNKNOWN and logs a
traceback for every one (a client could flood the log). `guarded(server)` is the server as the
generated `add_*_to_server` functions see it: each unary-request handler they register gets a
deserializer that cannot raise (an undecodable request becomes an `Undecodable`) and a handler
that turns it into INVALID_ARGUMENT naming the method and the parse error.

The handlers are wrapped once, at registration, not per call: a grpc.aio interceptor (what this
replaces) runs a coroutine and builds a handler for every call, a cost measured in
docs/benchmarks.md ("The decode guard at registration").
"""

from __future__ import annotations

import inspect

import grpc


class Undecodable:
    """What a request that does not parse is handed to its handler as."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def message(self, method: str) -> str:
        return f"{method}: the request does not parse as its message type ({type(self.error).__name__})"


def _safe(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data) if deserializer is not None else data
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return Undecodable(exc)

    return deserialize


def _guard(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming:
        return handler  # reflection's stream of requests keeps grpc's own handling
    kwargs = dict(request_deserializer=_safe(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    inner_stream = handler.unary_stream
    if not inspect.isasyncgenfunction(inner_stream):
        # A streaming handler that writes with context.write() and returns (grpc_health's Watch):
        # awaited, not iterated.
        async def written(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
            return await inner_stream(request, context)

        return grpc.unary_stream_rpc_method_handler(written, **kwargs)

    async def stream(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(method))
        async for response in inner_stream(request, context):
            yield response

    return grpc.unary_stream_rpc_method_handler(stream, **kwargs)


class _GuardedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose handlers are guarded, each once (at its method's first call)."""

    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        handler = self._guarded.get(method)
        if handler is None:
            handler = self._inner.service(handler_call_details)
            if handler is None:
                return None  # an unknown method: not kept, so clients cannot grow the table
            handler = self._guarded[method] = _guard(method, handler)
        return handler


class _GuardedServer:
    """The registration surface of a grpc.aio server, guarding what is registered through it."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(
            service, {name: _guard(f"/{service}/{name}", h) for name, h in handlers.items()})


def guarded(server: grpc.aio.Server) -> _GuardedServer:
    """`server` for the generated `add_*Servicer_to_server(servicer, guarded(server))`."""
    return _GuardedServer(server)
