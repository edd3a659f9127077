"""The worker's configuration tree, built and validated once from the parsed command line.

    WorkerConfig
      server  ServerConfig  the server process: where it listens, how it stops, the engines it starts
      engine  EngineConfig  what each engine process runs (config/engine.py: model, cache,
                            scheduler and parallel sections)

`WorkerConfig.from_args` is the one place a command-line parameter becomes a setting;
server/launch.py starts the worker from the tree. The server's request path (servicer, metrics)
reads the few parameters it needs from `ServerArgs` itself, which GetServerInfo reports whole.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from tokenspeed_worker.config.engine import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_dtype,
)
from tokenspeed_worker.config.parameters import ServerArgs
from tokenspeed_worker.config.values import kv_events_enabled, kv_events_settings
from tokenspeed_worker.kernel_cache import resolve_cache_dir, usable_cache_dir
from tokenspeed_worker.layers.quantization import kv_scales

DEFAULT_MAX_MODEL_LEN = 2048  # when neither --max-model-len nor the model's config.json gives one


@dataclass(frozen=True)
class ServerConfig:
    """The server process's own settings (server/launch.py)."""

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    api_key: str | None = None  # required on every RPC except the health checks (server/auth.py)
    log_level: str = "info"  # of the server and of every engine process
    drain_timeout: float = 30.0  # seconds in-flight requests get after the first stop signal
    watchdog_timeout: float = 300.0  # no engine progress this long with work pending: fail it all
    data_parallel_size: int = 1  # engine replicas behind the one port (server/engine_client.py)
    node_rank: int = 0  # > 0: this node only runs its share of the tensor-parallel ranks


@dataclass(frozen=True)
class WorkerConfig:
    server: ServerConfig
    engine: EngineConfig

    @classmethod
    def from_args(cls, args: ServerArgs) -> WorkerConfig:
        """The tree of parsed, resolved and supported arguments (cli.prepare). Reads the model's
        config.json for what `--dtype auto` and an unset --max-model-len leave to the checkpoint.
        Raises ValueError, naming the flag, for a value that cannot work here."""
        positions = _max_positions(args.model)
        if args.max_model_len and positions and args.max_model_len > positions:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's {positions} positions "
                             f"(max_position_embeddings, times its rope scaling factor for linear, dynamic and yarn "
                             f"rope); its rotary embedding is not defined past that")
        model = ModelConfig(
            path=args.model,
            dtype=resolve_dtype(args.dtype, args.device, args.model),
            device=f"cuda:{args.base_gpu_id}" if args.device == "cuda" and args.base_gpu_id else args.device,
            load_format=args.load_format,
            seed=args.seed,
            attention_backend=args.attention_backend,
            sampling_backend=args.sampling_backend,
            enforce_eager=args.enforce_eager,
            cudagraph_capture_sizes=args.cudagraph_capture_sizes,
            max_cudagraph_capture_size=args.max_cudagraph_capture_size,
            enable_piecewise_cuda_graph=args.enable_piecewise_cuda_graph,
            piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
            piecewise_cuda_graph_tokens=args.piecewise_cuda_graph_tokens,
            grammar_backend=args.grammar_backend,
            tokenizer_path=args.tokenizer,
            quantization=args.quantization,
            cache_dir=usable_cache_dir(resolve_cache_dir(args.cache_dir)),
        )
        cache = CacheConfig(
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization_param_path=_kv_scales_file(args),
            max_total_tokens=args.max_total_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_events=_kv_events(args.kv_events_config),
            report_kv_events=True,  # SubscribeKvEvents is always served
        )
        scheduler = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=int(args.max_model_len or positions or DEFAULT_MAX_MODEL_LEN),
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
            schedule_conservativeness=args.schedule_conservativeness,
            overlap_schedule=False if args.disable_overlap_schedule else None,
        )
        parallel = ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            expert_parallel_size=expert_parallel_size(args),
            nnodes=args.nnodes,
            custom_all_reduce=not args.disable_custom_all_reduce,
            dist_init_method=f"tcp://{args.dist_init_addr}" if args.dist_init_addr else None,
        )
        if args.speculative_algorithm == "EAGLE3":
            _check_eagle3(args)
        speculative = SpeculativeConfig(
            speculative_algorithm=args.speculative_algorithm,
            num_speculative_tokens=_num_speculative_tokens(args),
            ngram_min_match=args.speculative_ngram_min_match_window_size,
            ngram_max_match=args.speculative_ngram_max_match_window_size,
            draft_model_path=args.speculative_draft_model_path,
            eagle3_layers=(tuple(int(x) for x in args.eagle3_layers_to_capture.split(","))
                           if args.eagle3_layers_to_capture else None),
        ) if args.speculative_algorithm else SpeculativeConfig()
        server = ServerConfig(
            host=args.host,
            grpc_port=args.grpc_port,
            api_key=args.api_key,
            log_level=args.log_level,
            drain_timeout=args.drain_timeout,
            watchdog_timeout=args.watchdog_timeout,
            data_parallel_size=args.data_parallel_size,
            node_rank=args.node_rank,
        )
        return cls(server=server, engine=EngineConfig(model, cache, scheduler, parallel, speculative))


def _num_speculative_tokens(args: ServerArgs) -> int:
    """Draft tokens per request and step: --speculative-num-draft-tokens (default --speculative-num-steps
    + 1) counts the verify step's tokens, the last accepted one included."""
    if args.speculative_eagle_topk != 1:
        raise ValueError(f"--speculative-eagle-topk {args.speculative_eagle_topk}: only 1 (a chain of drafts) is "
                         "supported yet; draft trees are not")
    width = args.speculative_num_draft_tokens or args.speculative_num_steps + 1
    if width < 2:
        raise ValueError(f"--speculative-num-draft-tokens {width}: a verify step needs at least 2 tokens "
                         "(the last accepted one and a draft)")
    return width - 1


# An EAGLE-3 head's config.json names this architecture (models/llama_eagle3.py reads the rest).
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_head_config(path: str) -> dict:
    """The raw config.json of an EAGLE-3 Llama head folder; ValueError naming the flag and the file
    where it is missing, not JSON, not such a head, or of more than one layer, or where the folder has
    no weights. JSON only: the server checks it before any engine starts."""
    config_path = os.path.join(path, "config.json")
    flag = f"--speculative-draft-model-path {path}"
    if not os.path.isfile(config_path):
        raise ValueError(f"{flag}: no config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {config_path} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict) or EAGLE3_ARCHITECTURE not in (raw.get("architectures") or []):
        found = raw.get("architectures") if isinstance(raw, dict) else None
        raise ValueError(f"{flag}: architectures {found} is not an EAGLE-3 Llama head ({EAGLE3_ARCHITECTURE})")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{flag}: {raw.get('num_hidden_layers')} layers; an EAGLE-3 head with more than one layer "
                         "is not supported yet")
    names = os.listdir(path)
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        raise ValueError(f"{flag}: no *.safetensors or *.bin weights")
    return raw


def _check_eagle3(args: ServerArgs) -> None:
    """What EAGLE3 needs, checked before any engine starts: one rank, a head folder, capture layers
    within the model's."""
    if args.tensor_parallel_size > 1:
        raise ValueError("argument --speculative-algorithm: EAGLE3 with --tensor-parallel-size > 1 is not "
                         "supported yet")
    if not args.speculative_draft_model_path:
        return  # parsing refuses EAGLE3 without it
    eagle3_head_config(args.speculative_draft_model_path)
    if args.eagle3_layers_to_capture:
        layers = [int(x) for x in args.eagle3_layers_to_capture.split(",")]
        num_layers = kv_scales.model_num_layers(args.model)
        if len(layers) != 3 or (num_layers and not all(0 <= i < num_layers for i in layers)):
            counted = f"{num_layers} layers (indices 0..{num_layers - 1})" if num_layers else "layers"
            raise ValueError(f"argument --eagle3-layers-to-capture: {args.eagle3_layers_to_capture}: the head fuses "
                             f"three of the model's {counted}")


def expert_parallel_size(args: ServerArgs) -> int:
    """--ep-size, or the tensor-parallel size under --enable-expert-parallel (checked by
    config/parsing.unsupported_settings against --tp and --moe-tp-size)."""
    if args.expert_parallel_size > 1:
        return args.expert_parallel_size
    return args.tensor_parallel_size if args.enable_expert_parallel else 1


def _kv_scales_file(args: ServerArgs) -> str | None:
    """--quantization-param-path, checked against the model's layers and this worker's ranks."""
    path = args.quantization_param_path
    if path is not None and args.kv_cache_dtype != "auto":
        layers = kv_scales.model_num_layers(args.model)
        if layers:  # no readable config.json: the model facts report that
            kv_scales.read_scales_file(path, layers, 0, args.tensor_parallel_size)
    return path


def _max_positions(model_path: str) -> int | None:
    """The longest sequence the model's positions cover, or None (no readable config.json: the
    model facts report that, server/model_info.py): max_position_embeddings, times the rope
    scaling factor for the types that stretch positions (linear, dynamic; yarn from
    original_max_position_embeddings), as vLLM derives it. longrope and llama3 checkpoints already
    state their extended length."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    positions = cfg.get("max_position_embeddings")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type")
    factor = rope.get("factor")
    if positions and isinstance(factor, (int, float)) and factor > 1 and rope_type in ("linear", "dynamic", "yarn"):
        base = rope.get("original_max_position_embeddings") or positions if rope_type == "yarn" else positions
        return max(positions, int(base * factor))
    return positions


def _kv_events(text: str | None) -> dict[str, Any] | None:
    """The resolved --kv-events-config when it turns publishing on, else None."""
    if not kv_events_enabled(text):
        return None
    missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(
            f"--kv-events-config: publishing needs the Python package(s) {', '.join(missing)} "
            "(pip install pyzmq msgpack)"
        )
    return kv_events_settings(text)
