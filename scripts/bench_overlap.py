"""Can a large decode step's attention (memory-bound) overlap its matrix products (compute-bound)?

    python scripts/bench_overlap.py [--rows 128 256] [--context 1100] [--layers 32]

At offline throughput (1000 requests of 1000 in / 1000 out on Llama-8B) a bf16-cache decode step
spends about half its time in decode attention, reading K/V at copy bandwidth, and most of the rest
in cuBLAS products near the matmul peak (docs/benchmarks.md). Run one after the other, the step can
be no faster than the sum of the two; a step split into two micro-batches whose attention runs on
one stream while the other's products run on another (NanoFlow's nano-batches, SGLang's two-batch
overlap) could approach the larger of the two instead. This measures whether the GPU actually
overlaps them: Llama-8B layer shapes, `rows` decode rows per micro-batch, each with `context` keys:

- attention alone: the Triton decode attention (kernels/attention.py) over `layers` layers;
- products alone: q/k/v, o, gate/up and down (torch.matmul: cuBLAS) over `layers` layers;
- one stream: both, one after the other (what a step does now);
- two streams: attention of one micro-batch beside the products of the other.
Distinct weights and caches cycle over four layers, so nothing is read from L2. Each figure is the
median of several CUDA-graph replays. Prints and writes (--out) the times and
overlap gain = one stream / two streams.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenspeed_worker.kernels import attention  # noqa: E402
from bench_common import write_result  # noqa: E402
from roofline import copy_bandwidth, matmul_flops  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK = 4096, 32, 8, 128, 14336, 16
DISTINCT = 4  # layers of distinct weights and caches, cycled


def graph_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256], help="decode rows per micro-batch")
    ap.add_argument("--context", type=int, default=1100)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default=".cache/bench_overlap.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    bandwidth, peak = copy_bandwidth(device), matmul_flops(device, dtype)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    weights = [[torch.randn(n, k, device=device, dtype=dtype) * 0.02
                for n, k in ((HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN),
                             (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))] for _ in range(DISTINCT)]
    scale = HEAD_DIM ** -0.5
    results = []
    for rows in args.rows:
        blocks_per_row = -(-args.context // BLOCK)
        caches = []
        for layer in range(DISTINCT):  # one layer's caches for two micro-batches (a and b)
            num_blocks = 2 * rows * blocks_per_row
            k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            order = torch.randperm(num_blocks, device=device).to(torch.int32).view(2, rows, blocks_per_row)
            caches.append((k_cache, v_cache, order))
        seq_lens = torch.full((rows,), args.context, dtype=torch.int32, device=device)
        q = torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=dtype)
        outs = [torch.empty_like(q) for _ in range(2)]
        splits = attention.choose_num_splits(rows, KV_HEADS, blocks_per_row * BLOCK, device)
        workspaces = [attention.decode_workspace(rows, HEADS, HEAD_DIM, splits, device, KV_HEADS) for _ in range(2)]
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
        act = torch.randn(rows, INTERMEDIATE, device=device, dtype=dtype)

        def attend(half: int) -> None:
            for layer in range(args.layers):
                k_cache, v_cache, order = caches[layer % DISTINCT]
                attention.paged_decode_attention(q, k_cache, v_cache, order[half], seq_lens, scale, outs[half],
                                                 num_splits=splits, workspace=workspaces[half])

        def products() -> None:
            for layer in range(args.layers):
                qkv, o, gate_up, down = weights[layer % DISTINCT]
                torch.matmul(x, qkv.t())
                torch.matmul(x, o.t())
                torch.matmul(x, gate_up.t())
                torch.matmul(act, down.t())

        side = torch.cuda.Stream(device)

        def both_two_streams() -> None:
            main = torch.cuda.current_stream(device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                attend(0)
            products()
            main.wait_stream(side)

        def both_one_stream() -> None:
            attend(0)
            products()

        t_attn = graph_ms(lambda: attend(0))
        t_prod = graph_ms(products)
        t_one = graph_ms(both_one_stream)
        t_two = graph_ms(both_two_streams)
        kv_bytes = args.layers * 2 * rows * args.context * KV_HEADS * HEAD_DIM * 2
        flops = args.layers * 2 * rows * sum(w.shape[0] * w.shape[1] for w in weights[0])
        row = {"rows": rows, "context": args.context, "layers": args.layers, "attention_ms": t_attn,
               "attention_fraction_of_copy": kv_bytes / (t_attn / 1e3) / bandwidth,
               "products_ms": t_prod, "products_fraction_of_peak": flops / (t_prod / 1e3) / peak,
               "one_stream_ms": t_one, "two_streams_ms": t_two, "overlap_gain": t_one / t_two,
               "bound_ms": max(t_attn, t_prod)}
        results.append(row)
        print(f"rows {rows}, {args.context} keys, {args.layers} layers: attention {t_attn:.2f} ms "
              f"({100 * row['attention_fraction_of_copy']:.0f} % of copy), products {t_prod:.2f} ms "
              f"({100 * row['products_fraction_of_peak']:.0f} % of peak); one stream {t_one:.2f} ms, "
              f"two streams {t_two:.2f} ms: {row['overlap_gain']:.3f}x", flush=True)
        del caches
        torch.cuda.empty_cache()
    write_result(args.out, {"copy_bandwidth_tb_s": bandwidth / 1e12, "matmul_tflop_s": peak / 1e12,
                            "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
