"""SubscribeKvEvents: the engines' prefix-cache events and the worker's load, as `KvEventBatch`es.

Always served (no flag): each engine sends the events of a turn over its pipe (`KvEvents`, only
when there are any, riding on the turn's StepOutput), already encoded as protobuf wire bytes by the
native scheduler (event ids included); the hub gathers what arrives within `FLUSH_S` into one batch
per replica, numbers the batches into one stream for every subscriber, each batch with the
worker's load at the moment it is sent (`KvEventBatch.load`, the figures GetLoads reports). When
no batch went out for `HEARTBEAT_S`, every subscriber gets a `load_only` record, so the gateway
can skip its GetLoads poll and see a stalled engine (`engine_silence_ms`) even while nothing is
stored or evicted. `--kv-events-config` adds the engine's own ZMQ publisher beside this; the two
streams number their batches independently.

Stream contract:
- Event batches are numbered consecutively from a base taken at startup (the start time in
  microseconds), so a resume cursor from an earlier process of the worker is older than every
  batch of this one and the subscriber sees the gap.
- `start_sequence_number` 0 starts at the current state; N > 0 replays the batches after N when the
  history (the last `HISTORY_BATCHES`) still holds them, else starts at the current state (the
  sequence numbers show the gap).
- `load_only` records carry no events and the sequence number of the last event batch that
  subscriber got; before its first one they are numbered 0 and sent only when the subscriber set
  `load_records_before_first_batch` (then the first goes out at once).
- A subscriber that falls `SUBSCRIBER_BACKLOG` batches behind is ended with RESOURCE_EXHAUSTED
  (`SubscriberFellBehind`); it can resubscribe with its cursor.
- `sample` grows by one with every load record the hub builds (monotonic on every stream);
  `age_ms` is the age of the oldest replica's figures in it; `engine_silence_ms` is set while
  requests are in flight: the time since an engine last reported a step (every step is reported,
  `engine_reports_steps`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from tokenspeed_worker.proto import common_pb2
from tokenspeed_worker.server.engine_client import EngineUnavailable, combine_loads

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # a load_only record when no batch went out for this long
FLUSH_S = 0.02  # the events of the engine turns within this long go out as one batch
HISTORY_BATCHES = 4096  # event batches kept for resuming subscribers
SUBSCRIBER_BACKLOG = 2048  # batches a subscriber may lag before its stream is ended (< HISTORY_BATCHES)
PROBE_TIMEOUT_S = 0.25  # a heartbeat waits this long for fresh figures, then sends the last ones

_U32 = 2**32 - 1
_I32 = 2**31 - 1


class SubscriberFellBehind(Exception):
    pass


class _Subscriber:
    def __init__(self, early_loads: bool) -> None:
        self.items: collections.deque = collections.deque()
        self.wake = asyncio.Event()
        self.early_loads = early_loads
        self.last_seq = 0  # the last event batch it was sent
        self.fell_behind = False

    def put(self, item) -> None:
        if len(self.items) >= SUBSCRIBER_BACKLOG:
            self.fell_behind = True
        else:
            self.items.append(item)
        self.wake.set()


class KvEventHub:
    """Numbers the engines' KvEvents into one stream and fans it out to SubscribeKvEvents calls."""

    def __init__(self, engine, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.base = time.time_ns() // 1000  # see the module docstring: cursors of earlier processes are older
        self.seq = self.base  # the last event batch's number
        self.history: collections.deque = collections.deque(maxlen=HISTORY_BATCHES)
        self._pending: dict[int, list] = {}  # replica -> [timestamp of its last turn, [event bytes]]
        self._flush_handle: asyncio.TimerHandle | None = None
        self._sample = 0
        self._subscribers: set[_Subscriber] = set()
        self._last_push = 0.0  # time.monotonic() of the last record sent to the subscribers
        self._heartbeat_task: asyncio.Task | None = None
        engine.on_kv_events = self._on_events

    # ---- inbound (on the event loop) ----------------------------------------------

    def _on_events(self, replica: int, msg) -> None:
        """One engine turn's events (wire bytes): held until the next flush, FLUSH_S at most."""
        pending = self._pending.get(replica)
        if pending is None:
            self._pending[replica] = [msg.timestamp, [msg.data]]
        else:
            pending[0] = msg.timestamp
            pending[1].append(msg.data)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        pending, self._pending = self._pending, {}
        for replica in sorted(pending):
            stamp, chunks = pending[replica]
            self.seq += 1
            # Kept as bytes: with nobody subscribed a batch costs a join and an append.
            entry = (self.seq, replica, stamp, b"".join(chunks))
            self.history.append(entry)
            if self._subscribers:
                batch = self._batch(*entry)
                batch.load.CopyFrom(self.load_record(load_only=False))
                for sub in self._subscribers:
                    sub.put(batch)
                self._last_push = time.monotonic()

    @staticmethod
    def _batch(seq: int, replica: int, stamp: float, data: bytes) -> common_pb2.KvEventBatch:
        batch = common_pb2.KvEventBatch.FromString(data)  # the events, encoded by the engine
        batch.sequence_number = seq
        batch.timestamp = stamp
        batch.dp_rank = replica
        return batch

    # ---- load records ----------------------------------------------------------------

    def load_record(self, load_only: bool) -> common_pb2.EngineLoad:
        """The worker's load now: every replica's latest figures together (GetLoads' numbers)."""
        engine = self.engine
        now = time.monotonic()
        self._sample += 1
        record = common_pb2.EngineLoad(sample=self._sample, load_only=load_only, engine_reports_steps=True)
        known = [x for x in engine.latest_loads if x is not None]
        ready = engine.ready
        dp = engine.data_parallel_size
        capacity = ready.max_total_tokens * dp
        record.max_running_requests = min(_U32, ready.max_num_seqs * dp)
        record.max_total_num_tokens = min(_I32, capacity)
        record.memory.CopyFrom(common_pb2.EngineMemory(
            weight_gb=ready.weight_bytes * dp / 1e9, kv_cache_gb=ready.kv_cache_bytes * dp / 1e9,
            graph_gb=ready.graph_bytes * dp / 1e9, token_capacity=min(_I32, capacity)))
        if known:
            loads = combine_loads([x[0] for x in known])
            usage = loads.num_used_tokens / capacity if capacity else 0.0
            record.running_requests = min(_U32, loads.num_running)
            record.waiting_requests = min(_U32, loads.num_waiting)
            record.waiting_uncached_tokens = min(_U32, loads.waiting_tokens)
            record.token_usage = usage
            record.active_token_usage = usage  # the prefix cache's unheld blocks are in neither
            record.gen_throughput = loads.gen_throughput
            record.age_ms = min(_U32, int((now - min(x[1] for x in known)) * 1000))
            record.cache_hit_rate = loads.cache_hit_rate
            record.num_used_tokens = min(_I32, loads.num_used_tokens)
            record.queues.CopyFrom(common_pb2.EngineQueues(
                waiting=loads.num_waiting, grammar=loads.num_grammar_waiting, paused=0,
                retracted=loads.num_retracted))
            if loads.spec_accept_length is not None:
                record.speculative.CopyFrom(common_pb2.EngineSpeculative(
                    accept_length=loads.spec_accept_length, accept_rate=loads.spec_accept_rate or 0.0))
        if engine.requests:
            record.engine_silence_ms = min(_U32, int(max(0.0, now - engine.last_progress) * 1000))
            record.prefill_pending_tokens = min(_U32, engine.prefill_pending_tokens())
        return record

    def _push_load_only(self) -> None:
        record = self.load_record(load_only=True)
        stamp = time.time()
        for sub in self._subscribers:
            if sub.last_seq == 0 and not sub.early_loads:
                continue
            sub.put(common_pb2.KvEventBatch(sequence_number=sub.last_seq, timestamp=stamp, load=record))
        self._last_push = time.monotonic()

    async def _refresh(self, timeout: float) -> None:
        """Fresh figures if the engines answer within `timeout` (their replies update latest_loads)."""
        try:
            await self.engine.probe_all(timeout)
        except (asyncio.TimeoutError, EngineUnavailable):
            pass  # busy in a long step, stalled or gone: the last figures stay, with their age

    async def _heartbeat(self) -> None:
        while self._subscribers:
            wait = self._last_push + self.heartbeat_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            await self._refresh(PROBE_TIMEOUT_S)
            if time.monotonic() - self._last_push >= self.heartbeat_s * 0.999:
                self._push_load_only()
        self._heartbeat_task = None

    # ---- subscribers --------------------------------------------------------------------

    async def subscribe(self, request):
        """Async generator of KvEventBatch for one SubscribeKvEvents call, until it is cancelled."""
        sub = _Subscriber(bool(request.load_records_before_first_batch))
        start = int(request.start_sequence_number)
        replay = []
        if start > 0:
            oldest = self.history[0][0] if self.history else self.seq + 1
            if oldest <= start + 1 <= self.seq + 1:
                replay = [self._batch(*entry) for entry in self.history if entry[0] > start]
            else:
                logger.info("SubscribeKvEvents: cursor %d is outside the history (%d..%d); streaming from now",
                            start, oldest, self.seq)
        self._subscribers.add(sub)
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())
        logger.info("SubscribeKvEvents: a subscriber joined (%d now; cursor %d, %d batch(es) replayed)",
                    len(self._subscribers), start, len(replay))
        try:
            if replay:
                record = self.load_record(load_only=False)
                for batch in replay:
                    batch.load.CopyFrom(record)
                    sub.last_seq = batch.sequence_number
                    yield batch
            elif sub.early_loads:
                await self._refresh(PROBE_TIMEOUT_S)
                self._last_push = time.monotonic()
                yield common_pb2.KvEventBatch(sequence_number=0, timestamp=time.time(),
                                              load=self.load_record(load_only=True))
            while True:
                if sub.fell_behind:
                    raise SubscriberFellBehind(
                        f"fell {SUBSCRIBER_BACKLOG} batches behind; resubscribe with start_sequence_number "
                        f"{sub.last_seq}")
                if not sub.items:
                    sub.wake.clear()
                    await sub.wake.wait()
                    continue
                batch = sub.items.popleft()
                if not batch.load.load_only:
                    sub.last_seq = batch.sequence_number
                yield batch
        finally:
            self._subscribers.discard(sub)
            logger.info("SubscribeKvEvents: a subscriber left (%d now)", len(self._subscribers))
