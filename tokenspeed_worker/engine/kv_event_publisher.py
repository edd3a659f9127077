"""KV cache events out of the engine process: to the server, and over ZMQ (--kv-events-config).

After every turn of its loop (steps, aborts, a cache flush) the engine drains the native
scheduler's recorded prefix-cache events (`KvEventOutbox`) and, when there are any, hands them
to the server as one `KvEvents` and, with --kv-events-config, publishes one batch as three
frames, the layout TokenSpeed documents:

    topic bytes | 8-byte big-endian sequence number | msgpack payload

payload = [timestamp, events, dp_rank], each event one of
    ["BlockStored", [block_hash], parent_hash | None, token_ids, block_size]
    ["BlockRemoved", [block_hash]]
    ["AllBlocksCleared"]

Hashes are the scheduler's signed int64 chain hashes (`scheduler.scheduler.block_hash`).
pyzmq and msgpack are imported only by the publisher, so a worker without --kv-events-config
never needs them. The same events also go to the server for SubscribeKvEvents as protobuf wire
bytes (`events_wire` here when the publisher needs the tuples, else the native encoder).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable

from tokenspeed_worker.engine.messages import KvEvents, Loads

logger = logging.getLogger(__name__)

KV_LOADS_S = 0.02  # KvEvents carry the engine's loads at most this often (server/kv_event_hub.FLUSH_S)


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


def events_to_proto(batch, events: list[tuple], first_event_id: int = 0, id_stride: int = 1) -> int:
    """Append the scheduler's event tuples to `batch` (a KvEventBatch) as the native encoder
    (`Scheduler.drain_kv_events_wire`) writes them: a run of stored blocks that chain (each the
    parent of the next) is one KvBlocksStored; event i gets event_id first_event_id + i * id_stride.
    Returns how many events it added. Used when the ZMQ publisher needs the tuples too."""
    count = 0
    stored = None
    last_hash = None
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            _, h, parent, tokens, block_size = ev
            if stored is None or parent is None or int(parent) != last_hash:
                stored = batch.events.add(event_id=first_event_id + count * id_stride).stored
                count += 1
                if parent is not None:
                    stored.parent_block_hash = int(parent)
            stored.blocks.add(block_hash=int(h), token_ids=[int(t) for t in tokens], block_size=int(block_size))
            last_hash = int(h)
            continue
        stored = None
        if kind == "removed":
            batch.events.add(event_id=first_event_id + count * id_stride).removed.block_hashes.append(int(ev[1]))
        elif kind == "cleared":
            batch.events.add(event_id=first_event_id + count * id_stride).cleared.SetInParent()
        else:  # pragma: no cover - the native core emits only the three kinds
            logger.warning("unknown KV event %r skipped", kind)
            continue
        count += 1
    return count


def events_wire(events: list[tuple], first_event_id: int = 0, id_stride: int = 1) -> tuple[bytes, int]:
    """The tuples as `drain_kv_events_wire` would have returned them."""
    from tokenspeed_worker.proto import common_pb2

    batch = common_pb2.KvEventBatch()
    count = events_to_proto(batch, events, first_event_id, id_stride)
    return batch.SerializeToString(), count


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


class KvEventOutbox:
    """The engine's KV events: `take` drains what the scheduler recorded since the last call,
    publishes it on ZMQ when configured, and returns it for the server with event ids assigned
    (offset + k * stride for the engine's k-th event, so data-parallel replicas never share one)."""

    def __init__(self, scheduler, loads: Callable[[], Loads], zmq: dict | None = None, report: bool = False,
                 id_offset: int = 0, id_stride: int = 1) -> None:
        """zmq: the resolved --kv-events-config (endpoint, topic) or None; report: record events for
        the server's SubscribeKvEvents; loads: the engine's loads, sent along (`KvEvents.loads`)."""
        self._scheduler = scheduler
        self._loads = loads
        self.publisher = ZmqKvEventPublisher(zmq["endpoint"], zmq.get("topic", "")) if zmq is not None else None
        self._report = report
        self._id_offset = id_offset
        self._id_stride = id_stride
        self._sent = 0  # events handed out by take (their ids follow on)
        self._loads_at = -KV_LOADS_S  # time.monotonic() the last KvEvents carried loads

    def take(self) -> KvEvents | None:
        """The events recorded since the last call; None when there are none or none are recorded."""
        if self.publisher is None and not self._report:
            return None
        first = self._id_offset + self._sent * self._id_stride
        if self.publisher is not None:
            events = self._scheduler.drain_kv_events()
            if not events:
                return None
            self.publisher.publish(events)
            data, count = events_wire(events, first, self._id_stride)
        else:
            data, count = self._scheduler.drain_kv_events_wire(first, self._id_stride)
            if not count:
                return None
        self._sent += count
        # The server builds a load record at most every KV_LOADS_S (its batches gather that long), so
        # the engine's figures go along no more often; between them the last ones stand.
        now = time.monotonic()
        loads = None
        if now - self._loads_at >= KV_LOADS_S:
            self._loads_at = now
            loads = self._loads()
        return KvEvents(time.time(), data, count, loads)
