"""FlashInfer paged attention (`--attention-backend flashinfer`), when the flashinfer package is installed.

FlashInfer (PyPI `flashinfer-python`) ships tuned paged-attention kernels for decode and for
prefill over a paged cache, JIT-compiled for the GPU on first use. It reads our cache as is: one
layer's K and V are each [num_blocks, block_size, num_kv_heads, head_dim], FlashInfer's "NHD"
layout with block_size as its page size. What it needs from us per step is the page list of every
request in CSR form (`paged_kv_arrays`: indptr, page indices, length of each last page), from
which its `plan` chooses the work split on the host; every layer's `run` then reuses that plan.

- A decode-only step (every query one token) plans a `BatchDecodeWithPagedKVCacheWrapper`
  (tensor cores when a KV head serves at least 4 query heads); any other step a
  `BatchPrefillWithPagedKVCacheWrapper` with the causal mask after each request's cached context.
- CUDA graphs: each captured decode batch size has its own decode wrapper over fixed device
  buffers. The graph runner calls `plan_graph_replay` with the padded step's host arrays before
  every replay (model_executor/cuda_graph.py).
- A plan copies its arrays from a pinned host buffer with a non-blocking copy that runs in stream
  order. Before a wrapper is planned again, the host waits on an event recorded after its previous
  plan, so that buffer is never overwritten before its copy ran (overlap scheduling plans step N+1
  while step N may not have started).
- K/V of the step are written by the fused rotary + KV-write kernel or by `write_kv_cache`, as for
  the triton backend; an fp8 cache is passed with kv_data_type float8_e4m3fn (its
  per-layer scales are folded into the weights: layers/quantization/kv_scales.py).

Without flashinfer (or without CUDA) construction raises ValueError with the reason; the CLI
refuses the option before that (config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenspeed_worker.layers.attention.backend import AttentionBackend, AttentionInputs
from tokenspeed_worker.layers.kv_cache import write_kv_cache

FLASHINFER_UNAVAILABLE = "flashinfer attention needs a CUDA device and the flashinfer package (pip install flashinfer-python)"
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partial results)


def flashinfer_module(device: str | torch.device = "cuda") -> tuple[object | None, str]:
    """(the flashinfer module, "") when its kernels can run on `device`, else (None, why not)."""
    if torch.device(device).type != "cuda":
        return None, f"device is {torch.device(device)}"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    try:
        import flashinfer
    except Exception as error:  # ImportError, or a broken install failing inside its own imports
        return None, f"flashinfer does not import ({type(error).__name__}: {error})"
    return flashinfer, ""


def paged_kv_arrays(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> tuple[np.ndarray, ...]:
    """FlashInfer's page list of a batch: (indptr int32 [B+1], indices int32 [indptr[-1]], last_page_len
    int32 [B]). Request b's sequence of seq_lens[b] >= 1 tokens lies in the first ceil(seq_len /
    block_size) entries of block_tables[b]; its last page holds seq_len - (pages - 1) * block_size."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    block_tables = np.asarray(block_tables)
    pages = -(-seq_lens // block_size)
    if seq_lens.size and (seq_lens.min() < 1 or pages.max() > block_tables.shape[1]):
        raise ValueError(f"sequence lengths {seq_lens.tolist()} do not fit block tables of width {block_tables.shape[1]}")
    indptr = np.zeros(seq_lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(block_tables.shape[1])[None, :] < pages[:, None]
    indices = block_tables[used].astype(np.int32)  # row-major: each request's pages in order
    last_page_len = (seq_lens - (pages - 1) * block_size).astype(np.int32)
    return indptr, indices, last_page_len


@dataclass
class FlashInferMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: where the step's K/V go
    wrapper: object  # the planned FlashInfer wrapper every layer runs
    planned: dict = field(default_factory=dict)  # the wrapper's plan arguments (tests, logs)


class _Planned:
    """A wrapper and the event after its last plan's copies (see the module doc)."""

    def __init__(self, wrapper: object, device: torch.device) -> None:
        self.wrapper = wrapper
        self.on_cuda = device.type == "cuda"
        self.event: torch.cuda.Event | None = None

    def plan(self, *args, **kwargs) -> object:
        if self.event is not None:
            self.event.synchronize()  # the previous plan's pinned buffer has been copied
        self.wrapper.plan(*args, **kwargs)
        if self.on_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        return self.wrapper


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True
    supports_prewritten_kv = True

    def __init__(self, device: str | torch.device = "cuda", module: object | None = None,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        """module: the flashinfer module (default: imported; tests pass a stand-in)."""
        self.device = torch.device(device)
        if module is None:
            module, why = flashinfer_module(self.device)
            if module is None:
                raise ValueError(f"{FLASHINFER_UNAVAILABLE} ({why}); use --attention-backend triton")
        self.fi = module
        self.kernel_source = getattr(module, "__name__", "flashinfer") + " " + str(getattr(module, "__version__", ""))
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.q_dtype = torch.bfloat16
        self.kv_dtype = torch.bfloat16
        self.sm_scale: float | None = None
        self._decode: _Planned | None = None
        self._prefill: _Planned | None = None

    def configure(self, dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        self.q_dtype, self.kv_dtype, self.sm_scale = dtype, kv_dtype, float(scale)

    @property
    def _tensor_cores(self) -> bool:
        return self.num_heads >= 4 * max(1, self.num_kv_heads)

    @property
    def _prefill_kernels(self) -> str:
        # FlashInfer's "auto" picks its FA3 prefill on sm90, which cannot mix 16-bit queries with an
        # e4m3 cache (its build fails: "No eligible GMMA operator", seen with 0.5.3); FA2
        # reads an fp8 cache with 16-bit queries.
        return "fa2" if self.kv_dtype.itemsize == 1 else "auto"

    def _decode_wrapper(self, **graph_buffers) -> object:
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self._tensor_cores, **graph_buffers
        )

    def _plan_args(self) -> dict:
        return dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)

    def _plan_decode(self, planned: _Planned, seq_lens: np.ndarray, block_tables: np.ndarray) -> dict:
        """Plan a decode wrapper for these sequences; returns the page list it was planned with."""
        indptr, indices, last = paged_kv_arrays(block_tables, seq_lens, self.block_size)
        planned.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last),
                     self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, **self._plan_args())
        return {"kind": "decode", "indptr": indptr, "indices": indices, "last_page_len": last}

    # -- metadata -------------------------------------------------------------------------

    def build_metadata(self, inputs: AttentionInputs) -> FlashInferMetadata:
        plan = inputs.plan
        query_lens = np.asarray(plan.query_lens, dtype=np.int64)
        seq_lens = np.asarray(plan.seq_lens, dtype=np.int64)
        block_tables = np.asarray(plan.block_tables)
        if int(query_lens.max()) == 1:
            if self._decode is None:
                self._decode = _Planned(self._decode_wrapper(), self.device)
            return FlashInferMetadata(inputs.slot_mapping, self._decode.wrapper,
                                      self._plan_decode(self._decode, seq_lens, block_tables))
        if self._prefill is None:
            self._prefill = _Planned(self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self._prefill_kernels), self.device)
        indptr, indices, last = paged_kv_arrays(block_tables, seq_lens, self.block_size)
        qo_indptr = np.zeros(query_lens.shape[0] + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qo_indptr[1:])
        self._prefill.plan(
            torch.from_numpy(qo_indptr), torch.from_numpy(indptr), torch.from_numpy(indices),
            torch.from_numpy(last), self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
            causal=True, **self._plan_args(),
        )
        return FlashInferMetadata(inputs.slot_mapping, self._prefill.wrapper,
                                  {"kind": "prefill", "qo_indptr": qo_indptr, "indptr": indptr, "indices": indices,
                                   "last_page_len": last})

    def decode_graph_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> FlashInferMetadata:
        """A decode wrapper over fixed buffers for this graph's batch size, planned now on the static
        buffers' current contents (the capture's dummy rows); `plan_graph_replay` re-plans it."""
        size, width = block_tables.shape
        planned = _Planned(self._decode_wrapper(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(size * width, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=self.device),
        ), self.device)
        page_list = self._plan_decode(planned, seq_lens.cpu().numpy(), block_tables.cpu().numpy())
        return FlashInferMetadata(slot_mapping, planned.wrapper, {**page_list, "graph": planned})

    def plan_graph_replay(self, metadata: FlashInferMetadata, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """Before a replay: plan the graph's wrapper for the padded step (host arrays)."""
        metadata.planned.update(self._plan_decode(metadata.planned["graph"], seq_lens, block_tables))

    # -- startup ----------------------------------------------------------------------------

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> int:
        """JIT-compile the prefill kernels now (graph capture compiled the decode ones): one
        request of one and one of 16 tokens over block 0, read only."""
        calls = 0
        for query_len in (1, 16):
            blocks = -(-query_len // self.block_size)
            plan = _WarmUpPlan(query_len, blocks)
            metadata = self.build_metadata(AttentionInputs(
                plan=plan, query_lens=None, context_lens=None, slot_mapping=None, block_tables=None,
                block_size=self.block_size))
            q = torch.zeros((query_len, self.num_heads, self.head_dim), dtype=dtype, device=k_cache.device)
            self.attend(q, k_cache, v_cache, metadata, self.sm_scale or self.head_dim**-0.5)
            calls += 1
        if k_cache.device.type == "cuda":
            torch.cuda.synchronize(k_cache.device)
        return calls

    # -- per layer ------------------------------------------------------------------------

    def forward(self, q, k, v, k_cache, v_cache, metadata: FlashInferMetadata, scale: float) -> torch.Tensor:
        write_kv_cache(k_cache, v_cache, metadata.slot_mapping, k, v)
        return self.attend(q, k_cache, v_cache, metadata, scale)

    def attend(self, q, k_cache, v_cache, metadata: FlashInferMetadata, scale: float) -> torch.Tensor:
        if self.sm_scale is not None and abs(scale - self.sm_scale) > 1e-12 * max(1.0, abs(scale)):
            raise ValueError(f"flashinfer was planned with scale {self.sm_scale}, a layer asks for {scale}")
        return metadata.wrapper.run(q.contiguous(), (k_cache, v_cache))


@dataclass
class _WarmUpPlan:
    """The fields of a SchedulePlan that build_metadata reads, for warm_up's one request (a prefill of
    query_len tokens, or a decode when query_len is 1, over block 0)."""

    query_len: int
    blocks: int

    @property
    def query_lens(self) -> np.ndarray:
        return np.array([self.query_len], dtype=np.int32)

    @property
    def seq_lens(self) -> np.ndarray:
        return np.array([self.query_len], dtype=np.int32)

    @property
    def block_tables(self) -> np.ndarray:
        return np.zeros((1, self.blocks), dtype=np.int32)


__all__ = ["FLASHINFER_UNAVAILABLE", "FlashInferAttentionBackend", "FlashInferMetadata", "flashinfer_module",
           "paged_kv_arrays"]
