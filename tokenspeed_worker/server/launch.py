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
import signal
import socket
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenspeed_worker.config import EngineConfig, ServerArgs, ServerConfig, WorkerConfig
from tokenspeed_worker.config.hub_cache import resolve_hub_ids
from tokenspeed_worker.models.registry import check_architectures, check_parallel_fit
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2_grpc as pb_grpc
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.engine.lifetime import STOP_SIGNALS
from tokenspeed_worker.model_executor.checkpoint_files import check_weights_present
from tokenspeed_worker.server.engine_client import EngineClient, EngineUnavailable, StartCancelled
from tokenspeed_worker.server.model_info import load_model_facts
from tokenspeed_worker.server.servicer import SERVICE_NAME, TokenSpeedSchedulerServicer

logger = logging.getLogger("tokenspeed_worker")

WARMUP_TIMEOUT_S = 300.0
# A second stop signal this soon after the first is the same stop sent twice (GNU timeout signals its
# child, then the child's process group), not an operator's "stop now".
SAME_STOP_WITHIN_S = 0.25
# Streams can last minutes and the gateway keeps connections for days.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # grpc turns SO_REUSEPORT on by default: a second worker started on a running one's port would
    # bind it too and take half of its connections. Off, the second one fails "cannot listen on".
    ("grpc.so_reuseport", 0),
]


def listen_address(host: str, port: int) -> str:
    """host:port as grpc binds it and the log says it: an IPv6 address in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def unresolvable(host: str) -> str | None:
    """Why `host` cannot be listened on as given (it resolves to no address: a typo, an invalid
    IP), or None. Checked before the engine starts, like port_taken."""
    try:
        socket.getaddrinfo(host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


def port_taken(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (another process holds it, the address is not this
    machine's), or None. Checked before the engine starts, so a taken port fails in a second, not
    after minutes of loading; the server's own bind stays the final word (the port may be taken
    meanwhile). SO_REUSEADDR as grpc sets it: a port left in TIME_WAIT by a stopped worker is free."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError):
        return None  # unresolvable() reports it
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def structured_output_available(engine_cfg: EngineConfig, facts) -> bool:
    """Whether constraints are applied: --grammar-backend xgrammar, the xgrammar package, a tokenizer.
    Logged once at startup when the backend is on but cannot work."""
    if engine_cfg.model.grammar_backend == "none":
        return False
    if importlib.util.find_spec("xgrammar") is None:
        logger.warning("structured output off: the xgrammar package is not installed (pip install xgrammar)")
        return False
    if not facts.has_tokenizer:
        logger.warning("structured output off: no tokenizer.json next to the model")
        return False
    return True


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


async def serve(server_cfg: ServerConfig, args: ServerArgs, facts, engine: EngineClient,
                signals: list[int] | None = None, launched: float | None = None) -> int:
    """Serve until a stop signal or the engine's death. `args`: what the servicer and the metrics
    read (and GetServerInfo reports). `signals`: stop signals already received (during startup);
    the ones received here are appended."""
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

    first_signal = 0.0

    def on_signal(sig: int) -> None:
        nonlocal first_signal
        signals.append(sig)
        name = signal.Signals(sig).name
        if not stop.is_set():
            logger.info("%s: shutting down: draining in-flight requests for up to %.0fs "
                        "(a second SIGTERM/SIGINT stops at once)", name, server_cfg.drain_timeout)
            first_signal = time.monotonic()
            stop.set()
        elif time.monotonic() - first_signal < SAME_STOP_WITHIN_S:
            # One stop sent twice: GNU timeout signals its child, then the child's group.
            logger.info("%s again within %.2fs of the first: the same stop, still draining", name, SAME_STOP_WITHIN_S)
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
        # exit_code is read late: on_dead sets it.
        return await _serve(server_cfg, args, facts, engine, stop, now, signals, lambda: exit_code,
                            time.monotonic() if launched is None else launched)
    finally:
        # From here a stop signal kills the engine processes (engine.shutdown is next); swapped
        # here, not after the loop closes, which would restore the default handlers meanwhile.
        for sig in handled:
            loop.remove_signal_handler(sig)
            signal.signal(sig, _kill_on_signal(engine))


async def _serve(server_cfg: ServerConfig, args: ServerArgs, facts, engine: EngineClient, stop: asyncio.Event,
                 now: asyncio.Event, signals: list[int], exit_code, launched: float) -> int:
    """serve()'s body; `exit_code()`: 0, or 1 once the engine died."""
    if signals:  # a stop signal came between the engine's start and the handlers above
        stop.set()
        if len(signals) > 1:
            now.set()
    warm_up_start = time.monotonic()
    await _warm_up(engine, facts)
    logger.info("warm-up generation passed (startup: warm-up generation %.1f s)", time.monotonic() - warm_up_start)
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

    from tokenspeed_worker.server.decode_guard import guarded

    interceptors = []  # none unless asked for: an interceptor costs every call a coroutine
    if server_cfg.api_key == "":  # `--api-key "$KEY"` with KEY unset: say so rather than serve open in silence
        logger.warning("--api-key is empty: every client is served without a key")
    if server_cfg.api_key:
        from tokenspeed_worker.server.auth import ApiKeyInterceptor

        interceptors.append(ApiKeyInterceptor(server_cfg.api_key))
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors or None)
    servicer = TokenSpeedSchedulerServicer(engine, facts, args)
    pb_grpc.add_TokenSpeedSchedulerServicer_to_server(servicer, guarded(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, guarded(server))
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = listen_address(server_cfg.host, server_cfg.grpc_port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        logger.error("cannot listen on %s: %s", address, e)
        return 1
    await server.start()
    servicer.serving = True
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    engine.serving()  # the engines capture their decode graphs left from now on, while idle
    if server_cfg.api_key:
        logger.info("API key required on every RPC except the health checks")
    logger.info("tokenspeed-worker serving %s on %s (port %d), ready %.1f s after launch", facts.served_model_name,
                address, port, time.monotonic() - launched)

    watchdog = asyncio.create_task(_watchdog(engine, server_cfg.watchdog_timeout))
    await stop.wait()
    watchdog.cancel()
    if metrics_task is not None:
        metrics_task.cancel()
    # Both health surfaces go NOT_SERVING at once; new Generate calls get UNAVAILABLE.
    servicer.serving = False
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if exit_code() == 0:
        await _drain(engine, servicer, server_cfg.drain_timeout, now)
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
    # Counted as the gateway sees them: requests (Generate calls), not their samples (n > 1).
    logger.info("draining %d request(s) for up to %.0fs", len(engine.by_request_id), timeout)
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


_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def _ports_refused(server_cfg: ServerConfig, args: ServerArgs) -> int:
    """The exit code (logged why) when the gRPC port, or with --enable-metrics the metrics port,
    cannot be listened on; 0 when both can. Checked before the engine starts: not after minutes of
    loading."""
    bad = unresolvable(server_cfg.host)
    if bad:
        logger.error("argument --host: cannot listen on %r: %s", server_cfg.host, bad)
        return 2
    taken = port_taken(server_cfg.host, server_cfg.grpc_port)
    if taken:
        logger.error("cannot listen on %s: %s", listen_address(server_cfg.host, server_cfg.grpc_port), taken)
        return 1
    if not args.enable_metrics:
        return 0
    from tokenspeed_worker.server.metrics import metrics_address

    try:
        metrics_host, metrics_port = metrics_address(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    bad = unresolvable(metrics_host)
    if bad:
        logger.error("argument --metrics-host: cannot listen on %r: %s", metrics_host, bad)
        return 2
    hosts = {metrics_host, server_cfg.host.strip("[]")}
    if metrics_port == server_cfg.grpc_port and (len(hosts) == 1 or hosts & _WILDCARD_HOSTS):
        logger.error("cannot serve metrics: --metrics-port %d is the gRPC port", metrics_port)
        return 2
    taken = port_taken(metrics_host, metrics_port)
    if taken:
        logger.error("cannot serve metrics on %s: %s", listen_address(metrics_host, metrics_port), taken)
        return 1
    return 0


def run_server(args: ServerArgs, launched: float | None = None) -> int:
    """Run the worker of parsed, resolved and supported `args` (cli.prepare) until SIGTERM/SIGINT
    (exit 0) or an engine failure (exit 1); 2 when the model or a setting cannot work. The stop
    signals are handled from the engine's start on (see the module docstring). launched: the
    time.monotonic() of the launch, for the startup report (default: now)."""
    launched = time.monotonic() if launched is None else launched
    given = args.model
    try:
        resolve_hub_ids(args)  # a hub id served from the local hub cache; never downloaded
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if args.model != given:
        logger.info("model %s: the hub cache's snapshot %s", given, args.model)
    try:
        config = WorkerConfig.from_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    server_cfg, engine_cfg = config.server, config.engine
    try:
        facts = load_model_facts(args.model, args.tokenizer, args.served_model_name,
                                 engine_cfg.scheduler.max_model_len, engine_cfg.model.dtype)
    except (OSError, KeyError, ValueError) as e:
        logger.error("cannot read the model at %s: %s", args.model, e)
        return 2
    try:
        check_architectures(facts.architectures)  # before an engine is spawned to find out
        check_weights_present(args.model, engine_cfg.model.load_format)  # exit 2 now, not 1 from the engine
        parallel = engine_cfg.parallel
        check_parallel_fit(json.loads((Path(args.model) / "config.json").read_text()),
                           parallel.tensor_parallel_size, parallel.expert_parallel_size)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    if server_cfg.node_rank > 0:  # a node that only runs its tensor-parallel ranks
        from tokenspeed_worker.engine.tp_worker import run_node

        return run_node(engine_cfg, server_cfg.node_rank, server_cfg.log_level)
    refused = _ports_refused(server_cfg, args)
    if refused:
        return refused
    facts.data_parallel_size = server_cfg.data_parallel_size
    facts.structured_output = structured_output_available(engine_cfg, facts)
    if not facts.structured_output:  # one decision: the server refuses constraints, the engine builds nothing
        engine_cfg = engine_cfg.replace(grammar_backend="none")
    engine = EngineClient(engine_cfg, server_cfg.log_level, server_cfg.data_parallel_size)
    signals: list[int] = []

    def during_startup(signum, frame) -> None:  # the loading can take minutes: stop it
        signals.append(signum)
        engine.cancel_start()

    # Only the main thread may set handlers (and the engine processes are spawned from it).
    own_signals = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, during_startup) for sig in STOP_SIGNALS} if own_signals else {}
    try:
        try:
            engine_start = time.monotonic()
            logger.info("startup: server setup %.1f s (grpc imported, configuration and model read)",
                        engine_start - launched)
            ready = engine.start()
            logger.info("startup: engine start %.1f s (its processes spawned, their imports, the engine's phases)",
                        time.monotonic() - engine_start)
        except StartCancelled:
            logger.info("%s during startup: engine processes killed, exiting", signal.Signals(signals[0]).name)
            return 0
        except EngineUnavailable as e:
            logger.error("%s", e)
            return 1
        facts.dtype = ready.dtype
        if 0 < ready.max_request_tokens < facts.max_context_length:
            # As SGLang does: requests are bounded by what the pool holds, not refused one by one
            # (an unset max_new_tokens reaches the context length); GetModelInfo reports the bound.
            logger.warning("the KV pool holds %d tokens, fewer than the context length %d: a request's prompt and "
                           "output together are limited to %d tokens (a larger max_new_tokens is clamped)",
                           ready.max_request_tokens, facts.max_context_length, ready.max_request_tokens)
            facts.max_context_length = ready.max_request_tokens
        try:
            uvloop = __import__("uvloop")
            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        try:
            return runner(serve(server_cfg, args, facts, engine, signals, launched))
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
