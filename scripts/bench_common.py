"""Shared pieces of the engine benchmarks: building an EngineCore from flags, model arithmetic
(bytes and FLOPs per step) for the roofline, and the transformers baseline."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenspeed_worker.config import EngineConfig  # noqa: E402
from tokenspeed_worker.config.engine import SECTION_OF  # noqa: E402
from tokenspeed_worker.engine.engine_core import EngineCore  # noqa: E402
from tokenspeed_worker.engine.messages import AddRequest  # noqa: E402
from tokenspeed_worker.layers.moe import FusedMoE  # noqa: E402
from tokenspeed_worker.sampling.params import SamplingParams  # noqa: E402

MODEL_SHAPES = {"llama-3.2-1b": REPO / "scripts/model_configs/llama-3.2-1b",
                "llama-3.1-8b": REPO / "scripts/model_configs/llama-3.1-8b",
                "llama-3.1-70b": REPO / "scripts/model_configs/llama-3.1-70b",
                "llama-3.1-8b-fp8-block": REPO / "scripts/model_configs/llama-3.1-8b-fp8-block",
                "qwen3-30b-a3b": REPO / "scripts/model_configs/qwen3-30b-a3b",
                "qwen3-30b-a3b-fp8": REPO / "scripts/model_configs/qwen3-30b-a3b-fp8",
                "qwen1.5-moe-a2.7b": REPO / "scripts/model_configs/qwen1.5-moe-a2.7b",
                "mixtral-8x7b": REPO / "scripts/model_configs/mixtral-8x7b",
                "mistral-7b": REPO / "scripts/model_configs/mistral-7b",
                "gemma-3-12b": REPO / "scripts/model_configs/gemma-3-12b"}


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="llama-3.2-1b",
                    help=f"a model folder, or one of {sorted(MODEL_SHAPES)} (random weights at real shape)")
    ap.add_argument("--load-format", default=None, help="default: dummy for the named shapes, else auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="any engine setting (a field of an EngineConfig section), e.g. attention_backend=triton, "
                    "enforce_eager=true")


def build_engine(args, capture_all_graphs: bool = True, **overrides) -> EngineCore:
    if os.environ.get("BENCH_LOG_LEVEL"):  # e.g. DEBUG: shows each small-batch GEMV site's timed choice
        logging.basicConfig(level=os.environ["BENCH_LOG_LEVEL"].upper(), format="%(name)s %(message)s")
    path = MODEL_SHAPES.get(args.model, args.model)
    load_format = args.load_format or ("dummy" if args.model in MODEL_SHAPES else "auto")
    settings = {"device": args.device, "dtype": args.dtype, "load_format": load_format, **overrides}
    for item in args.engine_arg:
        key, _, raw = item.partition("=")
        if key not in SECTION_OF:
            raise SystemExit(f"--engine-arg: unknown engine setting {key!r} (known: {sorted(SECTION_OF)})")
        try:  # numbers, booleans, lists as JSON; anything else (torch, fp8, ...) as the string it is
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        settings[key] = value
    cfg = EngineConfig.build(str(path), **settings)
    if cfg.parallel.tensor_parallel_size > 1:
        cfg = start_tensor_parallel(cfg)
    core = EngineCore(cfg)
    if capture_all_graphs:  # what a serving engine captures while idle: none left for the timed steps
        core.runner.capture_all_graphs()
    return core


def start_tensor_parallel(cfg: EngineConfig) -> EngineConfig:
    """`--engine-arg tensor_parallel_size=N`: start ranks 1..N-1 (engine/tp_worker.py) and join them as
    rank 0 in this process, as the worker's engine process does; they stop when this process exits.
    Returns the config the ranks meet with."""
    import atexit

    from tokenspeed_worker import distributed
    from tokenspeed_worker.engine.tp_worker import join_group, start_followers

    cfg, followers = start_followers(cfg)
    join_group(cfg)

    def stop() -> None:
        try:
            distributed.broadcast_object(("stop",))
        except Exception:
            pass
        for proc in followers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    atexit.register(stop)
    return cfg


@dataclasses.dataclass
class ModelArithmetic:
    """Bytes and FLOPs of one step, from the model's shape (`from_core`, or the numbers themselves:
    scripts/sim_admission.py prices steps without a model)."""

    weight_bytes: int  # weights read by every step: all of them but an untied embedding table (rows looked up) and the experts
    kv_bytes_per_token: int
    linear_params: int  # matmul parameters every token passes through (not the embedding, not the LM head)
    lm_head_params: int
    num_layers: int
    q_dim: int
    # The linear layers run FP8 GEMMs (their FLOPs priced at the FP8 matrix rate when one is given);
    # the LM head and attention stay 16-bit.
    fp8_linear: bool = False
    # Mixtures of experts: the bytes of every expert of every MoE layer, and how many of the
    # num_experts each token goes to. A step of T tokens reads the experts chosen at least once:
    # under uniform routing (dummy weights' random routers) 1 - (1 - top_k / E)^T of them.
    # top_k / E of the experts' parameters are in linear_params (each token passes through those).
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0
    # Sliding-window layers (Gemma's local layers, Mistral's): each layer's window in keys, 0 for full
    # attention; empty: every layer full. A windowed layer reads (and attends to) at most its window's
    # keys per query token, so the KV and attention terms count keys per layer, averaged over layers.
    layer_windows: tuple = ()

    def kv_tokens(self, seq_lens: np.ndarray) -> float:
        """KV tokens a step reads for sequences of these lengths, in full-layer equivalents: the mean
        over layers of the keys each layer reads (all of a sequence's, or its window's last ones)."""
        seq = np.asarray(seq_lens, dtype=np.int64)
        if not any(self.layer_windows):
            return float(seq.sum())
        return self._layer_mean(lambda w: np.minimum(seq, w).sum() if w else seq.sum())

    def attended_keys(self, query_lens: np.ndarray, seq_lens: np.ndarray) -> float:
        """Keys attended by the step's query tokens (causal within each query; a windowed layer's query
        at key count k sees min(k, window)), the mean over layers."""
        q = np.asarray(query_lens, dtype=np.int64)
        seq = np.asarray(seq_lens, dtype=np.int64)
        full = float((q * (seq - q) + q * (q + 1) // 2).sum())
        if not any(self.layer_windows):
            return full
        first = seq - q + 1  # the first query token sees `first` keys, the last sees seq

        def windowed(w: int) -> float:
            # sum over k in [first, seq] of min(k, w): the k <= w part, then w for each k above it
            last_below = np.clip(w, first - 1, seq)
            below = (last_below - first + 1) * (first + last_below) // 2
            return float((below + w * (seq - last_below)).sum())

        return self._layer_mean(lambda w: windowed(w) if w else full)

    def _layer_mean(self, per_window) -> float:
        """The mean over layers of per_window(layer's window or None), computed once per distinct
        window (a model has one or two: a per-step figure over thousands of steps)."""
        counts = Counter(self.layer_windows)
        return float(sum(n * per_window(w) for w, n in counts.items()) / len(self.layer_windows))

    @classmethod
    def from_core(cls, core: EngineCore) -> "ModelArithmetic":
        runner = core.runner
        cfg = runner.hf_config
        embed = cfg.vocab_size * cfg.hidden_size
        params = sum(p.numel() for p in runner.model.parameters())
        tied = getattr(cfg, "tie_word_embeddings", False)
        # Not the embedding lookup, and not the LM head (counted for sampled rows only); an untied
        # LM head is a second vocab x hidden.
        # An untied embedding table is not read whole by a step (only its looked-up rows); the LM
        # head is, tied or not. FP8 layers count their FP8 bytes and scales.
        embedding = runner.model.model.embed_tokens.weight
        lookup_only = 0 if tied else embedding.numel() * embedding.element_size()
        experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
        expert_params = sum(m.w13_weight.numel() + m.w2_weight.numel() for m in experts)
        num_experts = experts[0].num_experts if experts else 0
        top_k = getattr(cfg, "num_experts_per_tok", 0) if experts else 0
        params -= expert_params - (expert_params * top_k // num_experts if experts else 0)
        return cls(weight_bytes=runner.weight_bytes() - lookup_only - runner.expert_bytes(),
                   kv_bytes_per_token=runner.kv_bytes_per_token(),
                   linear_params=params - embed if tied else params - 2 * embed, lm_head_params=embed,
                   num_layers=cfg.num_hidden_layers, q_dim=cfg.num_attention_heads * runner.head_dim,
                   fp8_linear=any(getattr(m, "weight_scale_rows", None) is not None
                                      or getattr(m, "weight_scale_blocks", None) is not None
                                      for m in runner.model.modules()),
                   expert_bytes=runner.expert_bytes(), num_experts=num_experts, top_k=top_k,
                   layer_windows=tuple(int(m.sliding_window or 0) for m in runner.attention_layers))

    def step_weight_bytes(self, num_tokens: int) -> float:
        """The weights a step of num_tokens tokens reads: the dense ones, and the experts chosen
        (their expected share under uniform routing)."""
        if not self.expert_bytes:
            return float(self.weight_bytes)
        chosen = 1.0 - (1.0 - self.top_k / self.num_experts) ** max(1, num_tokens)
        return self.weight_bytes + self.expert_bytes * chosen

    def step_flops(self, num_tokens: int, num_sampled: int, attended: int) -> float:
        """GEMM FLOPs: every token through the layers, sampled rows through the LM head, plus
        attention (QK^T and PV: 4 x q_dim per attended key per layer)."""
        return (2.0 * self.linear_params * num_tokens + 2.0 * self.lm_head_params * num_sampled
                + 4.0 * self.q_dim * attended * self.num_layers)

    def flops_seconds(self, record: tuple, flops: float, fp8_flops: float | None = None) -> float:
        """The GEMM time of one `step_record` at `flops` (16-bit), the linear layers' share at
        `fp8_flops` where they run FP8 GEMMs and an FP8 rate was measured."""
        num_tokens, num_sampled, _, attended = record
        total = self.step_flops(num_tokens, num_sampled, attended) / flops
        if self.fp8_linear and fp8_flops:
            linear = 2.0 * self.linear_params * num_tokens
            total += linear / fp8_flops - linear / flops
        return total

    def step_bytes(self, kv_tokens: float, num_tokens: int = 1) -> float:
        """Weights once (step_weight_bytes) plus the KV of every sequence in the step (kv_tokens as
        `kv_tokens` counts them)."""
        return self.step_weight_bytes(num_tokens) + self.kv_bytes_per_token * kv_tokens

    def minimum_seconds(self, record: tuple, flops: float, bandwidth: float, fp8_flops: float | None = None) -> float:
        """The step roofline of one `step_record`: its GEMM time (flops_seconds) plus its bytes at `bandwidth`."""
        return self.flops_seconds(record, flops, fp8_flops) + self.step_bytes(record[2], record[0]) / bandwidth


def step_record(plan, arithmetic: ModelArithmetic | None = None) -> tuple[int, int, float, float]:
    """(tokens computed, rows sampled, KV tokens read, keys attended) of a non-empty plan; keys
    attended count each query token's keys, causal within its query; with the model's arithmetic,
    its sliding windows bound both (ModelArithmetic.kv_tokens, attended_keys)."""
    arithmetic = arithmetic or ModelArithmetic(0, 0, 0, 0, 0, 0)
    q, seq = plan.query_lens, plan.seq_lens
    return (plan.num_tokens, len(plan.sample_rows), arithmetic.kv_tokens(seq), arithmetic.attended_keys(q, seq))


def plan_recorder(core: EngineCore, arithmetic: ModelArithmetic, records: list, host_times: list | None = None,
                  shapes: list | None = None) -> None:
    """Wrap the scheduler so each step's tokens, sampled rows and KV read are recorded, (host_times)
    the host time spent in schedule(), commit() and resolve() (advance() is the last two), and
    (shapes) each step's (rows of one query token, tokens of longer queries)."""
    schedule = core.scheduler.schedule

    def timed(method):
        def wrapper(*a):
            t0 = time.perf_counter()
            result = method(*a)
            if host_times is not None:
                host_times.append(time.perf_counter() - t0)
            return result
        return wrapper

    def recording_schedule():
        t0 = time.perf_counter()
        plan = schedule()
        if host_times is not None:
            host_times.append(time.perf_counter() - t0)
        if plan.num_reqs:
            records.append(step_record(plan, arithmetic))
            if shapes is not None:
                q = plan.query_lens
                shapes.append((int((q == 1).sum()), int(q[q > 1].sum())))
        return plan

    core.scheduler.schedule = recording_schedule
    core.scheduler.commit = timed(core.scheduler.commit)
    core.scheduler.resolve = timed(core.scheduler.resolve)


def greedy_request(req_id: int, prompt: np.ndarray, max_new: int) -> AddRequest:
    return AddRequest(req_id, prompt.astype(np.int32), max_new, SamplingParams(temperature=0.0))


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_engine_memory() -> None:
    """After `del core`: collect the engine's reference cycles and hand its device memory back, so a
    baseline model can load in the same process."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def hf_generate_tok_s(model_path: str, device: str, batch: int, prompt_len: int, new_tokens: int,
                      dummy: bool) -> float:
    """transformers generate, greedy, same shape: output tokens per second."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dummy:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.randint(10, vocab - 10, (batch, prompt_len), device=device)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        sync(device)
        wall = time.perf_counter() - t0
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return batch * (out.shape[1] - prompt_len) / wall


def write_result(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
