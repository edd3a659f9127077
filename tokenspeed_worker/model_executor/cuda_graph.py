"""CUDA graphs for decode steps: the model forward and the LM head, captured once per batch size.

A decode-only step (every request computes one token) of B rows runs the graph of the smallest
captured size P >= B. All graphs read one packed static input buffer, each through views laid out
for its own P (`step_input_views`: ids, positions, slots, lengths, then the block table), so a
small step's inputs arrive in one host-to-device copy from a pinned, double-buffered host mirror.
The graphs share one memory pool, captured largest first so the smaller ones reuse its memory.
The P - B padded rows are dummies: token 0 at position 0, writing their K/V into a reserved
*dummy block* that no request owns (the runner allocates the pool with one block more than the
scheduler hands out) and attending only to it (sequence length 1).

The LM head's output is written as float32 into a static logits buffer inside the graph, and the
graph takes each row's argmax of it into the runner's `last_sampled` buffer (one kernel on CUDA:
sampling/sampler.widen_and_greedy): for an all-greedy step whose rows are the leading ones those
are the sampled tokens; any other step's sampler (never inside a graph) reads the real rows'
logits (a view when they are the leading rows, else a gathered copy) and overwrites them. The view
is safe because everything that reads it is enqueued on the stream before the next replay, the
only writer.

Steps that are not decode-only run eagerly, as do decode batches larger than the largest captured
size or with a block table wider than the static one (logged once per reason: `decode_graph_size`).

Sizes may be captured in two parts (`capture(sizes)`, then `capture_next()` one size at a time):
the model runner captures the ones a start must have before it serves and leaves the rest for the
engine to capture while idle. Until a size is captured, a decode step that would replay it runs
eagerly (padding it to a larger captured graph would do more work than the eager step) and the
size is `wanted`: captured next, before any other.

A graph is anything with `capture(step, pool)` and `replay()` (`CudaGraph` here; CPU tests give
the runner one that re-runs the step, tests/emulated_graph.py, to exercise the whole graph path).
"""

from __future__ import annotations

import bisect
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenspeed_worker.layers.attention import AttentionBackend
from tokenspeed_worker.layers.fused_kernels import use_fused
from tokenspeed_worker.kernels.timing import back_to_back_us
from tokenspeed_worker.sampling.sampler import greedy_workspace, widen_and_greedy
from tokenspeed_worker.scheduler.plan import SchedulePlan
from tokenspeed_worker.startup import Progress

logger = logging.getLogger(__name__)

_GIB = 1 << 30

DEFAULT_MAX_CAPTURE_SIZE = 256
# Memory kept free for the graphs when the KV pool is sized, before they are captured: the
# exact static buffers plus this fixed allowance for the graphs' shared pool (the activations
# of the largest decode batch: tens of MiB for 1-8B models) and CUDA's per-graph bookkeeping.
# The capture logs what was really used and warns if it exceeded the reserve.
GRAPH_POOL_ALLOWANCE_BYTES = 1 * _GIB
# Keys each row attends to in the steps timed while tuning a graph's kernel choices (step_timer).
TUNING_CONTEXT = 256
# Bytes of each row's per-row inputs in the packed buffer: input id, position and slot (int64),
# sequence length (int32), 4 bytes of padding; the block table (int32) follows all rows.
ROW_BYTES = 32
# A step whose block-table region (its rows at the static width) spans at most this many bytes
# goes over in one copy with the per-row inputs; a larger one copies its [B, w] table on its own
# (about a microsecond of PCIe per 50 KiB against one more copy operation).
ONE_COPY_TABLE_BYTES = 64 << 10

# Why a step does not replay a graph. A prefill step is the normal case; the rest are logged once.
PREFILL_STEP = "prefill step"
NOT_CAPTURED = "not captured"
BATCH_TOO_LARGE = "batch larger than the largest captured size"
TABLE_TOO_WIDE = "block table wider than the static one"


def capture_sizes(
    max_num_seqs: int, explicit: list[int] | None = None, max_capture_size: int | None = None
) -> list[int]:
    """Batch sizes to capture, ascending.

    Default: 1, 2, 4, 8, then every multiple of 8 up to min(max_capture_size or 256,
    max_num_seqs), plus that limit itself so every batch the scheduler can form gets a
    graph. An explicit list is used as given (deduplicated, sorted), without sizes above
    max_num_seqs or max_capture_size (no batch can use them).
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if max_capture_size is not None and max_capture_size < 1:
        raise ValueError(f"max_cudagraph_capture_size must be positive, got {max_capture_size}")
    limit = min(max_num_seqs, max_capture_size if max_capture_size is not None else DEFAULT_MAX_CAPTURE_SIZE)
    if explicit is not None:
        bad = [s for s in explicit if int(s) < 1]
        if bad:
            raise ValueError(f"cudagraph_capture_sizes must be positive, got {bad}")
        return sorted({int(s) for s in explicit if int(s) <= limit})
    sizes = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_reqs rows; None if none does."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


def decode_graph_size(
    query_lens: np.ndarray, table_width: int, sizes: list[int], max_table_width: int
) -> tuple[int | None, str | None]:
    """(graph batch size, None) when the step can replay a graph, else (None, reason)."""
    if query_lens.shape[0] == 0 or not bool(np.all(query_lens == 1)):
        return None, PREFILL_STEP
    if not sizes:
        return None, NOT_CAPTURED
    size = padded_batch_size(int(query_lens.shape[0]), sizes)
    if size is None:
        return None, BATCH_TOO_LARGE
    if table_width > max_table_width:
        return None, TABLE_TOO_WIDE
    return size, None


@dataclass
class StepInputs:
    """A decode graph's inputs for its P rows (torch views of the packed buffer, or numpy arrays)."""

    input_ids: object  # int64 [P]
    positions: object  # int64 [P]
    slot_mapping: object  # int64 [P]
    seq_lens: object  # int32 [P]
    block_tables: object  # int32 [P, width]


def packed_input_bytes(size: int, width: int) -> int:
    """Bytes of the packed inputs of `size` rows with block tables `width` wide."""
    return size * (ROW_BYTES + 4 * width)


def step_input_views(buffer: torch.Tensor, size: int, width: int) -> StepInputs:
    """Views of a graph of `size` rows into a packed uint8 buffer: input ids, positions and slots
    (int64 [size] each), sequence lengths (int32 [size]), padding, then the block table (int32
    [size, width], row stride width). Every size lays its views out from byte 0, so graphs of
    different sizes alias the same bytes: only the graph being replayed reads them."""
    s = size

    def part(start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return buffer[start : start + nbytes].view(dtype)

    return StepInputs(
        input_ids=part(0, 8 * s, torch.int64),
        positions=part(8 * s, 8 * s, torch.int64),
        slot_mapping=part(16 * s, 8 * s, torch.int64),
        seq_lens=part(24 * s, 4 * s, torch.int32),
        block_tables=part(ROW_BYTES * s, 4 * s * width, torch.int32).view(s, width),
    )


def fill_decode_inputs(plan: SchedulePlan, inputs: StepInputs, dummy_block: int, block_size: int) -> None:
    """Write the plan's B rows into host arrays of P >= B rows, then P - B dummy rows writing into
    and reading only the dummy block. Block-table columns past the plan's width are left as they
    are: a row reads only its seq_len's blocks."""
    num_reqs, size = plan.num_reqs, inputs.input_ids.shape[0]
    if size < num_reqs:
        raise ValueError(f"cannot pad {num_reqs} rows to {size}")
    inputs.input_ids[:num_reqs] = plan.input_ids
    inputs.positions[:num_reqs] = plan.positions
    inputs.slot_mapping[:num_reqs] = plan.slot_mapping
    inputs.seq_lens[:num_reqs] = plan.seq_lens
    inputs.block_tables[:num_reqs, : plan.block_tables.shape[1]] = plan.block_tables
    inputs.input_ids[num_reqs:] = 0
    inputs.positions[num_reqs:] = 0
    inputs.slot_mapping[num_reqs:] = dummy_block * block_size
    inputs.seq_lens[num_reqs:] = 1
    inputs.block_tables[num_reqs:, 0] = dummy_block


def static_buffer_bytes(max_batch: int, max_table_width: int, vocab_size: int, logits_itemsize: int) -> int:
    """Bytes of the static buffers: logits (float32) and the packed inputs (ROW_BYTES a row and the
    block tables). (logits_itemsize, the model dtype's, is kept for the callers; the buffer is float32.)"""
    return max_batch * vocab_size * 4 + packed_input_bytes(max_batch, max_table_width)


def graph_reserve_bytes(max_batch: int, max_table_width: int, vocab_size: int, logits_itemsize: int) -> int:
    """Memory to keep free for the graphs when sizing the KV pool before capture (see GRAPH_POOL_ALLOWANCE_BYTES)."""
    return static_buffer_bytes(max_batch, max_table_width, vocab_size, logits_itemsize) + GRAPH_POOL_ALLOWANCE_BYTES


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """The one stream every graph of this process is captured on (decode graphs and piecewise
    pieces). The caching allocator gives a freed block of the graphs' shared pool only to
    allocations on the stream it was allocated on, and cuBLAS takes a workspace (32 MiB on Hopper)
    per stream: a fresh stream per capture kept each capture's activations and a workspace in the
    pool for good (2.8 GiB for the 17 piecewise counts of an 8B model, against the activations of the
    largest when they share one: 0.5 GiB; docs/benchmarks.md, twenty-fourth session)."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    stream = _CAPTURE_STREAMS.get(index)
    if stream is None:
        stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


class CudaGraph:
    """A torch.cuda.CUDAGraph behind the two calls DecodeGraphs needs."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, step: Callable[[], None], pool) -> None:
        # Keep the step (and through it the metadata: the decode workspace was allocated outside
        # the graph's pool) alive as long as the graph: a replay writes into that memory.
        self.step = step
        # No garbage collection inside a capture (torch.cuda.graph collects just before it): a
        # finalizer's CUDA call (an event destroyed, an older graph's memory given back) would
        # invalidate the capture.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=capture_stream()):
                step()
        finally:
            if collecting:
                gc.enable()

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    graph_bytes: int  # device memory the capture took (static buffers + graph pool), CUDA only
    static_bytes: int
    first_run_seconds: float = 0.0  # each size's eager run before capture: mostly kernel compiles
    tuning_seconds: float = 0.0  # the small-batch GEMV chooser timing steps (step_tuner)


class DecodeGraphs:
    """The captured decode graphs of one model, their static buffers, and the replay of a plan."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        *,
        sizes: list[int],
        max_table_width: int,
        dummy_block: int,
        block_size: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        last_sampled: torch.Tensor | None = None,
        graph_class: type = CudaGraph,
        step_tuner: Callable[[int, Callable[[], float]], dict] | None = None,
        aux_width: int = 0,
    ) -> None:
        """last_sampled: the runner's device buffer of the previous step's sampled tokens; an input
        id -1 - i reads entry i of it inside the graph (overlap scheduling), and each replay writes
        its rows' argmax there (`greedy_tokens`; without it, into a buffer of the graphs' own). step_tuner(size,
        step_us): called before each size's capture, after its warm-up step, with a timer of the
        whole step (step_timer) to refine kernel choices in (layers/small_batch_gemv.py's tune_in_step);
        what it returns is kept in `tuning` by size (with the steps it timed and the seconds
        it took) where it timed any."""
        if not sizes:
            raise ValueError("no capture sizes")
        self.model = model
        self.backend = backend
        self.sizes = sorted(sizes)
        self.max_batch = self.sizes[-1]
        self.max_table_width = max_table_width
        self.dummy_block = dummy_block
        self.block_size = block_size
        self.device = device
        self.graph_class = graph_class
        self.step_tuner = step_tuner
        self.tuning: dict[int, dict] = {}  # size -> the step tuner's report, where it timed steps
        self.timed_steps = 0  # steps captured and timed by step_timer
        self.graphs: dict[int, object] = {}
        self.metadata: dict[int, object] = {}  # size -> the attention metadata its graph was captured with
        self.wanted: set[int] = set()  # sizes not captured yet that a decode step would have replayed
        self.num_uncaptured_decodes = 0  # decode steps run eagerly for want of such a size
        self._pool = None  # the graphs' shared memory pool (CUDA), made by the first capture
        self.num_replays = 0
        self.num_eager_decodes = 0  # decode steps that could not replay (logged once per reason)
        # The last replay's argmax of its sampling rows (a view of greedy_tokens) when those are its
        # leading rows, in order; else None.
        self.last_greedy: torch.Tensor | None = None
        self._logged_reasons: set[str] = set()
        nbytes = packed_input_bytes(self.max_batch, max_table_width)
        pin = device.type == "cuda"
        with torch.inference_mode():
            self._packed = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self.logits = torch.zeros((self.max_batch, vocab_size), dtype=torch.float32, device=device)
            self.greedy_tokens = last_sampled if last_sampled is not None else torch.zeros(
                self.max_batch, dtype=torch.int64, device=device)
            self._argmax_workspace = greedy_workspace(self.max_batch, vocab_size, device)
            # EAGLE-3 (aux_width > 0): each replay copies the states the model kept (LlamaModel.aux_hidden)
            # here, and run() hands the replayed rows back as the model's aux_hidden.
            self.aux = torch.zeros((self.max_batch, aux_width), dtype=dtype, device=device) if aux_width else None
            # The host mirrors of the packed buffer, used in turn; each copy's event guards its reuse.
            self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # Recorded after each mirror's copy; waiting on one never recorded returns at once.
        self._host_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._host_turn = 0
        self.inputs = {size: step_input_views(self._packed, size, max_table_width) for size in self.sizes}
        self._host_inputs = [
            {size: _numpy_views(step_input_views(host, size, max_table_width)) for size in self.sizes}
            for host in self._host
        ]
        if self.greedy_tokens.shape[0] < self.max_batch:
            raise ValueError(f"last_sampled holds {self.greedy_tokens.shape[0]} rows, fewer than {self.max_batch}")
        self.last_sampled = last_sampled
        self.static_bytes = static_buffer_bytes(self.max_batch, max_table_width, vocab_size, dtype.itemsize)

    # -- capture ----------------------------------------------------------------------------

    def pool(self):
        """The graphs' memory pool (CUDA), made on first use; the piecewise graphs share it
        (model_executor/piecewise_graph.py): one graph runs at a time, and each one's outputs are
        read before the next replay."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @property
    def deferred(self) -> list[int]:
        """The sizes not captured yet, ascending."""
        return [size for size in self.sizes if size not in self.graphs]

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> CaptureReport:
        """Capture `sizes` (default every size) not captured yet, largest first. Nothing may be in
        flight on the device that reads the static buffers or `last_sampled` (a warm-up step writes
        them): at startup, or in the engine between completed steps."""
        on_cuda = self.device.type == "cuda"
        start = time.perf_counter()
        if on_cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = self.pool() if on_cuda and self.graph_class is CudaGraph else None
        todo = sorted(set(self.sizes if sizes is None else sizes) - set(self.graphs), reverse=True)
        progress = Progress("CUDA graph capture (decode batch sizes)", len(todo)) if len(todo) > 1 else None
        first_run = tuning = 0.0
        # Largest first: the smaller graphs reuse its pool memory (a later capture, smaller than the
        # startup's largest, does too).
        for done, size in enumerate(todo, 1):
            self._load_dummy_rows(size)
            step = self._make_step(size)
            t0 = time.perf_counter()
            step()  # warm-up: compiles and autotunes kernels, which must not happen while capturing
            if on_cuda:
                torch.cuda.synchronize(self.device)
            first_run += time.perf_counter() - t0
            if self.step_tuner is not None and on_cuda and self.graph_class is CudaGraph:
                timed_before, tuning_start = self.timed_steps, time.perf_counter()
                report = self.step_tuner(size, self.step_timer(size))
                if self.timed_steps != timed_before:  # the timer ran: dummy rows back, warm up what was chosen
                    self.tuning[size] = {**report, "timed_steps": self.timed_steps - timed_before,
                                         "seconds": time.perf_counter() - tuning_start}
                    tuning += self.tuning[size]["seconds"]
                    self._load_dummy_rows(size)
                    step = self._make_step(size)
                    step()
            graph = self.graph_class()
            try:
                graph.capture(step, pool)
            except Exception as error:
                raise RuntimeError(
                    f"CUDA graph capture failed at decode batch size {size} "
                    f"(attention backend {self.backend.name}); --enforce-eager runs without graphs"
                ) from error
            self.graphs[size] = graph
            self.wanted.discard(size)
            if progress is not None:
                progress.tick(done)
        graph_bytes = 0
        if on_cuda:
            torch.cuda.synchronize(self.device)
            graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
            if len(self.graphs) == len(todo):  # the first capture: the static buffers count too
                graph_bytes += self.static_bytes
        return CaptureReport(sorted(todo), time.perf_counter() - start, graph_bytes, self.static_bytes,
                             first_run, tuning)

    def capture_next(self) -> CaptureReport | None:
        """Capture one size not captured yet (the largest wanted one, else the largest left), as
        `capture` (nothing in flight); None when every size is captured. A size whose capture fails
        (e.g. out of memory while serving) is dropped, with a warning: its steps take the next larger
        graph, or run eagerly, and the worker keeps serving."""
        deferred = self.deferred
        if not deferred:
            return None
        wanted = [size for size in deferred if size in self.wanted]
        size = max(wanted or deferred)
        try:
            return self.capture([size])
        except Exception as error:  # noqa: BLE001 - whatever failed, serving goes on without this graph
            self.sizes.remove(size)
            self.wanted.discard(size)
            logger.warning("CUDA graph of decode batch size %d not captured (%s: %s): its steps take the next "
                           "larger graph or run eagerly", size, type(error).__name__, error)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return CaptureReport([], 0.0, 0, self.static_bytes)

    def _make_step(self, size: int) -> Callable[[], None]:
        inputs = self.inputs[size]
        metadata = self.backend.decode_graph_metadata(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens)
        self.metadata[size] = metadata

        def step() -> None:
            input_ids = inputs.input_ids
            if self.last_sampled is not None:
                input_ids = resolve_pending_ids(input_ids, self.last_sampled)
            hidden_states = self.model(input_ids, inputs.positions, metadata)
            # After the last read of last_sampled above: it may be the same buffer.
            widen_and_greedy(self.model.compute_logits(hidden_states), self.logits[:size], self.greedy_tokens[:size],
                             self._argmax_workspace)
            if self.aux is not None:
                self.aux[:size].copy_(self.model.model.aux_hidden)

        return step

    def step_timer(self, size: int) -> Callable[[], float]:
        """A timer of the decode step of `size` rows: each call captures the step afresh (so it runs
        the kernels' current choices) and returns the device microseconds of one replay replayed
        back to back (kernels/timing.back_to_back_us). Each row attends to
        TUNING_CONTEXT keys (fewer where the block table or the pool is smaller) in the pool's first
        blocks, still empty at startup; the step's K/V writes go to the dummy block as usual."""
        context = max(1, min(TUNING_CONTEXT, (self.max_table_width - 1) * self.block_size + 1,
                             self.dummy_block * self.block_size))
        width = -(-context // self.block_size)

        def step_us() -> float:
            self.timed_steps += 1
            self._load_dummy_rows(size)
            inputs = self.inputs[size]
            inputs.positions.fill_(context - 1)
            inputs.seq_lens.fill_(context)
            inputs.block_tables[:, :width].copy_(
                torch.arange(width, dtype=torch.int32, device=self.device).expand(size, width))
            step = self._make_step(size)
            step()
            return back_to_back_us(step)

        return step_us

    def _load_dummy_rows(self, size: int) -> None:
        inputs = self.inputs[size]
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        inputs.slot_mapping.fill_(self.dummy_block * self.block_size)
        inputs.seq_lens.fill_(1)
        inputs.block_tables.fill_(self.dummy_block)

    # -- replay -----------------------------------------------------------------------------

    def run(self, plan: SchedulePlan) -> torch.Tensor | None:
        """float32 logits [S, V] of the plan's sampling rows, or None when the step must run eagerly."""
        size, reason = decode_graph_size(
            np.asarray(plan.query_lens), plan.block_tables.shape[1], self.sizes, self.max_table_width
        )
        if size is not None and size not in self.graphs:  # captured soon (wanted): not worth a warning
            self.num_uncaptured_decodes += 1
            self.wanted.add(size)
            return None
        if size is None:
            if reason != PREFILL_STEP:
                self.num_eager_decodes += 1
                self._log_eager_once(reason, plan)
            return None
        host = self._copy_inputs(plan, size)
        plan_replay = getattr(self.backend, "plan_graph_replay", None)
        if plan_replay is not None:  # a backend that plans on the host (flashinfer): this step's pages
            width = max(1, plan.block_tables.shape[1])
            plan_replay(self.metadata[size], host.seq_lens, np.ascontiguousarray(host.block_tables[:, :width]))
        self.graphs[size].replay()
        self.num_replays += 1
        if self.aux is not None:
            self.model.model.aux_hidden = self.aux[: plan.num_reqs]
        rows = np.asarray(plan.sample_rows)
        if rows.shape[0] == plan.num_reqs and np.array_equal(rows, np.arange(plan.num_reqs)):
            self.last_greedy = self.greedy_tokens[: plan.num_reqs]
            return self.logits[: plan.num_reqs]
        self.last_greedy = None
        index = torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True)
        return self.logits.index_select(0, index)

    def _copy_inputs(self, plan: SchedulePlan, size: int) -> StepInputs:
        """Fill the next host mirror with the step's padded inputs and enqueue their copy to the
        packed buffer: one copy where the block-table region is small (ONE_COPY_TABLE_BYTES), else
        the per-row inputs and the [size, w] table apart. Returns the host arrays it filled."""
        turn = self._host_turn
        self._host_turn = 1 - turn
        if self._host_events is not None:  # the copy that last read this mirror is done
            self._host_events[turn].synchronize()
        host_bytes = self._host[turn]
        width = max(1, plan.block_tables.shape[1])
        table_bytes = 4 * ((size - 1) * self.max_table_width + width)
        if table_bytes <= ONE_COPY_TABLE_BYTES:
            host = self._host_inputs[turn][size]
            fill_decode_inputs(plan, host, self.dummy_block, self.block_size)
            end = ROW_BYTES * size + table_bytes
            self._packed[:end].copy_(host_bytes[:end], non_blocking=True)
        else:  # the table as a contiguous [size, width] array where the mirror's table starts
            host = _numpy_views(step_input_views(host_bytes, size, width))
            fill_decode_inputs(plan, host, self.dummy_block, self.block_size)
            end = ROW_BYTES * size
            self._packed[:end].copy_(host_bytes[:end], non_blocking=True)
            table = host_bytes[end : end + 4 * size * width].view(torch.int32).view(size, width)
            self.inputs[size].block_tables[:, :width].copy_(table, non_blocking=True)
        if self._host_events is not None:
            self._host_events[turn].record()
        return host

    def _log_eager_once(self, reason: str, plan: SchedulePlan) -> None:
        if reason in self._logged_reasons:
            return
        self._logged_reasons.add(reason)
        logger.warning(
            "decode step runs eagerly (%s): %d rows, block table width %d; captured sizes up to %d, "
            "static block table width %d (logged once per reason)",
            reason, plan.num_reqs, plan.block_tables.shape[1], self.max_batch, self.max_table_width,
        )


def _numpy_views(inputs: StepInputs) -> StepInputs:
    """The same views as numpy arrays (host tensors only)."""
    return StepInputs(*(t.numpy() for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                               inputs.seq_lens, inputs.block_tables)))


def resolve_pending_ids(input_ids: torch.Tensor, last_sampled: torch.Tensor) -> torch.Tensor:
    """Input ids with each -1 - i replaced by last_sampled[i] (overlap scheduling; device-side, no
    sync). One Triton kernel where the fused kernels run (layers/fused_kernels.py), else torch."""
    fused = use_fused(input_ids, "pending_ids")
    if fused is not None:
        return fused.resolve_pending_ids(input_ids, last_sampled)
    return torch.where(input_ids < 0, last_sampled[(-1 - input_ids).clamp(min=0)], input_ids)


def max_table_width(max_model_len: int, block_size: int) -> int:
    return math.ceil(max_model_len / block_size)
