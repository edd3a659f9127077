"""Forms of the small-batch GEMV's K loop at one row, compiled for sm_90 on the CPU machine: the
instructions per weight byte of each (issue 24: the FP8 sites ran at 57-72 % of the copy bandwidth
at batch 1 where the bf16 ones pass 90 %, and the FP8 K loop issues twice the bf16 one's
instructions per byte: scripts/sass_gemv.py). Minimal kernels, not the product's (no norm
prologue, no epilogue), to weigh a form before building it into kernels/gemv.py:

- `sum`:   as kernels/gemv.py today: each K step's products reduced across the tile (tl.sum) into
           one accumulator per output; weights widened by Triton's own fp8 -> f32 conversion.
- `acc`:   one float32 accumulator per tile element, reduced once after the loop.
- `words`: FP8 weights read as int32 words (4 e4m3 each) and widened by one inline-PTX call per
           word (two cvt.rn.f16x2.e4m3x2, four cvt.f32.f16), the input read at the four matching
           columns; with `acc`'s accumulators. Triton's own conversion unpacks each byte from its
           loaded vector (PRMT, LOP3) before converting; the word form has none of that. Built
           into kernels/gemv.py as Fp8Words configurations, it lost the timing at every Llama-8B
           FP8 site on an H100 (docs/benchmarks.md) and was deleted.

    python scripts/sass_gemv_forms.py
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_gemv import disassemble, loop_body  # noqa: E402

# Four e4m3 bytes of one word ($4) to four float32 ($0..$3), byte 0 first (exact: e4m3 -> f16 -> f32).
WIDEN_WORD = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 p0, p1;
.reg .f16 a0, a1, a2, a3;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p0, lo;
cvt.rn.f16x2.e4m3x2 p1, hi;
mov.b32 {a0, a1}, p0;
mov.b32 {a2, a3}, p1;
cvt.f32.f16 $0, a0;
cvt.f32.f16 $1, a1;
cvt.f32.f16 $2, a2;
cvt.f32.f16 $3, a3;
}""")


@triton.jit
def _sum_form(x_ptr, w_ptr, out_ptr, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_next = tl.load(rows + offs_k[None, :])
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        w = w_next.to(tl.float32)
        w_next = tl.load(rows + (kk + BLOCK_K)[None, :], mask=(kk + BLOCK_K < K)[None, :], other=0.0)
        x = tl.load(x_ptr + kk).to(tl.float32)
        if ACC:
            acc2 += w * x[None, :]
        else:
            acc += tl.sum(w * x[None, :], axis=1)
    if ACC:
        acc = tl.sum(acc2, axis=1)
    tl.store(out_ptr + offs_n, acc.to(tl.bfloat16))


@triton.jit
def _words_form(x_ptr, w_ptr, out_ptr, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    BLOCK_J: tl.constexpr = BLOCK_K // 4  # words per K step; w_ptr is int32, stride_w in words
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_J)
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    w_next = tl.load(rows + offs_j[None, :])
    for j0 in range(0, K // 4, BLOCK_J):
        jj = j0 + offs_j
        w = w_next
        w_next = tl.load(rows + (jj + BLOCK_J)[None, :], mask=(jj + BLOCK_J < K // 4)[None, :], other=0)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(WIDEN_WORD, "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4,
                                                   is_pure=True, pack=1)
        acc += w0 * tl.load(x_ptr + 4 * jj).to(tl.float32)[None, :]
        acc += w1 * tl.load(x_ptr + 4 * jj + 1).to(tl.float32)[None, :]
        acc += w2 * tl.load(x_ptr + 4 * jj + 2).to(tl.float32)[None, :]
        acc += w3 * tl.load(x_ptr + 4 * jj + 3).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(tl.bfloat16))


def sass(kernel, weight: str, consts: dict, num_warps: int) -> str:
    signature = {"x_ptr": "*bf16", "w_ptr": weight, "out_ptr": "*bf16", "K": "i32", "stride_w": "i32",
                 **{n: "constexpr" for n in consts}}
    return disassemble(kernel, signature, consts, (), num_warps)


def main() -> int:
    block_n, num_warps = 8, 4
    forms = [("bf16 sum", _sum_form, "*bf16", 512, dict(ACC=False)), ("bf16 acc", _sum_form, "*bf16", 512, dict(ACC=True)),
             ("fp8 sum", _sum_form, "*fp8e4nv", 1024, dict(ACC=False)), ("fp8 acc", _sum_form, "*fp8e4nv", 1024, dict(ACC=True)),
             ("fp8 words", _words_form, "*i32", 1024, {})]
    print(f"one row, tiles of {block_n} weight rows x 1024 bytes, {num_warps} warps, sm_90")
    for name, kernel, weight, block_k, extra in forms:
        text = sass(kernel, weight, dict(BLOCK_N=block_n, BLOCK_K=block_k, **extra), num_warps)
        body = loop_body(text)
        per_thread = block_n * 1024 / (32 * num_warps)  # weight bytes a thread loads per K step
        top = Counter(o.split(".")[0] for o in body).most_common(8)
        print(f"{name:10s} K loop {len(body):4d} instructions, {len(body) / per_thread:.2f} per weight byte, spills "
              f"{text.count(' STL')}; {', '.join(f'{op} {n}' for op, n in top)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
