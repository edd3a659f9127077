"""grpc's own cost per streamed message, beside the worker's: the floor of the serving path.

    python scripts/bench_grpc_stream.py --messages 128 --concurrency 256 --waves 2

A bare grpc.aio server (uvloop, as the worker runs) streams `messages` GenerateResponse chunks of one
token per Generate call, with no engine behind it; `concurrency` calls at once from `client-procs`
client processes. Reports messages per second and the server process's CPU seconds per message
(from /proc: Linux). Compare with the worker's own server CPU per streamed token
(docs/benchmarks.md): what is above this floor is ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb  # noqa: E402
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2_grpc as pb_grpc  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import cpu_seconds  # noqa: E402


class _Streamer(pb_grpc.TokenSpeedSchedulerServicer):
    def __init__(self, messages: int) -> None:
        self.messages = messages

    async def Generate(self, request, context):
        for i in range(self.messages):
            await asyncio.sleep(0)  # one message per loop turn, as the worker sends one per engine step
            yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
                token_ids=[i], prompt_tokens=128, completion_tokens=i + 1))


def _serve(port: int, messages: int, ready, guard: bool, options: list) -> None:
    async def main() -> None:
        from tokenspeed_worker.server.decode_guard import guarded
        from tokenspeed_worker.server.launch import GRPC_OPTIONS

        server = grpc.aio.server(options=[*GRPC_OPTIONS, *options])  # the worker's options, then these
        pb_grpc.add_TokenSpeedSchedulerServicer_to_server(_Streamer(messages), guarded(server) if guard else server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def _client(port: int, calls: int) -> None:
    stub = pb_grpc.TokenSpeedSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    def one(i: int) -> None:
        for _ in stub.Generate(pb.GenerateRequest(request_id=str(i)), timeout=600):
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=128, help="messages per call")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--guarded", action="store_true",
                    help="register the servicer as the worker does (server/decode_guard.guarded)")
    ap.add_argument("--server-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a grpc server channel argument beside the worker's (an integer value stays one), "
                         "e.g. grpc.http2.bdp_probe=0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    options = []
    for item in args.server_option:
        key, _, value = item.partition("=")
        options.append((key, int(value) if value.lstrip("-").isdigit() else value))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, args.messages, ready, args.guarded, options),
                        daemon=True)
    server.start()
    ready.wait()

    def wave() -> None:
        share = [args.concurrency // args.client_procs + (i < args.concurrency % args.client_procs)
                 for i in range(args.client_procs)]
        clients = [ctx.Process(target=_client, args=(port, n)) for n in share if n]
        for c in clients:
            c.start()
        for c in clients:
            c.join()

    wave()  # warm
    cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
    for _ in range(args.waves):
        wave()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
    server.terminate()
    n = args.waves * args.concurrency * args.messages
    result = {"guarded": args.guarded, "server_options": dict(options), "messages": n, "seconds": seconds, "messages_per_s": n / seconds, "server_cpu_s": cpu,
              "server_cpu_us_per_message": cpu / n * 1e6, "concurrency": args.concurrency,
              "messages_per_call": args.messages, "client_procs": args.client_procs, "cpus": os.cpu_count(),
              "grpc": grpc.__version__, "date": time.strftime("%Y-%m-%d")}
    print(f"{n} messages in {seconds:.2f} s ({n / seconds:,.0f}/s); server CPU {cpu:.2f} s = "
          f"{cpu / n * 1e6:.1f} us per message")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
