"""The flashinfer attention backend (layers/attention/flashinfer_backend.py).

On CPU (CI) FlashInfer itself cannot run, so its two wrappers are replaced by a stand-in written
here from FlashInfer's documented semantics (CSR page lists: indptr, page indices, last-page
lengths; causal prefill after the cached context; GQA), in plain torch. Through it the backend's
page lists, planning, graph re-planning and K/V writes are checked against the torch backend on
whole tiny models, eager and with emulated CUDA graphs. The `gpu` tests run the real FlashInfer
when it is installed (scripts/gpu_check.sh BENCH_FLASHINFER=1 carries it)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_cuda_graph_logic import MAX_MODEL_LEN, _decode_run, share_small_batch_gemv
from test_triton_backend import BLOCK_SIZE, MODELS, NUM_BLOCKS, assert_runners_agree, mixed_plans
from tokenspeed_worker.layers.attention import get_attention_backend
from tokenspeed_worker.layers.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    flashinfer_module,
    paged_kv_arrays,
)
from worker_harness import make_runner

CUDA = torch.cuda.is_available()


# -- page lists ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.sampled_from([1, 4, 16]), st.integers(0, 2**31 - 1))
def test_page_lists_follow_the_block_tables(seq_lens, block_size, seed):
    rng = np.random.default_rng(seed)
    width = max(-(-n // block_size) for n in seq_lens) + int(rng.integers(0, 3))
    tables = rng.integers(0, 1000, size=(len(seq_lens), width)).astype(np.int32)
    indptr, indices, last = paged_kv_arrays(tables, np.array(seq_lens), block_size)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    assert indptr[0] == 0 and indptr.shape == (len(seq_lens) + 1,)
    for b, n in enumerate(seq_lens):  # the plain loop FlashInfer's docs describe
        pages = math.ceil(n / block_size)
        assert indptr[b + 1] - indptr[b] == pages
        assert indices[indptr[b]:indptr[b + 1]].tolist() == tables[b, :pages].tolist()
        assert 1 <= last[b] <= block_size and (pages - 1) * block_size + last[b] == n


def test_page_lists_refuse_a_sequence_past_its_table():
    with pytest.raises(ValueError, match="do not fit"):
        paged_kv_arrays(np.zeros((1, 2), np.int32), np.array([2 * BLOCK_SIZE + 1]), BLOCK_SIZE)


# -- without flashinfer ------------------------------------------------------------------------


def test_unavailable_gives_a_clear_error():
    with pytest.raises(ValueError, match="flashinfer attention needs a CUDA device and the flashinfer package"):
        get_attention_backend("flashinfer", "cpu")
    module, why = flashinfer_module("cpu")
    assert module is None and "device is cpu" in why


# -- a stand-in for FlashInfer's wrappers (its documented semantics, plain torch) --------------


def _attend(q, k_cache, v_cache, indptr, indices, last, qo_indptr, page_size, sm_scale):
    """Each request's queries attend its pages; the last query sits at the last key (causal)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(indptr.shape[0] - 1):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        length = (pages.shape[0] - 1) * page_size + int(last[b])
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length].float().repeat_interleave(group, 1)
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length].float().repeat_interleave(group, 1)
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        qb = q[rows].float()
        n = qb.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _Wrapper:
    def __init__(self, workspace, layout, use_tensor_cores=False, use_cuda_graph=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, backend="auto"):
        assert layout == "NHD"
        self.backend = backend
        self.graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = 0

    def _plan(self, qo_indptr, indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size, sm_scale):
        self.plans += 1
        self.num_heads, self.page_size, self.sm_scale = num_heads, page_size, sm_scale
        self.qo_indptr = qo_indptr
        if self.graph:  # FlashInfer copies the page list into the fixed buffers a captured graph reads
            indptr_buf, indices_buf, last_buf = self.buffers
            assert indptr.shape[0] == indptr_buf.shape[0] and indices.shape[0] <= indices_buf.shape[0]
            indptr_buf.copy_(indptr)
            indices_buf[: indices.shape[0]].copy_(indices)
            last_buf.copy_(last)
            self.arrays = lambda: (indptr_buf, indices_buf, last_buf)
        else:
            self.arrays = lambda: (indptr, indices, last)

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        assert q.shape[1] == self.num_heads and k_cache.shape[1] == self.page_size
        indptr, indices, last = self.arrays()
        qo = self.qo_indptr if self.qo_indptr is not None else torch.arange(indptr.shape[0])
        return _attend(q, k_cache, v_cache, indptr, indices, last, qo, self.page_size, self.sm_scale)


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size, q_data_type=None,
             kv_data_type=None, sm_scale=None):
        self._plan(None, indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size, sm_scale)


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size, causal=False,
             q_data_type=None, kv_data_type=None, sm_scale=None):
        assert causal
        self._plan(qo_indptr, indptr, indices, last, num_heads, num_kv_heads, head_dim, page_size, sm_scale)


STAND_IN = SimpleNamespace(__name__="flashinfer-stand-in", BatchDecodeWithPagedKVCacheWrapper=_Decode,
                           BatchPrefillWithPagedKVCacheWrapper=_Prefill)


def _stand_in_backend() -> FlashInferAttentionBackend:
    return FlashInferAttentionBackend("cpu", module=STAND_IN, workspace_bytes=16)


@pytest.mark.parametrize("name", MODELS)
def test_mixed_batches_match_the_torch_backend(name, tiny_model_paths):
    path = str(tiny_model_paths[name])
    runners = [make_runner(path, dtype="float32", block_size=BLOCK_SIZE, attention_backend=backend)
               for backend in ("torch", _stand_in_backend())]
    for runner in runners:
        runner.allocate_kv_cache(NUM_BLOCKS)
    kinds = set()
    for plan in mixed_plans():
        kinds.add("decode" if (plan.query_lens == 1).all() else "prefill or mixed")
        expected, got = (runner.forward_all_logits(plan) for runner in runners)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert kinds == {"decode", "prefill or mixed"}
    torch.testing.assert_close(runners[1].kv_cache, runners[0].kv_cache, atol=1e-5, rtol=1e-5)
    backend = runners[1].attention_backend
    assert backend.sm_scale == runners[1].attention_layers[0].scale and backend.q_dtype == torch.float32


def test_emulated_graphs_replan_every_replay(tiny_model_paths):
    path = str(tiny_model_paths["llama-gqa-tied"])

    def runner(**kwargs):
        r = make_runner(path, dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                        attention_backend=_stand_in_backend(), **kwargs)
        r.allocate_kv_cache(NUM_BLOCKS)
        r.capture_cuda_graphs()
        return r

    eager, graphs = runner(enforce_eager=True), runner(emulate_cuda_graphs=True)
    batch_sizes = [3, 5, 8, 1, 2, 7, 6]
    for expected, got in zip(_decode_run(eager, batch_sizes), _decode_run(graphs, batch_sizes)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert graphs.cuda_graphs.num_replays == len(batch_sizes) and graphs.cuda_graphs.num_eager_decodes == 0
    wrappers = {size: m.planned["graph"].wrapper for size, m in graphs.cuda_graphs.metadata.items()}
    assert all(w.graph for w in wrappers.values())
    assert sum(w.plans for w in wrappers.values()) == len(wrappers) + len(batch_sizes)  # capture + each replay


def test_warm_up_plans_a_decode_and_a_prefill():
    backend = _stand_in_backend()
    backend.setup(num_heads=4, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE)
    backend.configure(torch.float32, torch.float32, 8**-0.5)
    k_cache = torch.randn(backend.kv_cache_shape(4, BLOCK_SIZE, 2, 8))
    before = k_cache.clone()
    assert backend.warm_up(k_cache, torch.randn_like(k_cache), torch.float32) == 2
    assert backend._decode.wrapper.plans == 1 and backend._prefill.wrapper.plans == 1
    assert torch.equal(k_cache, before)


# -- the real FlashInfer (GPU) -----------------------------------------------------------------


def _real_flashinfer() -> bool:
    return CUDA and flashinfer_module("cuda")[0] is not None


@pytest.fixture(scope="module")
def llama_head_dim_64(tiny_model_paths, tmp_path_factory):
    """The tiny llama with 64-wide heads: FlashInfer's kernels are built for the head sizes real
    models use (64, 128, 256), not the tiny models' 16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_paths["llama-gqa-tied"])
    config.head_dim = 64
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("llama_head_dim_64")
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _real_flashinfer(), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_flashinfer_matches_the_torch_backend_on_cuda(llama_head_dim_64, kv_cache_dtype):
    path = str(llama_head_dim_64)
    runners = [make_runner(path, dtype="bfloat16", device="cuda", block_size=BLOCK_SIZE, attention_backend=backend,
                           kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
               for backend in ("torch", "flashinfer")]
    share_small_batch_gemv(runners[1], runners[0])
    for runner in runners:
        runner.allocate_kv_cache(NUM_BLOCKS)
    assert_runners_agree(runners, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not _real_flashinfer(), reason="needs CUDA and flashinfer")
def test_flashinfer_cuda_graphs_give_the_eager_logits(llama_head_dim_64):
    path = str(llama_head_dim_64)

    def runner(enforce_eager):
        r = make_runner(path, dtype="bfloat16", device="cuda", block_size=BLOCK_SIZE, attention_backend="flashinfer",
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=8, enforce_eager=enforce_eager)
        r.allocate_kv_cache(NUM_BLOCKS)
        r.capture_cuda_graphs()
        return r

    eager, graphs = runner(True), runner(False)
    share_small_batch_gemv(eager, graphs)
    assert graphs.cuda_graphs is not None
    batch_sizes = [3, 5, 8, 1, 2, 7, 6]
    for expected, got in zip(_decode_run(eager, batch_sizes), _decode_run(graphs, batch_sizes)):
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
    assert graphs.cuda_graphs.num_replays == len(batch_sizes)


def test_an_fp8_cache_prefills_with_flashinfers_fa2_kernels():
    # FlashInfer's sm90 (FA3) prefill cannot build for 16-bit queries over an e4m3 cache.
    backend = _stand_in_backend()
    backend.configure(torch.bfloat16, torch.bfloat16, 0.125)
    assert backend._prefill_kernels == "auto"
    backend.configure(torch.bfloat16, torch.float8_e4m3fn, 0.125)
    assert backend._prefill_kernels == "fa2"
