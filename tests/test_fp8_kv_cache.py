"""The fp8 (e4m3) KV cache (`--kv-cache-dtype fp8`): writes saturate and round like torch's cast,
both attention backends read it widened to the model's dtype, and a model runs on it.

On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, which handles fp8
loads and stores); on CUDA the same tests run compiled.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; run with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_triton_kernels import DEVICE, PagedCase, _assert_close  # noqa: E402

from tokenspeed_worker.kernels import attention, rotary  # noqa: E402
from tokenspeed_worker.layers.kv_cache import to_cache_dtype, write_kv_cache  # noqa: E402

FP8 = torch.float8_e4m3fn


def test_writes_saturate_at_448_and_round_like_torch():
    k = torch.tensor([[[1000.0, -3000.0, 0.3, 447.0]]], device=DEVICE).expand(2, 1, 4).contiguous()
    v = -k
    k_cache = torch.zeros(4, 2, 1, 4, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    write_kv_cache(k_cache, v_cache, torch.tensor([5, 2], device=DEVICE), k, v)
    got = k_cache.view(-1, 1, 4)[5].float()
    assert got.tolist() == [[448.0, -448.0, torch.tensor(0.3).to(FP8).float().item(), 448.0]]
    assert torch.equal(v_cache.view(-1, 1, 4)[2].float(), -got)
    assert k_cache.view(-1, 1, 4)[[0, 1, 3, 4, 6, 7]].float().abs().sum() == 0  # other slots untouched
    assert torch.equal(to_cache_dtype(k, FP8).float(), k.clamp(-448, 448).to(FP8).float())


def test_rope_and_write_kv_into_fp8_equals_the_torch_path():
    from test_fused_kernels import _rope

    rope = _rope(32)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = (3 * torch.randn(tokens, heads, head_dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    k = (300 * torch.randn(tokens, kv_heads, head_dim, generator=gen)).to(torch.bfloat16).to(DEVICE)  # some saturate
    v = (300 * torch.randn(tokens, kv_heads, head_dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 100, 7], device=DEVICE)
    slots = torch.tensor([1, 6, 0, 12, 9], device=DEVICE)
    caches = []
    for fused in (True, False):
        k_cache = torch.zeros(4, 4, kv_heads, head_dim, dtype=FP8, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        if fused:
            rotary.rope_and_write_kv(q, k, v, positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache, slots)
        else:
            _, k_rot = rope(positions, q, k)
            write_kv_cache(k_cache, v_cache, slots, k_rot, v)
        caches.append((k_cache.float(), v_cache.float()))
    assert caches[0][0].abs().max() == 448.0
    torch.testing.assert_close(caches[0][0], caches[1][0], atol=0, rtol=0)
    torch.testing.assert_close(caches[0][1], caches[1][1], atol=0, rtol=0)


def _fp8(case: PagedCase) -> PagedCase:
    case.k_cache, case.v_cache = case.k_cache.to(FP8), case.v_cache.to(FP8)  # the NaN padding stays NaN
    return case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_an_fp8_cache(dtype, num_splits):
    case = _fp8(PagedCase([1, 16, 257], [1, 1, 1], 2, 4, 64, dtype, seed=5))
    out = torch.empty_like(case.q)
    attention.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens_t,
                                     case.scale, out, num_splits=num_splits)
    _assert_close(out, case.reference(), dtype)  # the reference reads the same fp8 values, widened


def test_extend_reads_an_fp8_cache():
    query_lens = [5, 1, 40]
    case = _fp8(PagedCase([30, 17, 40], query_lens, 2, 2, 32, torch.bfloat16, seed=6))
    out = torch.empty_like(case.q)
    attention.paged_extend_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
                                     case.seq_lens_t, case.scale, out, max(query_lens))
    _assert_close(out, case.reference(), torch.bfloat16)


def test_a_model_runs_on_an_fp8_cache(tiny_model_paths):
    """A tiny Llama (float32) on the torch backend: the pool holds 4x the tokens per byte, the
    logits stay close to the float32 cache's (e4m3 keeps 3 mantissa bits), and the engine serves."""
    from test_triton_backend import BLOCK_SIZE, Plans, random_seqs
    from worker_harness import make_runner

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.engine.engine_core import EngineCore
    from tokenspeed_worker.engine.messages import AddRequest
    from tokenspeed_worker.sampling.params import SamplingParams

    path = str(tiny_model_paths["llama-gqa-tied"])
    logits = []
    for kv in ("auto", "fp8"):
        runner = make_runner(path, dtype="float32", device=DEVICE.type, block_size=BLOCK_SIZE, kv_cache_dtype=kv)
        runner.allocate_kv_cache(32)
        assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else torch.float32)
        seqs = random_seqs([20, 9], seed=2)
        plans = Plans(num_blocks=32, seed=2)
        logits.append(runner.forward_all_logits(plans.plan([(s, len(s.tokens)) for s in seqs])))
        for s in seqs:
            s.tokens.append(7)
        logits.append(runner.forward_all_logits(plans.plan([(s, 1) for s in seqs])))
        if kv == "fp8":
            assert runner.kv_bytes_per_token() * 4 == bytes_fp32
        bytes_fp32 = runner.kv_bytes_per_token()
    for got, expected in zip(logits[2:], logits[:2]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=0.15, rtol=0.1)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_runner(path, dtype="float32", device=DEVICE.type, kv_cache_dtype="int4")

    core = EngineCore(EngineConfig.build(path, dtype="float32", device=DEVICE.type, max_model_len=256,
                                         max_num_seqs=4, max_total_tokens=1024, kv_cache_dtype="fp8"))
    core.add_request(AddRequest(1, np.arange(3, 40, dtype=np.int32), 8, SamplingParams(temperature=0.0, seed=1)))
    tokens = [t for out in core.run_steps() if out is not None for t in out.tokens.tolist()]
    assert len(tokens) == 8 and core.scheduler.num_used_tokens == 0


def test_the_cli_accepts_fp8_and_names_it_in_the_engine_config():
    from tokenspeed_worker.config import WorkerConfig, check_supported, parse_args

    for value in ("fp8", "fp8_e4m3", "auto"):
        args = parse_args(["m", "--kv-cache-dtype", value, "--device", "cpu"])
        check_supported(args)
        assert WorkerConfig.from_args(args).engine.cache.kv_cache_dtype == value
    with pytest.raises(SystemExit):
        parse_args(["m", "--kv-cache-dtype", "int8"])
