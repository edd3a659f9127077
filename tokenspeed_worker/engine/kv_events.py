"""KV cache events from the engine process over ZMQ (--kv-events-config).

After every step (and after a cache flush) the engine drains the native scheduler's
recorded prefix-cache events and, when there are any, publishes one batch as three
frames, the layout TokenSpeed documents:

    topic bytes | 8-byte big-endian sequence number | msgpack payload

payload = [timestamp, events, dp_rank], each event one of
    ["BlockStored", [block_hash], parent_hash | None, token_ids, block_size]
    ["BlockRemoved", [block_hash]]
    ["AllBlocksCleared"]

Hashes are the scheduler's signed int64 chain hashes (`scheduler.core.block_hash`).
pyzmq and msgpack are imported only here, so a worker without --kv-events-config
never needs them.
"""

from __future__ import annotations

import logging
import struct
import time

logger = logging.getLogger(__name__)


def encode_events(events: list[tuple]) -> list[list]:
    """Scheduler event tuples → the msgpack event arrays of the wire format."""
    out: list[list] = []
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            _, h, parent, tokens, block_size = ev
            out.append(["BlockStored", [int(h)], None if parent is None else int(parent),
                        [int(t) for t in tokens], int(block_size)])
        elif kind == "removed":
            out.append(["BlockRemoved", [int(ev[1])]])
        elif kind == "cleared":
            out.append(["AllBlocksCleared"])
        else:  # pragma: no cover - the native core emits only the three kinds
            logger.warning("unknown KV event %r dropped", kind)
    return out


class ZmqKvEventPublisher:
    """A ZMQ PUB socket bound to the configured endpoint; one `publish` per batch."""

    def __init__(self, endpoint: str, topic: str = "", dp_rank: int = 0) -> None:
        import msgpack
        import zmq

        self._packb = msgpack.packb
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(endpoint)
        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self.dp_rank = dp_rank
        self.seq = 0
        logger.info("KV cache events: publishing on %s (topic %r)", endpoint, topic)

    def publish(self, events: list[tuple]) -> None:
        if not events:
            return
        payload = self._packb([time.time(), encode_events(events), self.dp_rank], use_bin_type=True)
        import zmq

        try:
            self._sock.send_multipart([self.topic, struct.pack(">Q", self.seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # every subscriber is slow: drop rather than stall the engine
            logger.warning("KV event batch %d dropped (subscribers not keeping up)", self.seq)
        self.seq += 1

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
