"""SubscribeKvEvents: the engine's ZMQ KV-event batches as `smg.grpc.common.KvEventBatch`.

Each gRPC subscriber gets its own ZMQ SUB socket (zmq.asyncio, so the grpc.aio event loop
never blocks) connected to the engine's PUB endpoint, with a `*` or 0.0.0.0 host replaced by
127.0.0.1. Batches published before the subscription connects are not replayed: the stream
starts at the current state (the gateway's `start_sequence_number = 0`).
"""

from __future__ import annotations

import logging
import struct

from tokenspeed_worker.proto import common_pb2

logger = logging.getLogger(__name__)

_CONTEXT = None


def connect_endpoint(endpoint: str) -> str:
    """The address a local subscriber connects to for a PUB bind address."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme in ("tcp", "ws") and sep:
        host, colon, port = rest.rpartition(":")
        if host in ("*", "0.0.0.0", "", "[::]", "::"):
            host = "127.0.0.1"
        return f"{scheme}://{host}{colon}{port}"
    return endpoint


def batch_to_proto(seq: int, payload: list, first_event_id: int = 0) -> common_pb2.KvEventBatch:
    """One decoded msgpack payload `[timestamp, events, dp_rank]` as a KvEventBatch."""
    timestamp, events = payload[0], payload[1]
    dp_rank = payload[2] if len(payload) > 2 and payload[2] is not None else 0
    batch = common_pb2.KvEventBatch(sequence_number=seq, timestamp=float(timestamp), dp_rank=int(dp_rank))
    for i, ev in enumerate(events):
        out = batch.events.add(event_id=first_event_id + i)
        kind = ev[0]
        if kind == "BlockStored":
            _, hashes, parent, tokens, block_size = ev[:5]
            stored = out.stored
            per_block = len(tokens) // max(1, len(hashes)) if hashes else 0
            for j, h in enumerate(hashes):
                stored.blocks.add(
                    block_hash=int(h), token_ids=tokens[j * per_block:(j + 1) * per_block], block_size=int(block_size)
                )
            if parent is not None:
                stored.parent_block_hash = int(parent)
        elif kind == "BlockRemoved":
            out.removed.block_hashes.extend(int(h) for h in ev[1])
        elif kind == "AllBlocksCleared":
            out.cleared.SetInParent()
        else:
            logger.warning("unknown KV event %r skipped", kind)
    return batch


async def subscribe(settings: dict):
    """Async generator of KvEventBatch from the engine's publisher, until cancelled."""
    import msgpack
    import zmq
    import zmq.asyncio

    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = zmq.asyncio.Context()
    sock = _CONTEXT.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    topic = settings.get("topic", "").encode("utf-8")
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    address = connect_endpoint(settings["endpoint"])
    sock.connect(address)
    logger.info("SubscribeKvEvents: a subscriber connected to %s", address)
    event_id = 0
    try:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[0] != topic:
                continue
            seq = struct.unpack(">Q", frames[1])[0]
            payload = msgpack.unpackb(frames[2], raw=False)
            batch = batch_to_proto(seq, payload, event_id)
            event_id += len(batch.events)
            yield batch
    finally:
        sock.close(0)
        logger.info("SubscribeKvEvents: a subscriber left")
