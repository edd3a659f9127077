"""Request observability: Prometheus metrics, the per-request stats line, request logging.

All of it lives in the server process and is driven by `EngineClient` through one
`RequestObserver`. Without --enable-metrics, --enable-log-request-stats and
--enable-log-requests no observer exists and `EngineClient` skips every hook (one
`is None` check per step, none per token).

Timestamps are host-side wall-clock (`time.time()`), never a GPU sync:
  recv_ts    the server registered the request (EngineClient.submit)
  commit_ts  start of the engine step that first put the request in a forward batch
             (StepOutput.scheduled_ids / step_start_ts)
  first_ts   the server received the step output carrying the first token
  finish_ts  the server saw the request end (finish, abort or error)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tokenspeed_worker.engine.messages import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

logger = logging.getLogger("tokenspeed_worker.requests")

FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort"}
# --log-requests-level 2 truncates token id lists to this many.
LOG_IDS_LIMIT = 2048

# Buckets in the style of vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5,
                 1.0, 2.0, 5.0)


@dataclass
class RequestStats:
    """The `Req: <rid> Finish! RequestStats(...)` line's payload (its repr is the line)."""

    status: str
    reason: str
    prompt_tokens: int
    cache_tokens: int
    output_tokens: int
    cache_hit_rate: float
    queue_ms: float
    prefill_ms: float
    ttft_ms: float
    total_ms: float
    preempt_ms: float
    preempt_count: int
    decode_tps: float
    acc_len: float | None
    acc_rate: float | None
    recv_ts: float
    commit_ts: float
    finish_ts: float


class PrometheusMetrics:
    """The tokenspeed:* metrics, in their own registry (nothing process-global is exported)."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        m = {"model_name": model_name}
        self.model_name = model_name

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=registry)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(**m)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=registry).labels(**m)

        self._success = counter("tokenspeed:request_success", "Requests (samples) ended, by finish reason.",
                                ["finish_reason"])
        self.success = {r: self._success.labels(model_name=model_name, finish_reason=r)
                        for r in ("stop", "length", "abort")}
        self._errors = counter("tokenspeed:request_errors", "Requests that ended with a gRPC error, by status code.",
                               ["code"])
        self.prompt_tokens = counter("tokenspeed:prompt_tokens", "Prompt tokens of requests whose prefill "
                                     "completed.").labels(**m)
        self.generation_tokens = counter("tokenspeed:generation_tokens", "Generated tokens.").labels(**m)
        self.prefix_cache_hit_tokens = counter("tokenspeed:prefix_cache_hit_tokens",
                                               "Prompt tokens served from the prefix cache.").labels(**m)
        self.preemptions = counter("tokenspeed:num_preemptions", "Requests preempted by the scheduler.").labels(**m)
        self.spec_draft_tokens = counter("tokenspeed:spec_draft_tokens",
                                         "Draft tokens verified (speculative decoding).").labels(**m)
        self.spec_accepted_tokens = counter("tokenspeed:spec_accepted_tokens",
                                            "Draft tokens the model agreed with and output (speculative "
                                            "decoding).").labels(**m)
        self.spec_undrafted_batches = counter(
            "tokenspeed:spec_undrafted_batches", "Steps whose decoding batch was too large to draft for "
            "(speculative decoding off for the step).").labels(**m)
        self.spec_backoff_steps = counter(
            "tokenspeed:spec_backoff_steps", "Request-steps that drafted nothing because the request was "
            "backing off after a verified step that kept none of its drafts (speculative decoding).").labels(**m)
        self.ttft = hist("tokenspeed:time_to_first_token_seconds", "Received -> first token.", _TTFT_BUCKETS)
        self.itl = hist("tokenspeed:inter_token_latency_seconds",
                        "Gap between two tokens of a request, as the server receives them.", _ITL_BUCKETS)
        self.e2e = hist("tokenspeed:e2e_request_latency_seconds", "Received -> finished.", _REQUEST_BUCKETS)
        self.queue = hist("tokenspeed:request_queue_time_seconds",
                          "Received -> first scheduled into a forward batch.", _REQUEST_BUCKETS)
        self.step = hist("tokenspeed:step_duration_seconds", "Duration of one engine step.", _STEP_BUCKETS)
        self.running = gauge("tokenspeed:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("tokenspeed:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("tokenspeed:kv_cache_usage_perc", "KV cache usage, 0-1 (1 = full).")
        self.hit_rate = gauge("tokenspeed:prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens, 0-1.")
        # The engine reports these counters as running totals: each load's increase is added.
        self._totals = {"num_preemptions": self.preemptions, "spec_undrafted_batches": self.spec_undrafted_batches,
                        "spec_backoff_steps": self.spec_backoff_steps}
        self._last_totals: dict[str, int] = {}

    def error(self, code: str) -> None:
        self._errors.labels(model_name=self.model_name, code=code).inc()

    def set_loads(self, loads) -> None:
        self.running.set(loads.num_running)
        self.waiting.set(loads.num_waiting)
        capacity = loads.num_total_blocks * loads.block_size
        self.kv_usage.set(loads.num_used_tokens / capacity if capacity else 0.0)
        self.hit_rate.set(loads.cache_hit_rate)
        for name, counter in self._totals.items():
            total, last = getattr(loads, name), self._last_totals.get(name)
            if last is not None and total > last:
                counter.inc(total - last)
            self._last_totals[name] = total

    def start_http_server(self, host: str, port: int):
        """Serve /metrics from a daemon thread; returns the server (shutdown() to stop)."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class RequestObserver:
    """Called by EngineClient at a request's arrival, first schedule, tokens and end."""

    def __init__(self, metrics: PrometheusMetrics | None, log_stats: bool, log_requests: bool,
                 log_requests_level: int = 0) -> None:
        self.metrics = metrics
        self.log_stats = log_stats
        self.log_requests = log_requests
        self.level = log_requests_level
        # Output ids are kept per request only when the finish line prints them.
        self.keep_output_ids = log_requests and log_requests_level >= 2

    # ---- arrival -------------------------------------------------------------

    def on_arrival(self, request_id: str, adds) -> None:
        if not self.log_requests:
            return
        add = adds[0]
        parts = [f"n={len(adds)}", f"prompt_tokens={len(add.prompt_ids)}", f"max_new_tokens={add.max_new_tokens}"]
        if self.level >= 1:
            p = add.sampling_params
            parts.append(
                f"sampling=(temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k}, min_p={p.min_p}, "
                f"seed={p.seed}, stop_token_ids={list(p.stop_token_ids)}, min_new_tokens={p.min_new_tokens}, "
                f"frequency_penalty={p.frequency_penalty}, presence_penalty={p.presence_penalty}, "
                f"repetition_penalty={p.repetition_penalty}, return_logprob={p.return_logprob})"
            )
        if self.level >= 2:
            parts.append(f"input_ids={_ids(add.prompt_ids.tolist(), self.level)}")
        logger.info("Req: %s Receive! %s", request_id, ", ".join(parts))

    # ---- engine progress -----------------------------------------------------

    def on_scheduled(self, st, ts: float) -> None:
        if st.commit_ts:
            return
        st.commit_ts = ts
        if self.metrics is not None:
            self.metrics.queue.observe(max(0.0, ts - st.recv_ts))

    def on_step(self, msg, num_tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.step.observe(msg.step_seconds)
            if num_tokens:
                self.metrics.generation_tokens.inc(num_tokens)
            if msg.spec_ids is not None:
                self.metrics.spec_draft_tokens.inc(int(msg.spec_draft_tokens.sum()))
                self.metrics.spec_accepted_tokens.inc(int(msg.spec_accepted_tokens.sum()))

    def on_token(self, st, token: int, now: float) -> None:
        """After `st.num_output_tokens` was incremented for `token`."""
        m = self.metrics
        if st.num_output_tokens == 1:
            st.first_ts = now
            if m is not None:
                m.ttft.observe(now - st.recv_ts)
                m.prompt_tokens.inc(st.prompt_len)
                if st.cached_tokens:
                    m.prefix_cache_hit_tokens.inc(st.cached_tokens)
        elif m is not None:
            m.itl.observe(now - st.last_ts)
        st.last_ts = now
        if self.keep_output_ids:
            st.output_ids.append(token)

    # ---- end -------------------------------------------------------------------

    def on_end(self, st) -> None:
        """Once per sample, when it finished, was aborted or failed."""
        now = time.time()
        if st.error is not None:
            status, reason = "aborted", "error"
        else:
            reason = FINISH_NAMES.get(st.finish_reason, "abort")
            status = "aborted" if reason == "abort" else "finished"
        m = self.metrics
        if m is not None:
            if st.error is not None:
                m.error(st.error[0])
            else:
                m.success[reason].inc()
            m.e2e.observe(now - st.recv_ts)
        rid = st.request_id if st.index == 0 else f"{st.request_id}[{st.index}]"
        if self.log_stats:
            logger.info("Req: %s Finish! %r", rid, self.stats(st, status, reason, now))
        if self.log_requests:
            parts = [f"status={status}", f"reason={reason}", f"prompt_tokens={st.prompt_len}",
                     f"cached_tokens={st.cached_tokens}", f"output_tokens={st.num_output_tokens}",
                     f"e2e_ms={(now - st.recv_ts) * 1e3:.1f}"]
            if st.error is not None:
                parts.append(f"error={st.error[0]}: {st.error[1]}")
            if self.keep_output_ids:
                parts.append(f"output_ids={_ids(st.output_ids, self.level)}")
            logger.info("Req: %s Done! %s", rid, ", ".join(parts))

    @staticmethod
    def stats(st, status: str, reason: str, finish_ts: float) -> RequestStats:
        recv, commit, first = st.recv_ts, st.commit_ts, st.first_ts
        out = st.num_output_tokens
        decode_s = (finish_ts - first) if first else 0.0
        return RequestStats(
            status=status,
            reason=reason,
            prompt_tokens=st.prompt_len,
            cache_tokens=st.cached_tokens,
            output_tokens=out,
            cache_hit_rate=round(st.cached_tokens / st.prompt_len, 3) if st.prompt_len else 0.0,
            queue_ms=round(max(0.0, commit - recv) * 1e3, 1) if commit else 0.0,
            prefill_ms=round(max(0.0, first - commit) * 1e3, 1) if first and commit else 0.0,
            ttft_ms=round((first - recv) * 1e3, 1) if first else 0.0,
            total_ms=round((finish_ts - recv) * 1e3, 1),
            preempt_ms=0.0,
            preempt_count=0,
            decode_tps=round((out - 1) / decode_s, 1) if out > 1 and decode_s > 0 else 0.0,
            acc_len=round(1.0 + st.spec_accepted_tokens / st.spec_verify_steps, 3) if st.spec_verify_steps else None,
            acc_rate=round(st.spec_accepted_tokens / st.spec_draft_tokens, 3) if st.spec_draft_tokens else None,
            recv_ts=round(recv, 3),
            commit_ts=round(commit, 3),
            finish_ts=round(finish_ts, 3),
        )


def _ids(ids: list[int], level: int) -> str:
    if level < 3 and len(ids) > LOG_IDS_LIMIT:
        return f"{ids[:LOG_IDS_LIMIT]}... ({len(ids)} ids)"
    return str(ids)


def make_observer(args) -> RequestObserver | None:
    """The observer the flags ask for, or None (then nothing is measured at all)."""
    enable_metrics = bool(args.enable_metrics)
    log_stats = bool(args.enable_log_request_stats)
    log_requests = bool(args.enable_log_requests)
    if not (enable_metrics or log_stats or log_requests):
        return None
    metrics = PrometheusMetrics(args.served_model_name) if enable_metrics else None
    return RequestObserver(metrics, log_stats, log_requests, int(args.log_requests_level or 0))


def metrics_address(args) -> tuple[str, int]:
    host = args.metrics_host or args.host
    port = getattr(args, "metrics_port", None) or args.grpc_port + 1000
    if port > 65535:
        raise ValueError(f"--metrics-port: --grpc-port + 1000 = {port} is not a port; give --metrics-port")
    return host.strip("[]"), port
