"""Piecewise CUDA graphs: prefill and mixed steps replay everything but attention.

A step the decode graphs do not hold (a prompt or a prompt chunk in it, more rows than the largest
decode graph) ran eagerly: tens of thousands of Python calls and a few hundred kernel launches per
step, for an 8B model longer on the host than on the device up to about a thousand tokens. Here a
step of T tokens, once a token count P >= T is captured (`piecewise_sizes`), runs as the captured
*pieces* of a P-token forward: the work from the inputs to the first attention call, from each
attention call to the next, and from the last to the final norm. Each attention call runs eagerly
between two pieces, with this step's metadata (built once per step, as for an eager step), over
the tensors the piece before it left in the graphs' memory, and writes its output into a static
buffer the next piece reads. Attention is where steps of one token count differ (each request's
context and query lengths); everything else depends on the count alone.

Padding: the P - T rows are one dummy request appended to the step (token 0 at position 0, context
0), whose K/V go to the pool's dummy block (the decode graphs' padding block, never handed out):
its token j writes slot j mod block_size of that block and reads the same slots. Its rows are
identical at every layer, so the slots it shares are written with equal values. No real row reads
it, nothing samples it, and the step's hidden states are the first T rows.

How the pieces are cut: the model's `Attention` calls (layers/attention/layer.py) receive a
`PiecewiseStep` in place of the metadata and hand their attention (with the triton backend, only the
attention over K/V the piece wrote at the static slots) to `PiecewiseStep.hole`, which ends the
piece being captured, keeps the call (its tensors aliased without keeping them allocated, as the
graphs' own intermediates are: `_alias`) and begins the next piece. Models need no change. The
pieces of all sizes share one memory pool with the decode graphs, captured on the decode graphs'
stream (`capture_stream`), so each capture reuses what the larger ones freed and the pool holds
about the largest count's activations: at most one graph runs at a time, and the eager work between
pieces takes its memory elsewhere.

Sizes are captured after startup, largest first, one at a time while the engine idles or as soon as
a step wants one (the decode graphs' `deferred` scheme); until then such steps run eagerly. Each
capture replays once on inputs of its own (`check`: rows that differ, over the dummy block) against
the model's eager forward; a mismatch turns every size off (`turn_off`), so a replay that would read
or write the wrong memory on some GPU, driver or model serves nothing. On by default
(--no-enable-piecewise-cuda-graph turns them off), never with --enforce-eager; not under tensor
parallelism yet (a capture runs collectives, which every rank would have to enter together while
idle).

On CPU (tests) `emulate` re-runs the model's Python over the same static buffers with the holes
running in place, so the padding, the dummy request, the static buffers and the holes' plumbing
are exercised without a GPU; the capture itself is CUDA's.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenspeed_worker.layers.attention import AttentionBackend, AttentionInputs, GraphHoles
from tokenspeed_worker.model_executor.cuda_graph import capture_stream, padded_batch_size, resolve_pending_ids
from tokenspeed_worker.scheduler.plan import SchedulePlan

logger = logging.getLogger(__name__)

# The default token counts: from a short prompt chunk beside a few decodes to a long chunk, each
# about 1.5x the one before (a step pads at most that much). Past DEFAULT_MAX_TOKENS a step's
# device time hides its host time (docs/benchmarks.md, twenty-first session: an 8B step launches in
# about 30 ms eagerly, the device's time for ~1,300 tokens).
SIZE_LADDER = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
DEFAULT_MAX_TOKENS = 4096
# The largest relative error (2-norm over the hidden states) a capture's check accepts between a
# replay and the eager step on the same inputs: the rounding of kernels that may differ between
# them (a fused path for few rows, the order of atomics), far below a wrong input or output.
CHECK_TOLERANCE = 2e-2


def piecewise_sizes(token_budget: int, max_tokens: int | None = None, explicit: list[int] | None = None) -> list[int]:
    """Token counts to capture, ascending: SIZE_LADDER up to min(max_tokens (default
    DEFAULT_MAX_TOKENS), token_budget) with that limit itself added, or an explicit list without
    counts above the limit. max_tokens 0: none."""
    limit = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
    if limit < 0:
        raise ValueError(f"piecewise_cuda_graph_max_tokens must be >= 0, got {limit}")
    if token_budget > 0:
        limit = min(limit, token_budget)
    if limit == 0:
        return []
    if explicit is not None:
        bad = [s for s in explicit if int(s) < 1]
        if bad:
            raise ValueError(f"piecewise_cuda_graph_tokens must be positive, got {bad}")
        return sorted({int(s) for s in explicit if int(s) <= limit})
    sizes = [s for s in SIZE_LADDER if s <= limit]
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def pad_plan(plan: SchedulePlan, size: int, dummy_block: int, block_size: int) -> SchedulePlan:
    """The plan with its T tokens padded to `size` by one dummy request of size - T tokens (token
    0, position 0, context 0) writing and reading slots of the dummy block only; the plan itself
    where T == size."""
    pad = size - plan.num_tokens
    if pad < 0:
        raise ValueError(f"cannot pad {plan.num_tokens} tokens to {size}")
    if pad == 0:
        return plan
    blocks = -(-pad // block_size)
    num_reqs, width = plan.num_reqs, plan.block_tables.shape[1]
    tables = np.zeros((num_reqs + 1, max(width, blocks)), dtype=np.int32)
    tables[:num_reqs, :width] = plan.block_tables
    tables[num_reqs, :blocks] = dummy_block
    zeros = np.zeros(pad, dtype=np.int64)
    return SchedulePlan(
        req_ids=np.append(plan.req_ids, -1).astype(np.int64),
        query_lens=np.append(plan.query_lens, pad).astype(np.int32),
        context_lens=np.append(plan.context_lens, 0).astype(np.int32),
        input_ids=np.concatenate([plan.input_ids, zeros]),
        positions=np.concatenate([plan.positions, zeros]),
        slot_mapping=np.concatenate([plan.slot_mapping, dummy_block * block_size + np.arange(pad) % block_size]),
        block_tables=tables,
        sample_rows=plan.sample_rows,
        draft_lens=None if plan.draft_lens is None else np.append(plan.draft_lens, 0).astype(np.int32),
    )


class _Memory:
    """A CUDA array interface over a tensor's memory that does not own it (`_alias`)."""

    _TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}

    def __init__(self, t: torch.Tensor) -> None:
        size = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "strides": tuple(s * size for s in t.stride()),
            "typestr": self._TYPESTR[size], "data": (t.data_ptr(), False), "version": 2,
        }


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated. A hole keeps the tensors a piece
    left in the graphs' pool this way: held strongly, every layer's q/k/v of every size would stay
    allocated (hundreds of MiB per size for an 8B model); as the pieces' own intermediates, the
    memory goes back to the pool after the capture and each replay writes it before the hole reads
    it. torch has no public weak tensor; the CUDA array interface gives a tensor over a raw pointer
    (as vLLM's weak_ref_tensor does in C++). Host tensors and empty ones are returned as they are."""
    if not t.is_cuda or t.numel() == 0:
        return t
    return torch.as_tensor(_Memory(t), device=t.device).view(t.dtype)


class PiecewiseStep(GraphHoles):
    """What the model's attention calls receive as metadata during a capture (and an emulated run):
    `slot_mapping` (the static slots, for kernels before attention that write K/V themselves) and
    `hole`, through which each attention call runs."""

    def __init__(self, owner: "PiecewiseGraphs", metadata: object, slot_mapping: torch.Tensor,
                 capture: bool) -> None:
        self.owner = owner
        self.metadata = metadata  # the backend's metadata of the step (of the capture's dummy step)
        self.slot_mapping = slot_mapping
        self.capturing = capture
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.holes: list[tuple[Callable[[object], torch.Tensor], torch.Tensor]] = []
        self.open_piece: torch.cuda.CUDAGraph | None = None  # the piece being captured

    def hole(self, attend: Callable[..., torch.Tensor], *tensors: torch.Tensor,
             into: tuple[tuple[int, ...], torch.dtype] | None = None) -> torch.Tensor:
        """attend(metadata, *tensors) -> the attention output, run outside the graphs: now, and at
        each replay with that step's metadata; returns the static buffer holding its output. With
        `into` (shape, dtype), attend(metadata, out, *tensors) writes it into `out`, a view of that
        shape of the static buffer, and returns a view of it: no copy per layer."""
        out = self.owner.static_view(*into) if into is not None else None
        args = (out,) if out is not None else ()
        if not self.capturing:
            result = attend(self.metadata, *args, *tensors)
            return self.owner.static_out(result) if out is None or not _within(result, out) else result
        self.end_piece()
        aliases = tuple(_alias(t) for t in tensors)

        def run(metadata: object) -> torch.Tensor:
            return attend(metadata, *args, *aliases)

        result = run(self.metadata)
        if out is not None and _within(result, out):
            self.holes.append((run, None))  # writes the static buffer itself
        else:
            result = self.owner.static_out(result)
            self.holes.append((run, result))
        self.begin_piece()
        return result

    def begin_piece(self) -> None:
        self.open_piece = torch.cuda.CUDAGraph()
        self.open_piece.capture_begin(self.owner.pool())

    def end_piece(self) -> None:
        piece, self.open_piece = self.open_piece, None
        piece.capture_end()
        self.pieces.append(piece)


class _Captured:
    """One token count's pieces, the holes between them, and the outputs they leave."""

    def __init__(self, step: PiecewiseStep, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.pieces = step.pieces
        self.holes = step.holes
        self.hidden = hidden  # [P, hidden] final norm's output (an alias into the pool)
        self.aux = aux  # EAGLE-3's kept states [P, 3 x hidden], or None

    def replay(self, metadata: object) -> None:
        for piece, (run, out) in zip(self.pieces, self.holes):
            piece.replay()
            result = run(metadata)
            if out is not None:
                out.copy_(result)
        self.pieces[-1].replay()


def _within(result: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `result` is `out`'s memory (a view of it from its first element)."""
    return result.data_ptr() == out.data_ptr() and result.numel() == out.numel()


class PiecewiseGraphs:
    """The piecewise graphs of one model: token counts, static inputs, capture and replay."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, *, sizes: list[int], dummy_block: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, row_width: int,
                 last_sampled: torch.Tensor | None, pool: Callable[[], object], emulate: bool = False) -> None:
        """row_width: the widest attention output row (heads x head_dim) of the model's layers;
        pool(): the graph memory pool shared with the decode graphs; emulate: re-run the Python
        instead of capturing (CPU tests)."""
        if not sizes:
            raise ValueError("no piecewise sizes")
        self.model = model
        self.backend = backend
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.dummy_block = dummy_block
        self.block_size = block_size
        self.device = device
        self.last_sampled = last_sampled
        self.pool = pool
        self.emulate = emulate
        self.captured: dict[int, _Captured] = {}
        self.wanted: set[int] = set()
        self.num_replays = 0
        self.num_uncaptured = 0  # steps run eagerly for want of their size
        self.capture_seconds = 0.0
        self.off_reason: str | None = None  # why the check turned them off (turn_off), or None
        pin = device.type == "cuda"
        with torch.inference_mode():
            # ids, positions and slots of a step of P tokens: int64 [3 * P] from byte 0 (_views).
            self._inputs = torch.zeros(3 * self.max_tokens, dtype=torch.int64, device=device)
            self._host = [torch.zeros(3 * self.max_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
            self._out = torch.zeros(self.max_tokens * row_width, dtype=dtype, device=device)
        self._host_events = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0

    # -- shared by capture and replay ----------------------------------------------------------

    def _views(self, buffer: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return buffer[:size], buffer[size: 2 * size], buffer[2 * size: 3 * size]

    def static_view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The static attention output buffer's first elements as `shape` (see static_out)."""
        numel = math.prod(shape)
        if dtype != self._out.dtype or numel > self._out.numel():
            raise ValueError(f"attention output {tuple(shape)} {dtype} does not fit the static "
                             f"buffer ({self._out.numel()} x {self._out.dtype})")
        return self._out[:numel].view(shape)

    def static_out(self, result: torch.Tensor) -> torch.Tensor:
        """The static attention output buffer as `result`'s shape, holding it. One buffer for every
        layer: each layer's output is read by the piece after its attention, before the next
        attention call writes."""
        out = self.static_view(tuple(result.shape), result.dtype)
        out.copy_(result)
        return out

    def _forward(self, size: int, step: PiecewiseStep) -> torch.Tensor:
        """The model over the static inputs of `size` tokens with `step` as its attention metadata."""
        ids, positions, _ = self._views(self._inputs, size)
        if step.capturing:
            step.begin_piece()
        if self.last_sampled is not None:
            ids = resolve_pending_ids(ids, self.last_sampled)
        hidden = self.model(ids, positions, step)
        if step.capturing:
            step.end_piece()
        return hidden

    def _step(self, size: int, metadata: object, capture: bool = False) -> PiecewiseStep:
        return PiecewiseStep(self, metadata, self._views(self._inputs, size)[2], capture)

    def _metadata(self, plan: SchedulePlan, size: int) -> object:
        slots = self._views(self._inputs, size)[2]
        return self.backend.build_metadata(AttentionInputs.of(plan, self.device, self.block_size, slots))

    def _load(self, plan: SchedulePlan, size: int) -> None:
        """The padded plan's ids, positions and slots into the static inputs, in one copy from the
        next of two pinned host mirrors."""
        turn, self._turn = self._turn, 1 - self._turn
        if self._host_events is not None:
            self._host_events[turn].synchronize()  # the copy that last read this mirror is done
        host = self._host[turn]
        ids, positions, slots = (v.numpy() for v in self._views(host, size))
        ids[:] = plan.input_ids
        positions[:] = plan.positions
        slots[:] = plan.slot_mapping
        self._inputs[: 3 * size].copy_(host[: 3 * size], non_blocking=True)
        if self._host_events is not None:
            self._host_events[turn].record()

    # -- capture ---------------------------------------------------------------------------------

    @property
    def deferred(self) -> list[int]:
        return [size for size in self.sizes if size not in self.captured]

    def _dummy_plan(self, size: int) -> SchedulePlan:
        empty = SchedulePlan.empty()
        return pad_plan(empty, size, self.dummy_block, self.block_size)

    @torch.inference_mode()
    def capture(self, size: int) -> float:
        """Capture the pieces of `size` tokens, then check one replay against the eager step (`check`;
        a mismatch turns every size off: `off_reason`). Nothing may be in flight that reads the static
        buffers or last_sampled: between completed steps. Returns the seconds it took."""
        start = time.perf_counter()
        plan = self._dummy_plan(size)
        self._load(plan, size)
        metadata = self._metadata(plan, size)
        self._forward(size, self._step(size, metadata))  # warm-up: kernels compile and choose outside a capture
        if self.emulate:
            captured = _Captured(self._step(size, None), None, None)
        else:
            captured = self._capture_pieces(size, metadata)
        error = self.check(size, captured)
        if not error <= CHECK_TOLERANCE:  # NaN included
            self.turn_off(f"a replay of {size} tokens differs from the eager step by {error:.3g} (relative)")
            raise RuntimeError(self.off_reason)
        self.captured[size] = captured
        self.wanted.discard(size)
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        return seconds

    def _capture_pieces(self, size: int, metadata: object) -> "_Captured":
        torch.cuda.synchronize(self.device)
        collecting = gc.isenabled()
        gc.disable()  # a finalizer's CUDA call inside a capture would invalidate it
        step = self._step(size, metadata, capture=True)
        stream = capture_stream(self.device)  # the decode graphs' stream: their pool's free blocks are reused
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                try:
                    hidden = self._forward(size, step)
                except BaseException:
                    if step.open_piece is not None:  # end the capture: the stream must not stay capturing
                        try:
                            step.open_piece.capture_end()
                        except Exception:  # noqa: BLE001 - the first error is the one to report
                            pass
                    raise
                aux = getattr(getattr(self.model, "model", None), "aux_hidden", None)
                captured = _Captured(step, _alias(hidden), _alias(aux) if aux is not None else None)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
        finally:
            if collecting:
                gc.enable()
        return captured

    def _check_plan(self, size: int) -> SchedulePlan:
        """`size` tokens over the dummy block as new requests of block_size tokens each (the last one
        shorter where block_size does not divide `size`), all of one prompt: token j of a request is
        j mod 97 + 1 at position j, slot j of the block, attending to slots 0..j. Requests write equal
        values to the slots they share, so the step is deterministic, with rows that differ.
        (One-token requests would make a decode-only step, whose kernel of few rows rotates and writes
        K/V inside the attention, racing with rows that read a slot another row writes.)"""
        bs = self.block_size
        lens = np.full(size // bs, bs, dtype=np.int32)
        if size % bs:
            lens = np.append(lens, size % bs).astype(np.int32)
        offset = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        return SchedulePlan(
            req_ids=np.arange(len(lens), dtype=np.int64), query_lens=lens,
            context_lens=np.zeros(len(lens), dtype=np.int32), input_ids=offset % 97 + 1, positions=offset,
            slot_mapping=self.dummy_block * bs + offset,
            block_tables=np.full((len(lens), 1), self.dummy_block, dtype=np.int32),
            sample_rows=np.arange(len(lens), dtype=np.int32))

    @torch.inference_mode()
    def check(self, size: int, captured: "_Captured") -> float:
        """The relative error (2-norm) of a replay of `captured` against the model's eager forward on
        the same `_check_plan` inputs."""
        plan = self._check_plan(size)
        self._load(plan, size)
        metadata = self._metadata(plan, size)
        ids, positions, _ = self._views(self._inputs, size)
        expected = self.model(ids, positions, metadata).float()
        if self.emulate:
            got = self._forward(size, self._step(size, metadata))
        else:
            captured.replay(metadata)
            got = captured.hidden
        return float(((got.float() - expected).norm() / expected.norm().clamp(min=1e-30)).item())

    def turn_off(self, reason: str) -> None:
        """No more piecewise steps: every step they would take runs eagerly from now on."""
        self.off_reason = reason
        self.sizes = []
        self.captured.clear()
        self.wanted.clear()
        logger.error("piecewise CUDA graphs off: %s; prefill and mixed steps run eagerly", reason)

    def capture_next(self) -> int | None:
        """Capture one size not captured yet (the largest wanted, else the largest left); returns
        it, or None when none is left. A size whose capture fails (e.g. out of memory while serving)
        is dropped with a warning: its steps pad to a larger size or run eagerly."""
        deferred = self.deferred
        if not deferred:
            return None
        size = max([s for s in deferred if s in self.wanted] or deferred)
        try:
            self.capture(size)
        except Exception as error:  # noqa: BLE001 - whatever failed, serving goes on without this size
            if self.off_reason is not None:  # the check failed: all of them are off (logged)
                return size
            self.sizes.remove(size)
            self.wanted.discard(size)
            self.captured.pop(size, None)
            logger.warning("piecewise CUDA graph of %d tokens not captured (%s: %s): its steps pad to a larger "
                           "size or run eagerly", size, type(error).__name__, error)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return size

    # -- replay ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, plan: SchedulePlan) -> torch.Tensor | None:
        """The hidden states [T, hidden] of the plan's tokens (a view into the graphs' memory: read
        it, or enqueue its readers, before the next forward), or None where no captured size holds
        the step: it runs eagerly (a size not captured yet is wanted)."""
        size = padded_batch_size(plan.num_tokens, self.sizes)
        if size is None:
            return None
        if size not in self.captured:
            self.wanted.add(size)
            self.num_uncaptured += 1
            return None
        padded = pad_plan(plan, size, self.dummy_block, self.block_size)
        self._load(padded, size)
        metadata = self._metadata(padded, size)
        captured = self.captured[size]
        if self.emulate:
            hidden = self._forward(size, self._step(size, metadata))
            aux = getattr(getattr(self.model, "model", None), "aux_hidden", None)
        else:
            captured.replay(metadata)
            hidden, aux = captured.hidden, captured.aux
        if aux is not None:
            self.model.model.aux_hidden = aux[: plan.num_tokens]
        self.num_replays += 1
        return hidden[: plan.num_tokens]


def graph_memory_estimate(activation_bytes: int, activation_tokens: int, max_tokens: int) -> int:
    """The pool memory a max_tokens piecewise capture may take, from the profiled eager peak of an
    activation_tokens step (activations grow with the token count)."""
    if max_tokens <= 0 or activation_tokens <= 0:
        return 0
    return int(activation_bytes * min(1.0, max_tokens / activation_tokens))


__all__ = ["CHECK_TOLERANCE", "DEFAULT_MAX_TOKENS", "PiecewiseGraphs", "PiecewiseStep", "graph_memory_estimate", "pad_plan",
           "piecewise_sizes"]
