"""One MoE layer's experts at decode batch sizes: the decode kernels (kernels/moe.small_experts)
in each strip configuration against the grouped GEMMs with the sort, and the routing kernel
against torch's softmax + top-k; bandwidth of the chosen experts' bytes against a copy's.

    python scripts/bench_moe.py --shapes qwen3-30b-a3b mixtral-8x7b --weights bf16 fp8-block --tokens 1 4 16
    python scripts/bench_moe.py --tokens --prefill-tokens 512 4096 16384 --grouped-configs
    python scripts/bench_moe.py --tune [--model CONFIG_DIR ...] [--tp N] [--ep E] [--cache-dir DIR]

--tune times the grouped GEMMs' tile candidates (kernels/moe.GROUPED_CANDIDATES) at each pair count
of kernels/moe.TUNED_PAIRS for each shape and weight kind, and keeps the fastest that agrees with
the default tiles in the cache folder's fused_moe.json for this GPU (kernel_cache.py: the worker's
later starts with the same --cache-dir take them; scripts/ship_kernel_choices.py ships them).

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
AGREEMENT = 2e-2  # tiles whose layer output differs from the default tiles' by more (relative norm) are refused
CONFIGS = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8), (8, 1024, 4), (4, 1024, 4)]


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
        for config in [default] + ([c for c in moe.GROUPED_CANDIDATES if c != default] if configs else []):
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


def tune_tiles(w13: torch.Tensor, w2: torch.Tensor, top_k: int, time_us, s13=None, s2=None,
               pairs_counts=moe.TUNED_PAIRS, candidates=moe.GROUPED_CANDIDATES,
               max_tokens: int = 16384) -> tuple[dict[str, str], list[dict]]:
    """The grouped GEMMs' tiles for experts w13 [E, 2 I, H], w2 [E, H, I] (FP8 with scales s13, s2):
    at each pair count of at most max_tokens tokens (a prefill chunk's), each candidate timed (time_us(fn) -> µs) where it launches and its output
    agrees with the default tiles'; returns ({tiles_key/pairs: tiles_text of the fastest}, a row per
    pair count with every candidate's µs, None where refused)."""
    experts, _, hidden = w13.shape
    act_dtype = torch.bfloat16 if w13.element_size() == 1 else w13.dtype
    key = moe.tiles_key(experts, hidden, w2.shape[2], w13.dtype)
    entries, rows = {}, []
    for count in pairs_counts:
        tokens = max(1, count // top_k)
        if tokens > max_tokens:
            continue
        g = torch.Generator(device="cpu").manual_seed(count)
        x = torch.randn(tokens, hidden, generator=g).to(w13.device, act_dtype)
        weights, ids = select_experts(torch.randn(tokens, experts, generator=g).to(w13.device), top_k, True)
        ids = ids.to(torch.int32)

        def run(config, x=x, weights=weights, ids=ids):
            return moe.fused_experts(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, config=config,
                                     decode=False)

        reference = run(None).float()
        times: dict[str, float | None] = {}
        for config in candidates:
            text = moe.tiles_text(config)
            try:
                out = run(config).float()
            except Exception as error:  # noqa: BLE001 - e.g. triton's OutOfResources: more shared memory than the GPU has
                print(f"  {text} refused: {type(error).__name__}", flush=True)
                times[text] = None
                continue
            if (out - reference).norm() > AGREEMENT * reference.norm():
                print(f"  {text} refused: its output differs from the default tiles'", flush=True)
                times[text] = None
                continue
            times[text] = time_us(lambda config=config: run(config))
        timed = {text: us for text, us in times.items() if us is not None}
        pairs = tokens * top_k
        default = moe.tiles_text(moe._grouped_config(pairs))
        best = min(timed, key=timed.get)
        entries[f"{key}/{pairs}"] = best
        rows.append({"key": key, "pairs": pairs, "tokens": tokens, "us": times, "best": best,
                     "best_us": timed[best], "default": default, "default_us": timed.get(default)})
        print(f"{key} pairs {pairs}: best {best} {timed[best]:.1f} us, default {default} "
              f"{timed.get(default, float('nan')):.1f} us", flush=True)
    return entries, rows


def model_shape(folder: str) -> tuple[int, int, int, int, bool]:
    """(experts, top_k, hidden, intermediate, renormalize) of an MoE model's config.json."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)
    experts = config.get("num_experts") or config["num_local_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    return experts, config["num_experts_per_tok"], config["hidden_size"], inter, config.get("norm_topk_prob", True)


def tune(args) -> dict:
    """--tune: every shape's tiles, for each weight kind, kept in the cache folder (module docstring)."""
    from tokenspeed_worker import kernel_cache

    device = torch.device("cuda")
    path = kernel_cache.choices_path(kernel_cache.resolve_cache_dir(args.cache_dir), device, kernel_cache.MOE_FILE)
    shapes = {Path(m).name: model_shape(m) for m in args.model} if args.model else {s: SHAPES[s] for s in args.shapes}
    timer = Timer(args.iters)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "file": str(path),
              "tp": args.tp, "ep": args.ep, "rows": []}
    torch.manual_seed(0)
    for name, (experts, top_k, hidden, inter, _renormalize) in shapes.items():
        experts //= args.ep  # a rank's experts under expert parallelism (its group's), and intermediate rows
        inter //= args.tp // args.ep  # under the tensor parallelism within the group (--moe-tp-size)
        w13 = (0.02 * torch.randn(experts, 2 * inter, hidden, device="cuda")).to(torch.bfloat16)
        w2 = (0.02 * torch.randn(experts, hidden, inter, device="cuda")).to(torch.bfloat16)
        for kind in args.weights:
            q13, s13, q2, s2 = (*fp8_block(w13), *fp8_block(w2)) if kind == "fp8-block" else (w13, None, w2, None)
            entries, rows = tune_tiles(q13, q2, top_k, timer, s13, s2)
            kernel_cache.save_choices(path, entries)
            result["rows"] += [{"shape": name, "weights": kind, **row} for row in rows]
            print(f"{name} {kind}: {len(entries)} tuned tiles kept in {path}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8-block"], choices=["bf16", "fp8-block"])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="decode sizes")
    ap.add_argument("--configs", action="store_true", help="time every strip configuration pair, not the default")
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 4096, 16384],
                    help="prefill sizes: the grouped GEMMs against dense GEMMs of the same FLOPs")
    ap.add_argument("--grouped-configs", action="store_true", help="prefill: time kernels/moe.GROUPED_CANDIDATES too")
    ap.add_argument("--tune", action="store_true", help="tune the grouped GEMMs' tiles (module docstring)")
    ap.add_argument("--model", nargs="*", default=[], help="--tune: MoE model folders (config.json) instead of --shapes")
    ap.add_argument("--tp", type=int, default=1, help="--tune: the tensor-parallel size the worker will run")
    ap.add_argument("--ep", type=int, default=1, help="--tune: its expert-parallel size (--ep-size)")
    ap.add_argument("--cache-dir", help="--tune: the worker's --cache-dir (default: the worker's default)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_moe.json"))
    args = ap.parse_args()
    if args.tune:
        result = tune(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
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
