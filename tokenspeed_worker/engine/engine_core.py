"""The engine core: scheduler + model runner + sampler, stepped in one process.

`EngineCore` is the in-process heart (tests drive it directly); `process.py`
wraps it in the busy loop of the engine process. One `step()` is
schedule -> forward -> sample -> advance, and returns one `StepOutput` for
every request that produced a token in it.

Requests are known to the native scheduler by a *row*: a small integer that
indexes this class's per-request parameter arrays, so gathering sampling
parameters for a batch is one numpy fancy-index, not a per-request loop.
Rows are recycled after a request ends; the server's own ids never are.

Overlap scheduling (`launch` / `complete`): `launch()` schedules a step, enqueues its
forward and sampling on the device, starts copying the sampled tokens to the host and
commits the plan in the scheduler with those tokens *pending*; `complete()` waits for
the tokens and resolves them (finishes, releases). The engine loop launches step N+1
before completing step N, so the host's scheduling and output work for one step runs
while the device computes the other; a decode row of step N+1 reads its input token
(sampled by step N) on the device (model_runner: negative input ids). `step()` is
`complete(launch())`: the same without overlap.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_worker import distributed, env
from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine.kv_event_publisher import events_wire
from tokenspeed_worker.engine.messages import AddRequest, EngineReady, KvEvents, Loads, StepOutput

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# Sampler temporaries per logit of a full batch (a few float32 [S, V] copies: processed scores,
# noise, log-softmax for logprobs); an estimate, the sampler is not part of the profiling forward.
_SAMPLER_BYTES_PER_LOGIT = 16
THROUGHPUT_WINDOW_S = 10.0  # Loads.gen_throughput: output tokens per second over this window
KV_LOADS_S = 0.02  # KvEvents carry the engine's loads at most this often (server/kv_events.FLUSH_S)


def size_kv_pool_tokens(cfg: EngineConfig, kv_bytes_per_token: int, device: torch.device, runner=None) -> int:
    """How many tokens the paged KV pool holds when --max-total-tokens is not given.

    On CUDA: total x --gpu-memory-utilization, minus what is in use after loading (weights,
    CUDA context, other processes), minus the peak activations of the largest step measured
    by a profiling forward (`runner.profile_peak_activation_bytes`: one step's token budget
    of prefill plus the LM head for max_num_seqs rows), minus the CUDA graphs' reserve
    (exact static buffers + a fixed allowance, see model_executor/cuda_graph.py), minus an
    estimate for the sampler's [max_num_seqs, vocab] float32 temporaries.
    """
    cache, scheduler = cfg.cache, cfg.scheduler
    max_num_seqs, max_model_len = scheduler.max_num_seqs, scheduler.max_model_len
    if device.type == "cuda":
        utilization = cache.gpu_memory_utilization
        step_tokens = scheduler.token_budget
        if runner is not None:
            activation = runner.profile_peak_activation_bytes(step_tokens, max_num_seqs)
            graph_reserve = runner.cuda_graph_reserve_bytes()
            sampler_reserve = max_num_seqs * runner.vocab_size * _SAMPLER_BYTES_PER_LOGIT
            weights = runner.weight_bytes()
        else:  # no runner to profile: a fixed headroom
            activation = max(2 * _GIB, int(0.05 * torch.cuda.mem_get_info(device)[1]))
            graph_reserve = sampler_reserve = weights = 0
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * utilization) - used - activation - graph_reserve - sampler_reserve
        logger.info(
            "KV pool sizing: %.2f GiB total x %.2f utilization = %.2f GiB; in use %.2f GiB (weights %.2f GiB); "
            "peak activations %.2f GiB (profiled: %d-token prefill + LM head for %d rows); CUDA graph reserve "
            "%.2f GiB; sampler reserve %.2f GiB -> KV pool %.2f GiB = %d tokens",
            total / _GIB, utilization, total * utilization / _GIB, used / _GIB,
            weights / _GIB, activation / _GIB, step_tokens, max_num_seqs, graph_reserve / _GIB,
            sampler_reserve / _GIB, max(budget, 0) / _GIB, max(budget, 0) // kv_bytes_per_token,
        )
        if budget <= kv_bytes_per_token * cache.block_size:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (total {total / _GIB:.1f} GiB, used {used / _GIB:.1f} GiB, "
                f"peak activations {activation / _GIB:.2f} GiB, CUDA graph reserve {graph_reserve / _GIB:.2f} GiB, "
                f"--gpu-memory-utilization {utilization}); raise --gpu-memory-utilization, "
                "lower --chunked-prefill-size or --max-num-seqs, or pass --enforce-eager"
            )
        return budget // kv_bytes_per_token
    # CPU: a fixed share of physical memory, at most 4 GiB, and never more than
    # every sequence at full length needs.
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        phys = 16 * _GIB
    budget = min(4 * _GIB, phys // 8)
    tokens = budget // kv_bytes_per_token
    return int(max(max_model_len, min(tokens, max_model_len * max_num_seqs)))


def build_runner(cfg: EngineConfig):
    """The model runner of this rank with its KV pool allocated and its CUDA graphs captured;
    returns (runner, num_blocks). Every tensor-parallel rank runs this in lockstep (the profiling
    forward and the graph captures hold collectives); the pool size is the smallest any rank can hold."""
    from tokenspeed_worker.model_executor.model_runner import ModelRunner

    torch.manual_seed(cfg.model.seed)
    device = torch.device(cfg.rank_device)
    if device.type == "cuda" and device.index is not None:
        # Triton launches and CUDA-graph captures use the current device: a data-parallel replica
        # or tensor-parallel rank on cuda:1 must make it current, not just place its tensors there.
        torch.cuda.set_device(device)
    runner = ModelRunner(cfg)
    device = torch.device(runner.device)
    if cfg.cache.max_total_tokens:
        pool_tokens = int(cfg.cache.max_total_tokens)
    else:
        pool_tokens = size_kv_pool_tokens(cfg, runner.kv_bytes_per_token(), device, runner)
    if distributed.size() > 1:
        smallest = torch.tensor([pool_tokens], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN)
        pool_tokens = int(smallest.item())
    num_blocks = max(1, pool_tokens // cfg.cache.block_size)
    runner.allocate_kv_cache(num_blocks)
    runner.tune_attention()
    runner.capture_cuda_graphs()
    runner.warm_up_kernels()
    return runner, num_blocks


class EngineCore:
    def __init__(self, cfg: EngineConfig) -> None:
        from tokenspeed_worker.sampling.sampler import Sampler, default_sampling_backend
        from tokenspeed_worker.sampling.state import SamplingState
        from tokenspeed_worker.scheduler.scheduler import Scheduler

        self.cfg = cfg
        self.runner, self.num_blocks = build_runner(cfg)
        self.device = torch.device(self.runner.device)
        self.kv_cache_bytes = self.num_blocks * cfg.cache.block_size * self.runner.kv_bytes_per_token()
        self.tp_size = cfg.parallel.tensor_parallel_size
        self.scheduler = Scheduler.from_config(cfg.scheduler, cfg.cache, self.num_blocks)
        self.kv_publisher = None
        self._kv_events_sent = 0  # KV events handed out by take_kv_events (their ids follow on)
        self._kv_loads_at = -KV_LOADS_S  # time.monotonic() the last KvEvents carried loads
        kv_events = cfg.cache.kv_events
        if kv_events is not None:
            from tokenspeed_worker.engine.kv_event_publisher import ZmqKvEventPublisher

            self.kv_publisher = ZmqKvEventPublisher(kv_events["endpoint"], kv_events.get("topic", ""))
        self.overlap_schedule = resolve_overlap(cfg.scheduler.overlap_schedule, self.device)
        self.sampling_backend = cfg.model.sampling_backend or default_sampling_backend(self.device)
        self.sampler = Sampler(self.sampling_backend)
        self.grammars = self._make_grammars(cfg)
        self._grammar_pending: dict[int, tuple[AddRequest, object]] = {}  # req_id -> (request, future)
        self._failures: list[tuple[int, str, str]] = []  # (req_id, status code name, message) to report

        # Per-row request state (see module docstring): the server's id here, everything
        # sampling needs (parameters, output positions, penalty counts) in SamplingState.
        cap = 64
        self._server_id = np.full(cap, -1, dtype=np.int64)
        self._was_scheduled = np.zeros(cap, dtype=bool)  # row already in a forward batch once
        self.sampling = SamplingState(cap, self.runner.vocab_size, self.device)
        self._free_rows: list[int] = list(range(cap - 1, -1, -1))
        self._last_launched: LaunchedStep | None = None  # the grammar matchers follow its tokens
        self._row_of: dict[int, int] = {}

        # (time.monotonic(), tokens) of the steps of the last THROUGHPUT_WINDOW_S and their sum:
        # loads() runs after every step that has KV events, so it must not scan the window.
        self._tokens_window: collections.deque[tuple[float, int]] = collections.deque()
        self._window_tokens = 0
        self._steps = 0  # non-empty steps run
        from tokenspeed_worker.engine.profiler import EngineProfiler

        self.profiler = EngineProfiler(self.device)
        self._fault = _parse_fault(env.FAULT_INJECT.get())
        logger.info(
            "engine ready: %s on %s (%s), attention %s, CUDA graphs %s, overlap scheduling %s, KV pool %d blocks x %d tokens (%.2f GiB), "
            "weights %.2f GiB",
            cfg.model.path,
            self.device,
            self.runner.dtype,
            self.runner.attention_backend.name,
            "on" if self.runner.cuda_graphs is not None else f"off ({self.runner.cuda_graphs_off_reason})",
            "on" if self.overlap_schedule else "off",
            self.num_blocks,
            cfg.cache.block_size,
            self.kv_cache_bytes / _GIB,
            self.runner.weight_bytes() / _GIB,
        )

    # ---- facts ------------------------------------------------------------

    def stop_followers(self) -> None:
        """Tell the other tensor-parallel ranks to exit (they also exit when this rank dies)."""
        if self.tp_size > 1:
            try:
                distributed.broadcast_object(("stop",))
            except Exception:  # a rank already gone: nothing to stop
                pass

    def ready_message(self) -> EngineReady:
        return EngineReady(
            num_blocks=self.num_blocks,
            block_size=self.cfg.cache.block_size,
            max_total_tokens=self.num_blocks * self.cfg.cache.block_size,
            max_model_len=self.cfg.scheduler.max_model_len,
            max_num_seqs=self.cfg.scheduler.max_num_seqs,
            kv_cache_bytes=self.kv_cache_bytes,
            weight_bytes=self.runner.weight_bytes(),
            device=str(self.device),
            dtype=str(self.runner.dtype).replace("torch.", ""),
            graph_bytes=self.runner.graph_bytes,
        )

    def loads(self) -> Loads:
        s = self.scheduler
        now = time.monotonic()
        self._trim_window(now)
        window = self._tokens_window
        span = (now - window[0][0]) if len(window) > 1 else 0.0
        throughput = self._window_tokens / span if span > 0 else 0.0
        return Loads(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_used_tokens=s.num_used_tokens,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            block_size=self.cfg.cache.block_size,
            waiting_tokens=s.waiting_tokens,
            num_preemptions=s.num_preemptions,
            gen_throughput=throughput,
            cache_hit_rate=s.cache_hit_rate,
            num_cached_blocks=s.num_cached_blocks,
            num_grammar_waiting=len(self._grammar_pending),
            num_retracted=s.num_retracted,
        )

    def _trim_window(self, now: float) -> None:
        window = self._tokens_window
        while window and now - window[0][0] >= THROUGHPUT_WINDOW_S:
            self._window_tokens -= window.popleft()[1]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._grammar_pending)

    @property
    def waiting_for_grammar(self) -> bool:
        """Requests whose grammar is still compiling (not in the scheduler yet)."""
        return bool(self._grammar_pending)

    def take_failures(self) -> list[tuple[int, str, str]]:
        """Requests that failed outside a step (a grammar that did not compile): (id, code, message)."""
        failures, self._failures = self._failures, []
        return failures

    @staticmethod
    def _make_grammars(cfg: EngineConfig):
        from tokenspeed_worker.engine.grammar import Grammars, xgrammar_available

        # The server decided whether constraints are served (launch.structured_output_available) and
        # set grammar_backend "none" if not; engines built directly (tests, benchmarks) check here.
        if cfg.model.grammar_backend == "none" or not cfg.model.tokenizer_path or not xgrammar_available():
            return None
        try:
            return Grammars(cfg.model.tokenizer_path, _vocab_size(cfg))
        except Exception as exc:  # a tokenizer xgrammar cannot read: constraints are refused upstream
            logger.warning("structured output unavailable: %s", exc)
            return None

    @property
    def num_requests(self) -> int:
        return len(self._row_of)

    # ---- requests ---------------------------------------------------------

    def _grow(self) -> None:
        old = self._server_id.shape[0]
        new = old * 2
        grown = np.full(new, -1, dtype=np.int64)
        grown[:old] = self._server_id
        self._server_id = grown
        scheduled = np.zeros(new, dtype=bool)
        scheduled[:old] = self._was_scheduled
        self._was_scheduled = scheduled
        self.sampling.ensure_capacity(new)
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def add_request(self, req: AddRequest) -> None:
        """Queue a request. Raises ValueError (message names the problem) if it can't be served.
        A constrained request waits outside the scheduler until its grammar compiled (poll_grammars)."""
        if req.req_id in self._row_of or req.req_id in self._grammar_pending:
            raise ValueError(f"request {req.req_id} is already in flight")
        if req.constraint is not None:
            if self.grammars is None:
                raise ValueError(f"sampling_params.{req.constraint[0]}: structured output is not available "
                                 "(--grammar-backend none, no tokenizer, or xgrammar not installed)")
            self._grammar_pending[req.req_id] = (req, self.grammars.submit(*req.constraint))
            return
        self._admit(req)

    def poll_grammars(self) -> None:
        """Move requests whose grammar finished compiling into the scheduler (or fail them)."""
        for req_id, (req, future) in list(self._grammar_pending.items()):
            if not future.done():
                continue
            del self._grammar_pending[req_id]
            kind = req.constraint[0]
            try:
                compiled = future.result()
            except Exception as exc:  # noqa: BLE001 - xgrammar's errors name the problem
                from tokenspeed_worker.engine.grammar import error_text

                self._failures.append((req_id, "INVALID_ARGUMENT", f"sampling_params.{kind}: {error_text(exc)}"))
                continue
            try:
                self._admit(req)
            except ValueError as exc:
                self._failures.append((req_id, "INVALID_ARGUMENT", str(exc)))
                continue
            self.grammars.start(self._row_of[req_id], compiled)

    def _admit(self, req: AddRequest) -> None:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        wait_for = self._row_of.get(req.wait_for, -1) if req.wait_for >= 0 else -1
        prompt = np.asarray(req.prompt_ids, dtype=np.int32)
        try:
            self.sampling.add_row(row, prompt, _row_params(req))
        except Exception:
            self._free_rows.append(row)
            raise
        try:
            self.scheduler.add_request(
                row, prompt, int(req.max_new_tokens), list(req.stop_token_ids), wait_for=wait_for
            )
        except Exception:
            self.sampling.remove_row(row)
            self._free_rows.append(row)
            raise
        self._row_of[req.req_id] = row
        self._server_id[row] = req.req_id
        self._was_scheduled[row] = False

    def _release(self, row: int) -> None:
        if self.grammars is not None:
            self.grammars.release(row)
        sid = int(self._server_id[row])
        self._row_of.pop(sid, None)
        self._server_id[row] = -1
        self.sampling.remove_row(row)
        self._free_rows.append(row)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix; returns how many blocks stopped being shareable."""
        return int(self.scheduler.flush_prefix_cache())

    def take_kv_events(self) -> KvEvents | None:
        """The prefix-cache events recorded since the last call, for the server (published on ZMQ
        too, as one batch, with --kv-events-config); None when there are none or none are recorded."""
        cfg = self.cfg.cache
        if self.kv_publisher is None and not cfg.report_kv_events:
            return None
        first = cfg.kv_event_id_offset + self._kv_events_sent * cfg.kv_event_id_stride
        if self.kv_publisher is not None:
            events = self.scheduler.drain_kv_events()
            if not events:
                return None
            self.kv_publisher.publish(events)
            data, count = events_wire(events, first, cfg.kv_event_id_stride)
        else:
            data, count = self.scheduler.drain_kv_events_wire(first, cfg.kv_event_id_stride)
            if not count:
                return None
        self._kv_events_sent += count
        # The server builds a load record at most every KV_LOADS_S (its batches gather that long), so
        # the engine's figures go along no more often; between them the last ones stand.
        now = time.monotonic()
        loads = None
        if now - self._kv_loads_at >= KV_LOADS_S:
            self._kv_loads_at = now
            loads = self.loads()
        return KvEvents(time.time(), data, count, loads)

    def abort(self, req_id: int) -> bool:
        if self._grammar_pending.pop(req_id, None) is not None:
            return True
        row = self._row_of.get(req_id)
        if row is None:
            return False
        self.scheduler.abort(row)
        self._release(row)
        return True

    # ---- the step ---------------------------------------------------------

    def run_steps(self):
        """Step until no work is left (`pipeline_step`); yields each step's StepOutput in order, or
        None for a pass that could not schedule anything. Requests may be added between yields."""
        pending = None
        while self.has_work() or pending is not None:
            outputs, pending, failed, launched = self.pipeline_step(pending)
            if failed is not None:
                raise failed
            yield from outputs
            if not outputs and not launched:
                yield None

    def pipeline_step(self, pending: "LaunchedStep | None"):
        """One turn of the engine loop (the engine process and run_steps share it). With overlap
        scheduling, launch step N+1 before completing step N, the `pending` one; without it, complete
        every step first. Constrained requests keep the overlap: step N+1's mask waits, inside its
        launch, only for step N's tokens (`_accept_grammar_tokens`), while N+1's forward runs.
        Returns (outputs completed, in order; the step now pending or None; StepFailed if the launch
        failed (its requests already freed) or None; whether a step was launched)."""
        outputs: list[StepOutput] = []
        failed = None
        launched = None
        if self.has_work():
            try:
                launched = self.launch()
            except StepFailed as exc:
                failed = exc
        if pending is not None:
            outputs.append(self.complete(pending))
            pending = None
        if launched is not None:
            if self.overlap_schedule:
                pending = launched
            else:
                outputs.append(self.complete(launched))
        return outputs, pending, failed, launched is not None

    def step(self) -> StepOutput | None:
        """One step, start to finish (no overlap)."""
        launched = self.launch()
        return None if launched is None else self.complete(launched)

    def launch(self) -> "LaunchedStep | None":
        """Schedule a step and enqueue it on the device; None when nothing can run now.
        Raises StepFailed (its requests freed) when the step cannot run."""
        t0 = time.perf_counter()
        start_ts = time.time()
        if self._grammar_pending:
            self.poll_grammars()
        plan = self.scheduler.schedule()
        if plan.num_reqs == 0:
            return None
        # Requests whose first forward is this one (a boolean gather; no per-request loop).
        fresh = plan.req_ids[~self._was_scheduled[plan.req_ids]]
        if fresh.shape[0]:
            self._was_scheduled[fresh] = True
        rows = plan.req_ids[plan.sample_rows]
        out = StepOutput(
            req_ids=self._server_id[rows].copy(),
            tokens=np.zeros(0, dtype=np.int64),
            finished_ids=np.zeros(0, dtype=np.int64),
            finish_reasons=np.zeros(0, dtype=np.int32),
            scheduled_ids=self._server_id[fresh].copy() if fresh.shape[0] else None,
            step_start_ts=start_ts,
        )
        self._steps += 1
        host: dict[str, torch.Tensor] = {}
        try:
            if self._fault is not None:
                self._inject_fault()
            if self.tp_size > 1:  # the other ranks run the same forward (engine/tp_worker.py)
                distributed.broadcast_object(("step", plan, int(rows.shape[0])))
            if rows.shape[0] > 0:
                logits = self.runner.forward(plan)
                self._sample(logits, rows, host)
            else:
                self.runner.forward(plan)
        except torch.OutOfMemoryError as exc:
            raise self._fail_step(plan, f"out of memory in a step: {exc}".splitlines()[0]) from exc
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        # Read before the step completes: a request that finishes in it is forgotten then.
        out.cached_tokens = self.scheduler.cached_tokens(rows) if rows.shape[0] else np.zeros(0, np.int32)
        self.scheduler.commit()
        launched = LaunchedStep(out=out, rows=rows, host=host, event=event, t0=t0)
        self._last_launched = launched
        return launched

    def _accept_grammar_tokens(self, launched: "LaunchedStep") -> None:
        """Advance the constrained rows' matchers by the tokens `launched` sampled, once per step, in
        launch order. Called when the next step's mask needs them (in its launch, after its forward
        was enqueued, so the wait overlaps that forward) or, at the latest, when `launched` completes.
        A row whose request ended since the launch (released, or its row given to another request:
        engine request ids are unique) is skipped."""
        if launched.grammar_accepted:
            return
        launched.grammar_accepted = True
        tokens = launched.host.get("tokens")
        if self.grammars is None or not self.grammars.active or tokens is None or not launched.rows.shape[0]:
            return
        if launched.event is not None:
            launched.event.synchronize()
        same = self._server_id[launched.rows] == launched.out.req_ids
        rows, tokens = launched.rows[same], tokens.numpy()[same]
        if rows.shape[0]:
            self.grammars.accept(rows, tokens)

    def complete(self, launched: "LaunchedStep") -> StepOutput:
        """Wait for a launched step's sampled tokens; finish and release its requests. Steps
        complete in launch order. Tokens of requests that ended since the launch (aborted, or
        finished by the previous step) are left out of the output."""
        if launched.event is not None:
            launched.event.synchronize()
        self._accept_grammar_tokens(launched)  # before out.req_ids is narrowed to the live rows
        out = launched.out
        host = {name: tensor.numpy() for name, tensor in launched.host.items()}
        tokens = host.pop("tokens", None)
        tokens = np.zeros(0, dtype=np.int64) if tokens is None else tokens.astype(np.int64, copy=False)
        finished_rows, reasons, live = self.scheduler.resolve(tokens)
        if not live.all():
            out.req_ids = out.req_ids[live]
            out.cached_tokens = out.cached_tokens[live]
            tokens = tokens[live]
            host = {name: array[live] for name, array in host.items()}
        out.tokens = tokens
        if self.grammars is not None and self.grammars.active and tokens.shape[0]:
            live_rows = launched.rows if live.all() else launched.rows[live]
            done = set(finished_rows.tolist())
            ended = [row for row in self.grammars.terminated(live_rows) if row not in done]
            for row in ended:  # the grammar is complete: end the request with "stop" now
                self.scheduler.abort(row)
            if ended:
                from tokenspeed_worker.scheduler.scheduler import FinishReason

                finished_rows = np.concatenate([finished_rows, np.asarray(ended, dtype=finished_rows.dtype)])
                reasons = np.concatenate([np.asarray(reasons, dtype=np.int32),
                                          np.full(len(ended), int(FinishReason.STOP), dtype=np.int32)])
        for name, array in host.items():
            setattr(out, name, array)
        out.finished_ids = self._server_id[finished_rows].copy()
        out.finish_reasons = np.asarray(reasons, dtype=np.int32)
        for row in finished_rows.tolist():
            self._release(row)
        if out.tokens.shape[0]:
            now = time.monotonic()
            self._tokens_window.append((now, int(out.tokens.shape[0])))
            self._window_tokens += int(out.tokens.shape[0])
            self._trim_window(now)
        out.step_seconds = time.perf_counter() - launched.t0
        return out

    def _fail_step(self, plan, message: str) -> "StepFailed":
        """Free every request of a step that could not run; the engine keeps serving the rest."""
        failed = [int(self._server_id[row]) for row in plan.req_ids.tolist()]
        for row in plan.req_ids.tolist():
            self.scheduler.abort(row)
        self.scheduler.drop_plan()  # every request in it is gone
        for row in plan.req_ids.tolist():
            self._release(row)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.error("step failed, %d request(s) ended: %s", len(failed), message)
        return StepFailed(failed, message)

    def _inject_fault(self) -> None:
        """Test hook (env TOKENSPEED_FAULT_INJECT=kind@step[:seconds]): oom, hang (for seconds) or
        crash at that step."""
        kind, step, duration = self._fault
        if self._steps != step:
            return
        if kind == "oom":
            raise torch.OutOfMemoryError("injected by TOKENSPEED_FAULT_INJECT")
        if kind == "hang":
            time.sleep(duration)
        if kind == "crash":
            os._exit(3)

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, host: dict) -> None:
        """Sample the rows' next tokens (and logprobs if any row asked) on the device, keep the
        tokens there for the next step's inputs, and start copying the results to `host`
        (StepOutput field name -> CPU tensor, ready once the step's event fired)."""
        batch = self.sampling.batch(rows)
        if self.grammars is not None and self.grammars.active:
            # The previous step, possibly still pending (overlap): its tokens advance the matchers
            # this mask is built from. The device already has this step's forward queued behind it.
            if self._last_launched is not None:
                self._accept_grammar_tokens(self._last_launched)
            masks = self.grammars.fill_bitmask(rows)
            if masks is not None:
                batch.grammar_bitmask, batch.grammar_positions = masks
        # A decode graph took the rows' argmax already: an all-greedy batch's tokens, no kernel here.
        result = self.sampler.sample(logits, batch, greedy=self.runner.greedy_tokens)
        self.sampling.update(rows, result.tokens)
        self.runner.record_sampled(result.tokens)
        if self.tp_size > 1:  # the next plan's pending input ids read them on every rank
            distributed.broadcast_tensor(self.runner.last_sampled[: rows.shape[0]])
        fields = {
            "tokens": result.tokens,
            "logprobs": result.logprobs,
            "top_logprobs": result.top_logprobs,
            "top_logprob_ids": result.top_logprob_ids,
            "ids_logprobs": result.token_ids_logprobs,
            "ids_logprob_ids": result.token_ids_logprob_ids,
            "ids_logprob_counts": result.token_ids_logprob_counts,
        }
        for name, tensor in fields.items():
            if tensor is not None:
                host[name] = _to_host_async(tensor)


@dataclass
class LaunchedStep:
    """A step enqueued on the device whose sampled tokens are not resolved yet (EngineCore.complete)."""

    out: StepOutput
    rows: np.ndarray
    host: dict  # StepOutput field -> CPU tensor being filled by the device
    event: object | None  # CUDA event after the step's copies; None on CPU
    t0: float
    grammar_accepted: bool = False  # its tokens advanced the grammar matchers (_accept_grammar_tokens)


def _vocab_size(cfg: EngineConfig) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model.path)
    return int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)


def resolve_overlap(setting: bool | None, device: torch.device) -> bool:
    """Overlap scheduling: as configured, else env TOKENSPEED_OVERLAP_SCHEDULE (1/0), else on for CUDA."""
    if setting is not None:
        return bool(setting)
    forced = env.OVERLAP_SCHEDULE.get()
    if forced is not None:
        return forced
    return device.type == "cuda"


class StepFailed(RuntimeError):
    """A step could not run (e.g. out of memory); its requests were freed and must fail."""

    def __init__(self, server_ids: list[int], message: str) -> None:
        super().__init__(message)
        self.server_ids = server_ids
        self.message = message


def _parse_fault(spec: str) -> tuple[str, int, float] | None:
    """kind@STEP, or hang@STEP:SECONDS (a stall that ends; hang alone is an hour)."""
    if not spec:
        return None
    kind, _, when = spec.partition("@")
    step, _, seconds = when.partition(":")
    try:
        duration = float(seconds) if seconds else 3600.0
    except ValueError:
        duration = -1.0
    if kind not in ("oom", "hang", "crash") or not step.isdigit() or duration < 0 or (seconds and kind != "hang"):
        raise ValueError(f"TOKENSPEED_FAULT_INJECT: expected oom|hang|crash@STEP or hang@STEP:SECONDS, got {spec!r}")
    logger.warning("fault injection armed: %s at step %s", kind, when)
    return kind, int(step), duration


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of t; from CUDA a non-blocking copy into pinned memory (read after the step's event)."""
    if t.device.type == "cpu":
        return t
    return t.to("cpu", non_blocking=True)


def _row_params(req: AddRequest):
    from tokenspeed_worker.sampling.state import RowSamplingParams

    return RowSamplingParams(
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        min_p=req.min_p,
        seed=req.seed,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=dict(req.logit_bias or {}),
        min_new_tokens=req.min_new_tokens,
        stop_token_ids=tuple(req.stop_token_ids),
        return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num,
        token_ids_logprob=tuple(req.token_ids_logprob),
    )
