"""The model runner: loads a model, owns its paged KV cache, and runs one SchedulePlan per forward.

Per step: each plan array goes to the device once, the attention backend builds its
metadata once, the model runs over all T tokens, and the LM head runs only on the
sampling rows (the last query token of each request in plan.sample_rows).

Decode-only steps replay CUDA graphs (model_executor/cuda_graph.py) once
`capture_cuda_graphs` ran, on CUDA with a backend that supports them and without
`enforce_eager`; the KV pool then holds one extra *dummy block* (id `num_blocks`, never
handed to the scheduler) for the padded rows of a graph. With --enable-piecewise-cuda-graph,
prefill and mixed steps replay piecewise graphs (model_executor/piecewise_graph.py), captured
after startup. `profile_peak_activation_bytes`
measures the largest step's activations so the engine can size the KV pool.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from tokenspeed_worker import distributed
from tokenspeed_worker.config import EngineConfig, resolve_dtype
from tokenspeed_worker.layers import rotary, small_batch_gemv
from tokenspeed_worker.layers.moe import FusedMoE, expert_parallel
from tokenspeed_worker.layers.attention import Attention, AttentionBackend, AttentionInputs, get_attention_backend
from tokenspeed_worker.model_executor.cuda_graph import (
    CaptureReport,
    CudaGraph,
    DecodeGraphs,
    capture_sizes,
    graph_reserve_bytes,
    max_table_width,
    padded_batch_size,
    resolve_pending_ids,
)
from tokenspeed_worker.model_executor.piecewise_graph import PiecewiseGraphs, graph_memory_estimate, piecewise_sizes
from tokenspeed_worker.layers.quantization import kv_scales, methods as quant_methods
from tokenspeed_worker.model_executor.checkpoint_files import safetensors_files
from tokenspeed_worker.model_executor.loader import load_model_weights
from tokenspeed_worker import kernel_cache
from tokenspeed_worker.models.llama import head_dim_of
from tokenspeed_worker.models.registry import check_architectures, get_model_class, language_model_config
from tokenspeed_worker.scheduler.plan import SchedulePlan

logger = logging.getLogger(__name__)

_MIB = 1 << 20
_GIB = 1 << 30
# Decode batch sizes up to this many rows are captured before the worker serves (with the largest
# and a batch-1 verify step's): first_capture_sizes.
FIRST_CAPTURE_MAX_ROWS = 8

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def first_capture_sizes(sizes: list[int], verify_size: int | None, ranks: int) -> list[int]:
    """The decode sizes captured before the worker serves: the few-row ones (latency-bound, and where
    the small-batch kernels are timed and refined), the largest (its pool memory the others reuse)
    and a batch-1 verify step's. The engine captures the rest while idle, or as soon as a step needs
    one (ModelRunner.capture_deferred_graph). With tensor parallelism, all of them: a capture runs
    collectives, which every rank would have to enter together."""
    if ranks > 1 or not sizes:
        return list(sizes)
    first = {size for size in sizes if size <= FIRST_CAPTURE_MAX_ROWS} | {max(sizes)}
    if verify_size is not None:
        first.add(verify_size)
    return sorted(first)


def resolve_device(device: str) -> torch.device:
    """The torch device of "cpu", "cuda" or "cuda:N" (bare "cuda": the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    return device


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. On CPU its pages are taken from the OS only when first written:
    torch.zeros writes every byte (the whole pool is resident from the start), numpy's zeros asks
    calloc, which maps large blocks as zero pages. A CPU worker's memory then grows with the KV it
    uses, not with the pool's size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, *, attention_backend: AttentionBackend | None = None,
                 graph_class: type | None = None, setup_started: float | None = None) -> None:
        """The runner of `config`'s model (its model, cache and scheduler sections) on this rank's
        device (`config.rank_device`); max_model_len sets the CUDA graphs' block table width. The
        model section's attention_backend is "torch", "triton", "flashinfer" or "auto" (triton on
        CUDA when its kernels can run, else torch); `attention_backend`, a backend instance,
        replaces it. `graph_class`: what captures and replays the decode steps (default
        cuda_graph.CudaGraph, CUDA only); CPU tests pass one that re-runs the step on the static
        buffers (tests/emulated_graph.py), which also turns the graph path on off CUDA.
        setup_started: the time.perf_counter() the caller's share of the runtime setup began (the
        device made current), counted into this runner's "runtime setup" phase (default: now)."""
        init_start = time.perf_counter() if setup_started is None else setup_started
        from transformers import AutoConfig

        self.model_path = config.model.path
        config_path = Path(self.model_path) / "config.json"
        if not config_path.exists():
            raise ValueError(f"no config.json in {self.model_path}")
        check_architectures(list(json.loads(config_path.read_text()).get("architectures") or []))
        # Never code from the model folder (transformers would otherwise ask on stdin whether to run it).
        self.hf_config = language_model_config(AutoConfig.from_pretrained(self.model_path, trust_remote_code=False))
        self.device = resolve_device(config.rank_device)
        self.dtype = TORCH_DTYPES[resolve_dtype(config.model.dtype, self.device.type, self.model_path)]
        self.kv_dtype = self.dtype if config.cache.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if attention_backend is not None:
            self.attention_backend = attention_backend
        else:
            self.attention_backend = get_attention_backend(config.model.attention_backend, self.device)
        # Speculative decoding replays verify steps as decode graphs of one row per token
        # (flatten_verify): a row then attends to keys other rows of the same kernel write, which
        # the decode kernel's own rotary + KV write (attend_rotary) would race with.
        self.verify_in_graphs = config.speculative.enabled
        self.eagle3 = config.speculative.speculative_algorithm == "EAGLE3"
        if self.verify_in_graphs and hasattr(self.attention_backend, "fuse_rope_max_rows"):
            self.attention_backend.fuse_rope_max_rows = 0
        self.block_size = config.cache.block_size
        self.seed = config.model.seed

        model_class = get_model_class(self.hf_config)
        torch.manual_seed(self.seed)
        # This runner's small-batch GEMV choices: its layers consult it (layers/small_batch_gemv.py);
        # those an earlier start on this GPU kept (--cache-dir), or the package shipped for this GPU
        # model, are taken again untimed.
        self.choices_path = kernel_cache.choices_path(config.model.cache_dir, self.device)
        # The decode attention's timed split thresholds likewise (tune_attention).
        self.attention_choices_path = kernel_cache.choices_path(config.model.cache_dir, self.device,
                                                                kernel_cache.ATTENTION_FILE)
        self.small_batch_gemv = small_batch_gemv.SmallBatchGemv(kernel_cache.stored_choices(self.choices_path,
                                                                                             self.device))
        # (phase, seconds, detail) of this constructor's startup phases (build_runner reports them: startup.py)
        start = time.perf_counter()
        self.startup_timings: list[tuple[str, float, str]] = [
            ("runtime setup", start - init_start, "transformers' config, the device's runtime, the attention backend")]
        with (torch.device(self.device), _default_dtype(self.dtype), small_batch_gemv.building(self.small_batch_gemv),
              quant_methods.building(config.model.quant_config), expert_parallel(config.parallel.expert_parallel_size),
              rotary.serving_length(config.scheduler.max_model_len)):
            self.model = model_class(self.hf_config)
        if self.eagle3:
            self._capture_eagle3_states(config.speculative.eagle3_layers)
        self.startup_timings.append(("model construction", time.perf_counter() - start, ""))
        start = time.perf_counter()
        self.load_format = load_model_weights(self.model, config.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.startup_timings.append(("weight load", seconds, _load_detail(self.load_format, config.model.path, seconds)))
        self.kv_scales_source = self._fold_kv_cache_scales(config)
        experts = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        if config.parallel.expert_parallel_size > 1 and distributed.rank() == 0:
            if experts:
                logger.info("expert parallel: %d groups of %d rank(s), %d of the %d experts each (per MoE layer)",
                            config.parallel.expert_parallel_size, config.parallel.moe_tp_size,
                            experts[0].num_local_experts, experts[0].num_experts)
            else:
                logger.warning("expert parallel size %d: the model has no experts; every layer is tensor parallel",
                               config.parallel.expert_parallel_size)
        if experts:  # the grouped GEMMs' tiles tuned for these shapes on this GPU (kernels/moe.py), if any
            stored = kernel_cache.stored_choices(
                kernel_cache.choices_path(config.model.cache_dir, self.device, kernel_cache.MOE_FILE), self.device,
                kernel_cache.MOE_FILE)
            tuned = [m.take_tuned_tiles(stored) for m in experts]
            if any(tuned) and distributed.rank() == 0:
                logger.info("MoE grouped GEMMs: tiles tuned at %d pair counts (kernel_cache.MOE_FILE); the default "
                            "tiles elsewhere", max(tuned))
        # With those tiles: a disagreement sends every layer to the reference loop.
        if experts and not experts[0].kernels_agree(getattr(self.hf_config, "num_experts_per_tok", 2)):
            for m in experts:
                m.use_kernels = False
        self.model.eval()
        # Before any graph is captured: the all-reduce kernels the graphs will hold are chosen here.
        self.all_reduce_choice = distributed.setup_peer_all_reduce(
            self.dtype, self.device, enabled=config.parallel.custom_all_reduce, one_host=config.parallel.nnodes == 1)
        if distributed.size() > 1 and distributed.rank() == 0:
            logger.info("tensor parallel all-reduce: %s", self.all_reduce_choice)

        self.vocab_size: int = self.hf_config.vocab_size
        self.num_layers: int = self.hf_config.num_hidden_layers
        self.head_dim: int = head_dim_of(self.hf_config)
        self.max_model_len: int = config.scheduler.max_model_len
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        windows = {m.sliding_window for m in self.attention_layers}
        # The one window of every layer (Mistral-style): the scheduler releases the blocks that slid
        # out of it. 0 with full-attention layers (Gemma's hybrids keep every block).
        self.uniform_sliding_window: int = next(iter(windows)) or 0 if len(windows) == 1 else 0
        special = [m for m in self.attention_layers if m.needs_window_or_softcap]
        if special and not self.attention_backend.supports_windows_and_softcap:
            raise ValueError(f"{type(self.model).__name__} has sliding-window or soft-capped attention layers, which "
                             f"attention backend {self.attention_backend.name!r} does not support yet: run with "
                             f"--attention-backend torch")
        # This rank's heads (with tensor parallelism a share of the model's; distributed.py).
        self.num_heads: int = self.attention_layers[0].num_heads
        self.num_kv_heads: int = self.attention_layers[0].num_kv_heads
        self.attention_backend.setup(self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        self.attention_backend.configure(self.dtype, self.kv_dtype, self.attention_layers[0].scale)
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0  # blocks the scheduler may hand out (the pool may hold one dummy block more)
        self.dummy_block: int | None = None

        # CUDA graphs: decided here, because they change the pool's size (one dummy block).
        self.graph_class = graph_class
        self.max_num_seqs = max_num_seqs = config.scheduler.max_num_seqs
        self.cudagraph_sizes = capture_sizes(max_num_seqs, config.model.cudagraph_capture_sizes,
                                             config.model.max_cudagraph_capture_size)
        self.cuda_graphs_off_reason = self._cuda_graphs_off_reason(config.model.enforce_eager)
        self.use_cuda_graphs = self.cuda_graphs_off_reason is None
        verify_size = padded_batch_size(config.speculative.num_speculative_tokens + 1, self.cudagraph_sizes)
        self.first_capture_sizes = first_capture_sizes(self.cudagraph_sizes, verify_size, distributed.size())
        if self.verify_in_graphs and verify_size is not None:
            # A batch-1 verify step replays this graph: its choices were timed alone at these rows, as
            # for batch 1, so they are checked inside the step too.
            self.small_batch_gemv.refine_verify_step(verify_size)
        # Prefill and mixed steps (model_executor/piecewise_graph.py): on one GPU with the decode graphs.
        self.piecewise_sizes = piecewise_sizes(config.scheduler.token_budget, config.model.piecewise_cuda_graph_max_tokens,
                                               config.model.piecewise_cuda_graph_tokens) if (
            config.model.enable_piecewise_cuda_graph and self.use_cuda_graphs and distributed.size() == 1) else []
        self.piecewise: PiecewiseGraphs | None = None
        self.cuda_graphs: DecodeGraphs | None = None
        self.graph_bytes = 0  # device memory of the captured decode graphs (capture_cuda_graphs)
        self.deferred_capture_seconds = 0.0  # capture_deferred_graph's, in all
        self.capture_report: CaptureReport | None = None
        # The last step's sampled tokens, on the device: with overlap scheduling a plan's input
        # id -1 - i stands for sample i of the previous step, not yet known on the host.
        self.last_sampled = torch.zeros(max(1, max_num_seqs, *self.cudagraph_sizes), dtype=torch.int64,
                                        device=self.device)
        # After a decode graph replay whose sampling rows are the leading rows: their argmax, taken
        # inside the graph into last_sampled (the tokens of an all-greedy step); else None.
        self.greedy_tokens: torch.Tensor | None = None

    def _fold_kv_cache_scales(self, config: EngineConfig) -> str:
        """With an FP8 KV cache, fold each layer's k/v scales (--quantization-param-path, else the
        checkpoint's, else 1.0: layers/quantization/kv_scales.py) into the weights; returns where
        they came from ("file", "checkpoint", "none"), or "unused" for a 16-bit cache."""
        found = getattr(self.model, "checkpoint_kv_scales", {})
        if self.kv_dtype != torch.float8_e4m3fn:
            if found:
                logger.info("the checkpoint has FP8 KV-cache scales; they apply with --kv-cache-dtype fp8_e4m3")
            return "unused"
        scales, source = kv_scales.resolve(config.cache.quantization_param_path, found,
                                           self.hf_config.num_hidden_layers, config.parallel.tp_rank,
                                           config.parallel.tensor_parallel_size)
        if source == "none":
            logger.warning("FP8 KV cache without scales (neither --quantization-param-path nor the checkpoint "
                           "has them): every scale is 1.0, keys and values saturate at +-448")
            return source
        self.model.fold_kv_cache_scales(scales)
        ks, vs = [k for k, _ in scales.values()], [v for _, v in scales.values()]
        logger.info("FP8 KV cache: per-layer scales from the %s folded into the weights (k %.4g-%.4g, v %.4g-%.4g)",
                    "--quantization-param-path file" if source == "file" else "checkpoint",
                    min(ks), max(ks), min(vs), max(vs))
        return source

    def _capture_eagle3_states(self, layers: tuple[int, ...] | None) -> None:
        """Make every forward keep the residual streams an EAGLE-3 draft head reads (engine/eagle3.py):
        entering `layers`, or layers 2, L/2 and L-3."""
        from tokenspeed_worker.models.llama import LlamaModel
        from tokenspeed_worker.models.llama_eagle3 import aux_layers

        target = getattr(self.model, "model", None)
        if not isinstance(target, LlamaModel):
            raise ValueError(f"--speculative-algorithm EAGLE3 needs a Llama-family model (Llama, Qwen2/3, Mistral); "
                             f"{type(self.model).__name__} is not one")
        num_layers = self.hf_config.num_hidden_layers
        chosen = tuple(layers) if layers else tuple(aux_layers(num_layers))
        if len(chosen) != 3 or not all(0 <= i < num_layers for i in chosen):
            raise ValueError(f"--eagle3-layers-to-capture {','.join(map(str, chosen))}: the head fuses three of the "
                             f"model's {num_layers} layers (indices 0..{num_layers - 1})")
        target.aux_layers = chosen

    def _cuda_graphs_off_reason(self, enforce_eager: bool) -> str | None:
        if enforce_eager:
            return "--enforce-eager"
        if self.device.type != "cuda" and self.graph_class in (None, CudaGraph):
            return f"device is {self.device.type}"
        if any(isinstance(m, FusedMoE) and not m.supports_cuda_graphs for m in self.model.modules()):
            return "the model's experts run the reference loop (layers/moe.py: no grouped-GEMM kernels here), which syncs with the host"
        if not self.attention_backend.supports_cuda_graphs:
            return f"attention backend {self.attention_backend.name!r} cannot be captured (triton can)"
        if not self.cudagraph_sizes:
            return "no capture sizes (--cudagraph-capture-sizes left none <= --max-num-seqs and --max-cudagraph-capture-size)"
        return None

    # -- memory ---------------------------------------------------------------------------

    def weight_bytes(self) -> int:
        """Device bytes of the weights: the parameters, and the FP8 layers' scales (buffers)."""
        scales = [t for name, t in self.model.named_buffers() if "weight_scale" in name]
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *scales))

    def expert_bytes(self) -> int:
        """Device bytes of the MoE layers' experts (this rank's), part of weight_bytes."""
        return sum(t.numel() * t.element_size() for m in self.model.modules() if isinstance(m, FusedMoE)
                   for t in (m.w13_weight, m.w2_weight))

    def decode_read_bytes(self) -> int:
        """Weight bytes a one-token decode step must read: every weight but an untied embedding
        table (one row is looked up) and the experts not chosen (top_k of each MoE layer's)."""
        embedding = self.model.model.embed_tokens.weight
        untied = not getattr(self.hf_config, "tie_word_embeddings", False)
        skipped = embedding.numel() * embedding.element_size() if untied else 0
        experts = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        if experts:
            top_k = getattr(self.hf_config, "num_experts_per_tok", 2)
            skipped += self.expert_bytes() * max(0.0, 1.0 - top_k / experts[0].num_experts)
        return int(self.weight_bytes() - skipped)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor [2 (K, V), layers, *backend's per-layer shape]; each attention layer gets its slices.

        num_blocks is what the scheduler may use; with CUDA graphs the pool holds one more,
        the dummy block (id num_blocks) that padded graph rows write to.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if self.cuda_graphs is not None:
            raise RuntimeError("the KV cache cannot be reallocated after CUDA graphs were captured")
        pool_blocks = num_blocks + (1 if self.use_cuda_graphs else 0)
        shape = self.attention_backend.kv_cache_shape(pool_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = None  # free the old pool before allocating the new one
        self.kv_cache = _zeroed_pool((2, self.num_layers, *shape), self.kv_dtype, torch.device(self.device))
        self.num_blocks = num_blocks
        self.dummy_block = num_blocks if self.use_cuda_graphs else None
        for layer_index, attn in enumerate(self.attention_layers):
            attn.bind_kv_cache(self.kv_cache[0, layer_index], self.kv_cache[1, layer_index], self.attention_backend)

    def _release_kv_cache(self) -> None:
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = attn.backend = None
        self.kv_cache = None
        self.num_blocks = 0
        self.dummy_block = None

    def cuda_graph_reserve_bytes(self, activation_bytes: int = 0, activation_tokens: int = 0) -> int:
        """Memory to leave free for the CUDA graphs when sizing the KV pool (0 without graphs): the
        decode graphs' reserve, and with piecewise graphs their static buffers and the activations
        of their largest token count, scaled from a profiled eager step's (activation_bytes at
        activation_tokens tokens)."""
        if not self.use_cuda_graphs:
            return 0
        width = max_table_width(self.max_model_len, self.block_size)
        reserve = graph_reserve_bytes(max(self.cudagraph_sizes), width, self.vocab_size, self.dtype.itemsize)
        if self.piecewise_sizes:
            tokens = max(self.piecewise_sizes)
            reserve += tokens * (3 * 8 + self._attention_row_width() * self.dtype.itemsize)
            reserve += graph_memory_estimate(activation_bytes, activation_tokens, tokens)
        return reserve

    def _attention_row_width(self) -> int:
        return max(layer.num_heads * layer.head_dim for layer in self.attention_layers)

    @torch.inference_mode()
    def profile_peak_activation_bytes(self, num_tokens: int, num_sample_rows: int) -> int:
        """Peak device memory (beyond weights and KV) of the largest step: `num_tokens` tokens of
        prefill (one request, or several of max_model_len when it is shorter) and the LM head
        on `num_sample_rows` rows. CUDA only; runs on a temporary KV pool just big enough, which it frees."""
        if self.device.type != "cuda":
            raise RuntimeError("activation profiling needs a CUDA device")
        if self.kv_cache is not None:
            raise RuntimeError("profile before allocating the KV cache")
        num_tokens = max(1, int(num_tokens))
        lengths = [self.max_model_len] * (num_tokens // self.max_model_len)
        if num_tokens % self.max_model_len:
            lengths.append(num_tokens % self.max_model_len)
        plan = _profile_plan(lengths, self.block_size, self.vocab_size)
        blocks = int(sum(math.ceil(n / self.block_size) for n in lengths))
        use_graphs = self.use_cuda_graphs
        self.use_cuda_graphs = False  # no dummy block in the temporary pool
        try:
            self.allocate_kv_cache(blocks)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            baseline = torch.cuda.memory_allocated(self.device)
            hidden_states = self._hidden_states(plan)
            index = torch.full((max(1, num_sample_rows),), num_tokens - 1, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden_states[index]).float()
            del hidden_states, logits
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - baseline
        finally:
            self.use_cuda_graphs = use_graphs
            self._release_kv_cache()
            torch.cuda.empty_cache()
        return int(peak)

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile, at startup, the attention kernel variants that CUDA-graph capture and the
        profiling forward did not (the backend's `warm_up`; after allocate_kv_cache)."""
        warm_up = getattr(self.attention_backend, "warm_up", None)
        if warm_up is None or self.kv_cache is None:
            return
        t0 = time.perf_counter()
        calls = warm_up(self.kv_cache[0, 0], self.kv_cache[1, 0], self.dtype)
        if calls:
            logger.info("attention kernels warmed up: %d variants in %.1f s", calls, time.perf_counter() - t0)

    @torch.inference_mode()
    def tune_attention(self) -> dict[int, int]:
        """Let the attention backend time its decode choices (the triton backend's single-split
        threshold, `tune_decode`) for the decode batch sizes this runner will run: the captured
        sizes, or powers of two up to max_num_seqs without graphs. After allocate_kv_cache, before
        capture_cuda_graphs (graphs bake the choice in). Where an earlier start on this GPU kept a
        threshold for every one of these sizes at this shape (--cache-dir: kernel_cache.ATTENTION_FILE),
        they are taken untimed; what is timed is kept for the next start. Returns {batch size: threshold}."""
        tune = getattr(self.attention_backend, "tune_decode", None)
        if tune is None or self.kv_cache is None:
            return {}
        sizes = self.cudagraph_sizes if self.use_cuda_graphs else [
            1 << i for i in range(max(1, self.max_num_seqs).bit_length()) if 1 << i <= self.max_num_seqs]
        max_seq_len = max_table_width(self.max_model_len, self.block_size) * self.block_size
        # What the thresholds depend on besides the device (its folder): the attention's shape on this
        # rank, the dtypes, the block size and the longest context timed.
        prefix = "/".join(str(p) for p in (
            self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.kv_dtype, self.block_size, max_seq_len))
        stored = kernel_cache.stored_choices(self.attention_choices_path, self.device, kernel_cache.ATTENTION_FILE)
        try:
            kept = {size: int(stored[f"{prefix}/{size}"]) for size in sizes}
        except (KeyError, ValueError):  # a size not timed before, or not a number: time them all
            kept = None
        take = getattr(self.attention_backend, "take_decode_choices", None)
        if kept is not None and take is not None and take(kept):
            logger.info("decode attention: the split thresholds of an earlier start or the package's, untimed "
                        "(%d batch sizes)", len(kept))
            return kept
        t0 = time.perf_counter()
        try:
            chosen = tune(self.kv_cache[0, 0], self.kv_cache[1, 0], self.dtype, sizes, max_seq_len)
        except (RuntimeError, ValueError) as error:  # e.g. out of memory for the L2 flush buffer
            # The backend left its choice empty: every request splits as without the timing.
            logger.warning("decode attention timing failed (%s): every request splits as without it", error)
            return {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the timing's L2-flush buffer and graphs: back to the device before capture
        if any(chosen.values()):
            logger.info("decode attention: one program per kv head up to %s keys (by decode batch size; "
                        "timed in %.1f s)", {b: t for b, t in chosen.items() if t}, time.perf_counter() - t0)
        logger.debug("decode attention timings (batch: {keys: (split µs, single µs)}): %s",
                     getattr(self.attention_backend, "tuning", {}))
        if chosen and distributed.rank() == 0:
            kernel_cache.save_choices(self.attention_choices_path,
                                      {f"{prefix}/{size}": str(tokens) for size, tokens in chosen.items()})
        return chosen

    def keep_kernel_choices(self) -> None:
        """Write the small-batch GEMV choices for the next start (--cache-dir; after the capture,
        which makes and refines them). Only rank 0 of a tensor-parallel group writes."""
        if self.choices_path is not None and distributed.rank() == 0:
            kernel_cache.save_choices(self.choices_path, self.small_batch_gemv.to_store())

    # -- CUDA graphs ----------------------------------------------------------------------

    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs (after allocate_kv_cache); logs what was captured, or why not."""
        if not self.use_cuda_graphs:
            logger.info("CUDA graphs off (%s): every step runs eagerly", self.cuda_graphs_off_reason)
            return
        if self.kv_cache is None:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        if self.cuda_graphs is not None:
            return
        graphs = DecodeGraphs(
            self.model,
            self.attention_backend,
            sizes=self.cudagraph_sizes,
            max_table_width=max_table_width(self.max_model_len, self.block_size),
            dummy_block=self.dummy_block,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            device=self.device,
            last_sampled=self.last_sampled,
            graph_class=self.graph_class or CudaGraph,
            aux_width=3 * self.hf_config.hidden_size if self.eagle3 else 0,
            step_tuner=step_tuner(self.small_batch_gemv, self.device),
        )
        report = graphs.capture(self.first_capture_sizes)
        self.capture_report = report
        self.graph_bytes = int(report.graph_bytes)
        for size, tuning in sorted(graphs.tuning.items()):
            _log_step_tuning(size, tuning)
        self.cuda_graphs = graphs
        reserve = self.cuda_graph_reserve_bytes()
        logger.info(
            "CUDA graphs: captured %d decode batch sizes %s in %.1f s (attention %s via %s)%s; "
            "graph memory %.0f MiB incl. static buffers %.0f MiB (reserved for them: %.0f MiB); "
            "static block table width %d blocks (max_model_len %d)",
            len(report.sizes), _ranges(report.sizes), report.seconds, self.attention_backend.name,
            getattr(self.attention_backend, "kernel_source", self.attention_backend.name),
            f"; {len(graphs.deferred)} more {_ranges(graphs.deferred)} while the engine idles or needs them"
            if graphs.deferred else "",
            report.graph_bytes / _MIB, report.static_bytes / _MIB, reserve / _MIB,
            graphs.max_table_width, self.max_model_len,
        )
        if self.piecewise_sizes:
            self.piecewise = PiecewiseGraphs(
                self.model, self.attention_backend, sizes=self.piecewise_sizes, dummy_block=self.dummy_block,
                block_size=self.block_size, dtype=self.dtype, device=self.device,
                row_width=self._attention_row_width(), last_sampled=self.last_sampled, pool=graphs.pool,
                emulate=graphs.graph_class is not CudaGraph)
            logger.info("piecewise CUDA graphs (prefill and mixed steps): %d token counts %s, captured while the "
                        "engine idles or as steps need them", len(self.piecewise_sizes), _ranges(self.piecewise_sizes))
        if report.graph_bytes > reserve:
            logger.warning(
                "CUDA graphs took %.0f MiB, more than the %.0f MiB reserved when the KV pool was sized; "
                "lower --gpu-memory-utilization if memory runs out",
                report.graph_bytes / _MIB, reserve / _MIB,
            )

    @property
    def deferred_graphs(self) -> bool:
        """Whether decode sizes or piecewise token counts are left to capture (capture_deferred_graph)."""
        return ((self.cuda_graphs is not None and bool(self.cuda_graphs.deferred))
                or (self.piecewise is not None and bool(self.piecewise.deferred)))

    @property
    def graphs_wanted(self) -> bool:
        """Whether a step ran eagerly for want of a decode size or a token count not captured yet."""
        return ((self.cuda_graphs is not None and bool(self.cuda_graphs.wanted))
                or (self.piecewise is not None and bool(self.piecewise.wanted)))

    def capture_deferred_graph(self) -> None:
        """Capture one decode size left by capture_cuda_graphs (a wanted one first), else one
        piecewise token count (likewise). Only between completed steps: nothing in flight may read
        the graphs' buffers or last_sampled. After the last of either, the kernel choices timed
        meanwhile are kept and the whole capture logged."""
        graphs = self.cuda_graphs
        if self.piecewise is not None and self.piecewise.deferred and (
                graphs is None or not graphs.deferred or (self.piecewise.wanted and not graphs.wanted)):
            self._capture_piecewise()
            return
        report = graphs.capture_next() if graphs is not None else None
        if report is None:
            return
        self.deferred_capture_seconds += report.seconds
        self.graph_bytes += int(report.graph_bytes)
        for size in report.sizes:
            if size in graphs.tuning:
                _log_step_tuning(size, graphs.tuning[size])
        logger.debug("CUDA graph of decode batch size %s captured in %.2f s", report.sizes, report.seconds)
        if not graphs.deferred:
            self.keep_kernel_choices()
            logger.info("CUDA graphs: the other %d decode batch sizes captured after startup (%.1f s in all; "
                        "%d decode steps ran eagerly meanwhile); graph memory now %.0f MiB",
                        len(graphs.sizes) - len(self.first_capture_sizes), self.deferred_capture_seconds,
                        graphs.num_uncaptured_decodes, self.graph_bytes / _MIB)

    def _capture_piecewise(self) -> None:
        piecewise = self.piecewise
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        size = piecewise.capture_next()
        if self.device.type == "cuda":
            self.graph_bytes += free - torch.cuda.mem_get_info(self.device)[0]
        logger.debug("piecewise CUDA graph of %s tokens captured", size)
        if not piecewise.deferred and piecewise.off_reason is None:  # (turned off: its error line said so)
            self.keep_kernel_choices()
            logger.info("piecewise CUDA graphs: %d token counts captured after startup (%.1f s in all; %d steps ran "
                        "eagerly meanwhile); graph memory now %.0f MiB", len(piecewise.sizes),
                        piecewise.capture_seconds, piecewise.num_uncaptured, self.graph_bytes / _MIB)

    def capture_all_graphs(self) -> None:
        """Capture every decode size and piecewise token count left (benchmarks: steady state from
        their first step)."""
        while self.deferred_graphs:
            self.capture_deferred_graph()

    # -- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, plan: SchedulePlan) -> torch.Tensor:
        """float32 logits [S, V] of the plan's sampling rows, in sample_rows order. After a graph replay
        this may be a view of the graphs' static buffer: read it (or enqueue its readers) before the
        next forward. Sets greedy_tokens (above)."""
        self.greedy_tokens = None
        if self.cuda_graphs is not None:
            graph_plan = plan
            if plan.has_drafts:
                graph_plan = flatten_verify(plan) if self.verify_in_graphs else None
            logits = self.cuda_graphs.run(graph_plan) if graph_plan is not None else None
            if logits is not None:
                self.greedy_tokens = self.cuda_graphs.last_greedy
                return logits
        hidden_states = self.piecewise.run(plan) if self.piecewise is not None else None
        if hidden_states is None:
            hidden_states = self._hidden_states(plan)
        sample_index = self._to_device(plan.sample_token_index, np.int64)
        return self.model.compute_logits(hidden_states[sample_index]).float()

    @torch.inference_mode()
    def forward_all_logits(self, plan: SchedulePlan) -> torch.Tensor:
        """float32 logits [T, V] of every token of the step (for tests and prompt logprobs)."""
        return self.model.compute_logits(self._hidden_states(plan)).float()

    def record_sampled(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens on the device for the next plan's pending inputs (overlap).
        Tokens that already are last_sampled's leading rows (a decode graph's greedy_tokens) stay."""
        n = tokens.shape[0]
        if n > self.last_sampled.shape[0]:
            raise ValueError(f"{n} sampled tokens, more than max_num_seqs ({self.last_sampled.shape[0]})")
        if tokens.data_ptr() == self.last_sampled.data_ptr() and tokens.device == self.last_sampled.device:
            return
        self.last_sampled[:n].copy_(tokens, non_blocking=True)

    def _to_device(self, array: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(self.device, non_blocking=True)

    def _hidden_states(self, plan: SchedulePlan) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated: call allocate_kv_cache(num_blocks) first")
        if plan.num_tokens == 0:
            raise ValueError("the plan has no tokens")
        attn_metadata = self.attention_backend.build_metadata(AttentionInputs.of(plan, self.device, self.block_size))
        input_ids = self._to_device(plan.input_ids, np.int64)
        if plan.num_tokens and int(plan.input_ids.min()) < 0:
            input_ids = resolve_pending_ids(input_ids, self.last_sampled)
        positions = self._to_device(plan.positions, np.int64)
        return self.model(input_ids, positions, attn_metadata)


def step_tuner(gemv: small_batch_gemv.SmallBatchGemv, device: torch.device):
    """What refines the small-batch GEMV choices inside the batch-1 step before its capture
    (gemv.tune_in_step), or None. On one GPU only: with tensor parallelism a timed step
    all-reduces, so every rank would have to time the same steps in lockstep, and each rank's own
    timings would choose differently."""
    return gemv.tune_in_step if device.type == "cuda" and distributed.size() == 1 else None


def _log_step_tuning(size: int, tuning: dict) -> None:
    """One line per graph size whose kernel choices were refined in-step (layers/small_batch_gemv.py)."""
    changed = ", ".join(f"{site}: {old} -> {new}" for site, (old, new) in tuning.get("changed", {}).items())
    note = f"; changed {changed}" if changed else "; no change"
    if "unconfirmed" in tuning:
        note += f" (changes {tuning['unconfirmed']} not confirmed: the lone-timed choices stay)"
    logger.info("decode step of %d rows, kernel choices refined in-step (%d steps timed, %.1f s): %.1f -> %.1f us%s",
                size, tuning.get("timed_steps", 0), tuning.get("seconds", 0.0), tuning.get("before_us", 0.0),
                tuning.get("after_us", 0.0), note)


def _profile_plan(lengths: list[int], block_size: int, vocab_size: int) -> SchedulePlan:
    """A prefill of fresh requests of the given lengths on consecutive blocks (for memory profiling)."""
    rng = np.random.default_rng(0)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    blocks_per_req = [math.ceil(n / block_size) for n in lengths]
    first_block = np.concatenate([[0], np.cumsum(blocks_per_req)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    block_tables = np.zeros((len(lengths), max(blocks_per_req)), dtype=np.int32)
    for row, (start, count) in enumerate(zip(first_block, blocks_per_req)):
        block_tables[row, :count] = np.arange(start, start + count)
    return SchedulePlan(
        req_ids=np.arange(len(lengths), dtype=np.int64),
        query_lens=np.asarray(lengths, dtype=np.int32),
        context_lens=np.zeros(len(lengths), dtype=np.int32),
        input_ids=rng.integers(0, vocab_size, size=int(sum(lengths))).astype(np.int64),
        positions=positions,
        slot_mapping=first_block[owner] * block_size + positions,
        block_tables=block_tables,
        sample_rows=np.arange(len(lengths), dtype=np.int32),
    )


def flatten_verify(plan: SchedulePlan) -> SchedulePlan | None:
    """A speculative verify step (every row decoding: its last token and its draft, all sampled) as
    a decode step of one row per token: token j of a row attends to the row's context and the j
    tokens before it (its K/V written earlier in the same layer), so the decode graphs run it and
    give logits in sample_token_index order. None for a step that is not only that (a prefill row,
    a row that does not sample)."""
    query_lens = plan.query_lens.astype(np.int64)
    draft_lens = plan.draft_lens if plan.draft_lens is not None else np.zeros_like(plan.query_lens)
    if (plan.sample_rows.shape[0] != plan.num_reqs or not bool((plan.context_lens > 0).all())
            or not np.array_equal(query_lens, 1 + draft_lens.astype(np.int64))):
        return None
    starts = np.cumsum(query_lens) - query_lens
    offsets = np.arange(plan.num_tokens, dtype=np.int64) - np.repeat(starts, query_lens)
    return SchedulePlan(
        req_ids=np.repeat(plan.req_ids, query_lens),
        query_lens=np.ones(plan.num_tokens, dtype=np.int32),
        context_lens=(np.repeat(plan.context_lens, query_lens) + offsets).astype(np.int32),
        input_ids=plan.input_ids,
        positions=plan.positions,
        slot_mapping=plan.slot_mapping,
        block_tables=np.repeat(plan.block_tables, query_lens, axis=0),
        sample_rows=np.arange(plan.num_tokens, dtype=np.int32),
    )


def _ranges(sizes: list[int]) -> str:
    """[1, 2, 4, 8, 16, 24, ..., 256] compactly for a log line."""
    return str(sizes) if len(sizes) <= 8 else f"[{', '.join(map(str, sizes[:6]))}, ..., {sizes[-1]}]"


def _load_detail(load_format: str, path: str, seconds: float) -> str:
    """What the weight load read: dummy weights, or the checkpoint's bytes and their rate."""
    if load_format == "dummy":
        return "dummy weights"
    size = sum(f.stat().st_size for f in safetensors_files(path))
    return f"{size / _GIB:.2f} GiB of safetensors at {size / _GIB / max(seconds, 1e-9):.2f} GiB/s"
