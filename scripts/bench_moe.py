"""One MoE layer's experts at decode batch sizes: the decode kernels (kernels/moe.small_experts)
in each strip configuration against the grouped GEMMs with the sort, and the routing kernel
against torch's softmax + top-k; bandwidth of the chosen experts' bytes against a copy's.

    python scripts/bench_moe.py --shapes qwen3-30b-a3b mixtral-8x7b --weights bf16 fp8-block --tokens 1 4 16
    python scripts/bench_moe.py --tokens --prefill-tokens 512 4096 16384 --grouped-configs

Times are medians of CUDA-graph replays with the L2 cache flushed before each. Random router
logits: each token's choices are spread like a trained router's at its most even.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenspeed_worker.kernels import moe  # noqa: E402
from tokenspeed_worker.layers.moe import select_experts  # noqa: E402

SHAPES = {  # experts, top_k, hidden, intermediate, renormalize
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}
CONFIGS = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8), (8, 1024, 4), (4, 1024, 4)]
# (block_m, block_n, block_k, num_warps, num_stages): the shapes of vLLM's tuned fused_moe tables for Hopper
GROUPED_CONFIGS = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3), (128, 128, 64, 8, 4),
                   (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (32, 64, 128, 4, 4), (16, 64, 128, 4, 4)]


class Timer:
    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, fn) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1000  # us


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, moe.ExpertScales]:
    e, n, k = w.shape
    tiles = w.reshape(e, n // 128, 128, k // 128, 128)
    scales = tiles.abs().amax(dim=(2, 4)).float().clamp(min=1e-6) / 448.0
    q = (tiles / scales[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q, moe.ExpertScales(scales.contiguous(), 128, 128)


def prefill_row(timer: Timer, shape: str, kind: str, tokens: int, q13, s13, q2, s2, configs: bool) -> dict:
    """The grouped path at a prefill's size (the sort alone, then the whole layer's experts per
    tile configuration) against dense GEMMs of the same FLOPs: the pairs' rows times one expert."""
    experts, top_k, hidden, inter, renormalize = SHAPES[shape]
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k, renormalize)
    ids = ids.to(torch.int32)
    pairs = tokens * top_k
    flops = 2 * pairs * 3 * hidden * inter
    a = torch.randn(pairs, hidden, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(pairs, inter, device="cuda", dtype=torch.bfloat16)
    w13, w2 = q13[0].to(torch.bfloat16), q2[0].to(torch.bfloat16)
    dense_us = timer(lambda: (a @ w13.t(), h @ w2.t()))
    default = moe._grouped_config(pairs)
    row = {"shape": shape, "weights": kind, "prefill_tokens": tokens, "flops": flops, "dense_us": dense_us,
           "dense_TFLOPs": flops / dense_us * 1e-6,
           "align_us": timer(lambda: moe.align_by_expert(ids, experts, default.block_m)), "grouped_us": {}}
    saved, moe.SMALL_PAIRS = moe.SMALL_PAIRS, 0
    try:
        for config in [default] + ([moe.GroupedConfig(*c) for c in GROUPED_CONFIGS] if configs else []):
            row["grouped_us"][str(tuple(config))] = timer(
                lambda: moe.fused_experts(x, q13, q2, weights, ids, w13_scales=s13, w2_scales=s2, config=config))
    finally:
        moe.SMALL_PAIRS = saved
    best = min(row["grouped_us"], key=row["grouped_us"].get)
    row.update(best=best, best_us=row["grouped_us"][best], default_us=row["grouped_us"][str(tuple(default))])
    row["best_TFLOPs"] = flops / row["best_us"] * 1e-6
    print(f"{shape} {kind} prefill T={tokens}: dense {dense_us:.0f} us ({row['dense_TFLOPs']:.0f} TFLOP/s); sort "
          f"{row['align_us']:.1f} us; grouped default {row['default_us']:.0f} us, best {best} {row['best_us']:.0f} us "
          f"({row['best_TFLOPs']:.0f} TFLOP/s, {dense_us / row['best_us']:.2f} of dense)", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8-block"], choices=["bf16", "fp8-block"])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="decode sizes")
    ap.add_argument("--configs", action="store_true", help="time every strip configuration pair, not the default")
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 4096, 16384],
                    help="prefill sizes: the grouped GEMMs against dense GEMMs of the same FLOPs")
    ap.add_argument("--grouped-configs", action="store_true", help="prefill: time GROUPED_CONFIGS too")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_moe.json"))
    args = ap.parse_args()
    timer = Timer(args.iters)
    src = torch.empty(2**30, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / copy_us * 1e-6  # TB/s: read + written
    del src, dst
    print(f"copy bandwidth: {copy_bw:.2f} TB/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_TBps": copy_bw,
              "small_pairs": moe.SMALL_PAIRS, "rows": []}
    torch.manual_seed(0)
    for shape in args.shapes:
        experts, top_k, hidden, inter, renormalize = SHAPES[shape]
        w13 = (0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda")).to(torch.bfloat16)
        w2 = (0.02 * torch.randn(experts, hidden, inter, device="cuda")).to(torch.bfloat16)
        for kind in args.weights:
            if kind == "fp8-block":
                (q13, s13), (q2, s2) = fp8_block(w13), fp8_block(w2)
            else:
                q13, s13, q2, s2 = w13, None, w2, None
            per_expert = (q13[0].numel() + q2[0].numel()) * q13.element_size()
            for tokens in args.tokens:
                x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
                logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
                weights, ids = select_experts(logits, top_k, renormalize)
                ids = ids.to(torch.int32)
                moved = ids.unique().numel() * per_expert
                row = {"shape": shape, "weights": kind, "tokens": tokens, "expert_bytes": moved,
                       "route_us": timer(lambda: moe.route(logits, top_k, renormalize)),
                       "torch_route_us": timer(lambda: select_experts(logits, top_k, renormalize))}
                saved, moe.SMALL_PAIRS = moe.SMALL_PAIRS, 0
                try:
                    row["grouped_us"] = timer(lambda: moe.fused_experts(x, q13, q2, weights, ids, w13_scales=s13,
                                                                         w2_scales=s2))
                finally:
                    moe.SMALL_PAIRS = saved
                pairs = [(None, None)]
                if args.configs:
                    pairs += [(moe.GemvConfig(*a), moe.GemvConfig(*b)) for a, b in itertools.product(CONFIGS, CONFIGS)]
                times = {}
                for gate_up, down in pairs:
                    if moe.small_experts(x, q13, q2, weights, ids, s13, s2, gate_up, down) is None:
                        continue
                    times[f"{tuple(gate_up) if gate_up else 'default'}/{tuple(down) if down else 'default'}"] = timer(
                        lambda: moe.small_experts(x, q13, q2, weights, ids, s13, s2, gate_up, down))
                best = min(times, key=times.get)
                row.update(decode_us=times, best=best, best_us=times[best], default_us=times["default/default"],
                           best_TBps=moved / times[best] * 1e-6, default_TBps=moved / times["default/default"] * 1e-6)
                result["rows"].append(row)
                print(f"{shape} {kind} T={tokens}: {moved / 1e6:.1f} MB of experts; route {row['route_us']:.1f} us "
                      f"(torch {row['torch_route_us']:.1f}); grouped {row['grouped_us']:.1f} us; decode default "
                      f"{row['default_us']:.1f} us ({row['default_TBps']:.2f} TB/s), best {best} {row['best_us']:.1f} us "
                      f"({row['best_TBps']:.2f} TB/s)", flush=True)
            for tokens in args.prefill_tokens:
                result["rows"].append(prefill_row(timer, shape, kind, tokens, q13, s13, q2, s2, args.grouped_configs))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
