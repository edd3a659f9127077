"""The engine core: scheduler + model runner + sampler, stepped in one process.

`EngineCore` is the in-process heart (tests drive it directly); `process.py` wraps it in the
busy loop of the engine process. A step is schedule -> run -> postprocess: `launch()` schedules
(scheduler/scheduler.py) and runs the forward and the sampling on the device; `complete()` waits
for the sampled tokens and postprocesses them (finishes, releases) into one `StepOutput` for
every request that produced a token.

Its parts, one per file: the row table (engine/rows.py: requests by row, so a batch's parameters
are one numpy fancy-index), the per-row sampling state (sampling/state.py), the queue of requests
whose grammar is compiling (engine/grammar.py), the throughput window (engine/throughput.py), the
KV-event outbox (engine/kv_event_publisher.py) and the fault-injection test hook (engine/faults.py).

Overlap scheduling: `launch()` enqueues a step's forward and sampling on the device, starts
copying the sampled tokens to the host and commits the plan in the scheduler with those tokens
*pending*; `complete()` waits for the tokens and resolves them. The engine loop launches step
N+1 before completing step N, so the host's scheduling and output work for one step runs while
the device computes the other; a decode row of step N+1 reads its input token (sampled by step
N) on the device (model_runner: negative input ids). `step()` is `complete(launch())`: the same
without overlap.

Speculative decoding (cfg.speculative): the scheduler gives decoding rows drafts, the step samples
at every drafted position and `complete()` keeps what the model agrees with (engine/speculative.py),
so a row may output several tokens in one step (its id repeats in the StepOutput, one entry per
token, in order). A step with drafts is completed before the next is scheduled, since the next
step's inputs depend on how many tokens were kept, and a request drafts only from known tokens:
so before launching a step that may draft (Scheduler.may_draft) the pending step is completed.
Steps that cannot draft (a batch too large to speculate, every request backing off) keep the
overlap. EAGLE-3 completes every step first: its head drafts from each step's hidden states.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_worker import distributed, env
from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine import faults
from tokenspeed_worker.engine.grammar import GrammarQueue, build_grammars
from tokenspeed_worker.engine.kv_event_publisher import KvEventOutbox
from tokenspeed_worker.engine.messages import AddRequest, EngineReady, KvEvents, Loads, StepOutput
from tokenspeed_worker.engine.rows import RowTable
from tokenspeed_worker.engine.speculative import OracleDrafter, Verify
from tokenspeed_worker.engine.throughput import ThroughputWindow
from tokenspeed_worker.sampling.sampler import SampleOutput
from tokenspeed_worker.startup import StartupPhases

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# Sampler temporaries per logit of a full batch (a few float32 [S, V] copies: processed scores,
# noise, log-softmax for logprobs); an estimate, the sampler is not part of the profiling forward.
_SAMPLER_BYTES_PER_LOGIT = 16


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
            graph_reserve = runner.cuda_graph_reserve_bytes(activation, step_tokens)
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


def build_runner(cfg: EngineConfig, phases: StartupPhases | None = None):
    """The model runner of this rank with its KV pool allocated and its CUDA graphs captured;
    returns (runner, num_blocks); each step timed into `phases` (startup.py). Every tensor-parallel
    rank runs this in lockstep (the profiling forward and the graph captures hold collectives); the
    pool size is the smallest any rank can hold."""
    from tokenspeed_worker.model_executor.model_runner import ModelRunner

    phases = phases if phases is not None else StartupPhases()
    setup_start = time.perf_counter()
    torch.manual_seed(cfg.model.seed)
    device = torch.device(cfg.rank_device)
    if device.type == "cpu" and cfg.model.cpu_threads:
        torch.set_num_threads(cfg.model.cpu_threads)
        logger.info("CPU: %d intra-op threads (this engine process's share of the node's cores)", cfg.model.cpu_threads)
    if device.type == "cuda" and device.index is not None:
        # Triton launches and CUDA-graph captures use the current device: a data-parallel replica
        # or tensor-parallel rank on cuda:1 must make it current, not just place its tensors there.
        torch.cuda.set_device(device)
    runner = ModelRunner(cfg, setup_started=setup_start)  # the CUDA context above counts as runtime setup
    for name, seconds, detail in runner.startup_timings:
        phases.add(name, seconds, detail)
    device = torch.device(runner.device)
    with phases.phase("memory profile and KV pool sizing"):
        if cfg.cache.max_total_tokens:
            pool_tokens = int(cfg.cache.max_total_tokens)
        else:
            pool_tokens = size_kv_pool_tokens(cfg, runner.kv_bytes_per_token(), device, runner)
        if distributed.size() > 1:
            smallest = torch.tensor([pool_tokens], dtype=torch.int64, device=device)
            torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN)
            pool_tokens = int(smallest.item())
    num_blocks = max(1, pool_tokens // cfg.cache.block_size)
    max_len = cfg.scheduler.max_model_len
    if num_blocks * cfg.cache.block_size < max_len and distributed.rank() == 0:
        logger.warning("the KV pool holds %d tokens, fewer than --max-model-len %d: a request needing more is "
                       "refused (raise --max-total-tokens or --gpu-memory-utilization, or lower --max-model-len)",
                       num_blocks * cfg.cache.block_size, max_len)
    with phases.phase("KV cache allocation"):
        runner.allocate_kv_cache(num_blocks)
    with phases.phase("attention timing"):
        runner.tune_attention()
    with phases.phase("CUDA graph capture") as info:
        runner.capture_cuda_graphs()
        report = runner.capture_report
        if report is not None:
            chooser = runner.small_batch_gemv
            info["detail"] = (f"{len(report.sizes)} sizes; first runs, mostly kernel compiles, "
                              f"{report.first_run_seconds:.1f} s; small-batch kernel timing {report.tuning_seconds:.1f} s; "
                              f"small-batch choices {chooser.reused} kept from an earlier start, "
                              f"{len(chooser.decisions) - chooser.reused} timed")
        runner.keep_kernel_choices()
    with phases.phase("kernel warm-up"):
        runner.warm_up_kernels()
    return runner, num_blocks


class EngineCore:
    """One engine: requests in (`add_request`, `abort`), steps out (`launch`/`complete`, `step`,
    `pipeline_step`, `run_steps`), facts for the server (`ready_message`, `loads`, `take_kv_events`)."""

    def __init__(self, cfg: EngineConfig) -> None:
        from tokenspeed_worker.engine.profiler import EngineProfiler
        from tokenspeed_worker.sampling.sampler import Sampler, default_sampling_backend
        from tokenspeed_worker.sampling.state import SamplingState
        from tokenspeed_worker.scheduler.scheduler import Scheduler

        self.cfg = cfg
        self.startup = StartupPhases()
        self.runner, self.num_blocks = build_runner(cfg, self.startup)
        self.device = torch.device(self.runner.device)
        setup_start = time.perf_counter()
        self.kv_cache_bytes = self.num_blocks * cfg.cache.block_size * self.runner.kv_bytes_per_token()
        self.tp_size = cfg.parallel.tensor_parallel_size
        self.speculative = cfg.speculative if cfg.speculative.enabled else None
        self.scheduler = Scheduler.from_config(cfg.scheduler, cfg.cache, self.num_blocks,
                                               sliding_window=self.runner.uniform_sliding_window,
                                               speculative=self.speculative)
        cache = cfg.cache
        self.kv_events = KvEventOutbox(self.scheduler, self.loads, cache.kv_events, cache.report_kv_events,
                                       cache.kv_event_id_offset, cache.kv_event_id_stride)
        # A verified step's kept tokens decide the next step's inputs: it completes first
        # (pipeline_step); EAGLE-3's head drafts after every step, so it never overlaps.
        self.overlap_schedule = resolve_overlap(cfg.scheduler.overlap_schedule, self.device) and not (
            self.speculative is not None and self.speculative.speculative_algorithm == "EAGLE3")
        self.spec_draft_tokens = 0  # drafts verified since start, and of them kept
        self.spec_accepted_tokens = 0
        self.spec_steps = 0  # row-steps that verified a draft
        # A drafter outside the scheduler (the benchmarks' oracle); NGRAM drafts inside it.
        oracle = env.SPECULATIVE_ORACLE.get()
        self.drafter = None
        self.eagle = None
        if self.speculative is not None and self.speculative.speculative_algorithm == "EAGLE3":
            if self.tp_size > 1:
                raise ValueError("--speculative-algorithm EAGLE3 with --tensor-parallel-size > 1 is not supported yet")
            from tokenspeed_worker.engine.eagle3 import Eagle3Drafter

            self.eagle = Eagle3Drafter(self.speculative.draft_model_path, self.runner, self.num_blocks,
                                       cfg.scheduler.max_num_seqs, self.speculative.num_speculative_tokens,
                                       self.speculative.max_speculative_batch)
        if self.speculative is not None and oracle:
            self.drafter = OracleDrafter(oracle, env.SPECULATIVE_ORACLE_ACCEPT.get(), self.runner.vocab_size,
                                         self.speculative.num_speculative_tokens)
            logger.warning("speculative decoding drafts from the oracle file %s (benchmarks only)", oracle)
        self.sampling_backend = cfg.model.sampling_backend or default_sampling_backend(self.device)
        self.sampler = Sampler(self.sampling_backend)
        self.grammars = build_grammars(cfg.model.grammar_backend, cfg.model.tokenizer_path, self.runner.vocab_size,
                                       draft_tokens=cfg.speculative.num_speculative_tokens if cfg.speculative.enabled else 0)
        self.grammar_queue = GrammarQueue()
        self._failures: list[tuple[int, str, str]] = []  # (req_id, status code name, message) to report
        self.sampling = SamplingState(64, self.runner.vocab_size, self.device)
        self.rows = RowTable(self.sampling, 64)
        self._last_launched: LaunchedStep | None = None  # the grammar matchers follow its tokens
        self.throughput = ThroughputWindow()
        self.profiler = EngineProfiler(self.device)
        fault = faults.from_env()
        if fault is not None:  # the test hook wraps the step's device work; nothing checks for it otherwise
            self._run = fault.wrap(self._run)
        self.startup.add("scheduler, sampler and grammar setup", time.perf_counter() - setup_start)
        logger.info(
            "engine ready: %s on %s (%s), attention %s, CUDA graphs %s, overlap scheduling %s, KV pool %d blocks x %d tokens (%.2f GiB), "
            "weights %.2f GiB%s",
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
            "" if self.speculative is None else
            f", speculative decoding {self.speculative.speculative_algorithm} with {self.speculative.num_speculative_tokens} "
            f"draft tokens (steps with drafts complete before the next is scheduled)",
        )
        if distributed.rank() == 0:
            logger.info("startup phases: %s", self.startup.summary())

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
            decode_read_bytes=self.runner.decode_read_bytes(),
            max_request_tokens=self.max_request_tokens(),
        )

    def max_request_tokens(self) -> int:
        """The longest request the scheduler can ever admit: it refuses one whose tokens need more
        blocks than the pool has (Scheduler.peak_blocks), unless a uniform sliding window under
        chunked prefill bounds what a request holds: the window and one step's tokens, plus a block
        (as peak_blocks counts them), when that fits the pool."""
        max_len = self.cfg.scheduler.max_model_len
        block_size = self.cfg.cache.block_size
        window = self.runner.uniform_sliding_window
        if window and window > 0 and self.cfg.scheduler.chunked_prefill:
            held = -(-(window - 1 + max(self.cfg.scheduler.token_budget, 1)) // block_size) + 1
            if held <= self.num_blocks:
                return max_len
        return min(max_len, self.num_blocks * block_size)

    def loads(self) -> Loads:
        s = self.scheduler
        return Loads(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_used_tokens=s.num_used_tokens,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            block_size=self.cfg.cache.block_size,
            waiting_tokens=s.waiting_tokens,
            num_preemptions=s.num_preemptions,
            gen_throughput=self.throughput.rate(),
            cache_hit_rate=s.cache_hit_rate,
            num_cached_blocks=s.num_cached_blocks,
            num_grammar_waiting=len(self.grammar_queue),
            num_retracted=s.num_retracted,
            spec_accept_length=(1.0 + self.spec_accepted_tokens / self.spec_steps) if self.spec_steps else None,
            spec_accept_rate=(self.spec_accepted_tokens / self.spec_draft_tokens) if self.spec_draft_tokens else None,
            spec_undrafted_batches=s.num_undrafted_batches,
            spec_backoff_steps=s.num_backoff_steps,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammar_queue)

    @property
    def waiting_for_grammar(self) -> bool:
        """Requests whose grammar is still compiling (not in the scheduler yet)."""
        return bool(self.grammar_queue)

    @property
    def num_requests(self) -> int:
        return len(self.rows)

    def take_failures(self) -> list[tuple[int, str, str]]:
        """Requests that failed outside a step (a grammar that did not compile): (id, code, message)."""
        failures, self._failures = self._failures, []
        return failures

    def take_kv_events(self) -> KvEvents | None:
        """The prefix-cache events recorded since the last call, for the server (published on ZMQ
        too, as one batch, with --kv-events-config); None when there are none or none are recorded."""
        return self.kv_events.take()

    # ---- requests ---------------------------------------------------------

    def add_request(self, req: AddRequest) -> None:
        """Queue a request. Raises ValueError (message names the problem) if it can't be served.
        A constrained request waits outside the scheduler until its grammar compiled (poll_grammars)."""
        if req.req_id in self.rows or req.req_id in self.grammar_queue:
            raise ValueError(f"request {req.req_id} is already in flight")
        if req.constraint is not None:
            if self.grammars is None:
                raise ValueError(f"sampling_params.{req.constraint[0]}: structured output is not available "
                                 "(--grammar-backend none, no tokenizer, or xgrammar not installed)")
            self.grammar_queue.add(req, self.grammars.submit(*req.constraint))
            return
        self._admit(req)

    def poll_grammars(self) -> None:
        """Move requests whose grammar finished compiling into the scheduler (or fail them)."""
        for req, compiled, error in self.grammar_queue.take_compiled():
            if error is not None:
                self._failures.append((req.req_id, "INVALID_ARGUMENT", error))
                continue
            try:
                row = self._admit(req)
            except ValueError as exc:
                self._failures.append((req.req_id, "INVALID_ARGUMENT", str(exc)))
                continue
            self.grammars.start(row, compiled)

    def _admit(self, req: AddRequest) -> int:
        """Give the request a row and hand it to the scheduler; returns its row."""
        wait_row = self.rows.row_of(req.wait_for) if req.wait_for >= 0 else None  # None: gone, or none
        prompt = np.asarray(req.prompt_ids, dtype=np.int32)
        params = req.sampling_params
        row = self.rows.add(req.req_id, prompt, params)
        try:
            self.scheduler.add_request(row, prompt, int(req.max_new_tokens), list(params.stop_token_ids),
                                       wait_for=-1 if wait_row is None else wait_row,
                                       speculates=self.speculative is not None)
        except Exception:
            self.rows.release(row)
            raise
        return row

    def _release(self, row: int) -> None:
        if self.grammars is not None:
            self.grammars.release(row)
        self.rows.release(row)

    def abort(self, req_id: int) -> bool:
        if self.grammar_queue.discard(req_id):
            return True
        row = self.rows.row_of(req_id)
        if row is None:
            return False
        self.scheduler.abort(row)
        self._release(row)
        return True

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix; returns how many blocks stopped being shareable."""
        return int(self.scheduler.flush_prefix_cache())

    # ---- the loop ---------------------------------------------------------

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
        Speculating, a step that may draft is launched only once the pending step is complete (a
        draft follows known tokens), and a step with drafts completes before the next launch.
        Returns (outputs completed, in order; the step now pending or None; StepFailed if the launch
        failed (its requests already freed) or None; whether a step was launched)."""
        outputs: list[StepOutput] = []
        failed = None
        launched = None
        if self.has_work():
            if pending is not None and self.speculative is not None and self.scheduler.may_draft():
                outputs.append(self.complete(pending))
                pending = None
            if self.runner.graphs_wanted:  # a decode step ran eagerly for want of its graph: capture it now,
                if pending is not None:  # with nothing in flight (the graph's warm-up writes its buffers)
                    outputs.append(self.complete(pending))
                    pending = None
                self.runner.capture_deferred_graph()
            try:
                launched = self.launch()
            except StepFailed as exc:
                failed = exc
        if pending is not None:
            outputs.append(self.complete(pending))
            pending = None
        if launched is not None:
            if self.overlap_schedule and launched.verify is None:
                pending = launched
            else:
                outputs.append(self.complete(launched))
        return outputs, pending, failed, launched is not None

    def capture_deferred_graph(self) -> bool:
        """While idle (nothing scheduled, nothing in flight): capture one decode graph the startup
        left (ModelRunner.capture_deferred_graph); returns whether one was captured."""
        if not self.runner.deferred_graphs or self.has_work():
            return False
        self.runner.capture_deferred_graph()
        return True

    def step(self) -> StepOutput | None:
        """One step, start to finish (no overlap)."""
        launched = self.launch()
        return None if launched is None else self.complete(launched)

    # ---- one step: schedule -> run (launch), postprocess (complete) ---------

    def launch(self) -> "LaunchedStep | None":
        """Schedule a step and enqueue its device work; None when nothing can run now.
        Raises StepFailed (its requests freed) when the step cannot run."""
        t0 = time.perf_counter()
        start_ts = time.time()
        if self.grammar_queue:
            self.poll_grammars()
        if self.drafter is not None:
            self.drafter.propose(self.scheduler, self.rows.active_rows())
        plan = self.scheduler.schedule()
        if plan.num_reqs == 0:
            return None
        table = self.rows
        fresh = table.first_scheduled(plan.req_ids)  # requests whose first forward this is
        rows = plan.req_ids[plan.sample_rows]
        verify = None
        if plan.has_drafts:  # one entry per sampled position from here on
            verify = Verify.of(plan)
            rows, _ = verify.expand(rows)
        out = StepOutput(
            req_ids=table.server_id[rows].copy(),
            tokens=np.zeros(0, dtype=np.int64),
            finished_ids=np.zeros(0, dtype=np.int64),
            finish_reasons=np.zeros(0, dtype=np.int32),
            scheduled_ids=table.server_id[fresh].copy() if fresh.shape[0] else None,
            step_start_ts=start_ts,
        )
        try:
            sampled = self._run(plan, rows, verify)
        except torch.OutOfMemoryError as exc:
            raise self._fail_step(plan, f"out of memory in a step: {exc}".splitlines()[0]) from exc
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        # Read before the step completes: a request that finishes in it is forgotten then.
        out.cached_tokens = self.scheduler.cached_tokens(rows) if rows.shape[0] else np.zeros(0, np.int32)
        self.scheduler.commit()
        launched = LaunchedStep(out=out, rows=rows, sampled=sampled, event=event, t0=t0, verify=verify,
                                plan=plan if self.eagle is not None else None)
        self._last_launched = launched
        return launched

    def _run(self, plan, rows: np.ndarray, verify: Verify | None = None) -> SampleOutput | None:
        """The step's device work: the forward and, when rows sample, the sampling, whose host copies
        it starts (ready once the step's event fired); None when no row samples. `verify`: a step
        with drafts, `rows` one entry per sampled position."""
        if self.tp_size > 1:  # the other ranks run the same forward (engine/tp_worker.py)
            # A verified step's tokens are never a later plan's pending inputs: nothing to share.
            distributed.broadcast_object(("step", plan, 0 if verify is not None else int(rows.shape[0])))
        if rows.shape[0] == 0:
            self.runner.forward(plan)
            return None
        logits = self.runner.forward(plan)
        return self._sample(logits, rows, verify).to_host()

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, verify: Verify | None = None) -> SampleOutput:
        """Sample the rows' next tokens (and logprobs if any row asked) on the device and keep the
        tokens there for the next step's inputs. With `verify` (a step with drafts), each entry
        samples its row's output token as many places further as its offset, under the grammar's
        mask after the drafts before it; `complete` keeps what it verifies."""
        batch = self.sampling.batch(rows, None if verify is None else verify.offsets,
                                    None if verify is None else verify.inputs)
        if self.grammars is not None and self.grammars.active:
            # The previous step, possibly still pending (overlap): its tokens advance the matchers
            # this mask is built from. The device already has this step's forward queued behind it.
            if self._last_launched is not None:
                self._accept_grammar_tokens(self._last_launched)
            masks = self.grammars.fill_bitmask(rows, None if verify is None else verify.inputs)
            if masks is not None:
                batch.grammar_bitmask, batch.grammar_positions = masks
        # A decode graph took the rows' argmax already: an all-greedy batch's tokens, no kernel here.
        result = self.sampler.sample(logits, batch, greedy=self.runner.greedy_tokens)
        if verify is not None:  # the rows advance by the tokens kept, in complete()
            return result
        self.sampling.update(rows, result.tokens)
        self.runner.record_sampled(result.tokens)
        if self.tp_size > 1:  # the next plan's pending input ids read them on every rank
            distributed.broadcast_tensor(self.runner.last_sampled[: rows.shape[0]])
        return result

    def _accept_grammar_tokens(self, launched: "LaunchedStep") -> None:
        """Advance the constrained rows' matchers by the tokens `launched` sampled, once per step, in
        launch order. Called when the next step's mask needs them (in its launch, after its forward
        was enqueued, so the wait overlaps that forward) or, at the latest, when `launched` completes.
        A row whose request ended since the launch (released, or its row given to another request:
        engine request ids are unique) is skipped. A verified step (drafts) is never replayed here:
        its kept tokens advanced the matchers in _resolve_verified, when grammars were active then,
        and its output no longer has one entry per launched position."""
        if launched.grammar_accepted or launched.verify is not None:
            return
        launched.grammar_accepted = True
        sampled = launched.sampled
        if self.grammars is None or not self.grammars.active or sampled is None or not launched.rows.shape[0]:
            return
        if launched.event is not None:
            launched.event.synchronize()
        same = self.rows.server_id[launched.rows] == launched.out.req_ids
        rows, tokens = launched.rows[same], sampled.tokens.numpy()[same]
        if rows.shape[0]:
            self.grammars.accept(rows, tokens)

    def complete(self, launched: "LaunchedStep") -> StepOutput:
        """Wait for a launched step's sampled tokens; finish and release its requests. Steps
        complete in launch order. Tokens of requests that ended since the launch (aborted, or
        finished by the previous step) are left out of the output."""
        if launched.event is not None:
            launched.event.synchronize()
        if launched.verify is None:  # a verified step's kept tokens: _resolve_verified
            self._accept_grammar_tokens(launched)  # before out.req_ids is narrowed to the live rows
        out = launched.out
        sampled = launched.sampled
        if sampled is None:
            tokens = np.zeros(0, dtype=np.int64)
        else:
            tokens = sampled.tokens.numpy().astype(np.int64, copy=False)
        if launched.verify is not None:
            finished_rows, reasons, keep, tokens = self._resolve_verified(launched, tokens)
        else:
            finished_rows, reasons, live = self.scheduler.resolve(tokens)
            keep = None if live.all() else live
            if self.eagle is not None:
                launched.used = live.astype(np.int64)
        if keep is not None:
            out.req_ids = out.req_ids[keep]
            out.cached_tokens = out.cached_tokens[keep]
            tokens = tokens[keep]
        out.tokens = tokens
        if sampled is not None and sampled.logprobs is not None:
            _put_logprobs(out, sampled, keep)
        if self.grammars is not None and self.grammars.active and tokens.shape[0]:
            live_rows = launched.rows if keep is None else launched.rows[keep]
            finished_rows, reasons = self._stop_completed_grammars(live_rows, finished_rows, reasons)
        out.finished_ids = self.rows.server_id[finished_rows].copy()
        out.finish_reasons = np.asarray(reasons, dtype=np.int32)
        if self.eagle is not None:
            self._draft_eagle(launched, finished_rows)
        for row in finished_rows.tolist():
            self._release(row)
        if out.tokens.shape[0]:
            self.throughput.add(int(out.tokens.shape[0]))
        out.step_seconds = time.perf_counter() - launched.t0
        return out

    def _resolve_verified(self, launched: "LaunchedStep", tokens: np.ndarray):
        """A step with drafts: keep what the model agrees with (engine/speculative.py), advance the
        scheduler and the rows' sampling state by it, count drafts and keeps. Returns (finished rows,
        reasons, the entries of the step's positions that are output, in order; the step's tokens,
        as the oracle forced them)."""
        verify = launched.verify
        if self.drafter is not None:  # the benchmarks' oracle forces its acceptance
            tokens = self.drafter.force(verify, launched.rows, tokens)
        kept, kept_tokens = verify.accept(tokens)
        if self.grammars is not None and self.grammars.active:
            kept = self._accept_kept_by_grammars(launched, tokens, kept)
            kept_tokens = tokens[verify.select(kept)]
        finished_rows, reasons, live, used = self.scheduler.resolve_verified(kept_tokens, kept)
        select = verify.select(used)
        launched.used = used.astype(np.int64)
        self.sampling.update(launched.rows[select], tokens[select], repeated=True)
        drafted = live & (verify.draft_lens > 0)
        accepted = np.maximum(used.astype(np.int64) - 1, 0)
        self.spec_draft_tokens += int(verify.draft_lens[drafted].sum())
        self.spec_accepted_tokens += int(accepted[drafted].sum())
        self.spec_steps += int(drafted.sum())
        out = launched.out
        first = verify.starts[drafted]
        out.spec_ids = out.req_ids[first].copy()
        out.spec_draft_tokens = verify.draft_lens[drafted].astype(np.int32)
        out.spec_accepted_tokens = accepted[drafted].astype(np.int32)
        return finished_rows, reasons, select, tokens

    def _accept_kept_by_grammars(self, launched: "LaunchedStep", tokens: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """Advance the constrained rows' matchers by their kept tokens, in order; a row whose grammar
        ends (accepts its stop token) keeps nothing after that token, as decoding one at a time would."""
        launched.grammar_accepted = True
        kept = kept.copy()
        for i, start in enumerate(launched.verify.starts.tolist()):
            kept[i] = self.grammars.accept_kept(int(launched.rows[start]), tokens[start: start + int(kept[i])])
        return kept

    def _draft_eagle(self, launched: "LaunchedStep", finished_rows: np.ndarray) -> None:
        """Hand the EAGLE-3 drafter the positions this step computed for good: a row's whole query
        unless it sampled, else its query less its draft plus the drafts kept (engine/eagle3.py)."""
        plan = launched.plan
        final = plan.query_lens.astype(np.int64)
        rows = plan.sample_rows
        drafts = plan.draft_lens[rows].astype(np.int64) if plan.draft_lens is not None else 0
        used = launched.used if launched.used is not None else np.zeros(rows.shape[0], dtype=np.int64)
        final[rows] = np.where(used > 0, final[rows] - drafts + used - 1, 0)
        self.eagle.after_step(plan, final, self.scheduler, set(finished_rows.tolist()))

    def _stop_completed_grammars(self, live_rows: np.ndarray, finished_rows: np.ndarray, reasons):
        """Rows whose grammar is complete end with "stop" now (added to the step's finished rows)."""
        done = set(finished_rows.tolist())
        ended = [row for row in self.grammars.terminated(live_rows) if row not in done]
        if not ended:
            return finished_rows, reasons
        from tokenspeed_worker.scheduler.scheduler import FinishReason

        for row in ended:
            self.scheduler.abort(row)
        finished_rows = np.concatenate([finished_rows, np.asarray(ended, dtype=finished_rows.dtype)])
        reasons = np.concatenate([np.asarray(reasons, dtype=np.int32),
                                  np.full(len(ended), int(FinishReason.STOP), dtype=np.int32)])
        return finished_rows, reasons

    def _fail_step(self, plan, message: str) -> "StepFailed":
        """Free every request of a step that could not run; the engine keeps serving the rest."""
        failed = [int(self.rows.server_id[row]) for row in plan.req_ids.tolist()]
        for row in plan.req_ids.tolist():
            self.scheduler.abort(row)
        self.scheduler.drop_plan()  # every request in it is gone
        for row in plan.req_ids.tolist():
            self._release(row)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.error("step failed, %d request(s) ended: %s", len(failed), message)
        return StepFailed(failed, message)


@dataclass
class LaunchedStep:
    """A step enqueued on the device whose sampled tokens are not resolved yet (EngineCore.complete)."""

    out: StepOutput
    rows: np.ndarray
    sampled: SampleOutput | None  # host copies being filled by the device; None when no row samples
    event: object | None  # CUDA event after the step's copies; None on CPU
    t0: float
    grammar_accepted: bool = False  # its tokens advanced the grammar matchers (_accept_grammar_tokens)
    verify: Verify | None = None  # a step with drafts: its layout (rows are then one per sampled position)
    plan: object | None = None  # the step's plan, kept for the EAGLE-3 drafter
    used: np.ndarray | None = None  # per sample row: tokens output (set at completion)


def _put_logprobs(out: StepOutput, sampled: SampleOutput, keep: np.ndarray | None) -> None:
    """The step's logprobs (host copies, all fields set or None together with logprobs) into `out`,
    narrowed to the live rows (`keep`, None for all)."""

    def host(t: torch.Tensor | None) -> np.ndarray | None:
        if t is None:
            return None
        return t.numpy() if keep is None else t.numpy()[keep]

    out.logprobs = host(sampled.logprobs)
    out.top_logprobs = host(sampled.top_logprobs)
    out.top_logprob_ids = host(sampled.top_logprob_ids)
    out.token_ids_logprobs = host(sampled.token_ids_logprobs)
    out.token_ids_logprob_ids = host(sampled.token_ids_logprob_ids)
    out.token_ids_logprob_counts = host(sampled.token_ids_logprob_counts)


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
