"""What the small-batch GEMV kernel compiles to on Hopper, without a GPU: spills, load widths and
the instruction mix per weight byte, for each configuration of a site.

    python scripts/sass_gemv.py [--weight fp8|bf16] [--rows 1] [--site linear|norm_linear|gate_up] [--configs all]

Compiles kernels/gemv.py's one-shot kernel for sm_90 with Triton's own ptxas (in the triton wheel)
and disassembles it with its cuobjdump, integers specialized as a real launch sees them (divisible
by 16: what makes the weight loads 16 bytes wide). Per configuration it prints the local-memory
stores and loads (spills), the global load widths, the instructions of the kernel and per weight
byte of one K step (the loop body dominates), and the most frequent opcodes: a kernel that issues
several instructions per weight byte cannot stream weights at the memory's rate.
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
            "w_scale_ptr": "fp32", "bias_ptr": "bf16", "out_ptr": "bf16", "positions_ptr": "i64", "slots_ptr": "i64",
            "cos_ptr": "fp32", "sin_ptr": "fp32", "k_cache_ptr": "bf16", "v_cache_ptr": "bf16"}
NOT_ALIGNED = ("eps", "num_heads", "num_kv_heads", "up_offset")  # runtime values not divisible by 16


def sass(config: tuple, weight: str, rows: int, site: str) -> str:
    """The disassembly of the one-shot kernel for one configuration, as compiled for sm_90."""
    kernel = gemv._gemv_kernel
    names = kernel.arg_names
    block_n, block_k, num_warps, *one_pass = config
    norm = site in ("norm_linear", "gate_up")
    consts = dict(ROWS=rows, NORM=norm, ADD_RESIDUAL=norm, SILU=site == "gate_up", HAS_BIAS=False, LIBDEVICE=True,
                  BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, ONE_PASS=bool(one_pass and one_pass[0]) and norm,
                  ROPE=False, HEAD_DIM=2, KV_SATURATE=0.0, W_SCALE=weight == "fp8")
    pointers = {**POINTERS, "w_ptr": "fp8e4nv" if weight == "fp8" else "bf16"}
    signature = {n: "constexpr" if n in consts else ("*" + pointers[n] if n in pointers else
                                                      "fp32" if n == "eps" else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n] != "constexpr" and n not in NOT_ALIGNED}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(TOOLS / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def summary(text: str, config: tuple, weight: str) -> dict:
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text)
    block_n, block_k, num_warps = config[:3]
    tile_bytes = block_n * block_k * (1 if weight == "fp8" else 2)
    per_thread = tile_bytes / (32 * num_warps)
    return {"spill_stores": text.count(" STL"), "spill_loads": text.count(" LDL"),
            "loads": dict(Counter(re.findall(r"(LDG\.[A-Z0-9.]+)", text))), "instructions": len(ops),
            "instructions_per_weight_byte": len(ops) / per_thread, "top": Counter(ops).most_common(8)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weight", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--rows", type=int, default=1, choices=range(1, gemv.MAX_ROWS + 1))
    parser.add_argument("--site", choices=("linear", "norm_linear", "gate_up"), default="linear")
    parser.add_argument("--configs", default="all", help="'all' (the weight's one-shot configurations) or one, e.g. 8,1024,4")
    args = parser.parse_args(argv)
    if args.configs == "all":
        configs = [c for c in gemv.configs_for(gemv.torch.float8_e4m3fn if args.weight == "fp8" else gemv.torch.bfloat16,
                                               norm=args.site != "linear") if not isinstance(c, gemv.Persistent)]
    else:
        configs = [tuple(int(v) for v in args.configs.split(","))]
    print(f"{args.weight} weights, {args.rows} row(s), site {args.site}, sm_90")
    for config in configs:
        s = summary(sass(config, args.weight, args.rows, args.site), config, args.weight)
        print(f"{str(config):22s} spills {s['spill_stores']}/{s['spill_loads']}  loads {s['loads']}  "
              f"{s['instructions']} instructions, {s['instructions_per_weight_byte']:.1f} per weight byte of a K step; "
              f"{', '.join(f'{op} {n}' for op, n in s['top'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
