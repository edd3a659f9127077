"""The worker's parameter table: the `ServerArgs` dataclass, one field per command-line parameter.

Every parameter TokenSpeed documents (docs/configuration/server.md, mirrored in
docs/parameters.md) is a field of `ServerArgs`; its field metadata (`OptionSpec`) is the one
table that drives the argparse parser and the --config loader (config/parsing.py),
`check_supported` and the generated parameter reference (config/docs.py). A parameter the
worker does not implement yet is still accepted with its documented default, so recipes
written for TokenSpeed parse, but any other value stops startup with `--<flag> is not
supported yet` instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_worker.config import values
from tokenspeed_worker.config.values import LOG_LEVELS

PROG = "tokenspeed-worker"


class Status(enum.Enum):
    """Whether the worker implements a parameter."""

    SUPPORTED = "supported"
    NOT_YET = "not supported yet"
    GATEWAY = "handled by the smg gateway"


# Argument groups, in the order of TokenSpeed's server parameter reference.
MODEL_LOADING = "Model Loading"
PRECISION = "Precision And Quantization"
API_SURFACE = "API Surface"
SCHEDULER = "Scheduler And Memory"
PARALLELISM = "Parallelism"
BACKENDS = "Backend Selection"
REASONING = "Reasoning And Tool Calling"
SPECULATIVE = "Speculative Decoding"
OBSERVABILITY = "Observability"
TOKENSPEED_SPECIFIC = "TokenSpeed-Specific"
WORKER = "Worker"  # parameters tokenspeed-worker adds to TokenSpeed's set

GROUPS: tuple[str, ...] = (
    MODEL_LOADING,
    PRECISION,
    API_SURFACE,
    SCHEDULER,
    PARALLELISM,
    BACKENDS,
    REASONING,
    SPECULATIVE,
    OBSERVABILITY,
    TOKENSPEED_SPECIFIC,
    WORKER,
)

GROUP_DESCRIPTIONS: dict[str, str] = {
    TOKENSPEED_SPECIFIC: "Runtime knobs specific to TokenSpeed (KV store, disaggregation, fusion).",
    WORKER: "Parameters tokenspeed-worker adds to TokenSpeed's set.",
}

LOAD_FORMATS: tuple[str, ...] = ("auto", "pt", "safetensors", "npcache", "dummy", "extensible")
# TokenSpeed's and SGLang's --quantization values (docs/configuration/server.md); the worker loads
# fp8, compressed-tensors and modelopt (FP8) checkpoints, and refuses the rest by name.
QUANTIZATION_CHOICES: tuple[str, ...] = (
    "fp8", "compressed-tensors", "modelopt", "mxfp4", "nvfp4", "w8a8_fp8", "awq", "gptq", "marlin",
    "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt_fp4", "petit_nvfp4", "w8a8_int8",
    "moe_wna16", "qoq", "w4afp8",
)
ATTENTION_BACKENDS: tuple[str, ...] = (
    "torch",
    "mha",
    "mla",
    "fa3",
    "fa4",
    "triton",
    "flashinfer",
    "trtllm",
    "trtllm_mla",
    "flashmla",
    "tokenspeed_mla",
    "hybrid_linear_attn",
)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class OptionSpec:
    """How one `ServerArgs` field appears on the command line, in --config and in the docs."""

    group: str
    help: str
    status: Status = Status.SUPPORTED
    aliases: tuple[str, ...] = ()  # extra flags for the same field, e.g. --port for --grpc-port
    parse: Callable[[str], Any] | None = None  # argparse `type`; derived from the annotation if None
    choices: tuple[Any, ...] | None = None
    negatable: bool = False  # bool with a --no-<flag> form
    # Values that differ from the default yet are accepted by a not-yet-supported option
    # because they change nothing today (turning off a feature the worker lacks).
    harmless: tuple[Any, ...] = ()
    # Values of a supported option that the parser accepts but the worker does not implement.
    unsupported_values: tuple[Any, ...] = ()
    default_doc: str | None = None  # how the default reads in --help and the docs
    metavar: str | None = None


def _option(default: Any, group: str, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={"option": OptionSpec(group=group, help=help, **spec)})


def _not_yet(default: Any, group: str, help: str, **spec: Any) -> Any:
    return _option(default, group, help, status=Status.NOT_YET, **spec)


def _gateway(default: Any, group: str, help: str, **spec: Any) -> Any:
    return _option(default, group, help, status=Status.GATEWAY, **spec)


@dataclass
class ServerArgs:
    """Everything the worker is configured with. Attribute names are the flag names with
    dashes turned into underscores. After `parse_args`, `tokenizer`, `served_model_name`,
    `device` and `attention_backend` hold resolved values (never None or "auto")."""

    # ---- Model Loading
    model: str = _option(
        "",
        MODEL_LOADING,
        "Model path (a local folder with config.json and weights), or a Hugging Face hub id (org/name) "
        "already in the local hub cache. Give it as the positional argument or with --model; they are equivalent.",
        aliases=("--model-path",),
        default_doc="none (required)",
    )
    tokenizer: str | None = _option(
        None, MODEL_LOADING, "Tokenizer path when it differs from the model path.", default_doc="the model path"
    )
    tokenizer_mode: str = _not_yet(
        "auto",
        MODEL_LOADING,
        "Tokenizer behavior: 'auto' uses the fast tokenizer, 'slow' the slow one.",
        choices=("auto", "slow", "deepseek_v4"),
    )
    skip_tokenizer_init: bool = _not_yet(
        False, MODEL_LOADING, "Skip tokenizer initialization (input-ID-only serving).", negatable=True
    )
    load_format: str = _option(
        "auto",
        MODEL_LOADING,
        "Weight format: 'auto' (safetensors), 'safetensors', or 'dummy' (random weights, for "
        "profiling). 'pt', 'npcache' and 'extensible' are accepted but not supported yet.",
        choices=LOAD_FORMATS,
        unsupported_values=("pt", "npcache", "extensible"),
    )
    trust_remote_code: bool = _option(
        False, MODEL_LOADING, "Accepted as other engines take it, and changes nothing: the worker runs only its own "
        "model code and never imports code from the model folder, so a model whose architecture it does not "
        "implement is refused with or without it.", negatable=True
    )
    revision: str | None = _option(
        None, MODEL_LOADING, "Branch, tag or commit of a Hugging Face hub id given as the model, looked up in the "
        "local hub cache (never downloaded).", default_doc="main")
    download_dir: str | None = _option(
        None, MODEL_LOADING, "The Hugging Face hub cache a hub id given as the model is served from (never "
        "downloaded into).", default_doc="HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub")
    hf_overrides: str | None = _not_yet(
        None, MODEL_LOADING, "JSON overrides for model configuration values.", harmless=("{}",)
    )

    # ---- Precision And Quantization
    dtype: str = _option(
        "auto",
        PRECISION,
        "Weight and activation dtype: auto (follow the model's torch_dtype), bfloat16/bf16, "
        "float16/half/fp16, float32/float/fp32.",
        parse=values.dtype,
    )
    kv_cache_dtype: str = _option(
        "auto", PRECISION, "KV cache dtype; 'auto' uses the model dtype. 'fp8' / 'fp8_e4m3': float8 e4m3, half "
        "the bytes of bf16 (twice the tokens in the pool, half the KV reads per decode step), with one k and one "
        "v scale per layer: from --quantization-param-path, else the checkpoint's (ModelOpt k_proj.k_scale / "
        "v_proj.v_scale, compressed-tensors self_attn.k_scale / v_scale, or kv_scale), else 1.0 (values "
        "saturate at +-448). The scales are folded into the attention weights at load.",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    kv_cache_quant_method: str = _not_yet(
        "none", PRECISION, "KV cache quantization method.", choices=("none", "per_token_head")
    )
    quantization: str | None = _option(
        None,
        PRECISION,
        "Weight quantization; unset follows the checkpoint's config.json quantization_config (or "
        "hf_quant_config.json), and a value must match it. Supported: FP8 checkpoints, 'fp8' "
        "(quant_method fp8, per-tensor or block-wise), 'compressed-tensors' (float-quantized FP8) and "
        "'modelopt' (ModelOpt FP8); 'fp8' on an unquantized (bf16/fp16) checkpoint quantizes every "
        "linear layer at load (online FP8: one scale per output channel). On a GPU of compute "
        "capability 9.0+ the weights stay FP8 (FP8 GEMMs with per-token activation scales; the "
        "small-batch GEMV reads FP8 weights; block-wise checkpoints run a block-scaled FP8 GEMM with "
        "per-token, per-128-column activation scales); on other devices FP8 models are dequantized to "
        "--dtype at load. Embeddings and the LM head stay in --dtype.",
        choices=QUANTIZATION_CHOICES,
        unsupported_values=tuple(c for c in QUANTIZATION_CHOICES if c not in ("fp8", "compressed-tensors", "modelopt")),
    )
    quantization_param_path: str | None = _option(
        None, PRECISION, "JSON file with the FP8 KV cache's per-layer scaling factors, in vLLM's and SGLang's "
        "format ({\"kv_cache\": {\"dtype\": \"float8_e4m3fn\", \"scaling_factor\": {\"0\": {\"0\": s0, "
        "\"1\": s1, ...}}}}: tensor-parallel rank, then layer; one scale for both k and v; a file with rank 0 "
        "only serves every rank). Needs --kv-cache-dtype fp8_e4m3; overrides the checkpoint's scales. Every "
        "layer must be there; a bad file is a startup error naming the field."
    )

    # ---- API Surface
    host: str = _option(
        "127.0.0.1",
        API_SURFACE,
        "gRPC bind address. Loopback by default, as in TokenSpeed and SGLang; use 0.0.0.0 "
        "(or [::]) when the gateway runs on another host.",
    )
    grpc_port: int = _option(50051, API_SURFACE, "gRPC bind port.", aliases=("--port",), parse=values.port)
    served_model_name: str | None = _option(
        None,
        API_SURFACE,
        "Model name reported to the gateway (the id clients use).",
        default_doc="the model path",
    )
    api_key: str | None = _option(
        None,
        API_SURFACE,
        "API key required by the server: every RPC except the two health surfaces needs metadata "
        "'authorization: Bearer <key>' (UNAUTHENTICATED otherwise). smg sends it with its own --api-key.",
        default_doc="none (no authentication)",
    )
    chat_template: str | None = _gateway(None, API_SURFACE, "Chat template name or file.")
    stream_interval: int = _option(
        1,
        API_SURFACE,
        "Streaming buffer interval in generated tokens: the first token goes out at once, then a "
        "chunk every N tokens per sample; the last chunk and the GenerateComplete are never delayed.",
        parse=values.positive_int,
    )
    stream_output: bool = _not_yet(False, API_SURFACE, "Return generated text as disjoint streaming segments.")

    # ---- Scheduler And Memory
    max_model_len: int | None = _option(
        None,
        SCHEDULER,
        "Maximum sequence length (prompt + output).",
        aliases=("--context-length",),
        parse=values.model_len,
        default_doc="from the model config",
    )
    gpu_memory_utilization: float = _option(
        0.9,
        SCHEDULER,
        "GPU only: fraction of GPU memory for weights and KV cache; sizes the KV pool.",
        parse=values.fraction,
    )
    max_num_seqs: int = _option(
        256, SCHEDULER, "Maximum number of sequences running concurrently.", parse=values.positive_int
    )
    chunked_prefill_size: int = _option(
        8192,
        SCHEDULER,
        "Token budget the scheduler may issue in one iteration; -1 disables chunked prefill.",
        parse=values.chunk_size,
    )
    max_prefill_tokens: int = _option(
        8192, SCHEDULER, "Prefill token budget used when chunked prefill is disabled.", parse=values.positive_int
    )
    max_total_tokens: int | None = _option(
        None,
        SCHEDULER,
        "Size of the KV token pool, overriding the automatic sizing.",
        parse=values.positive_int,
        default_doc="sized automatically",
    )
    block_size: int = _option(16, SCHEDULER, "KV cache block size in tokens.", parse=values.positive_int)
    schedule_conservativeness: float = _option(
        1.0,
        SCHEDULER,
        "How much KV room admission keeps for the running requests' remaining output: a waiting "
        "request is admitted only if its prompt, plus this factor times the learned fraction of "
        "max_new_tokens (clipped to 4096) that requests really produce, fits beside the running "
        "ones' expected rest. Larger is more conservative (fewer preemptions, smaller batches); 0 "
        "admits whenever the first prompt chunk fits.",
        parse=values.non_negative_float,
    )
    enable_prefix_caching: bool = _option(
        True,
        SCHEDULER,
        "Reuse the KV cache of full blocks shared with earlier requests (a hash chain over their "
        "token ids); cached blocks are kept after their request ends and evicted least-recently-used.",
        negatable=True,
    )
    enforce_eager: bool = _option(
        False, SCHEDULER, "Disable CUDA graph execution (decode steps, and piecewise-captured prefill steps, then "
        "run eagerly; GPU only)."
    )
    disable_overlap_schedule: bool = _option(
        False,
        SCHEDULER,
        "Run each step's host work (scheduling, input preparation, output handling) after the "
        "device finished the previous step instead of while it runs. Overlap is on by default on "
        "GPUs; on CPU there is nothing to overlap and steps always run one after another.",
    )
    max_cudagraph_capture_size: int | None = _option(
        None,
        SCHEDULER,
        "Largest decode batch captured as a CUDA graph; larger batches run eagerly (logged once).",
        parse=values.positive_int,
        default_doc="min(256, max-num-seqs)",
    )
    cudagraph_capture_sizes: list[int] | None = _option(
        None,
        SCHEDULER,
        "Explicit CUDA graph capture sizes; a decode batch pads to the next captured size.",
        parse=values.positive_int,
        default_doc="1, 2, 4, 8, 16, 24, 32, ... up to the max",
    )
    enable_piecewise_cuda_graph: bool = _option(
        True,
        SCHEDULER,
        "Replay prefill and mixed steps as piecewise CUDA graphs: everything but attention captured "
        "per padded token count, attention run eagerly between the pieces (each step's own "
        "lengths). Captured after startup while the engine idles; each capture checks one replay "
        "against the eager step and turns them off on a mismatch. One GPU only (eager under tensor "
        "parallelism); nothing on CPU. --no-enable-piecewise-cuda-graph turns them off.",
        negatable=True,
    )
    piecewise_cuda_graph_max_tokens: int = _option(
        4096,
        SCHEDULER,
        "Largest step (in tokens) replayed as piecewise CUDA graphs; larger steps run eagerly. "
        "Capped by the step token budget (--chunked-prefill-size).",
        parse=values.positive_int,
    )
    piecewise_cuda_graph_tokens: list[int] | None = _option(
        None,
        SCHEDULER,
        "Explicit token counts for the piecewise CUDA graphs; a step pads to the next captured count.",
        parse=values.positive_int,
        default_doc="16, 24, 32, 48, 64, 96, ... (about 1.5x apart) up to the max",
    )

    # ---- Parallelism
    tensor_parallel_size: int = _option(
        1,
        PARALLELISM,
        "Tensor parallel size: one engine process per rank (one GPU each; gloo on CPU), attention heads, "
        "MLP and vocabulary split across them; rank 0 schedules and samples.",
        aliases=("--tp", "--tp-size"),
        parse=values.positive_int,
    )
    attn_tp_size: int | None = _option(
        None, PARALLELISM, "Tensor parallel size for attention; only the tensor parallel size is supported.",
        parse=values.positive_int, default_doc="the tensor parallel size",
    )
    dense_tp_size: int | None = _option(
        None, PARALLELISM, "Tensor parallel size for dense layers; only the tensor parallel size is supported.",
        parse=values.positive_int, default_doc="the tensor parallel size",
    )
    moe_tp_size: int | None = _option(
        None, PARALLELISM, "Tensor parallel size for MoE layers: the ranks that split each expert's intermediate "
        "rows; must be the tensor parallel size divided by the expert parallel size.",
        parse=values.positive_int, default_doc="the tensor parallel size / the expert parallel size",
    )
    data_parallel_size: int = _option(
        1, PARALLELISM, "Number of data-parallel replicas: independent engines (each its own scheduler, KV "
        "cache and tensor-parallel-size GPUs) behind the one gRPC port; a new request goes to the least "
        "loaded replica unless data_parallel_rank pins one.", aliases=("--dp-size", "--dp"), parse=values.positive_int,
    )
    enable_expert_parallel: bool = _option(
        False, PARALLELISM, "Expert parallelism across the tensor-parallel ranks: each MoE layer's experts are "
        "dealt whole to the ranks (expert parallel size = tensor parallel size) instead of every rank holding a "
        "slice of every expert; attention and dense layers stay tensor parallel. No effect on dense models.")
    expert_parallel_size: int = _option(
        1, PARALLELISM, "Explicit expert parallel size: the experts are dealt to this many groups of "
        "tensor-parallel-size / ep-size ranks, which split each expert's intermediate rows; must divide "
        "the tensor parallel size (and the number of experts).", aliases=("--ep-size",), parse=values.positive_int
    )
    world_size: int | None = _not_yet(None, PARALLELISM, "Total worker process count across all nodes.", parse=values.positive_int)
    nprocs_per_node: int | None = _not_yet(None, PARALLELISM, "Worker process count per node.", parse=values.positive_int)
    nnodes: int = _option(
        1, PARALLELISM, "Number of nodes the tensor-parallel ranks of this worker span (each node runs "
        "tensor-parallel-size / nnodes ranks; only node 0 serves gRPC).", parse=values.positive_int,
    )
    node_rank: int = _option(
        0, PARALLELISM, "Rank of this node (0 serves gRPC; the others run their ranks and exit when node 0 stops).",
        parse=values.non_negative_int,
    )
    base_gpu_id: int = _option(
        0, PARALLELISM, "First GPU this worker uses (its ranks and data-parallel replicas take the next ones in "
        "order); for several workers, or several nodes played by one machine, on one host.",
        parse=values.non_negative_int,
    )
    disable_custom_all_reduce: bool = _option(
        False, PARALLELISM, "Send every tensor-parallel all-reduce through NCCL. By default a small one (a decode "
        "step's rows) takes a one-shot all-reduce over peer GPU memory where the ranks share a host and their "
        "GPUs reach each other's memory (the startup log says which was chosen).",
    )
    dist_init_addr: str | None = _option(
        None, PARALLELISM, "Address (host:port) where the ranks meet; node 0 listens there. Required with "
        "--nnodes > 1; default for one node: a free loopback port.", default_doc="a free loopback port",
    )

    # ---- Backend Selection
    attention_backend: str | None = _option(
        None,
        BACKENDS,
        "Attention kernel backend: 'triton' (our paged-attention kernels, GPU), 'flashinfer' "
        "(FlashInfer's kernels, GPU, when the flashinfer package is installed) or 'torch' (the "
        "reference backend, CPU and GPU).",
        choices=ATTENTION_BACKENDS,
        unsupported_values=tuple(name for name in ATTENTION_BACKENDS if name not in ("torch", "triton", "flashinfer")),
        default_doc="triton on a GPU, torch on a CPU",
    )
    drafter_attention_backend: str | None = _not_yet(
        None, BACKENDS, "Attention backend of the speculative decoding drafter.", choices=ATTENTION_BACKENDS
    )
    moe_backend: str = _not_yet("auto", BACKENDS, "MoE backend.")
    draft_moe_backend: str | None = _not_yet(None, BACKENDS, "MoE backend of the speculative decoding draft model.")
    all2all_backend: str = _not_yet("none", BACKENDS, "MoE all-to-all backend.")
    deepep_mode: str = _not_yet("auto", BACKENDS, "DeepEP mode.", choices=("auto", "normal", "low_latency"))
    sampling_backend: str | None = _option(
        None,
        BACKENDS,
        "Sampling backend: 'torch' (CPU and GPU) or 'triton' (GPU; fused hashed noise and "
        "Gumbel-max draw). Unset: triton on a GPU when triton imports, else torch. Both draw the "
        "same tokens for the same seed.",
        choices=("torch", "triton", "greedy", "flashinfer", "flashinfer_full", "triton_full"),
        unsupported_values=("greedy", "flashinfer", "flashinfer_full", "triton_full"),
        default_doc="triton on a GPU, else torch",
    )
    grammar_backend: str = _option(
        "xgrammar",
        BACKENDS,
        "Structured output backend for the json_schema, regex, ebnf_grammar and structural_tag "
        "constraints the gateway sends (response_format, forced tool choice): 'xgrammar' (needs the "
        "xgrammar package and the model's tokenizer), or 'none' to refuse constraints (UNIMPLEMENTED).",
        choices=("xgrammar", "none", "llguidance", "outlines"),
        unsupported_values=("llguidance", "outlines"),
    )

    # ---- Reasoning And Tool Calling
    reasoning_parser: str | None = _gateway(None, REASONING, "Reasoning content parser.")
    tool_call_parser: str | None = _gateway(None, REASONING, "Tool-call payload parser.")
    enable_custom_logit_processor: bool = _not_yet(False, REASONING, "Allow custom logit processors.")

    # ---- Speculative Decoding
    speculative_config: str | None = _option(
        None, SPECULATIVE, "JSON speculative decoding configuration, as TokenSpeed takes it: "
        '{"method": "ngram" | "eagle3", "model": DRAFT_PATH, "num_speculative_tokens": N} fills '
        "--speculative-algorithm, --speculative-draft-model-path and --speculative-num-steps (N draft "
        "tokens per step) where those flags are not given.")
    speculative_algorithm: str | None = _option(
        None,
        SPECULATIVE,
        "Speculative algorithm. 'NGRAM': each decoding request's next tokens are proposed from its own "
        "prompt and output (the tokens that followed the latest earlier occurrence of its last few "
        "tokens; no draft model) and checked by one forward of the model over all of them; output "
        "is unchanged (greedy and seeded sampling give the tokens they give without it). 'EAGLE3': "
        "the drafts come from an EAGLE-3 draft head (--speculative-draft-model-path) reading the "
        "model's hidden states (Llama-family models, one GPU or CPU). "
        "Unset: off.",
        choices=("NGRAM", "EAGLE3", "EAGLE", "MTP", "DFLASH", "DSPARK"),
        unsupported_values=("EAGLE", "MTP", "DFLASH", "DSPARK"),
    )
    speculative_draft_model_path: str | None = _option(
        None, SPECULATIVE, "Draft model path: with EAGLE3, a local folder holding an EAGLE-3 Llama head as its "
        "authors publish it (config.json with architectures LlamaForCausalLMEagle3; safetensors or .bin weights).")
    speculative_draft_model_quantization: str = _not_yet("unquant", SPECULATIVE, "Draft model quantization.")
    speculative_num_steps: int = _option(
        3, SPECULATIVE, "Number of draft model steps. With NGRAM it only sets the default of "
        "--speculative-num-draft-tokens.", parse=values.positive_int)
    speculative_num_draft_tokens: int | None = _option(
        None,
        SPECULATIVE,
        "Tokens each speculative verify step computes per request: the last accepted token and "
        "this minus one draft tokens (at least 2).",
        parse=values.positive_int,
        default_doc="--speculative-num-steps + 1",
    )
    speculative_eagle_topk: int = _option(
        1, SPECULATIVE, "EAGLE top-k: 1 (a chain of drafts); more (draft trees) is refused: not supported yet.",
        parse=values.positive_int)
    eagle3_layers_to_capture: str | None = _option(
        None, SPECULATIVE, "EAGLE3: the model's layers (comma-separated indices) whose incoming hidden "
        "states the draft head reads.", default_doc="2, L/2, L-3 of the model's L layers")
    speculative_ngram_min_match_window_size: int = _option(
        1, SPECULATIVE, "NGRAM: the fewest trailing tokens that must have occurred before to propose a draft.",
        parse=values.positive_int)
    speculative_ngram_max_match_window_size: int = _option(
        12, SPECULATIVE, "NGRAM: the most trailing tokens matched; the longest match, then the latest, wins.",
        parse=values.positive_int)

    # ---- Observability
    log_level: str = _option("info", OBSERVABILITY, "Log level: " + ", ".join(LOG_LEVELS) + ".", parse=values.log_level)
    log_level_http: str | None = _not_yet(
        None, OBSERVABILITY, "HTTP server log level.", parse=values.log_level, default_doc="--log-level"
    )
    enable_log_requests: bool = _option(
        False,
        OBSERVABILITY,
        "Log every request on arrival and on finish (its request id on every line); "
        "--log-requests-level sets how much.",
        negatable=True,
    )
    log_requests_level: int = _option(
        0,
        OBSERVABILITY,
        "Request logging verbosity: 0 metadata only (ids, lengths, finish reason); 1 adds the sampling "
        "parameters; 2 adds the input and output token ids, truncated to 2048 each; 3 the full ids.",
        choices=(0, 1, 2, 3),
    )
    enable_log_request_stats: bool = _option(
        False,
        OBSERVABILITY,
        "Log a one-line performance summary per finished request (`Req: <rid> Finish! RequestStats(...)`), "
        "from host-side timestamps only.",
        negatable=True,
    )
    enable_metrics: bool = _option(
        False, OBSERVABILITY, "Serve Prometheus metrics (tokenspeed:*) on --metrics-host:--metrics-port."
    )
    metrics_reporters: list[str] | None = _option(
        None,
        OBSERVABILITY,
        "Metrics reporters; only `prometheus` (also what unset means with --enable-metrics).",
        choices=("prometheus",),
    )
    metrics_host: str | None = _option(
        None, OBSERVABILITY, "Bind address of the Prometheus endpoint.", default_doc="--host"
    )
    metrics_port: int | None = _option(
        None,
        OBSERVABILITY,
        "Port of the Prometheus endpoint (HTTP, path /metrics). The worker has no HTTP port of its own, "
        "so metrics get a separate one.",
        parse=values.port,
        default_doc="--grpc-port + 1000",
    )
    decode_log_interval: int = _not_yet(40, OBSERVABILITY, "Decode batch log interval.", parse=values.positive_int)
    enable_cache_report: bool = _option(
        False,
        OBSERVABILITY,
        "Report each request's prefix-cache hit (cached_tokens in GenerateComplete and stream chunks), "
        "which the smg gateway puts into the OpenAI usage as prompt_tokens_details.cached_tokens. Off, "
        "the worker reports 0 there (the gateway still prints the field): a client cannot learn what "
        "other requests left in the cache. Metrics and request logs count cache hits either way.",
    )
    kv_events_config: str | None = _option(
        None,
        OBSERVABILITY,
        "JSON config for a ZMQ publisher of the KV cache mutation events (prefix-cache blocks stored, "
        'removed, cleared), e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\'. Keys: '
        "enable_kv_cache_events (default false), publisher ('zmq' or 'null', default 'zmq'), "
        "endpoint (ZMQ PUB bind address, default 'tcp://*:5557'), topic (default ''). Without it "
        "SubscribeKvEvents still streams the events (and the pushed loads) over gRPC, which is what "
        "the smg gateway uses; this only adds ZMQ. Needs pyzmq and msgpack (the zmq extra).",
        parse=values.kv_events_config,
    )

    # ---- TokenSpeed-Specific (the ones not already listed in the sections above)
    disable_kvstore: bool = _not_yet(
        False, TOKENSPEED_SPECIFIC, "Disable the host KV store (the worker has none: accepted, no effect).", harmless=(True,)
    )
    kvstore_ratio: float = _not_yet(2.0, TOKENSPEED_SPECIFIC, "Host KV store size relative to the device pool.")
    kvstore_size: int = _not_yet(0, TOKENSPEED_SPECIFIC, "Host KV store size in GB (overrides --kvstore-ratio).")
    kvstore_io_backend: str = _not_yet(
        "kernel", TOKENSPEED_SPECIFIC, "Host KV store IO backend.", choices=("direct", "kernel")
    )
    kvstore_mem_layout: str = _not_yet(
        "layer_first",
        TOKENSPEED_SPECIFIC,
        "Host KV store memory layout.",
        choices=("layer_first", "page_first", "page_head"),
    )
    kvstore_storage_backend: str | None = _not_yet(
        None, TOKENSPEED_SPECIFIC, "KV store L3 storage backend.", choices=("mooncake",)
    )
    kvstore_storage_backend_extra_config: str | None = _not_yet(
        None, TOKENSPEED_SPECIFIC, "JSON extra configuration for the KV store storage backend."
    )
    enable_mla_l1_5_cache: bool = _not_yet(False, TOKENSPEED_SPECIFIC, "MLA L1.5 cache in disaggregation paths.")
    mla_chunk_multiplier: int = _not_yet(
        4, TOKENSPEED_SPECIFIC, "MLA chunked-prefill capacity multiplier.", parse=values.positive_int
    )
    disaggregation_mode: str = _not_yet(
        "null", TOKENSPEED_SPECIFIC, "Prefill/decode disaggregation role.", choices=("null", "prefill", "decode")
    )
    disaggregation_bootstrap_port: int = _not_yet(
        8998, TOKENSPEED_SPECIFIC, "Bootstrap server port on the prefill server.", parse=values.port
    )
    disaggregation_transfer_backend: str = _not_yet(
        "mooncake", TOKENSPEED_SPECIFIC, "Disaggregation KV transfer backend.", choices=("mooncake", "mooncake_async")
    )
    disaggregation_ib_device: str | None = _not_yet(
        None, TOKENSPEED_SPECIFIC, "InfiniBand device(s) for disaggregation transfer."
    )
    disaggregation_layerwise_interval: int = _not_yet(
        1, TOKENSPEED_SPECIFIC, "Layerwise transfer interval for disaggregation.", parse=values.positive_int
    )
    comm_fusion_max_num_tokens: int = _not_yet(
        2048, TOKENSPEED_SPECIFIC, "Max tokens of the communication fusion workspace.", parse=values.integer
    )
    enable_allreduce_fusion: bool = _not_yet(False, TOKENSPEED_SPECIFIC, "All-reduce + norm fusion.")

    # ---- Worker (our additions)
    device: str = _option(
        "auto", WORKER, "Device: auto (cuda when available, else cpu), cpu, or cuda.", choices=("auto", "cpu", "cuda")
    )
    drain_timeout: float = _option(
        30.0,
        WORKER,
        "Seconds in-flight requests get to finish after SIGTERM/SIGINT; then the rest end with "
        "finish_reason 'abort' and the worker exits 0. Keep it below terminationGracePeriodSeconds.",
        parse=values.positive_float,
    )
    watchdog_timeout: float = _option(
        300.0,
        WORKER,
        "If the engine makes no progress for this many seconds while work is pending, every "
        "in-flight request ends with INTERNAL and the worker exits non-zero (its supervisor restarts it).",
        parse=values.positive_float,
    )
    max_queued_requests: int | None = _option(
        None,
        WORKER,
        "Bound on requests waiting to start (not yet producing tokens; a request of n samples counts n); "
        "beyond it Generate gets RESOURCE_EXHAUSTED, which the gateway retries on another worker.",
        parse=values.positive_int,
        default_doc="unbounded",
    )
    cache_dir: str | None = _option(
        None,
        WORKER,
        "Directory kept between starts: Triton's compiled kernels (unless TRITON_CACHE_DIR is set) and "
        "the kernel choices timed at startup, under a folder per GPU, driver and version; Python's "
        "bytecode where the install has none and may not write it (pycache/). 'none': no "
        "timed choice is kept (Triton keeps its kernels in its own default, ~/.triton/cache). A folder "
        "that cannot be written is replaced by a temporary one for that start, with a warning.",
        default_doc="$XDG_CACHE_HOME/tokenspeed-worker (~/.cache/tokenspeed-worker)",
    )
    seed: int = _option(
        0, WORKER, "Random seed for sampling and dummy weights.", aliases=("--random-seed",), parse=values.non_negative_int
    )
    config: str | None = _option(
        None,
        WORKER,
        "YAML file of parameters; keys are flag names (dashes or underscores). "
        "The command line wins over the file.",
        metavar="FILE.yaml",
    )


# --------------------------------------------------------------------------- table access


@dataclass(frozen=True)
class Option:
    """One row of the table: a `ServerArgs` field with its resolved flag names and kind."""

    dest: str
    default: Any
    kind: type  # bool, int, float, str, or list (for a list[...] field)
    item_parse: Callable[[str], Any]  # parses one command-line token
    spec: OptionSpec

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, *self.spec.aliases)

    def is_offending(self, value: Any) -> bool:
        """True when `value` asks for something the worker does not do."""
        if self.spec.status is Status.SUPPORTED:
            return value in self.spec.unsupported_values
        return value != self.default and value not in self.spec.harmless

    def unsupported_message(self, value: Any) -> str:
        if self.spec.status is Status.GATEWAY:
            return f"{self.flag} is not supported: handled by the smg gateway (set it on `smg launch`)"
        if self.spec.status is Status.NOT_YET:
            return f"{self.flag} is not supported yet"
        supported = [str(c) for c in self.spec.choices or () if c not in self.spec.unsupported_values]
        return f"{self.flag} {value} is not supported yet (supported: {', '.join(supported)})"

    def default_text(self) -> str:
        if self.spec.default_doc is not None:
            return self.spec.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)


def _kind_of(hint: Any) -> tuple[type, type]:
    """(kind, item type) of a field annotation such as `int | None` or `list[int] | None`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if typing.get_origin(base) is list:
        return list, typing.get_args(base)[0]
    return base, base


def _build_options() -> tuple[Option, ...]:
    hints = typing.get_type_hints(ServerArgs)
    options = []
    for f in dataclasses.fields(ServerArgs):
        spec: OptionSpec = f.metadata["option"]
        kind, item = _kind_of(hints[f.name])
        options.append(Option(f.name, f.default, kind, spec.parse or item, spec))
    return tuple(options)


OPTIONS: tuple[Option, ...] = _build_options()
OPTIONS_BY_DEST: dict[str, Option] = {o.dest: o for o in OPTIONS}

