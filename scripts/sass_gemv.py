"""What the small-batch GEMV kernel compiles to on Hopper, without a GPU: spills, load widths and
the instruction mix per weight byte, for each configuration of a site.

    python scripts/sass_gemv.py [--weight fp8|fp8-block|bf16] [--rows 1] [--site linear|norm_linear|gate_up|gemma_...] [--configs all] [--k 4096]

Compiles kernels/gemv.py's one-shot, Persistent or tensor-core (Mma, Fp8Mma) kernel for sm_90 with Triton's own ptxas
(in the triton wheel) and disassembles it with its cuobjdump, integers specialized as a real launch
sees them (divisible by 16: what makes the weight loads 16 bytes wide). Per configuration it prints
the local-memory stores and loads (spills), the global load widths, and the K loop's instructions
per weight byte a thread loads in one iteration, with its most frequent opcodes: at 4 TB/s every
instruction per byte is about 4 T instructions/s of the GPU's ~33 T thread-instructions/s issue rate.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tokenspeed_worker.kernels import gemv  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = {"x_ptr": "bf16", "residual_ptr": "bf16", "residual_out_ptr": "bf16", "norm_weight_ptr": "bf16",
            "x_norm_weight_ptr": "bf16",
            "w_scale_ptr": "fp32", "bias_ptr": "bf16", "out_ptr": "bf16", "positions_ptr": "i64", "slots_ptr": "i64",
            "cos_ptr": "fp32", "sin_ptr": "fp32", "k_cache_ptr": "bf16", "v_cache_ptr": "bf16"}
NOT_ALIGNED = ("eps", "num_heads", "num_kv_heads", "up_offset", "stride_w_blocks")  # runtime values not divisible by 16


def sass(config: tuple, weight: str, rows: int, site: str, k: int = 4096) -> str:
    """The disassembly of the one-shot, Persistent or tensor-core (Mma, Fp8Mma) kernel for one
    configuration, as compiled for sm_90 (k: the hidden size, which sizes a Persistent strip)."""
    gemma = site.startswith("gemma_")  # Gemma's forms: (1 + w) norms, the sublayer's norm first, GELU
    site = site.removeprefix("gemma_")
    norm = site in ("norm_linear", "gate_up")
    common = dict(ROWS=rows, NORM=norm, ADD_RESIDUAL=norm, SILU=site == "gate_up", HAS_BIAS=False, LIBDEVICE=True,
                  PDL=True)
    if isinstance(config, gemv.Persistent):
        if weight == "fp8-block":
            raise ValueError("Persistent configurations take no block scales")
        kernel, num_warps = gemv._gemv_persistent_kernel, config.num_warps
        consts = dict(common, BLOCK_N=config.block_n, BLOCK_K=triton.next_power_of_2(k), W_SCALE=weight == "fp8",
                      NORM_X=gemma and norm, UNIT_OFFSET=gemma and norm, GELU=gemma and site == "gate_up")
    elif isinstance(config, (gemv.Fp8Mma, gemv.Mma)):
        kernel, num_warps = gemv._gemv_mma_kernel, config.num_warps
        consts = dict(common, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
                      DOT_F32=False, QUANT=isinstance(config, gemv.Fp8Mma), W_SCALE=weight == "fp8", FP8_MAX=448.0,
                      MIN_SCALE=1.0 / (448.0 * 512.0))
    else:
        kernel = gemv._gemv_kernel
        block_n, block_k, num_warps, *one_pass = config
        consts = dict(common, BLOCK_N=block_n, BLOCK_K=block_k, ONE_PASS=bool(one_pass and one_pass[0]) and norm,
                      ROPE=False, HEAD_DIM=2, KV_SATURATE=0.0, W_SCALE=weight == "fp8")
        # 128 x 128 tiles, as block-wise checkpoints ship them (constexprs both ways: never runtime ints)
        consts.update(W_BLOCK_ROWS=128 if weight == "fp8-block" else 1, W_BLOCK_COLS=128 if weight == "fp8-block" else 0)
        consts.update(NORM_X=gemma and norm, UNIT_OFFSET=gemma and norm, GELU=gemma and site == "gate_up")
    names = kernel.arg_names
    pointers = {**POINTERS, "w_ptr": "bf16" if weight == "bf16" else "fp8e4nv"}
    signature = {n: "constexpr" if n in consts else ("*" + pointers[n] if n in pointers else
                                                      "fp32" if n == "eps" else "i32") for n in names}
    return disassemble(kernel, signature, consts, NOT_ALIGNED, num_warps)


def disassemble(kernel, signature: dict, consts: dict, not_aligned, num_warps: int) -> str:
    """cuobjdump's listing of `kernel` compiled for sm_90: `signature` types every argument (constexpr
    for those in `consts`), and the integers and pointers not in `not_aligned` are specialized as
    divisible by 16, as a real launch sees them."""
    names = kernel.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n] != "constexpr" and n not in not_aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(TOOLS / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def _instructions(text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction of a cuobjdump listing."""
    found = re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);", text)
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in found]


def loop_body(text: str) -> list[str]:
    """The opcodes of the longest loop (a backward branch to its head): the K loop, for this kernel."""
    instructions = _instructions(text)
    index = {address: i for i, (address, _, _) in enumerate(instructions)}
    best: list[str] = []
    for i, (address, op, operands) in enumerate(instructions):
        target = re.match(r"(0x[0-9a-f]+)", operands.strip()) if op == "BRA" else None
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            body = [o for _, o, _ in instructions[index[int(target.group(1), 16)]:i + 1]]
            best = max(best, body, key=len)
    return best


def summary(text: str, config: tuple, weight: str, k: int = 4096) -> dict:
    """Spills, global load widths, and the K loop's instructions per weight byte a thread loads in one
    iteration (with the most frequent opcodes); for a Persistent configuration, its strip loop's per
    gate strip (BLOCK_K the whole of K, as the disassembly was compiled)."""
    if isinstance(config, gemv.Persistent):
        block_n, block_k, num_warps = config.block_n, triton.next_power_of_2(k), config.num_warps
    else:
        block_n, block_k, num_warps = config[:3]
    per_thread = block_n * block_k * (2 if weight == "bf16" else 1) / (32 * num_warps)
    body = loop_body(text)
    return {"spill_stores": text.count(" STL"), "spill_loads": text.count(" LDL"),
            "loads": dict(Counter(re.findall(r"(LDG\.[A-Z0-9.]+)", text))), "loop_instructions": len(body),
            "loop_instructions_per_weight_byte": len(body) / per_thread,
            "top": Counter(o.split(".")[0] for o in body).most_common(8)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight", choices=("fp8", "fp8-block", "bf16"), default="fp8")
    parser.add_argument("--rows", type=int, default=1, choices=range(1, gemv.MMA_MAX_ROWS + 1))
    parser.add_argument("--site", choices=("linear", "norm_linear", "gate_up", "gemma_norm_linear", "gemma_gate_up"),
                        default="linear")
    parser.add_argument("--configs", default="all",
                        help="'all' (every configuration the site times) or one, e.g. 8,1024,4 (four numbers: a "
                        "tensor-core one, Mma for bf16 or Fp8Mma, block_n,block_k,num_warps,num_stages; p2,4,4: "
                        "Persistent block_n,num_warps,per_sm)")
    parser.add_argument("--k", type=int, default=4096, help="the hidden size (a Persistent strip holds all of it)")
    args = parser.parse_args(argv)
    if args.configs == "all":
        configs = list(gemv.configs_for(gemv.torch.bfloat16 if args.weight == "bf16" else gemv.torch.float8_e4m3fn,
                                        norm=args.site != "linear",
                                        block_rows=128 if args.weight == "fp8-block" else None,
                                        gemma=args.site.startswith("gemma_"), rows=args.rows))
    elif args.configs.startswith("p"):
        configs = [gemv.Persistent(*(int(v) for v in args.configs[1:].split(",")))]
    else:
        values = tuple(int(v) for v in args.configs.split(","))
        mma = gemv.Mma if args.weight == "bf16" else gemv.Fp8Mma
        configs = [mma(*values) if len(values) == 4 else values]
    print(f"{args.weight} weights, {args.rows} row(s), site {args.site}, K {args.k}, sm_90")
    for config in configs:
        s = summary(sass(config, args.weight, args.rows, args.site, args.k), config, args.weight, args.k)
        print(f"{str(config):22s} spills {s['spill_stores']}/{s['spill_loads']}  loads {s['loads']}  K loop "
              f"{s['loop_instructions']} instructions, {s['loop_instructions_per_weight_byte']:.2f} per weight byte; "
              f"{', '.join(f'{op} {n}' for op, n in s['top'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
