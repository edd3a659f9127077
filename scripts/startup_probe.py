"""Where an engine process's first seconds go, step by step, each in a fresh interpreter.

The worker's startup log names its phases ("engine process start", "runtime setup", ...), but
each holds several things: the interpreter, torch's import, the CUDA driver's initialization and
the primary context, transformers' import and its config parsing, triton's import. This times
them one at a time, in the order the engine meets them, in a fresh process per repeat (as every
start is), and once more with the driver initialized from a thread beside torch's import (ctypes
releases the GIL in foreign calls: can the two overlap?); then AutoConfig.from_pretrained under
cProfile, as is and with HF_HUB_OFFLINE=1. Prints a JSON result (also --out).

    python scripts/startup_probe.py --model scripts/model_configs/llama-3.2-1b --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

# Runs in a fresh interpreter: each step's seconds, in order (the process's start from /proc).
CHILD = r"""
import json, os, sys, time, threading
t = {"t0": time.perf_counter()}
with open(f"/proc/{os.getpid()}/stat") as f:  # the process's start, in clock ticks since boot
    start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
with open("/proc/uptime") as f:
    t["interpreter_s"] = float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
model, overlap = sys.argv[1], sys.argv[2] == "1"
steps = {}

def driver_init():
    import ctypes
    t0 = time.perf_counter()
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver here (the CPU machine): nothing to time
        return None
    rc = lib.cuInit(0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    lib.cuDeviceGet(ctypes.byref(dev), 0)
    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    steps["driver_init_and_primary_context_s (thread)" if overlap else "driver_init_and_primary_context_s"] = \
        time.perf_counter() - t0
    return rc

def step(name, fn):
    t0 = time.perf_counter()
    fn()
    steps[name] = time.perf_counter() - t0

thread = None
if overlap:
    thread = threading.Thread(target=driver_init)
    thread.start()
step("import_torch_s", lambda: __import__("torch"))
import torch
if not overlap and torch.cuda.is_available():
    step("driver_init_and_primary_context_s", driver_init)
if thread is not None:
    step("wait_for_driver_thread_s", thread.join)
if torch.cuda.is_available():
    step("torch_cuda_init_s", lambda: torch.cuda.set_device(0))
    step("first_allocation_s", lambda: torch.empty(1, device="cuda"))
step("import_triton_s", lambda: __import__("triton"))
step("import_transformers_s", lambda: __import__("transformers"))
from transformers import AutoConfig
step("autoconfig_from_pretrained_s", lambda: AutoConfig.from_pretrained(model))
step("import_tokenspeed_engine_s", lambda: __import__("tokenspeed_worker.engine.engine_core"))
steps["total_in_process_s"] = time.perf_counter() - t["t0"]
steps["interpreter_s"] = t["interpreter_s"]
print(json.dumps(steps))
"""

# Runs in a fresh interpreter after torch's and transformers' imports: AutoConfig.from_pretrained
# under cProfile, its seconds and the 25 functions it spent the most cumulative time in (on the
# GPU machine it took 5 s against 0.7 s on the CPU machine: what is it doing?).
PROFILE_CHILD = r"""
import cProfile, io, json, pstats, sys, time
import torch, transformers
from transformers import AutoConfig
profile = cProfile.Profile()
t0 = time.perf_counter()
profile.enable()
AutoConfig.from_pretrained(sys.argv[1])
profile.disable()
seconds = time.perf_counter() - t0
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
lines = [line.rstrip() for line in text.getvalue().splitlines() if line.strip()]
print(json.dumps({"autoconfig_from_pretrained_s": seconds, "transformers": transformers.__version__,
                  "top_cumulative": lines[-27:]}))
"""


def profile_autoconfig(model: str) -> dict[str, dict]:
    """AutoConfig.from_pretrained profiled in fresh processes: as the engine runs it, and with
    HF_HUB_OFFLINE=1 (does it look for a hub it cannot reach?)."""
    import os

    out = {}
    for name, extra in (("as_is", {}), ("hf_hub_offline", {"HF_HUB_OFFLINE": "1"})):
        done = subprocess.run([sys.executable, "-c", PROFILE_CHILD, model], capture_output=True, text=True,
                              check=False, timeout=300, env=dict(os.environ, **extra))
        if done.returncode != 0:
            out[name] = {"error": done.stderr[-2000:]}
            continue
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"autoconfig {name}: {out[name]['autoconfig_from_pretrained_s']:.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (its config.json is parsed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"sequential": [], "driver_beside_torch_import": []}
    for _ in range(args.repeats):
        for mode, overlap in (("sequential", "0"), ("driver_beside_torch_import", "1")):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, args.model, overlap], capture_output=True, text=True,
                                  check=False, timeout=300)
            if done.returncode != 0:
                raise SystemExit(f"probe failed ({mode}):\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["wall_s"] = time.perf_counter() - t0
            runs[mode].append(result)
            print(mode, {k: round(v, 3) for k, v in result.items()}, flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "python": sys.version.split()[0],
           "model": args.model, "runs": runs, "autoconfig_profile": profile_autoconfig(args.model)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
