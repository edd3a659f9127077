"""The Triton paged-attention and fused decoder-layer kernels against the hardware's limits, measured in the same run.

    python scripts/bench_kernels.py [--batches 1 64 256] [--contexts 1024 8192] [--prefill-lens 2048]
    python scripts/bench_kernels.py --only fused [--fused-batches 1 256]
    python scripts/bench_kernels.py --only gemv [--gemv-rows 1 4] [--gemv-shapes 8b 1b]

Decode (Llama-3.1-8B attention: H=32, Hkv=8, D=128, bf16, block 16) is memory-bound: its
figure is the bandwidth achieved (bytes of K/V read + q read + out written, divided by the
time) and its fraction of the device copy bandwidth (a 2 GiB tensor copy, read + write bytes
over time). Extend (a causal prefill over the paged cache) is compute-bound: its figure is
TFLOP/s (4 * H * D per visible query-key pair) and its fraction of a bf16 8192^3 matmul. The
torch reference (gather through the block table + scaled_dot_product_attention, what the torch
backend does) is timed alongside, and each kernel's output is checked against it.

Timing: CUDA events around each call, L2 flushed before each (so a small cache is not served
from L2), median of --iters after warmups; decode runs replayed from a CUDA graph as in serving
(launch overhead excluded; --eager to include it). Progress goes to stdout, the result to a
JSON file (--out). `--device cpu` runs tiny shapes in Triton's interpreter: a smoke test of the
script only, its numbers mean nothing.

Fused decoder-layer kernels (--only fused, or part of the default run; Llama-3.1-8B shapes:
hidden 4096, intermediate 14336, H=32, Hkv=8, D=128, bf16), each against the torch code it
replaces, through the layers with layers/fused_kernels.py's switch ("force" vs "off"): add +
RMSNorm (RMSNorm(x, residual)), silu(gate) * up (SiluAndMul), and rotary + the KV-cache write
(RotaryEmbedding.rope_and_write_kv: q, k, v strided views of a qkv projection, scattered slots;
torch: rotary, q.contiguous() and two index_copy_). All are memory-bound: the figure is the
bandwidth of the bytes each must move and its fraction of the copy bandwidth; at batch 1 both
are launch-bound, so the time ratio (torch / fused) is the point. Timed from a CUDA graph, as
decode runs (--eager to include launch overhead).

Small-batch GEMV products (--only gemv, or part of the default run): the decode-step kernels of
kernels/gemv.py at each site of a decoder layer (add + RMSNorm + qkv_proj, o_proj,
add + RMSNorm + gate_up_proj + SiLU·mul, down_proj) for Llama-3.1-8B and Llama-3.2-1B shapes,
every configuration, against the unfused path they replace (the norm kernel + cuBLAS, cuBLAS +
the SiLU kernel, cuBLAS alone with its split-K reduce). Weight-bandwidth bound: the figure is the
bytes moved (weights, rows in and out) over the time and its fraction of the copy bandwidth;
timed from a CUDA graph with L2 flushed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for an interpreter smoke test")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="decode batch sizes")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192], help="decode sequence lengths")
    ap.add_argument("--num-splits", type=int, nargs="*", default=[],
                    help="fixed decode splits to time besides the default choice (e.g. 1 8 32)")
    ap.add_argument("--single-split", action="store_true",
                    help="decode: also time every request as one program per kv head (single_split_tokens = context)")
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[2048], help="extend: query tokens, no prefix")
    ap.add_argument("--prefill-context", type=int, default=0, help="extend: cached prefix before each prefill")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="time decode eagerly instead of from a CUDA graph")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--reference-max-gib", type=float, default=24.0,
                    help="skip the torch decode reference when its gathered K/V copy would exceed this")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth-probe copy")
    ap.add_argument("--matmul-size", type=int, default=8192)
    ap.add_argument("--gemv-rows", type=int, nargs="+", default=[1, 4], help="small-batch GEMV products: rows per call")
    ap.add_argument("--gemv-shapes", nargs="+", default=["8b", "1b"], choices=["8b", "1b"],
                    help="small-batch GEMV products: Llama-3.1-8B and/or Llama-3.2-1B layer shapes")
    ap.add_argument("--only", choices=["all", "attention", "fused", "gemv"], default="all",
                    help="attention: the paged-attention kernels; fused: the fused decoder-layer kernels")
    ap.add_argument("--fused-batches", type=int, nargs="+", default=[1, 256], help="fused kernels: tokens per call")
    ap.add_argument("--hidden", type=int, default=4096, help="fused kernels: hidden size")
    ap.add_argument("--intermediate", type=int, default=14336, help="fused kernels: MLP intermediate size")
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench_kernels.json"))
    return ap.parse_args()


args = parse_args()
if args.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenspeed_worker.kernels import attention  # noqa: E402


class Timer:
    """Median time of fn in seconds: CUDA events per call with an L2 flush before each; CPU wall clock."""

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn, graph: bool = False) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(self.iters):
                fn()
            return (time.perf_counter() - start) / self.iters
        call = fn
        if graph:
            torch.cuda.synchronize()
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                fn()
            call = cuda_graph.replay
            call()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)]
        torch.cuda.synchronize()
        for start, end in events:
            self.flush.zero_()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) / 1000


def paged_cache(num_tokens_per_req: list[int], hkv: int, d: int, bs: int, dtype, device, seed: int):
    """K/V caches holding every request's tokens in shuffled blocks, and the block tables."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-n // bs) for n in num_tokens_per_req]
    num_blocks = sum(blocks)
    k_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    used = 0
    for b, count in enumerate(blocks):
        tables[b, :count] = order[used:used + count]
        used += count
    return k_cache, v_cache, tables.to(device)


def torch_reference(q, k_cache, v_cache, tables, query_lens: list[int], seq_lens: list[int], scale: float):
    """Gather each request's K/V through its block table, then one SDPA per request (the torch backend's way)."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    outputs, start = [], 0
    uniform = len(set(seq_lens)) == 1 and len(set(query_lens)) == 1
    if uniform:  # one batched call: every request has the same shape
        length, qlen = seq_lens[0], query_lens[0]
        nblk = -(-length // bs)
        k = k_cache[tables[:, :nblk].long()].reshape(len(seq_lens), nblk * bs, hkv, d)[:, :length]
        v = v_cache[tables[:, :nblk].long()].reshape(len(seq_lens), nblk * bs, hkv, d)[:, :length]
        qb = q.reshape(len(seq_lens), qlen, q.shape[1], d)
        mask = None
        if qlen > 1:
            qpos = length - qlen + torch.arange(qlen, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape)
    for b, (qlen, length) in enumerate(zip(query_lens, seq_lens)):
        nblk = -(-length // bs)
        k = k_cache[tables[b, :nblk].long()].reshape(nblk * bs, hkv, d)[:length]
        v = v_cache[tables[b, :nblk].long()].reshape(nblk * bs, hkv, d)[:length]
        qpos = length - qlen + torch.arange(qlen, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(q[start:start + qlen].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(o[0].transpose(0, 1))
        start += qlen
    return torch.cat(outputs)


def bench_fused(device: torch.device, dtype: torch.dtype, timer: Timer, copy_bw: float) -> list[dict]:
    """The fused decoder-layer kernels against the torch code they replace, through the layers."""
    from tokenspeed_worker.layers.activation import SiluAndMul
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.layers.layernorm import RMSNorm
    from tokenspeed_worker.layers.rotary import rope_from_parameters

    hidden, inter = args.hidden, args.intermediate
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    elt = torch.empty((), dtype=dtype).element_size()
    max_position = 8192
    rms = RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        rms.weight.normal_(1.0, 0.1)
    act = SiluAndMul()
    rope = rope_from_parameters(D, max_position, dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=8192)).to(device)
    rows = []
    for batch in args.fused_batches:
        x = torch.randn(batch, hidden, dtype=dtype, device=device)
        residual = torch.randn(batch, hidden, dtype=dtype, device=device)
        gate_up = 3 * torch.randn(batch, 2 * inter, dtype=dtype, device=device)
        qkv = torch.randn(batch, (H + 2 * Hkv) * D, dtype=dtype, device=device)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(batch, H, D), k.view(batch, Hkv, D), v.view(batch, Hkv, D)
        positions = torch.randint(0, max_position, (batch,), device=device)
        num_blocks = max(64, 4 * batch)
        k_cache = torch.zeros(num_blocks, bs, Hkv, D, dtype=dtype, device=device)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * bs, device=device)[:batch]
        cases = [
            ("add_rms_norm", lambda: rms(x, residual), (4 * batch * hidden + hidden) * elt),
            ("silu_and_mul", lambda: act(gate_up), 3 * batch * inter * elt),
            ("rope_and_write_kv", lambda: rope.rope_and_write_kv(positions, q, k, v, k_cache, v_cache, slots),
             2 * batch * (H + 2 * Hkv) * D * elt + 2 * batch * rope.rotary_dim * 4),
        ]
        for kernel, fn, moved in cases:
            times, outputs = {}, {}
            for mode in ("force", "off"):
                with fused_kernels(mode):
                    outputs[mode] = fn()
                    times[mode] = timer(fn, graph=device.type == "cuda" and not args.eager)
            fused_out, torch_out = (outputs[m][0] if isinstance(outputs[m], tuple) else outputs[m] for m in ("force", "off"))
            row = {
                "kernel": kernel, "batch": batch, "bytes": moved,
                "time_us": times["force"] * 1e6, "GBps": moved / times["force"] / 1e9,
                "fraction_of_copy": moved / times["force"] / copy_bw,
                "torch_time_us": times["off"] * 1e6, "torch_GBps": moved / times["off"] / 1e9,
                "speedup_vs_torch": times["off"] / times["force"],
                "max_abs_err_vs_torch": (fused_out.float() - torch_out.float()).abs().max().item(),
            }
            rows.append(row)
            print(f"fused {kernel:18s} B={batch:4d}: {row['time_us']:8.1f} us {row['GBps']:7.0f} GB/s "
                  f"({100 * row['fraction_of_copy']:5.1f}% of copy)  torch {row['torch_time_us']:8.1f} us "
                  f"{row['torch_GBps']:7.0f} GB/s  torch/fused {row['speedup_vs_torch']:5.2f}x  "
                  f"err {row['max_abs_err_vs_torch']:.2e}", flush=True)
    return rows


SKINNY_SHAPES = {"8b": (4096, 6144, 4096, 14336), "1b": (2048, 3072, 2048, 8192)}  # hidden, qkv out, o in, intermediate
SKINNY_HEADS = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # q heads, kv heads, head_dim


def bench_gemv(device: torch.device, dtype: torch.dtype, timer: Timer, copy_bw: float) -> list[dict]:
    """Each site's small-batch GEMV kernel (every config) against the unfused path it replaces."""
    from tokenspeed_worker.kernels import gemv
    from tokenspeed_worker.layers.activation import SiluAndMul
    from tokenspeed_worker.layers.fused_kernels import fused_kernels
    from tokenspeed_worker.kernels import rotary as rotary_kernels
    from tokenspeed_worker.layers.layernorm import RMSNorm
    from tokenspeed_worker.layers.rotary import rope_from_parameters

    elt = torch.empty((), dtype=dtype).element_size()
    act = SiluAndMul()
    rows_out = []
    for shape in args.gemv_shapes:
        hidden, qkv_out, o_in, inter = SKINNY_SHAPES[shape]
        norm = RMSNorm(hidden, eps=1e-5).to(device=device, dtype=dtype)
        w = {"qkv": 0.02 * torch.randn(qkv_out, hidden, dtype=dtype, device=device),
             "o": 0.02 * torch.randn(hidden, o_in, dtype=dtype, device=device),
             "gate_up": 0.02 * torch.randn(2 * inter, hidden, dtype=dtype, device=device),
             "down": 0.02 * torch.randn(hidden, inter, dtype=dtype, device=device)}
        for m in args.gemv_rows:
            x = torch.randn(m, hidden, dtype=dtype, device=device)
            residual = torch.randn(m, hidden, dtype=dtype, device=device)
            attn_out = torch.randn(m, o_in, dtype=dtype, device=device)
            mlp_in = torch.randn(m, inter, dtype=dtype, device=device)

            def unfused_qkv():
                h, r = norm(x, residual)
                return F.linear(h, w["qkv"])

            def unfused_mlp():
                h, r = norm(x, residual)
                return act(F.linear(h, w["gate_up"]))

            heads, kv_heads, head_dim = SKINNY_HEADS[shape]
            rope = rope_from_parameters(head_dim, 4096, {"rope_type": "default", "rope_theta": 500000.0}).to(device)
            caches = [torch.zeros((64, 16, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(2)]
            positions = torch.arange(m, device=device) + 200
            slots = torch.arange(m, device=device) * 16
            rotary = gemv.RotaryKV(heads, kv_heads, head_dim, positions, rope.cos_cache, rope.sin_cache, *caches, slots)

            def unfused_qkv_rope():  # add+RMSNorm, cuBLAS q/k/v, then the rotary + KV-write kernel
                h, r = norm(x, residual)
                q, k, v = F.linear(h, w["qkv"]).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
                return rotary_kernels.rope_and_write_kv(
                    q.view(m, heads, head_dim), k.view(m, kv_heads, head_dim), v.view(m, kv_heads, head_dim), positions,
                    rope.cos_cache, rope.sin_cache, caches[0], caches[1], slots)

            sites = [
                ("add_norm_qkv_rope", unfused_qkv_rope, lambda c: gemv.small_batch_linear(
                    x, w["qkv"], norm_weight=norm.weight, residual=residual, eps=1e-5, rotary=rotary, config=c)[0],
                 w["qkv"].numel() * elt + (3 * m * hidden + m * qkv_out) * elt),
                ("add_norm_qkv", unfused_qkv, lambda c: gemv.small_batch_linear(
                    x, w["qkv"], norm_weight=norm.weight, residual=residual, eps=1e-5, config=c)[0],
                 w["qkv"].numel() * elt + (3 * m * hidden + m * qkv_out) * elt),
                ("o_proj", lambda: F.linear(attn_out, w["o"]), lambda c: gemv.small_batch_linear(attn_out, w["o"], config=c)[0],
                 w["o"].numel() * elt + m * (o_in + hidden) * elt),
                ("add_norm_gate_up_silu", unfused_mlp, lambda c: gemv.small_batch_linear(
                    x, w["gate_up"], norm_weight=norm.weight, residual=residual, eps=1e-5, silu=True, config=c)[0],
                 w["gate_up"].numel() * elt + (3 * m * hidden + m * inter) * elt),
                ("down_proj", lambda: F.linear(mlp_in, w["down"]), lambda c: gemv.small_batch_linear(mlp_in, w["down"], config=c)[0],
                 w["down"].numel() * elt + m * (inter + hidden) * elt),
            ]
            graph = device.type == "cuda" and not args.eager
            for site, unfused, fused, moved in sites:
                with fused_kernels("auto"):
                    expected = unfused()
                    unfused_s = timer(unfused, graph=graph)
                best, config_us = None, {}
                configs = gemv.NORM_CONFIGS if "norm" in site else gemv.CONFIGS
                if site.endswith("rope"):  # columns pair within half a head
                    configs = [c for c in configs if not isinstance(c, gemv.Persistent) and (head_dim // 2) % c[0] == 0]
                for config in configs:
                    try:
                        got = fused(config)
                        seconds = timer(lambda: fused(config), graph=graph)
                    except Exception as error:  # noqa: BLE001 - a config this GPU cannot run
                        print(f"gemv {shape} {site} m={m} {config}: {type(error).__name__}: {error}", flush=True)
                        continue
                    err = (got.float() - expected.float()).abs().max().item()
                    config_us[str(config)] = seconds * 1e6
                    if best is None or seconds < best[1]:
                        best = (config, seconds, err)
                if best is None:
                    continue
                config, seconds, err = best
                row = {"shape": shape, "site": site, "rows": m, "bytes": moved, "best_config": str(config),
                       "time_us": seconds * 1e6, "GBps": moved / seconds / 1e9, "fraction_of_copy": moved / seconds / copy_bw,
                       "unfused_time_us": unfused_s * 1e6, "unfused_GBps": moved / unfused_s / 1e9,
                       "speedup_vs_unfused": unfused_s / seconds, "max_abs_err_vs_unfused": err,
                       "config_us": config_us}
                rows_out.append(row)
                print(f"gemv {shape} {site:22s} m={m:2d}: {row['time_us']:7.1f} us {row['GBps']:6.0f} GB/s "
                      f"({100 * row['fraction_of_copy']:5.1f}% of copy) {config}  unfused {row['unfused_time_us']:7.1f} us "
                      f"{row['unfused_GBps']:6.0f} GB/s  unfused/gemv {row['speedup_vs_unfused']:4.2f}x  err {err:.1e}",
                      flush=True)
    return rows_out


def main() -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --device cpu for a smoke test", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = D**-0.5
    timer = Timer(device, args.iters, args.warmup)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}", flush=True)

    copy_elems = int(args.copy_gib * 2**30) // 2
    src = torch.empty(copy_elems, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * src.element_size() / copy_s
    del src, dst
    print(f"copy bandwidth ({args.copy_gib:g} GiB read + written): {copy_bw / 1e9:.0f} GB/s", flush=True)

    run_attention = args.only in ("all", "attention")
    mm_flops = None
    if run_attention:
        n = args.matmul_size
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        mm_s = timer(lambda: a @ b)
        mm_flops = 2 * n**3 / mm_s
        del a, b
        print(f"{args.dtype} matmul {n}^3: {mm_flops / 1e12:.0f} TFLOP/s", flush=True)

    result = {
        "device": name, "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "triton_interpret": os.environ.get(
            "TRITON_INTERPRET", "0"), "heads": H, "kv_heads": Hkv, "head_dim": D, "block_size": bs,
        "timing": "median of CUDA events, L2 flushed before each call; decode from a CUDA graph" + (
            " (eager)" if args.eager else ""),
        "copy_GBps": copy_bw / 1e9, "matmul_TFLOPs": mm_flops / 1e12 if mm_flops else None, "decode": [],
        "extend": [], "fused": [], "gemv": [],
    }

    for context in args.contexts if run_attention else []:
        for batch in args.batches:
            k_cache, v_cache, tables = paged_cache([context] * batch, Hkv, D, bs, dtype, device, seed=batch)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, H, D, dtype=dtype, device=device)
            out = torch.empty_like(q)
            kv_bytes = 2 * batch * context * Hkv * D * k_cache.element_size()
            moved = kv_bytes + 2 * q.numel() * q.element_size()
            default_splits = attention.choose_num_splits(batch, Hkv, tables.shape[1] * bs, device)
            reference = None
            ref_s = None
            if not args.no_reference and kv_bytes / 2**30 <= args.reference_max_gib:
                reference = torch_reference(q, k_cache, v_cache, tables, [1] * batch, [context] * batch, scale)
                ref_s = timer(lambda: torch_reference(q, k_cache, v_cache, tables, [1] * batch, [context] * batch, scale))
            variants = [(s, 0) for s in [default_splits] + [s for s in args.num_splits if s != default_splits]]
            if args.single_split and default_splits > 1:
                variants.append((default_splits, context))
            for splits, single in variants:
                workspace = attention.decode_workspace(batch, H, D, splits, device) if splits > 1 else None

                def decode():
                    attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, out,
                                                     num_splits=splits, workspace=workspace, single_split_tokens=single)

                seconds = timer(decode, graph=device.type == "cuda" and not args.eager)
                row = {
                    "batch": batch, "context": context, "num_splits": splits,
                    "default_splits": splits == default_splits and not single, "single_split_tokens": single,
                    "time_us": seconds * 1e6, "bytes": moved, "GBps": moved / seconds / 1e9,
                    "fraction_of_copy": moved / seconds / copy_bw,
                }
                if reference is not None:
                    row["max_abs_err_vs_torch"] = (out.float() - reference.float()).abs().max().item()
                    row["torch_time_us"] = ref_s * 1e6
                    row["torch_GBps"] = moved / ref_s / 1e9
                    row["speedup_vs_torch"] = ref_s / seconds
                result["decode"].append(row)
                label = "one program" if single else f"splits={splits:3d}"
                print(f"decode B={batch:4d} ctx={context:6d} {label}: {seconds * 1e6:9.1f} us "
                      f"{row['GBps']:7.0f} GB/s ({100 * row['fraction_of_copy']:5.1f}% of copy)"
                      + (f"  torch {ref_s * 1e6:9.1f} us  err {row['max_abs_err_vs_torch']:.2e}" if reference is not None
                         else ""), flush=True)
            del k_cache, v_cache, tables, reference
            if device.type == "cuda":
                torch.cuda.empty_cache()

    for qlen in args.prefill_lens if run_attention else []:
        context = args.prefill_context
        k_cache, v_cache, tables = paged_cache([context + qlen], Hkv, D, bs, dtype, device, seed=qlen)
        q = torch.randn(qlen, H, D, dtype=dtype, device=device)
        out = torch.empty_like(q)
        query_start_loc = torch.tensor([0, qlen], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([context + qlen], dtype=torch.int32, device=device)
        pairs = qlen * context + qlen * (qlen + 1) // 2  # visible (query, key) pairs
        flops = 4 * H * D * pairs

        def extend():
            attention.paged_extend_attention(q, k_cache, v_cache, tables, query_start_loc, seq_lens, scale, out, qlen)

        seconds = timer(extend)
        row = {"query_len": qlen, "context": context, "time_us": seconds * 1e6, "flops": flops,
               "TFLOPs": flops / seconds / 1e12, "fraction_of_matmul": flops / seconds / mm_flops}
        if not args.no_reference:
            reference = torch_reference(q, k_cache, v_cache, tables, [qlen], [context + qlen], scale)
            ref_s = timer(lambda: torch_reference(q, k_cache, v_cache, tables, [qlen], [context + qlen], scale))
            row["max_abs_err_vs_torch"] = (out.float() - reference.float()).abs().max().item()
            row["torch_time_us"] = ref_s * 1e6
            row["torch_TFLOPs"] = flops / ref_s / 1e12
            if context == 0:  # the dense causal flash kernel torch has, on contiguous K/V: the bar
                slots = (tables[0].long()[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)[:qlen]
                k = k_cache.reshape(-1, Hkv, D)[slots].transpose(0, 1)[None]
                v = v_cache.reshape(-1, Hkv, D)[slots].transpose(0, 1)[None]
                qd = q.transpose(0, 1)[None]
                dense_s = timer(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale,
                                                                       enable_gqa=True))
                row["torch_dense_causal_time_us"] = dense_s * 1e6
                row["torch_dense_causal_TFLOPs"] = flops / dense_s / 1e12
        result["extend"].append(row)
        print(f"extend q={qlen:6d} ctx={context:6d}: {seconds * 1e6:9.1f} us {row['TFLOPs']:6.1f} TFLOP/s "
              f"({100 * row['fraction_of_matmul']:5.1f}% of matmul)"
              + (f"  torch {row['torch_time_us']:9.1f} us  err {row['max_abs_err_vs_torch']:.2e}"
                 if "torch_time_us" in row else "")
              + (f"  dense sdpa {row['torch_dense_causal_TFLOPs']:.0f} TFLOP/s" if "torch_dense_causal_TFLOPs" in row
                 else ""), flush=True)

    if args.only in ("all", "fused"):
        result["fused"] = bench_fused(device, dtype, timer, copy_bw)
    if args.only in ("all", "gemv"):
        result["gemv"] = bench_gemv(device, dtype, timer, copy_bw)

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
