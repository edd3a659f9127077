"""`--api-key`: every RPC except the two health surfaces needs `authorization: Bearer <key>`.

A grpc.aio server interceptor: the key is compared in constant time (hmac.compare_digest),
and a refused call gets UNAUTHENTICATED before its handler runs. Health probes stay open so
Kubernetes and load balancers need no secret.
"""

from __future__ import annotations

import hmac

import grpc

EXEMPT_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/tokenspeed.grpc.scheduler.TokenSpeedScheduler/HealthCheck",
    }
)


def _denied_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (an async generator, as streaming handlers are)

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._expected = api_key.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in EXEMPT_METHODS:
            return handler
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
                break
        if not presented:
            return _denied_handler(handler, "authorization: missing (this worker needs 'authorization: Bearer <key>')")
        # The scheme is case-insensitive (RFC 7235: "bearer", "BEARER"); the key is compared exactly.
        scheme, _, key = presented.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key, self._expected):
            return _denied_handler(handler, "authorization: invalid API key")
        return handler
