"""Triton paged attention (kernels in tokenspeed_worker/kernels/attention.py): the GPU default.

Per step, `build_metadata` picks the paths from the host plan (no device syncs): a decode-only
batch (every query one token) goes to `paged_decode_attention` (split over the keys, with a split
count fixed per CUDA graph); any other batch to `paged_extend_attention` (causal after each
request's cached context), except its leading decode rows (the scheduler puts decodes first),
which still take the decode kernel. Each layer's K/V reach the cache one of three ways: `forward`
writes them with `index_copy_` (a device scatter, graph-safe) and attends; with the fused kernels
on (layers/fused_kernels.py) the rotary kernel (or the q/k/v projection's epilogue) wrote them and
the layer calls `attend`; in a decode-only step of at most `fuse_rope_max_rows` rows the layer
calls `attend_rotary` and the decode kernel rotates q and the step's key and writes the cache itself.

Decode batches replayed as CUDA graphs (model_executor/cuda_graph.py) get their metadata from
`decode_graph_metadata`, over the graph's static input buffers. At startup (`tune_decode`, before
graph capture) each small decode batch size times whether its short requests are faster as one
program per kv head than split over the keys; the longest context where one program wins becomes
that batch size's `single_split_tokens`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
import numpy as np
import torch

from tokenspeed_worker.kernels import compile_ahead
from tokenspeed_worker.kernels.attention import DecodeRope
from tokenspeed_worker.layers.attention.backend import AttentionBackend, AttentionInputs
from tokenspeed_worker.kernels.timing import l2_flush_buffer, time_us
from tokenspeed_worker.layers.kv_cache import write_kv_cache

logger = logging.getLogger(__name__)

# The decode kernel's single-split threshold (tune_decode): contexts tried, in keys; the margin by
# which one program per kv head must beat the split path to be taken (timing noise must not make a
# step slower); decode calls per timed graph, each over blocks of its own (as the layers of a step
# read caches of their own).
SINGLE_SPLIT_CANDIDATES = (128, 256, 512, 1024)
SINGLE_SPLIT_MARGIN = 0.97
TUNE_CALLS = 8

TRITON_UNAVAILABLE = "triton attention needs a CUDA device and the triton package"


def triton_attention_kernels() -> tuple[object | None, str]:
    """(the kernels module, "") when the triton kernels can run, else (None, why not)."""
    try:
        from tokenspeed_worker.kernels import attention as kernels
    except ImportError as error:
        return None, f"tokenspeed_worker.kernels.attention does not import ({error})"
    if not getattr(kernels, "AVAILABLE", False):
        return None, "the triton package is not importable"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    return kernels, ""


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T] where each new token's K/V goes
    block_tables: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B] context + query
    query_start_loc: torch.Tensor | None  # int32 [B + 1]; None on the decode path
    max_query_len: int  # from the host plan
    decode_only: bool
    num_splits: int | None = None  # decode path only
    workspace: object | None = None  # decode path only: preallocated split-K partials and arrival counters
    single_split_tokens: int = 0  # decode path only: requests of at most this many keys are not split
    # A mixed batch's leading decode rows (tokens [0, D) of the step), on the decode path; this
    # metadata's own fields then describe the extend rows [D, B) only (slot_mapping stays whole).
    decode: "TritonAttentionMetadata | None" = None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_prewritten_kv = True
    supports_windows_and_softcap = True
    attends_into = True
    # Decode-only steps of at most this many rows rotate inside the decode kernel (attend_rotary):
    # small batches are latency-bound and save the rotary kernel's launch; larger ones run faster
    # with the rotary kernel before attention (the fused decode kernel holds more registers).
    fuse_rope_max_rows = 32

    def __init__(self, device: str | torch.device = "cuda", kernels: object | None = None) -> None:
        """kernels: a module with the kernels' interface (default: kernels.attention when it can
        run, else ValueError). Kernels that set `is_reference` (torch stand-ins, as tests use) have
        nothing to compile or time: `warm_up` and `tune_decode` do nothing with them."""
        self.device = torch.device(device)
        if kernels is None:
            if self.device.type == "cuda":
                kernels, why = triton_attention_kernels()
            else:
                why = f"device is {self.device}"
            if kernels is None:
                raise ValueError(f"{TRITON_UNAVAILABLE} ({why}); use --attention-backend torch")
        self.kernels = kernels
        self.uses_reference = bool(getattr(kernels, "is_reference", False))
        self.kernel_source = getattr(kernels, "__name__", type(kernels).__name__)
        # Split count and workspace of the decode kernel (kernels without them: one split, no workspace).
        self._choose_num_splits = getattr(kernels, "choose_num_splits", None)
        self._decode_workspace = getattr(kernels, "decode_workspace", None)
        # decode batch size -> single_split_tokens, timed by tune_decode (empty: never tuned, 0 for all)
        self.single_split_tokens: dict[int, int] = {}
        self.tuning: dict[int, dict[int, tuple[float, float]]] = {}  # batch -> {keys: (split µs, single µs)}

    # -- metadata -------------------------------------------------------------------------

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        plan = inputs.plan
        host_query_lens = np.asarray(plan.query_lens)
        max_query_len = int(host_query_lens.max())
        seq_lens = (inputs.context_lens + inputs.query_lens).to(torch.int32)
        block_tables = inputs.block_tables.contiguous()
        host_seq_lens = np.asarray(plan.seq_lens)
        if max_query_len == 1:
            return self._decode_metadata(inputs.slot_mapping, block_tables, seq_lens, int(host_seq_lens.max()))
        # Leading rows of one query token (D of them) go to the decode kernel, the rest to extend.
        num_decode = int(np.argmax(host_query_lens != 1))
        decode = None
        if num_decode:
            decode = self._decode_metadata(inputs.slot_mapping[:num_decode], block_tables[:num_decode],
                                           seq_lens[:num_decode], int(host_seq_lens[:num_decode].max()))
        query_lens = inputs.query_lens[num_decode:]
        query_start_loc = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int32, device=query_lens.device)
        torch.cumsum(query_lens, 0, out=query_start_loc[1:])
        return TritonAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=block_tables[num_decode:],
            seq_lens=seq_lens[num_decode:],
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            decode_only=False,
            decode=decode,
        )

    def decode_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> TritonAttentionMetadata:
        """Metadata over a CUDA graph's static buffers; the split count is fixed for the graph's
        batch size and the longest sequence its block table can hold (later steps' splits may be empty)."""
        return self._decode_metadata(slot_mapping, block_tables, seq_lens, block_tables.shape[1] * self.block_size)

    def _decode_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int
    ) -> TritonAttentionMetadata:
        """Decode-path metadata for seq_lens.shape[0] rows of at most max_seq_len keys: the split count
        for them, its workspace (allocated now) and the batch size's single-split threshold."""
        batch_size = seq_lens.shape[0]
        num_splits = self.decode_num_splits(batch_size, max_seq_len)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=None,
            max_query_len=1,
            decode_only=True,
            num_splits=num_splits,
            workspace=self._make_workspace(batch_size, num_splits),
            single_split_tokens=self.single_split_for(batch_size),
        )

    def decode_num_splits(self, batch_size: int, max_seq_len: int) -> int:
        """Key ranges per decode request: the kernels' choice for this batch and longest sequence."""
        if self._choose_num_splits is None:
            return 1
        return int(self._choose_num_splits(batch_size, self.num_kv_heads, max_seq_len, self.device))

    def _make_workspace(self, batch_size: int, num_splits: int) -> object | None:
        """Allocated with the metadata: once per step, or once per graph before its capture."""
        if self._decode_workspace is None or num_splits == 1:
            return None
        return self._decode_workspace(
            batch_size, self.num_heads, self.head_dim, num_splits, self.device, num_kv_heads=self.num_kv_heads
        )

    def take_decode_choices(self, choices: dict[int, int]) -> bool:
        """Take thresholds an earlier start timed (`tune_decode`'s result, kept by the model runner
        in --cache-dir) instead of timing them; each must be 0 or one of SINGLE_SPLIT_CANDIDATES.
        Returns whether they were taken (False: none is, and tune_decode must run)."""
        if self.uses_reference or any(v != 0 and v not in SINGLE_SPLIT_CANDIDATES for v in choices.values()):
            return False
        self.single_split_tokens = dict(choices)
        return True

    def single_split_for(self, batch_size: int) -> int:
        """The threshold timed for the smallest tuned batch size >= batch_size (0: none tuned)."""
        fits = [size for size in self.single_split_tokens if size >= batch_size]
        return self.single_split_tokens[min(fits)] if fits else 0

    # -- startup ----------------------------------------------------------------------------

    def tune_decode(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, batch_sizes: Iterable[int],
        max_seq_len: int, timer: Callable[[Callable[[], None]], float] | None = None,
    ) -> dict[int, int]:
        """Time, for each decode batch size whose requests are split over their keys, one program per
        kv head against the split path (partials through the workspace, combined by the last split)
        at contexts of SINGLE_SPLIT_CANDIDATES keys, shortest first; the longest context where one
        program wins by SINGLE_SPLIT_MARGIN, with every shorter one won too, becomes that size's
        `single_split_tokens` (0: always split). Call after allocate_kv_cache and before
        graph capture (the graphs bake the value in). Reads blocks of the given layer cache,
        writes none of them. timer: device µs of a callable (default: kernels.timing.time_us, on
        CUDA only; tests pass their own). Returns {batch size: threshold}. The choice is made
        afresh: until it is complete (or if the timing raises) every request splits."""
        self.single_split_tokens = {}
        if self.uses_reference or (timer is None and k_cache.device.type != "cuda"):
            return {}
        device = k_cache.device
        if timer is None:
            flush = l2_flush_buffer(device)
            timer = lambda fn: time_us(fn, flush)  # noqa: E731
        num_blocks = k_cache.shape[0]
        chosen: dict[int, int] = {}
        for batch in sorted(set(batch_sizes)):
            num_splits = self.decode_num_splits(batch, max_seq_len)
            chosen[batch] = 0
            if num_splits == 1:
                continue
            workspace = self._make_workspace(batch, num_splits)
            q = torch.randn((batch, self.num_heads, self.head_dim), dtype=dtype, device=device)
            out = torch.empty_like(q)
            self.tuning[batch] = {}
            for tokens in SINGLE_SPLIT_CANDIDATES:
                if tokens > max_seq_len:
                    break
                blocks = -(-tokens // self.block_size)
                ids = torch.arange(TUNE_CALLS * batch * blocks, dtype=torch.int32, device=device) % num_blocks
                tables = ids.view(TUNE_CALLS, batch, blocks)
                seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device=device)

                def run(single: int) -> None:
                    for table in tables:
                        self.kernels.paged_decode_attention(
                            q, k_cache, v_cache, table, seq_lens, self.head_dim**-0.5, out,
                            num_splits=num_splits, workspace=workspace, single_split_tokens=single,
                        )

                split_us = timer(lambda: run(0))
                single_us = timer(lambda: run(tokens))  # noqa: B023 (called here, inside the loop)
                self.tuning[batch][tokens] = (split_us, single_us)
                if single_us > split_us * SINGLE_SPLIT_MARGIN:
                    break
                chosen[batch] = tokens
        self.single_split_tokens = chosen
        return chosen

    # Longest query of a step, one per query-tile size the extend kernel picks (it takes a smaller
    # tile for short queries: a prefix-cache hit with a short suffix, a short prompt).
    WARM_UP_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> int:
        """Compile the attention kernels' variants now, not in the first request that needs one:
        Triton compiles a variant on first use, which would stall that request's first token.
        Runs one extend request of each WARM_UP_QUERY_LENS length, then the decode
        kernel writing its output directly (one split) and through the workspace (two), as a mixed
        step's decode rows or an eager decode step may, each also with its own rotary (as decode-only
        steps run it: q/k/v views of one projection output, int64 positions and slots); all over
        block 0 of the given layer cache: reads it, and puts back the slot the rotary calls write.
        The variants first compile side by side (kernels/compile_ahead.py), then each runs once.
        Returns the calls made (0 with the reference kernels, which compile nothing)."""
        if self.uses_reference:
            return 0
        if compile_ahead.available():
            try:
                with compile_ahead.compiling():
                    self._warm_up_variants(k_cache, v_cache, dtype)
            except Exception as error:  # noqa: BLE001 (the runs below compile what this did not, one by one)
                logger.info("attention variants not compiled ahead (%s): each compiles at its run", error)
        return self._warm_up_variants(k_cache, v_cache, dtype)

    def _warm_up_variants(self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> int:
        device = k_cache.device
        calls = 0
        for query_len in self.WARM_UP_QUERY_LENS:
            q = torch.zeros((query_len, self.num_heads, self.head_dim), dtype=dtype, device=device)
            blocks = -(-query_len // self.block_size)
            self.kernels.paged_extend_attention(
                q, k_cache, v_cache,
                torch.zeros((1, blocks), dtype=torch.int32, device=device),
                torch.tensor([0, query_len], dtype=torch.int32, device=device),
                torch.tensor([query_len], dtype=torch.int32, device=device),
                1.0, torch.empty_like(q), max_query_len=query_len,
            )
            calls += 1
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = torch.zeros((1, (heads + 2 * kv_heads) * head_dim), dtype=dtype, device=device)
        q, k, v = (part.view(1, -1, head_dim) for part in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                     kv_heads * head_dim], dim=-1))
        table = torch.zeros((1, 1), dtype=torch.int32, device=device)
        seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        tables = torch.zeros((1, head_dim), dtype=torch.float32, device=device)
        slot_0 = (k_cache[0, 0].clone(), v_cache[0, 0].clone())
        for rope in (None, DecodeRope(k, v, zero, tables, tables, zero)):
            for num_splits in (1, 2):
                self.kernels.paged_decode_attention(
                    q, k_cache, v_cache, table, seq_lens, 1.0, torch.empty(q.shape, dtype=dtype, device=device),
                    num_splits=num_splits, workspace=self._make_workspace(1, num_splits), rope=rope,
                )
                calls += 1
        k_cache[0, 0].copy_(slot_0[0])
        v_cache[0, 0].copy_(slot_0[1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return calls

    # -- per layer ------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv_cache(k_cache, v_cache, metadata.slot_mapping, k, v)
        return self.attend(q, k_cache, v_cache, metadata, scale, window, softcap)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's K/V are already in the cache at metadata.slot_mapping (written by `forward`,
        or by the fused rotary + KV-write kernel); window and softcap as the kernels take them; the
        output written into `out` ([T, H, D], contiguous) where given."""
        q = q.contiguous()
        out = torch.empty_like(q) if out is None else out
        extras = {"window": window, "softcap": softcap} if window or softcap else {}
        if metadata.decode_only:
            self._decode(q, k_cache, v_cache, metadata, scale, out, **extras)
            return out
        num_decode = 0
        if metadata.decode is not None:
            num_decode = metadata.decode.seq_lens.shape[0]
            self._decode(q[:num_decode], k_cache, v_cache, metadata.decode, scale, out[:num_decode], **extras)
        self.kernels.paged_extend_attention(
            q[num_decode:], k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
            scale, out[num_decode:], max_query_len=metadata.max_query_len, **extras,
        )
        return out

    fuses_head_norms = True  # attend_rotary takes q/k RMSNorms (q_norm, k_norm) before its rotary

    def fuses_rope(self, metadata: TritonAttentionMetadata) -> bool:
        """Decode-only steps (eager or in a CUDA graph) of at most fuse_rope_max_rows rows take the
        decode kernel's own rotary."""
        return metadata.decode_only and metadata.seq_lens.shape[0] <= self.fuse_rope_max_rows

    def attend_rotary(self, q, k, v, k_cache, v_cache, metadata: TritonAttentionMetadata, scale: float,
                      positions, cos_cache, sin_cache, window: int | None = None,
                      softcap: float | None = None, q_norm=None, k_norm=None) -> torch.Tensor:
        if not self.fuses_rope(metadata):
            raise ValueError("attend_rotary serves decode-only steps (fuses_rope)")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        rope = DecodeRope(k, v, positions, cos_cache, sin_cache, metadata.slot_mapping)
        if q_norm is not None:
            rope.q_norm_weight, rope.k_norm_weight = q_norm.weight, k_norm.weight
            rope.norm_eps, rope.norm_unit_offset = q_norm.eps, q_norm.unit_offset
        extras = {"window": window, "softcap": softcap} if window or softcap else {}
        self._decode(q, k_cache, v_cache, metadata, scale, out, rope, **extras)
        return out

    def _decode(self, q, k_cache, v_cache, metadata: TritonAttentionMetadata, scale: float, out,
                rope: DecodeRope | None = None, **extras) -> None:
        self.kernels.paged_decode_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, out,
            num_splits=metadata.num_splits, workspace=metadata.workspace,
            single_split_tokens=metadata.single_split_tokens, rope=rope, **extras,
        )
