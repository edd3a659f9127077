"""The engine process: a busy loop around `EngineCore`, talking to the server over a pipe.

Between two steps it takes every pending message (new requests, aborts, probes); when idle it
captures one of the decode graphs its startup left (once the worker serves: `Serving`), or else
blocks on the pipe. Each step sends one `StepOutput`. With overlap scheduling (the GPU
default) the next step is launched before the last one's output is completed and sent. If a
step raises, it reports `EngineDead` and exits non-zero so the server fails every in-flight
request instead of leaving it hanging.

Signals: the engine ignores SIGTERM and SIGINT (a stop of the whole process group must not kill it
while the server drains) and dies with the server (engine/lifetime.py). It exits when the server
sends Shutdown, when the pipe closes, or when the server kills it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker import bytecode, kernel_cache
from tokenspeed_worker.engine import lifetime
from tokenspeed_worker.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    FlushCache,
    FlushReply,
    Probe,
    ProbeReply,
    ProfileReply,
    RequestFailed,
    Serving,
    Shutdown,
    StartProfile,
    StopProfile,
)

logger = logging.getLogger(__name__)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
        stream=sys.stderr,
    )


def engine_main(cfg: EngineConfig, conn: Connection, log_level: str = "info", spawned_at: float | None = None,
                busy=None) -> None:
    """Entry point of the engine process (spawned by the server at time.time() `spawned_at`). `busy`:
    a shared double (multiprocessing.RawValue) the loop sets to time.time() while a step or an idle
    capture runs and to 0 between them, so the server's health check can tell a long step (a long
    prompt on a CPU) from an engine that stopped answering."""
    lifetime.guard()  # first: ignore the service's stop signals, die with the server
    bytecode.inherit()  # before the engine's imports
    _setup_logging(log_level)
    try:
        triton_cache = kernel_cache.use_triton_cache(cfg.model.cache_dir)  # before anything compiles
        from tokenspeed_worker.engine.engine_core import EngineCore

        logger.debug("Triton's kernel cache: %s", triton_cache or "its default (~/.triton/cache)")

        if spawned_at is not None:
            logger.info("startup: engine process start %.1f s (interpreter, imports)", time.time() - spawned_at)

        if cfg.parallel.tensor_parallel_size > 1:  # the server started the other ranks; join them
            from tokenspeed_worker.engine.tp_worker import join_group

            join_group(cfg)
        core = EngineCore(cfg)
    except Exception as exc:  # startup failure: say why, in one line, and exit
        logger.error("engine failed to start: %s", exc)
        logger.debug("%s", traceback.format_exc())
        try:
            conn.send(EngineDead(f"engine failed to start: {exc}"))
        finally:
            os._exit(1)
    lifetime.still_guarded()
    conn.send(core.ready_message())
    try:
        _loop(core, conn, busy)
        core.stop_followers()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("server went away; engine exiting")
        core.stop_followers()
        os._exit(0)
    except Exception as exc:
        logger.error("engine step failed: %s\n%s", exc, traceback.format_exc())
        try:
            conn.send(EngineDead(f"engine failed: {type(exc).__name__}: {exc}"))
        except Exception:
            pass
        os._exit(1)


def _handle(core, conn: Connection, msg) -> bool:
    """Apply one message; False means shut down."""
    if isinstance(msg, AddRequest):
        try:
            core.add_request(msg)
        except ValueError as exc:
            conn.send(RequestFailed(msg.req_id, "INVALID_ARGUMENT", str(exc)))
    elif isinstance(msg, AbortRequests):
        for req_id in msg.req_ids:
            core.abort(req_id)
    elif isinstance(msg, Probe):
        conn.send(ProbeReply(msg.nonce, core.loads()))
    elif isinstance(msg, FlushCache):
        dropped = core.flush_prefix_cache()
        conn.send(FlushReply(msg.nonce, True, f"flushed the prefix cache ({dropped} blocks)"))
    elif isinstance(msg, StartProfile):
        ok, message = core.profiler.start(msg.output_dir, msg.num_steps, msg.activities, msg.with_stack,
                                          msg.record_shapes)
        conn.send(ProfileReply(msg.nonce, ok, message))
    elif isinstance(msg, StopProfile):
        ok, message = core.profiler.stop()
        conn.send(ProfileReply(msg.nonce, ok, message))
    elif isinstance(msg, Shutdown):
        return False
    else:
        logger.warning("engine ignoring unknown message %r", type(msg).__name__)
    return True


def _loop(core, conn: Connection, busy=None) -> None:
    """With overlap scheduling, step N+1 is launched before step N is completed (its output
    sent): the host schedules and prepares N+1 and routes N's output while the device runs
    (EngineCore.pipeline_step)."""
    pending = None  # a launched step not completed yet (overlap only)
    serving = False  # the decode graphs left are captured only once the worker serves (Serving)
    while True:
        # Take everything pending; block only when there is nothing to compute or complete (and no
        # decode graph left to capture: one at a time, so a request waits for one capture at most).
        if pending is None and not core.has_work():
            if conn.poll(0) or not (serving and _busy(busy, core.capture_deferred_graph)):
                conn.poll(None)
        while conn.poll(0):
            msg = conn.recv()
            if isinstance(msg, Serving):
                serving = True
            elif not _handle(core, conn, msg):
                return
        outputs, pending, failed, launched = _busy(busy, core.pipeline_step, pending)
        # KV cache events of this turn (and of aborts and flushes applied before it): they ride on
        # its last output, or go alone when it has none.
        events = core.take_kv_events()
        if events is not None:
            if outputs:
                outputs[-1].kv_events = events
            else:
                conn.send(events)
        for out in outputs:
            _send_output(core, conn, out)
        if failed is not None:  # only this step's requests end; the engine keeps serving
            for req_id in failed.server_ids:
                conn.send(RequestFailed(req_id, "RESOURCE_EXHAUSTED", failed.message))
        for req_id, code, message in core.take_failures():  # e.g. a grammar that did not compile
            conn.send(RequestFailed(req_id, code, message))
        if not launched and pending is None and core.waiting_for_grammar and not core.scheduler.has_work():
            conn.poll(0.002)  # only grammars compiling: wait a little (or for a message) instead of spinning


def _busy(busy, work, *args):
    """work(*args), with `busy` (engine_main) saying since when it runs."""
    if busy is None:
        return work(*args)
    busy.value = time.time()
    try:
        return work(*args)
    finally:
        busy.value = 0.0


def _send_output(core, conn: Connection, out) -> None:
    conn.send(out)
    core.profiler.step_done()
