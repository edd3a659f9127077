"""The engine's configuration: one frozen tree, validated when it is built and passed whole.

    EngineConfig
      model      ModelConfig      the checkpoint, where and in which dtype it runs, its kernels
      cache      CacheConfig      the paged KV pool, the prefix cache and its events
      scheduler  SchedulerConfig  what one step may hold: sequences, their length, its token budget
      parallel   ParallelConfig   the tensor-parallel ranks and where they meet
      speculative SpeculativeConfig speculative decoding: the drafter and how far it drafts

The server builds it from the parsed command line (config/worker.py); tests and benchmarks build
it with `EngineConfig.build(model_path, **settings)`, each setting named as its section's field
(`dtype="float32"`, `block_size=4`). ModelRunner reads the whole tree, the Scheduler its section
and the cache's (`Scheduler.from_config`), engine/tp_worker.py the parallel section.

Imports only the standard library, like the rest of the package: the server builds it before
torch is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_worker.config.values import DTYPE_ALIASES
from tokenspeed_worker.layers.quantization import QuantConfig, resolve_quantization

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "dummy")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
MODEL_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")  # what resolve_dtype returns


def resolve_dtype(dtype: str, device: str, model_path: str) -> str:
    """The dtype the model runs in: "bfloat16", "float16" or "float32"; aliases ("bf16", "half",
    ...) name theirs. "auto" on a CPU is float32, which is faster there than bf16 without native
    bf16 matrix units and matches references exactly; on a GPU it follows the checkpoint's
    config.json (`torch_dtype`, or `dtype` since transformers 5), bfloat16 when that names none
    of the three or cannot be read. `dtype`: a --dtype name (ModelConfig checks it)."""
    dtype = DTYPE_ALIASES[dtype]
    if dtype != "auto":
        return dtype
    if str(device).partition(":")[0] == "cpu":
        return "float32"
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        found = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    except (OSError, ValueError):  # no readable config.json: the model facts report it (server/model_info.py)
        found = "bfloat16"
    return found if found in MODEL_DTYPES else "bfloat16"


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint and how its forward runs (model_executor/model_runner.py)."""

    path: str  # a local folder with config.json (and safetensors weights unless load_format is dummy)
    dtype: str = "auto"  # a --dtype name; "auto": resolve_dtype
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": rank 0's device (EngineConfig.rank_device: the others')
    load_format: str = "auto"  # "auto" (safetensors), "safetensors", or "dummy" (random weights)
    seed: int = 0  # dummy weights and the engine's torch generator
    attention_backend: str = "auto"  # triton on CUDA when triton imports, else torch
    sampling_backend: str | None = None  # None: triton on CUDA when available, else torch
    enforce_eager: bool = False  # no CUDA graphs
    cudagraph_capture_sizes: list[int] | None = None  # None: 1, 2, 4, 8, 16, 24, ... up to the max
    max_cudagraph_capture_size: int | None = None  # None: min(256, max_num_seqs)
    # Prefill and mixed steps' piecewise graphs (model_executor/piecewise_graph.py): on or off, the
    # largest token count captured, and an explicit list of counts (None: the ladder).
    enable_piecewise_cuda_graph: bool = True
    piecewise_cuda_graph_max_tokens: int = 4096
    piecewise_cuda_graph_tokens: list[int] | None = None
    # Structured output (engine/grammar.py): "xgrammar" or "none"; the tokenizer it is built from
    # (None: no constraints).
    grammar_backend: str = "xgrammar"
    tokenizer_path: str | None = None
    # Weight quantization: --quantization (None: follow the checkpoint), and what the checkpoint
    # loads with, resolved from `path` when the config is built (layers/quantization/; None:
    # unquantized). Building refuses a mismatch or an unsupported scheme (ValueError).
    quantization: str | None = None
    quant_config: QuantConfig | None = None
    # Where compiled kernels and timed kernel choices are kept between starts (kernel_cache.py);
    # None: nothing kept.
    cache_dir: str | None = None
    # On a CPU: torch's intra-op threads in this engine process (0: torch's default, every core, or
    # OMP_NUM_THREADS). The server sets it when several engine processes share the node's cores.
    cpu_threads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype {self.dtype!r} is not supported (supported: {', '.join(DTYPE_ALIASES)})")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device {self.device!r} is not supported (supported: cpu, cuda, cuda:N)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format {self.load_format!r} is not supported (supported: {', '.join(LOAD_FORMATS)})")
        if self.quant_config is None:
            object.__setattr__(self, "quant_config", resolve_quantization(self.path, self.quantization))


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and its prefix cache (engine_core.size_kv_pool_tokens, the Scheduler)."""

    block_size: int = 16  # tokens per KV block
    # "auto": the model's dtype; "fp8"/"fp8_e4m3": float8 e4m3 with per-layer k/v scales (the
    # attention kernels widen it to the model's dtype as they read; layers/quantization/kv_scales.py).
    kv_cache_dtype: str = "auto"
    # The JSON file of the FP8 cache's per-layer scales (vLLM's format; kv_scales.read_scales_file);
    # None: the checkpoint's, else 1.0.
    quantization_param_path: str | None = None
    max_total_tokens: int | None = None  # the pool's size; None: what memory allows (size_kv_pool_tokens)
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device's memory for weights and the pool
    enable_prefix_caching: bool = True
    # --kv-events-config, resolved (config.kv_events_settings) when it turns publishing on, else None.
    kv_events: dict | None = None
    # Record prefix-cache events for the server's SubscribeKvEvents (the CLI always does; engines
    # driven directly, as benchmarks do, leave it off so nothing accumulates undrained).
    report_kv_events: bool = False
    # Event ids of this engine's KV events: offset + k * stride for its k-th event, so the replicas
    # of a data-parallel worker never share one (replica index, number of replicas).
    kv_event_id_offset: int = 0
    kv_event_id_stride: int = 1

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization_param_path is not None and self.kv_cache_dtype == "auto":
            raise ValueError("--quantization-param-path: its KV-cache scales apply only to an FP8 KV cache "
                             "(add --kv-cache-dtype fp8_e4m3)")

    @property
    def records_kv_events(self) -> bool:
        """Whether the scheduler records its prefix-cache events (for ZMQ, the server, or both)."""
        return self.kv_events is not None or self.report_kv_events


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold (scheduler/scheduler.py)."""

    max_num_seqs: int = 256  # sequences running at once
    max_model_len: int = 2048  # the longest sequence, prompt + output
    chunked_prefill_size: int = 8192  # a step's token budget; <= 0: prompts are never split
    max_prefill_tokens: int = 8192  # the token budget without chunked prefill
    # Admission keeps room for the running requests' expected output (scheduler/scheduler.py); 0: off.
    schedule_conservativeness: float = 1.0
    # Overlap scheduling (host work of step N+1 while the device runs step N); None: on for CUDA
    # devices (env TOKENSPEED_OVERLAP_SCHEDULE=1/0 forces it on/off, for tests), off on CPU.
    overlap_schedule: bool | None = None

    @property
    def chunked_prefill(self) -> bool:
        return self.chunked_prefill_size > 0

    @property
    def token_budget(self) -> int:
        """Tokens one step may compute: the chunk size, or max_prefill_tokens without chunking."""
        return self.chunked_prefill_size if self.chunked_prefill else self.max_prefill_tokens


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (engine/tp_worker.py): the ranks, this process's rank, where they meet."""

    tensor_parallel_size: int = 1
    tp_rank: int = 0
    nnodes: int = 1  # the ranks span this many nodes, tensor_parallel_size / nnodes on each
    # The rendezvous (tcp://host:port); None: a free loopback port (tp_worker.start_followers).
    dist_init_method: str | None = None
    # Expert parallelism inside the tensor-parallel ranks (layers/moe.py): the experts are dealt to
    # this many groups of tensor_parallel_size / expert_parallel_size ranks, which split each of
    # their experts' intermediate rows; attention and dense layers stay tensor parallel.
    expert_parallel_size: int = 1
    # Small all-reduces through the one-shot kernel over peer memory where the ranks can take it
    # (distributed.setup_peer_all_reduce); False: every all-reduce through NCCL.
    custom_all_reduce: bool = True

    def __post_init__(self) -> None:
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if ep < 1 or tp % ep:
            raise ValueError(f"expert_parallel_size {ep} must divide tensor_parallel_size {tp} (the experts are "
                             f"dealt to groups of the tensor-parallel ranks)")

    @property
    def moe_tp_size(self) -> int:
        """The ranks that split each expert's intermediate rows."""
        return self.tensor_parallel_size // self.expert_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // max(1, self.nnodes)


SPECULATIVE_ALGORITHMS: tuple[str, ...] = ("NGRAM", "EAGLE3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py): each step, a decoding request's next tokens are
    proposed by a drafter and checked by one forward of the model over all of them."""

    # None: off; "NGRAM": drafts from the request's own tokens; "EAGLE3": from a draft head
    # (draft_model_path) reading the model's hidden states (engine/eagle3.py)
    speculative_algorithm: str | None = None
    draft_model_path: str | None = None
    eagle3_layers: tuple[int, ...] | None = None  # EAGLE3: the layers the head reads (None: 2, L/2, L-3)
    num_speculative_tokens: int = 3  # draft tokens per request and step (the verify computes 1 + this)
    ngram_min_match: int = 1  # NGRAM: the shortest suffix that may match earlier tokens
    ngram_max_match: int = 12  # NGRAM: the longest suffix tried first
    # A step with more decoding requests than this drafts for none of them (0: no limit): a large
    # batch gains little from drafts and pays for verifying them.
    max_speculative_batch: int = 32

    def __post_init__(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm {algorithm!r} is not supported "
                             f"(supported: {', '.join(SPECULATIVE_ALGORITHMS)})")
        if algorithm == "EAGLE3" and not self.draft_model_path:
            raise ValueError("speculative_algorithm EAGLE3 needs a draft model (--speculative-draft-model-path)")
        if algorithm != "EAGLE3" and self.draft_model_path:
            raise ValueError(f"a draft model path is only used with EAGLE3, not with {algorithm}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.max_speculative_batch < 0:
            raise ValueError(f"max_speculative_batch must be >= 0, got {self.max_speculative_batch}")
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError(f"the n-gram match window must satisfy 1 <= min ({self.ngram_min_match}) "
                             f"<= max ({self.ngram_max_match})")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None


SECTIONS: tuple[str, ...] = ("model", "cache", "scheduler", "parallel", "speculative")
_SECTION_TYPES = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, SpeculativeConfig)
# Every setting's section; `build` and `replace` route a flat setting by its name.
SECTION_OF: dict[str, str] = {
    f.name: section for section, kind in zip(SECTIONS, _SECTION_TYPES) for f in dataclasses.fields(kind)
}
assert len(SECTION_OF) == sum(len(dataclasses.fields(kind)) for kind in _SECTION_TYPES), "setting names must be unique"


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine process runs with, one section per concern (module docstring)."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def build(cls, model_path: str, **settings: Any) -> EngineConfig:
        """The config of the model at `model_path` with the given settings, each named as a field
        of its section (`dtype="float32"`, `block_size=4`, `tensor_parallel_size=2`); the rest keep
        their defaults. Raises TypeError for a name no section has, ValueError for a bad value."""
        return cls(ModelConfig(model_path)).replace(**settings)

    def replace(self, **settings: Any) -> EngineConfig:
        """A copy with the given settings changed (named as in `build`)."""
        unknown = sorted(set(settings) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"unknown engine setting {unknown[0]!r} (known: {', '.join(sorted(SECTION_OF))})")
        changes: dict[str, Any] = {}
        for section in SECTIONS:
            mine = {name: value for name, value in settings.items() if SECTION_OF[name] == section}
            if mine:
                changes[section] = dataclasses.replace(getattr(self, section), **mine)
        return dataclasses.replace(self, **changes)

    @property
    def rank_device(self) -> str:
        """The device of this tensor-parallel rank: the configured CUDA device's index + the
        rank's place on its node (its node's first rank on the configured device)."""
        device, parallel = self.model.device, self.parallel
        if not device.startswith("cuda") or parallel.tensor_parallel_size == 1:
            return device
        index = int(device.partition(":")[2] or 0)
        return f"cuda:{index + parallel.tp_rank % parallel.ranks_per_node}"
