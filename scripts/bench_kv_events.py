"""Host cost of the KV events on their way to SubscribeKvEvents: a native scheduler prefills N
requests (each its own prompt, so every full block is a stored event), and the events are drained,
sent through a pickle round trip (as over the engine's pipe) and made into a KvEventBatch, once as
the scheduler's Python tuples (Python protobufs) and once as the native wire bytes the engine uses.

    python scripts/bench_kv_events.py --requests 256 --prompt-len 128 --block-size 16
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenspeed_worker.engine.kv_event_publisher import events_to_proto  # noqa: E402
from tokenspeed_worker.proto import common_pb2  # noqa: E402
from tokenspeed_worker.scheduler.scheduler import Scheduler  # noqa: E402


def prefilled(requests: int, prompt_len: int, block_size: int) -> Scheduler:
    blocks = requests * (prompt_len // block_size + 2)
    s = Scheduler(blocks, block_size, requests, prompt_len + 8, requests * prompt_len, enable_kv_events=True)
    for i in range(requests):
        s.add_request(i + 1, np.arange(i * prompt_len, (i + 1) * prompt_len, dtype=np.int64), 1, [])
    while s.has_work():
        plan = s.schedule()
        s.advance(np.full(len(plan.sample_rows), 7, dtype=np.int64))
    return s


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - t0) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    ap.add_argument("--out")
    args = ap.parse_args()
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        a, b = (prefilled(args.requests, args.prompt_len, args.block_size) for _ in range(2))
        events, t_drain = timed(a.drain_kv_events)
        _, t_pipe = timed(lambda: pickle.loads(pickle.dumps(events)))
        _, t_proto = timed(lambda: events_to_proto(common_pb2.KvEventBatch(), events))
        (data, count), t_wire = timed(lambda: b.drain_kv_events_wire(0, 1))
        _, t_wire_pipe = timed(lambda: pickle.loads(pickle.dumps(data)))
        _, t_parse = timed(lambda: common_pb2.KvEventBatch.FromString(data))
        for name, value in (("tuples_drain_us", t_drain), ("tuples_pipe_us", t_pipe), ("tuples_protobuf_us", t_proto),
                            ("wire_drain_us", t_wire), ("wire_pipe_us", t_wire_pipe), ("wire_parse_us", t_parse)):
            best[name] = min(best.get(name, float("inf")), value)
    result = {"blocks": len(events), "events": count, "wire_bytes": len(data), **best,
              "tuples_total_us": best["tuples_drain_us"] + best["tuples_pipe_us"] + best["tuples_protobuf_us"],
              "wire_total_us": best["wire_drain_us"] + best["wire_pipe_us"] + best["wire_parse_us"]}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
