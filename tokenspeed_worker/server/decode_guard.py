"""Bytes that do not parse as the method's request message get INVALID_ARGUMENT.

By default grpc.aio answers a request whose deserialization raises with UNKNOWN and logs a
traceback for every one (a client could flood the log). This interceptor gives each unary-request
handler a deserializer that cannot raise: an undecodable request becomes a marker the handler
turns into INVALID_ARGUMENT naming the method and the parse error.
"""

from __future__ import annotations

import grpc


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data) if deserializer is not None else data
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return _Undecodable(exc)

    return deserialize


def _message(method: str, request: _Undecodable) -> str:
    return f"{method}: the request does not parse as its message type ({type(request.error).__name__})"


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # reflection's stream of requests keeps grpc's own handling
        method = handler_call_details.method
        kwargs = dict(request_deserializer=_safe(handler.request_deserializer),
                      response_serializer=handler.response_serializer)
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))
            async for response in inner_stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
