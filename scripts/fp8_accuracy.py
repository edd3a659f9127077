"""How far an FP8 model's next-token distributions are from the bf16 model's on the same weights.

    python scripts/fp8_accuracy.py --model llama-3.1-8b [--batches 4 64] [--tokens 2048] [--out fp8_accuracy.json]

Three model runners on the same dummy weights (the same seed): bf16; online FP8 (`--quantization
fp8`: the same bf16 weights quantized per output channel at load, run with the FP8 GEMMs); and the
same FP8 weights dequantized to bf16 at load ("rounded": the weights' rounding alone, run with the
bf16 kernels, as on CPU). The bf16 runner generates greedily; all runners are fed the same tokens (teacher forcing) so every position compares the two
distributions over the same context. For each batch size B (rows per decode step: B <= 4 runs the
small-batch GEMV kernels on FP8 weights, more rows the FP8 scaled GEMM), B prompts of --prompt-len
random tokens are prefilled (every prompt position compared too), then decode steps until --tokens
tokens were generated. Reported per batch size: top-1 agreement (the FP8 argmax equals the bf16
argmax), mean KL(bf16 || FP8) in nats, and the largest KL, for "fp8" and "rounded"; nothing is
asserted.

Dummy weights are random: their distributions are flatter than a trained model's, which makes
near-ties (and so top-1 disagreements) more likely than on real checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from tokenspeed_worker.config import EngineConfig  # noqa: E402
from tokenspeed_worker.layers.quantization import methods  # noqa: E402
from tokenspeed_worker.model_executor.model_runner import ModelRunner  # noqa: E402
from tokenspeed_worker.scheduler.plan import SchedulePlan  # noqa: E402

BLOCK = 16


def model_dir(name: str) -> str:
    path = Path(name)
    return str(path if path.exists() else REPO / "scripts" / "model_configs" / name)


def runner(path: str, quantization: str | None, max_len: int, device: str, keep_fp8: bool = True) -> ModelRunner:
    config = EngineConfig.build(path, load_format="dummy", dtype="bfloat16", device=device, block_size=BLOCK,
                                max_model_len=max_len, enforce_eager=True, quantization=quantization)
    if keep_fp8:
        return ModelRunner(config)
    keeps, methods.keeps_fp8 = methods.keeps_fp8, lambda device: False  # dequantized at load, as on CPU
    try:
        return ModelRunner(config)
    finally:
        methods.keeps_fp8 = keeps


def plan(batch: int, lengths: list[int], query: list[int], ids: np.ndarray, blocks_per_req: int) -> SchedulePlan:
    """Request b holds blocks [b * blocks_per_req, ...); its `query[b]` new tokens follow `lengths[b]` cached ones."""
    positions = np.concatenate([np.arange(n, n + q) for n, q in zip(lengths, query)]).astype(np.int64)
    owner = np.repeat(np.arange(batch), query)
    tables = (np.arange(batch)[:, None] * blocks_per_req + np.arange(blocks_per_req)[None, :]).astype(np.int32)
    return SchedulePlan(req_ids=np.arange(batch, dtype=np.int64), query_lens=np.asarray(query, dtype=np.int32),
                        context_lens=np.asarray(lengths, dtype=np.int32), input_ids=ids.astype(np.int64),
                        positions=positions, slot_mapping=owner * blocks_per_req * BLOCK + positions,
                        block_tables=tables, sample_rows=np.arange(batch, dtype=np.int32))


class Tally:
    def __init__(self) -> None:
        self.agree = self.count = 0
        self.kl_sum = 0.0
        self.kl_max = 0.0

    def add(self, ref: torch.Tensor, test: torch.Tensor) -> None:
        log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        self.agree += int((ref.argmax(-1) == test.argmax(-1)).sum())
        self.count += ref.shape[0]
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))

    def report(self) -> dict:
        return {"positions": self.count, "top1_agreement": self.agree / max(1, self.count),
                "mean_kl": self.kl_sum / max(1, self.count), "max_kl": self.kl_max}


def compare(ref: ModelRunner, tests: dict[str, ModelRunner], batch: int, prompt_len: int, tokens: int,
            seed: int) -> dict:
    steps = math.ceil(tokens / batch)
    blocks_per_req = math.ceil((prompt_len + steps + 1) / BLOCK)
    for r in (ref, *tests.values()):
        r.allocate_kv_cache(batch * blocks_per_req)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, ref.vocab_size, size=(batch, prompt_len))
    prefill = plan(batch, [0] * batch, [prompt_len] * batch, prompts.reshape(-1), blocks_per_req)
    prompt_tally = {name: Tally() for name in tests}
    decode_tally = {name: Tally() for name in tests}
    logits_ref = ref.forward_all_logits(prefill)
    last = np.arange(1, batch + 1) * prompt_len - 1
    for name, r in tests.items():
        logits = r.forward_all_logits(prefill)
        prompt_tally[name].add(logits_ref, logits)
        decode_tally[name].add(logits_ref[last], logits[last])
    next_ids = logits_ref[last].argmax(-1)
    for step in range(steps - 1):
        decode = plan(batch, [prompt_len + step] * batch, [1] * batch, next_ids.cpu().numpy(), blocks_per_req)
        a = ref.forward(decode)
        for name, r in tests.items():
            decode_tally[name].add(a, r.forward(decode))
        next_ids = a.argmax(-1)
    return {"batch": batch, **{name: {"prompt": prompt_tally[name].report(), "generated": decode_tally[name].report()}
                               for name in tests}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--tokens", type=int, default=2048, help="generated tokens compared per batch size")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script (FP8 dequantized at load there)")
    args = parser.parse_args(argv)
    path = model_dir(args.model)
    max_len = args.prompt_len + args.tokens + 2 * BLOCK
    t0 = time.perf_counter()
    ref, fp8 = runner(path, None, max_len, args.device), runner(path, "fp8", max_len, args.device)
    rounded = runner(path, "fp8", max_len, args.device, keep_fp8=False)
    layers = sum(1 for m in fp8.model.modules() if getattr(m, "weight_scale_rows", None) is not None)
    print(f"{args.model}: runners built in {time.perf_counter() - t0:.1f} s; {layers} FP8 layers; "
          f"weights {ref.weight_bytes() / 1e9:.2f} GB bf16, {fp8.weight_bytes() / 1e9:.2f} GB FP8")
    results = []
    for batch in args.batches:
        result = compare(ref, {"fp8": fp8, "rounded": rounded}, batch, args.prompt_len, args.tokens,
                         args.seed + batch)
        results.append(result)
        for name in ("fp8", "rounded"):
            for part in ("prompt", "generated"):
                r = result[name][part]
                print(f"batch {batch:4d} {name:7s} {part:9s}: {r['positions']:6d} positions, top-1 agreement "
                      f"{100 * r['top1_agreement']:.2f} %, mean KL {r['mean_kl']:.3e}, max KL {r['max_kl']:.3e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "fp8_layers": layers, "results": results},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
