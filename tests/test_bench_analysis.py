"""The benchmark scripts' analysis helpers (pure functions over recorded steps and profiler events)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_offline  # noqa: E402
import profile_decode  # noqa: E402
from sim_admission import LLAMA_8B  # noqa: E402


def test_step_boundaries_measure_the_span_between_steps_and_its_idle_time():
    events = [("layer", 0, 10), ("_argmax_over_chunks", 10, 12), ("Memcpy DtoH", 14, 16), ("Memcpy HtoD", 18, 19),
              ("_resolve_pending_kernel", 22, 23), ("layer", 23, 40), ("_argmax_over_chunks", 40, 42),
              ("Memcpy DtoH", 43, 45), ("_resolve_pending_kernel", 50, 51), ("layer", 51, 60)]
    result = profile_decode.step_boundaries(events, "_argmax_over_chunks", "_resolve_pending_kernel")
    assert result["boundaries"] == 2
    assert result["gap_us"] == pytest.approx((10 + 8) / 2)  # 12 -> 22 and 42 -> 50
    assert result["idle_us"] == pytest.approx((7 + 6) / 2)
    assert result["ops"] == [{"name": "Memcpy DtoH", "us": 2.0}, {"name": "Memcpy HtoD", "us": 0.5}]
    assert profile_decode.step_boundaries(events[:2], "_argmax_over_chunks", "_resolve_pending_kernel")["boundaries"] == 0


def test_offline_breakdown_sums_each_kind_of_step_against_its_roofline():
    # (tokens, sampled rows, KV tokens read, keys attended) and (decode rows, prefill tokens) per step
    records = [(432, 432, 432 * 1500, 432 * 1500), (430, 430, 430 * 1600, 430 * 1600),
               (8192, 340, 8000 + 192 * 1500, 8 * 500_500 + 192 * 1500), (8192, 8, 8192, 8 * 512_512)]
    shapes = [(432, 0), (430, 0), (192, 8000), (0, 8192)]
    busy_ms = [33.0, 34.0, 210.0, 180.0]
    kinds = bench_offline.breakdown(records, shapes, busy_ms, LLAMA_8B, 790e12, 4.15e12)
    assert set(kinds) == {"decode, > 320 rows", "mixed (prefill + decode rows)", "prefill only"}
    decode = kinds["decode, > 320 rows"]
    assert decode["steps"] == 2 and decode["busy_s"] == pytest.approx(0.067)
    assert decode["busy_ms_median"] == pytest.approx(33.5) and decode["busy_ms_max"] == 34.0
    assert decode["mean_decode_rows"] == 431
    expected = sum(LLAMA_8B.minimum_seconds(r, 790e12, 4.15e12) for r in records[:2])
    assert decode["roofline_s"] == pytest.approx(expected)
    assert decode["flops_s"] + decode["weights_s"] + decode["kv_s"] == pytest.approx(expected)
    assert decode["fraction_of_roofline"] == pytest.approx(expected / 0.067)
    assert kinds["mixed (prefill + decode rows)"]["mean_decode_rows"] == 192
    assert bench_offline.step_kind(100, 0) == "decode, <= 128 rows" and bench_offline.step_kind(200, 0) == "decode, <= 320 rows"


def test_fp8_linear_layers_are_priced_at_the_fp8_rate():
    """With FP8 linear layers the layers' GEMM FLOPs go at the FP8 rate, the LM head's and
    attention's at the 16-bit one; without a measured FP8 rate everything stays 16-bit."""
    import dataclasses

    fp8 = dataclasses.replace(LLAMA_8B, fp8_linear=True)
    record = (4096, 8, 200_000, 2_000_000)  # tokens, sampled rows, KV tokens read, keys attended
    linear = 2.0 * LLAMA_8B.linear_params * 4096
    rest = LLAMA_8B.step_flops(4096, 8, 2_000_000) - linear
    assert fp8.flops_seconds(record, 800e12, 1600e12) == pytest.approx(linear / 1600e12 + rest / 800e12)
    assert fp8.flops_seconds(record, 800e12, None) == pytest.approx(LLAMA_8B.flops_seconds(record, 800e12))
    assert LLAMA_8B.flops_seconds(record, 800e12, 1600e12) == pytest.approx((linear + rest) / 800e12)
    assert fp8.minimum_seconds(record, 800e12, 4e12, 1600e12) == pytest.approx(
        fp8.flops_seconds(record, 800e12, 1600e12) + fp8.step_bytes(200_000) / 4e12)


def test_the_small_batch_gemv_streams_fp8_weights_with_16_byte_loads():
    """scripts/sass_gemv.py compiles the kernel for sm_90 on this machine (Triton's ptxas and
    cuobjdump, no GPU; a process of its own: the tests run kernels in the interpreter): the FP8
    weight tiles load 16 bytes at a time, with no spills at one row, and e4m3 pairs widen to f16."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "sass_gemv.py"),
                          "--weight", "fp8", "--configs", "8,1024,4"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert "spills 0/0" in line and "'LDG.E.128'" in line and "F2FP" in line, line


def test_a_persistent_program_in_gemmas_forms_compiles_without_spills():
    """The Persistent configurations take Gemma's forms (the sandwich's two norms, GELU): at Gemma-3-12B's
    gate/up (hidden 3840) the strip loop compiles for sm_90 with 16-byte loads and no spills at one row."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "sass_gemv.py"),
                          "--weight", "bf16", "--site", "gemma_gate_up", "--k", "3840", "--configs", "p2,8,2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("Persistent(") and "spills 0/0" in line and "'LDG.E.128'" in line, line


def test_a_moe_step_reads_the_experts_its_tokens_chose():
    """The tiny Qwen3-MoE's arithmetic: a one-token step reads the dense weights and top_k / E of
    the experts (what the worker reports as decode_read_bytes), a wide step nearly all of them;
    each token's FLOPs count only its top_k experts."""
    from bench_common import ModelArithmetic
    from worker_harness import make_runner, tiny_models

    runner = make_runner(tiny_models()["qwen3-moe"], dtype="float32", device="cpu", block_size=4, max_model_len=64)

    class Core:
        pass

    core = Core()
    core.runner = runner
    arithmetic = ModelArithmetic.from_core(core)
    experts, top_k = arithmetic.num_experts, arithmetic.top_k
    assert (experts, top_k) == (8, 2) and 0 < arithmetic.expert_bytes < runner.weight_bytes()
    assert arithmetic.step_weight_bytes(1) == pytest.approx(runner.decode_read_bytes(), abs=1)
    assert arithmetic.step_weight_bytes(1) == pytest.approx(arithmetic.weight_bytes + arithmetic.expert_bytes / 4)
    assert arithmetic.step_weight_bytes(512) == pytest.approx(arithmetic.weight_bytes + arithmetic.expert_bytes)
    dense_linear = sum(p.numel() for p in runner.model.parameters()) - arithmetic.expert_bytes // 4 \
        - 2 * runner.hf_config.vocab_size * runner.hf_config.hidden_size
    assert arithmetic.linear_params == dense_linear + arithmetic.expert_bytes // 4 * top_k // experts


def test_bench_serving_reads_the_startup_phases_from_the_worker_log():
    import bench_serving

    log = ("2026-12-03 19:26:55,102 INFO [engine] tokenspeed_worker.startup: startup: weight load 2.1 s (dummy weights)\n"
           "2026-12-03 19:26:55,117 INFO [engine] tokenspeed_worker.startup: startup: CUDA graph capture 21.0 s "
           "(35 sizes; first runs, mostly kernel compiles, 12.3 s)\n"
           "2026-12-03 19:26:55,323 INFO [engine] tokenspeed_worker.engine.engine_core: startup phases: weight load "
           "2.1 s, CUDA graph capture 21.0 s = 23.1 s\n"
           "2026-12-03 19:26:55.483 INFO MainProcess tokenspeed_worker: warm-up generation passed (startup: warm-up "
           "generation 0.2 s)\n")
    assert bench_serving.parse_startup_phases(log) == {"weight load": 2.1, "CUDA graph capture": 21.0,
                                                       "warm-up generation": 0.2}


def test_serving_figures_carry_the_server_processs_cpu_where_measured(tmp_path):
    """bench_serving's levels carry the server process's CPU over the run (a worker it started); the
    summary line says it, and leaves it out for a result without it (--address, older results)."""
    import os

    import bench_serving
    import bench_summary

    assert bench_serving.cpu_seconds(os.getpid()) > 0
    level = {"concurrency": 64, "output_tok_s": 33000.0, "ttft_ms_median": 44.0, "itl_ms_median": 1.54,
             "itl_ms_p99": 2.0}
    (row,) = bench_summary.figures("serving", {"levels": [level]})
    assert "server process" not in row[3]
    measured = dict(level, server_cpu_s=3.9, server_cpu_fraction_of_wall=0.97, server_cpu_us_per_output_token=29.7)
    (row,) = bench_summary.figures("serving", {"levels": [measured]})
    assert row[2] == 33000.0 and "server process CPU 97% of the wall (30 us/token)" in row[3]
    assert "engine" not in row[3]
    engine = dict(measured, engine_cpu_fraction_of_wall=0.55, engine_steps_per_s=540.0, engine_tokens_per_step=61.1)
    (row,) = bench_summary.figures("serving", {"levels": [engine]})
    assert "engine process CPU 55%, engine 540 steps/s of 61.1 tokens" in row[3]


def test_graph_memory_figures_give_each_kind_of_capture_its_pool_and_cache(tmp_path):
    """bench_graph_memory's totals by kind of capture come out as one summary row each: the graphs'
    pool, with the ordinary cache and the device memory beside it."""
    import json

    import bench_summary

    totals = {"used": 1124.0, "reserved": 1120.0, "ordinary": 592.0, "private": 528.0, "ordinary_alloc": 0.0,
              "private_alloc": 0.0}
    result = {"by_kind_mib": {"decode": dict.fromkeys(totals, 0.0), "piecewise": totals}}
    rows = bench_summary.figures("graphmem", result)
    assert [(what, unit, value) for what, unit, value, _ in rows] == [("decode graphs' pool", "MiB", 0.0),
                                                                      ("piecewise graphs' pool", "MiB", 528.0)]
    assert rows[1][3] == "ordinary cache +592 MiB, device +1124 MiB"
    path = tmp_path / "graphmem.json"
    path.write_text(json.dumps(result))
    assert bench_summary.line("graphmem", path, "graphmem 8b").startswith("graphmem 8b: decode graphs' pool 0 MiB")


def test_serving_reads_the_engines_steps_from_the_workers_metrics():
    """bench_serving counts the engine's steps and generated tokens over a level from the worker's
    Prometheus text (the step histogram's count and sum, the token counter), summed over labels."""
    import http.server
    import threading

    import bench_serving

    text = (b'# HELP x\ntokenspeed:step_duration_seconds_count{model_name="m"} 120.0\n'
            b'tokenspeed:step_duration_seconds_sum{model_name="m"} 0.25\n'
            b'tokenspeed:step_duration_seconds_bucket{le="0.001",model_name="m"} 3.0\n'
            b'tokenspeed:generation_tokens_total{model_name="m"} 7680.0\n'
            b'tokenspeed:generation_tokens_created{model_name="m"} 1.7e9\n')

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = bench_serving.engine_counters(server.server_address[1])
    finally:
        server.shutdown()
    assert got == {"steps": 120.0, "step_s": 0.25, "tokens": 7680.0}


def test_sliding_window_layers_read_and_attend_only_their_windows_keys():
    """A windowed layer reads min(keys, window) of a sequence's KV and each query token attends to
    min(its keys, window): the roofline's KV and attention terms are the mean over layers, checked
    against a count token by token; the tiny Gemma 3 carries its per-layer windows into them."""
    import dataclasses

    import numpy as np
    from bench_common import ModelArithmetic, step_record

    windowed = dataclasses.replace(LLAMA_8B, layer_windows=(4, 0, 4, 10))
    query_lens, seq_lens = np.array([1, 1, 7, 3]), np.array([3, 12, 9, 20])

    def brute(window: int) -> tuple[int, int]:
        read = sum(min(s, window) if window else s for s in seq_lens)
        attended = sum(min(k, window) if window else k
                       for q, s in zip(query_lens, seq_lens) for k in range(s - q + 1, s + 1))
        return read, attended

    counts = [brute(w) for w in windowed.layer_windows]
    assert windowed.kv_tokens(seq_lens) == pytest.approx(np.mean([c[0] for c in counts]))
    assert windowed.attended_keys(query_lens, seq_lens) == pytest.approx(np.mean([c[1] for c in counts]))
    assert LLAMA_8B.kv_tokens(seq_lens) == seq_lens.sum() == brute(0)[0]
    assert LLAMA_8B.attended_keys(query_lens, seq_lens) == brute(0)[1]

    class Plan:
        num_tokens, sample_rows = int(query_lens.sum()), [0, 1, 2, 3]

    Plan.query_lens, Plan.seq_lens = query_lens, seq_lens
    assert step_record(Plan, windowed) == (12, 4, windowed.kv_tokens(seq_lens), windowed.attended_keys(query_lens, seq_lens))
    assert step_record(Plan) == (12, 4, brute(0)[0], brute(0)[1])

    from worker_harness import make_runner, tiny_models

    runner = make_runner(tiny_models()["gemma3"], dtype="float32", device="cpu", block_size=4, max_model_len=64)

    class Core:
        pass

    core = Core()
    core.runner = runner
    windows = ModelArithmetic.from_core(core).layer_windows
    assert windows == tuple(int(m.sliding_window or 0) for m in runner.attention_layers)
    assert 0 in windows and any(windows)  # Gemma 3: local layers between full ones


@pytest.mark.slow
def test_offline_closed_loop_keeps_c_requests_in_flight_until_all_were_sent(tmp_path):
    """bench_offline --closed-loop C: C requests at first, one more as each finishes. Ten requests
    of three tokens four at a time run as waves of 4, 4 and 2 (three steps each: the prefill's
    token, then two decode steps); all at once, as one wave of three steps."""
    import json
    import subprocess

    from worker_harness import REPO, tiny_models

    model = tiny_models()["llama-gqa-tied"]
    results = {}
    for closed in (4, 0):
        out = tmp_path / f"closed{closed}.json"
        subprocess.run([sys.executable, str(REPO / "scripts" / "bench_offline.py"), "--model", str(model),
                        "--device", "cpu", "--num-requests", "10", "--input-len", "8", "--output-len", "3",
                        "--closed-loop", str(closed), "--out", str(out)], check=True, capture_output=True, cwd=REPO)
        results[closed] = json.loads(out.read_text())
    assert results[4]["output_tokens"] == results[0]["output_tokens"] == 30
    assert (results[4]["closed_loop"], results[0]["closed_loop"]) == (4, None)
    assert (results[4]["steps"], results[0]["steps"]) == (9, 3)


def test_bench_steps_times_each_kind_of_step_and_profiles_one(tmp_path):
    """bench_steps: a lone prefill, a decode batch and a mixed step (the decode batch plus one new
    prompt), each timed; the batch really decodes (B rows) and the mixed step carries the prompt; the
    profiled kind's cProfile table comes back."""
    import json
    import subprocess

    from worker_harness import REPO, tiny_models

    model = tiny_models()["llama-gqa-tied"]
    out = tmp_path / "steps.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench_steps.py"), "--model", str(model), "--device", "cpu",
                    "--batch", "4", "--prompt-len", "16", "--repeats", "3", "--profile", "mixed", "--out", str(out)],
                   check=True, capture_output=True, cwd=REPO / "scripts")
    result = json.loads(out.read_text())
    assert (result["batch"], result["prompt_len"], result["repeats"]) == (4, 16, 3)
    for kind in ("prefill", "decode", "mixed"):
        assert 0 < result[kind]["launch_ms"] <= result[kind]["step_ms"]
    assert (result["prefill"]["rows"], result["decode"]["rows"], result["mixed"]["rows"]) == (1, 4, 4)
    # The table keeps the 30 costliest functions, which differ by machine: the step's forward is among them.
    assert "model_runner.py" in result["profile_mixed"] and "profile_prefill" not in result
