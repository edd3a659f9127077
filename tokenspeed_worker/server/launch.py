"""Start the worker: engine process first, warm-up, then the gRPC port.

Order matters to the gateway and to probes: the port opens only once the model
is loaded and one generation went through the whole path, so nothing ever sees a
half-started worker; both health surfaces say SERVING from then on, and
NOT_SERVING again as soon as shutdown starts.

Stop signals (SIGTERM, SIGINT), to the server alone or to its whole process group (the child
processes ignore them, engine/lifetime.py): the first drains (`_drain`), a second during the drain
aborts what remains and exits at once; both exit 0. During startup one stops the start (the engine
processes are killed; exit 0); during the final shutdown one kills the engine processes at once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
import logging
import os
import signal
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenspeed_worker.engine.engine_core import EngineConfig
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb, tokenspeed_scheduler_pb2_grpc as pb_grpc
from tokenspeed_worker.engine.lifetime import STOP_SIGNALS
from tokenspeed_worker.server.engine_client import EngineClient, EngineUnavailable, StartCancelled
from tokenspeed_worker.server.model_info import load_model_facts
from tokenspeed_worker.server.servicer import SERVICE_NAME, TokenSpeedSchedulerServicer

logger = logging.getLogger("tokenspeed_worker")

WARMUP_TIMEOUT_S = 300.0
# Streams can last minutes and the gateway keeps connections for days.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str, model_path: str) -> str:
    """'auto' follows the model's config on a GPU; on a CPU it picks float32, which is
    faster there than bf16 without native bf16 matrix units and matches references exactly."""
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    dtype = aliases.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        found = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    except OSError:
        found = "bfloat16"
    return found if found in ("bfloat16", "float16", "float32") else "bfloat16"


def engine_config_from_args(args, max_model_len: int, device: str, dtype: str) -> EngineConfig:
    return EngineConfig(
        model_path=args.model,
        dtype=dtype,
        device=f"cuda:{args.base_gpu_id}" if device == "cuda" and args.base_gpu_id else device,
        load_format=args.load_format,
        attention_backend=args.attention_backend or "auto",
        block_size=args.block_size,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        schedule_conservativeness=getattr(args, "schedule_conservativeness", 1.0),
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
        enable_prefix_caching=args.enable_prefix_caching,
        sampling_backend=args.sampling_backend,
        enforce_eager=args.enforce_eager,
        kv_cache_dtype=args.kv_cache_dtype,
        overlap_schedule=False if getattr(args, "disable_overlap_schedule", False) else None,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1) or 1,
        grammar_backend=getattr(args, "grammar_backend", "xgrammar") or "xgrammar",
        tokenizer_path=getattr(args, "tokenizer", None) or args.model,
        nnodes=getattr(args, "nnodes", 1) or 1,
        dist_init_method=f"tcp://{args.dist_init_addr}" if getattr(args, "dist_init_addr", None) else None,
        cudagraph_capture_sizes=args.cudagraph_capture_sizes,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        seed=getattr(args, "seed", 0) or 0,
        kv_events=_kv_events(args),
        report_kv_events=True,  # SubscribeKvEvents is always served
    )


def structured_output_available(args, facts) -> bool:
    """Whether constraints are applied: --grammar-backend xgrammar, the xgrammar package, a tokenizer.
    Logged once at startup when the backend is on but cannot work."""
    if getattr(args, "grammar_backend", "xgrammar") == "none":
        return False
    if importlib.util.find_spec("xgrammar") is None:
        logger.warning("structured output off: the xgrammar package is not installed (pip install xgrammar)")
        return False
    if not facts.has_tokenizer:
        logger.warning("structured output off: no tokenizer.json next to the model")
        return False
    return True


def _kv_events(args) -> dict | None:
    """The resolved --kv-events-config when it turns publishing on, else None."""
    from tokenspeed_worker.config import kv_events_enabled, kv_events_settings

    text = getattr(args, "kv_events_config", None)
    if not kv_events_enabled(text):
        return None
    missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"--kv-events-config: publishing needs the Python package(s) {', '.join(missing)} "
            "(pip install pyzmq msgpack)"
        )
    return kv_events_settings(text)


async def _warm_up(engine: EngineClient, facts) -> None:
    """One short greedy generation through the whole engine path."""
    prompt = [facts.bos_token_id if facts.bos_token_id < facts.vocab_size else 0] * 4
    import numpy as np

    add = AddRequest(0, np.asarray(prompt, dtype=np.int32), 2, SamplingParams(temperature=0.0))
    (st,) = engine.submit("__warmup__", [add])
    while not st.done:
        await asyncio.wait_for(st.event.wait(), WARMUP_TIMEOUT_S)
        st.event.clear()
    if st.error is not None:
        raise EngineUnavailable(f"warm-up generation failed: {st.error[1]}")


def _kill_on_signal(engine: EngineClient):
    """The stop signals' handler once serving is over: kill the engine processes now."""

    def handler(signum, frame) -> None:
        logger.warning("%s during shutdown: killing the engine processes now", signal.Signals(signum).name)
        engine.kill_now()

    return handler


async def serve(args, facts, engine: EngineClient, signals: list[int] | None = None) -> int:
    """Serve until a stop signal or the engine's death. `signals`: stop signals already received
    (during startup); the ones received here are appended."""
    loop = asyncio.get_running_loop()
    engine.attach(loop)
    stop = asyncio.Event()
    now = asyncio.Event()  # a second stop signal: abort what remains, exit at once
    exit_code = 0
    signals = signals if signals is not None else []

    def on_dead(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        stop.set()

    def on_signal(sig: int) -> None:
        signals.append(sig)
        name = signal.Signals(sig).name
        if not stop.is_set():
            logger.info("%s: shutting down: draining in-flight requests for up to %.0fs "
                        "(a second SIGTERM/SIGINT stops at once)", name, float(getattr(args, "drain_timeout", 30.0)))
            stop.set()
        elif not now.is_set():
            logger.warning("%s again: stopping now", name)
            now.set()

    engine.on_dead = on_dead
    handled = []
    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            handled.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    try:
        return await _serve(args, facts, engine, stop, now, signals, lambda: exit_code)  # read late: on_dead sets it
    finally:
        # From here a stop signal kills the engine processes (engine.shutdown is next); swapped
        # here, not after the loop closes, which would restore the default handlers meanwhile.
        for sig in handled:
            loop.remove_signal_handler(sig)
            signal.signal(sig, _kill_on_signal(engine))


async def _serve(args, facts, engine: EngineClient, stop: asyncio.Event, now: asyncio.Event,
                 signals: list[int], exit_code) -> int:
    """serve()'s body; `exit_code()`: 0, or 1 once the engine died."""
    if signals:  # a stop signal came between the engine's start and the handlers above
        stop.set()
        if len(signals) > 1:
            now.set()
    await _warm_up(engine, facts)
    logger.info("warm-up generation passed")
    if stop.is_set():  # stopped during the warm-up: never open the port
        logger.info("stopped before serving")
        return exit_code()

    # Observability starts after the warm-up, so its generation is never counted.
    from tokenspeed_worker.server.metrics import make_observer, metrics_address

    engine.observer = make_observer(args)
    metrics_server = None
    metrics_task = None
    if engine.observer is not None and engine.observer.metrics is not None:
        try:
            host, mport = metrics_address(args)
            metrics_server = engine.observer.metrics.start_http_server(host, mport)
        except (OSError, ValueError) as e:
            logger.error("cannot serve metrics: %s", e)
            return 1
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, mport)
        metrics_task = asyncio.create_task(_refresh_gauges(engine, engine.observer.metrics))

    from tokenspeed_worker.server.decode_guard import DecodeErrorInterceptor

    interceptors = [DecodeErrorInterceptor()]  # outermost: sees the handler auth may have replaced
    if getattr(args, "api_key", None):
        from tokenspeed_worker.server.auth import ApiKeyInterceptor

        interceptors.append(ApiKeyInterceptor(args.api_key))
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    servicer = TokenSpeedSchedulerServicer(engine, facts, args)
    pb_grpc.add_TokenSpeedSchedulerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{args.host}:{args.grpc_port}"
    if ":" in args.host and not args.host.startswith("["):
        address = f"[{args.host}]:{args.grpc_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        logger.error("cannot listen on %s: %s", address, e)
        return 1
    await server.start()
    servicer.serving = True
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if getattr(args, "api_key", None):
        logger.info("API key required on every RPC except the health checks")
    logger.info("tokenspeed-worker serving %s on %s (port %d)", facts.served_model_name, address, port)

    watchdog = asyncio.create_task(_watchdog(engine, float(getattr(args, "watchdog_timeout", 300.0))))
    await stop.wait()
    watchdog.cancel()
    if metrics_task is not None:
        metrics_task.cancel()
    # Both health surfaces go NOT_SERVING at once; new Generate calls get UNAVAILABLE.
    servicer.serving = False
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if exit_code() == 0:
        await _drain(engine, servicer, float(getattr(args, "drain_timeout", 30.0)), now)
    await server.stop(grace=1.0)
    if metrics_server is not None:
        metrics_server.shutdown()
    return exit_code()


GAUGE_REFRESH_S = 1.0


async def _refresh_gauges(engine: EngineClient, metrics) -> None:
    """The engine gauges (running, waiting, KV usage, hit rate, preemptions) every second, by
    the same Probe round trip GetLoads uses."""
    while True:
        try:
            metrics.set_loads(await engine.probe(5.0))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # engine dead or busy: keep the last values
            logger.debug("metrics: loads probe failed: %s", e)
            if engine.dead_message is not None:
                return
        await asyncio.sleep(GAUGE_REFRESH_S)


async def _drain(engine: EngineClient, servicer: TokenSpeedSchedulerServicer, timeout: float,
                 now: asyncio.Event | None = None) -> None:
    """Let in-flight requests finish for up to `timeout` s (or until `now` is set: a second stop
    signal), then end the rest with abort: each gets its one terminal message."""
    loop = asyncio.get_running_loop()
    now = now if now is not None else asyncio.Event()
    deadline = loop.time() + timeout
    logger.info("draining %d request(s) for up to %.0fs", len(engine.requests), timeout)
    while engine.requests and loop.time() < deadline and engine.dead_message is None and not now.is_set():
        try:
            await asyncio.wait_for(now.wait(), 0.05)
        except asyncio.TimeoutError:
            pass
    if engine.requests:
        groups = list(engine.by_request_id.values())
        why = "second stop signal" if now.is_set() else "drain timeout"
        logger.warning("%s: aborting %d request(s)", why, len(groups))
        for states in groups:
            engine.abort(states)
    # Give the handlers a moment to send their terminal messages.
    flush_deadline = loop.time() + 5.0
    while servicer.active_calls and loop.time() < flush_deadline:
        await asyncio.sleep(0.02)
    logger.info("drained")


async def _watchdog(engine: EngineClient, timeout: float) -> None:
    """Fail everything if the engine makes no progress for `timeout` s while work is pending."""
    period = min(1.0, timeout / 4)
    while True:
        await asyncio.sleep(period)
        if engine.dead_message is not None:
            return
        if engine.requests and time.monotonic() - engine.last_progress > timeout:
            message = f"engine made no progress for {timeout:.0f}s (--watchdog-timeout) with work pending"
            logger.error("watchdog: %s", message)
            engine.fail_everything(message)
            return


    return exit_code


def _max_positions(model_path: str) -> int | None:
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError:
        return None
    return (cfg.get("text_config") or cfg).get("max_position_embeddings")


def run_server(args) -> int:
    """Run the worker until SIGTERM/SIGINT (exit 0) or an engine failure (exit 1). The stop signals
    are handled from the engine's start on (see the module docstring)."""
    if not os.path.isdir(args.model):
        logger.error("model %r is not a local folder (this worker never downloads weights)", args.model)
        return 2
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, args.model)
    try:
        facts = load_model_facts(args.model, args.tokenizer, args.served_model_name, args.max_model_len, dtype)
    except (OSError, KeyError, ValueError) as e:
        logger.error("cannot read the model at %s: %s", args.model, e)
        return 2
    model_positions = _max_positions(args.model)
    if args.max_model_len and model_positions and args.max_model_len > model_positions:
        logger.error(
            "--max-model-len %d exceeds the model's max_position_embeddings (%d); its rotary embedding is "
            "not defined past that", args.max_model_len, model_positions)
        return 2
    try:
        engine_cfg = engine_config_from_args(args, facts.max_context_length, device, dtype)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if getattr(args, "node_rank", 0) > 0:  # a node that only runs its tensor-parallel ranks
        from tokenspeed_worker.engine.tp_worker import run_node

        return run_node(engine_cfg, args.node_rank, args.log_level)
    facts.data_parallel_size = getattr(args, "data_parallel_size", 1) or 1
    facts.structured_output = structured_output_available(args, facts)
    if not facts.structured_output:  # one decision: the server refuses constraints, the engine builds nothing
        engine_cfg.grammar_backend = "none"
    engine = EngineClient(engine_cfg, args.log_level, facts.data_parallel_size)
    signals: list[int] = []

    def during_startup(signum, frame) -> None:  # the loading can take minutes: stop it
        signals.append(signum)
        engine.cancel_start()

    # Only the main thread may set handlers (and the engine processes are spawned from it).
    own_signals = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, during_startup) for sig in STOP_SIGNALS} if own_signals else {}
    try:
        try:
            ready = engine.start()
        except StartCancelled:
            logger.info("%s during startup: engine processes killed, exiting", signal.Signals(signals[0]).name)
            return 0
        except EngineUnavailable as e:
            logger.error("%s", e)
            return 1
        facts.dtype = ready.dtype
        try:
            uvloop = __import__("uvloop")
            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        try:
            return runner(serve(args, facts, engine, signals))
        except EngineUnavailable as e:
            logger.error("%s", e)
            return 1
        finally:
            if own_signals:
                for sig in STOP_SIGNALS:
                    signal.signal(sig, _kill_on_signal(engine))
            engine.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
