"""ModelRunner against Hugging Face transformers on the tiny models (same weights, same sequences).

Plans are built by hand the way a scheduler would: prompts split into chunks under a
token budget, decodes one token at a time, requests arriving at different steps, and
blocks handed out in shuffled order so every request's KV is scattered over the pool.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tokenspeed_worker.model_executor.model_runner import ModelRunner
from tokenspeed_worker.scheduler.plan import SchedulePlan
from worker_harness import make_runner

MODELS = ["llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"]
BLOCK_SIZE = 4
NUM_BLOCKS = 128
ATOL, RTOL = 2e-5, 1e-4


# -- a hand-driven scheduler ---------------------------------------------------------------


@dataclass
class Sequence:
    req_id: int
    tokens: list[int]  # the whole sequence, known ahead (teacher forcing)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one [V] row per computed token

    @property
    def num_left(self) -> int:
        return len(self.tokens) - self.num_computed


class PlanBuilder:
    """Allocates blocks in shuffled order and turns (sequence, num_tokens) work lists into plans."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, seed: int = 0) -> None:
        self.block_size = block_size
        self.free_blocks = np.random.default_rng(seed).permutation(num_blocks).tolist()

    def plan(self, work: list[tuple[Sequence, int]]) -> SchedulePlan:
        bs = self.block_size
        for seq, n in work:
            while len(seq.blocks) < math.ceil((seq.num_computed + n) / bs):
                seq.blocks.append(self.free_blocks.pop())
        width = max(len(seq.blocks) for seq, _ in work)
        block_tables = np.zeros((len(work), width), dtype=np.int32)
        ids, positions, slots = [], [], []
        for row, (seq, n) in enumerate(work):
            block_tables[row, : len(seq.blocks)] = seq.blocks
            pos = np.arange(seq.num_computed, seq.num_computed + n)
            positions.append(pos)
            ids.append(np.asarray(seq.tokens[seq.num_computed : seq.num_computed + n]))
            slots.append(np.asarray(seq.blocks)[pos // bs] * bs + pos % bs)
        return SchedulePlan(
            req_ids=np.array([seq.req_id for seq, _ in work], dtype=np.int64),
            query_lens=np.array([n for _, n in work], dtype=np.int32),
            context_lens=np.array([seq.num_computed for seq, _ in work], dtype=np.int32),
            input_ids=np.concatenate(ids).astype(np.int64),
            positions=np.concatenate(positions).astype(np.int64),
            slot_mapping=np.concatenate(slots).astype(np.int64),
            block_tables=block_tables,
            sample_rows=np.arange(len(work), dtype=np.int32),
        )

    def run(self, runner: ModelRunner, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """One step; records every token's logits on its sequence. Returns the sampling rows' logits."""
        plan = self.plan(work)
        all_logits = runner.forward_all_logits(plan)
        sampled = runner.forward(plan)
        starts = plan.cu_query_lens
        for row, (seq, n) in enumerate(work):
            seq.logits.extend(all_logits[starts[row] : starts[row] + n])
            seq.num_computed += n
        torch.testing.assert_close(sampled, all_logits[plan.sample_token_index], atol=1e-5, rtol=1e-5)
        return sampled


def budgeted_steps(builder: PlanBuilder, runner: ModelRunner, seqs: list[Sequence], budget: int) -> int:
    """Chunked prefill: each step fills `budget` tokens from the sequences in order until all are done."""
    steps = 0
    while any(s.num_left for s in seqs):
        work, left = [], budget
        for seq in seqs:
            if seq.num_left and left:
                n = min(seq.num_left, left)
                work.append((seq, n))
                left -= n
        builder.run(runner, work)
        steps += 1
    return steps


# -- references ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_models(tiny_model_paths):
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(
            tiny_model_paths[name], dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for name in MODELS
    }


@pytest.fixture(scope="module")
def runners(tiny_model_paths):
    out = {}
    for name in MODELS:
        runner = make_runner(str(tiny_model_paths[name]), dtype="float32", block_size=BLOCK_SIZE)
        runner.allocate_kv_cache(NUM_BLOCKS)
        out[name] = runner
    return out


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_matches_hf(hf_model, seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.num_left == 0
        torch.testing.assert_close(torch.stack(seq.logits), hf_logits(hf_model, seq.tokens), atol=ATOL, rtol=RTOL)


def random_sequences(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    return [Sequence(i + 1, rng.integers(3, vocab, size=n).tolist()) for i, n in enumerate(lengths)]


# -- equality with transformers ------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_whole_prompt_prefill_batch_matches_hf(name, runners, hf_models):
    seqs = random_sequences([5, 23, 40, 1])
    PlanBuilder().run(runners[name], [(s, len(s.tokens)) for s in seqs])
    assert_matches_hf(hf_models[name], seqs)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("budget", [16, 33])
def test_chunked_prefill_matches_hf(name, budget, runners, hf_models):
    seqs = random_sequences([20, 50, 37, 3], seed=budget)
    steps = budgeted_steps(PlanBuilder(seed=budget), runners[name], seqs, budget)
    assert steps == math.ceil(110 / budget)
    assert_matches_hf(hf_models[name], seqs)


@pytest.mark.parametrize("name", MODELS)
def test_decode_steps_after_prefill_match_hf(name, runners, hf_models):
    prompt_lens, num_decodes = [7, 12, 4], 9
    seqs = random_sequences([n + num_decodes for n in prompt_lens], seed=3)
    builder = PlanBuilder(seed=3)
    builder.run(runners[name], [(s, n) for s, n in zip(seqs, prompt_lens)])
    for _ in range(num_decodes):
        builder.run(runners[name], [(s, 1) for s in seqs])
    assert_matches_hf(hf_models[name], seqs)


@pytest.mark.parametrize("name", MODELS)
def test_mixed_batches_with_staggered_arrivals_match_hf(name, runners, hf_models):
    """Requests arrive at different steps; prefill chunks and decodes share steps, in shuffled row order."""
    seqs = random_sequences([30, 45, 9, 26, 14], seed=11)
    prompt_lens = [22, 37, 5, 20, 2]
    arrive_at = [0, 1, 1, 3, 6]
    budget = 24
    builder = PlanBuilder(seed=11)
    rng = np.random.default_rng(5)
    saw_mixed = False
    for step in range(100):
        active = [s for s, t in zip(seqs, arrive_at) if t <= step and s.num_left]
        if not active and step > max(arrive_at):
            break
        work, left = [], budget
        for seq in active:  # decodes first, then prefill chunks under the budget
            prompt_left = prompt_lens[seq.req_id - 1] - seq.num_computed
            n = 1 if prompt_left <= 0 else min(prompt_left, left)
            if n and left >= n:
                work.append((seq, n))
                left -= n
        if not work:
            continue
        saw_mixed |= any(n == 1 for _, n in work) and any(n > 1 for _, n in work)
        order = rng.permutation(len(work))
        builder.run(runners[name], [work[i] for i in order])
    assert saw_mixed
    assert_matches_hf(hf_models[name], seqs)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_continuation_equals_hf_generate(name, runners, hf_models):
    runner, hf = runners[name], hf_models[name]
    prompts = [s.tokens for s in random_sequences([6, 19], seed=21)]
    max_new = 8
    seqs = [Sequence(i + 1, list(p)) for i, p in enumerate(prompts)]
    builder = PlanBuilder(seed=21)
    logits = builder.run(runner, [(s, len(s.tokens)) for s in seqs])
    for step in range(max_new):
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.tokens.append(token)
        if step < max_new - 1:
            logits = builder.run(runner, [(s, 1) for s in seqs])
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                pad_token_id=hf.config.pad_token_id,
            )
        assert seq.tokens == out[0].tolist()


# -- dtypes, formats, errors ---------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_runs_and_mostly_agrees(name, tiny_model_paths, hf_models):
    runner = make_runner(str(tiny_model_paths[name]), dtype="bfloat16", block_size=BLOCK_SIZE)
    runner.allocate_kv_cache(NUM_BLOCKS)
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
    seqs = random_sequences([40, 25], seed=4)
    budgeted_steps(PlanBuilder(seed=4), runner, seqs, budget=16)
    for seq in seqs:
        ours = torch.stack(seq.logits)
        ref = hf_logits(hf_models[name], seq.tokens)
        assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
        assert (ours - ref).abs().max() < 0.05 * ref.abs().max() + 0.05
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_sharded_checkpoint_loads_same_weights(tiny_model_paths, runners):
    path = tiny_model_paths["qwen3-sharded"]
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
    sharded = make_runner(str(path), block_size=BLOCK_SIZE)
    sharded.allocate_kv_cache(NUM_BLOCKS)
    seq_a, seq_b = random_sequences([30], seed=8), random_sequences([30], seed=8)
    budgeted_steps(PlanBuilder(), sharded, seq_a, budget=16)
    budgeted_steps(PlanBuilder(), runners["qwen3-qknorm"], seq_b, budget=16)
    torch.testing.assert_close(torch.stack(seq_a[0].logits), torch.stack(seq_b[0].logits), atol=0, rtol=0)


@pytest.mark.parametrize("weight", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                                    "model.norm.weight"])
def test_a_checkpoint_tensor_of_the_wrong_shape_is_named(tiny_model_paths, tmp_path, weight):
    """A checkpoint tensor a row short (a fused part, a plain linear, a norm) fails the load with its
    checkpoint name in the message, as a missing one does."""
    from safetensors.torch import load_file, save_file

    source = tiny_model_paths["llama-gqa-tied"]
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    (checkpoint,) = source.glob("*.safetensors")
    tensors = load_file(checkpoint)
    tensors[weight] = tensors[weight][:-1].clone()
    save_file(tensors, tmp_path / checkpoint.name)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint weight {weight!r}")):
        make_runner(str(tmp_path), block_size=BLOCK_SIZE)


def test_dummy_load_format_needs_only_config(tiny_model_paths, tmp_path):
    shutil.copy(tiny_model_paths["qwen2-bias"] / "config.json", tmp_path / "config.json")
    runs = []
    for seed in (0, 0, 1):
        runner = make_runner(str(tmp_path), load_format="dummy", seed=seed, block_size=BLOCK_SIZE)
        assert runner.load_format == "dummy"
        runner.allocate_kv_cache(16)
        seqs = random_sequences([10])
        runs.append(PlanBuilder(num_blocks=16).run(runner, [(seqs[0], 10)]))
        assert runs[-1].shape == (1, runner.vocab_size) and torch.isfinite(runs[-1]).all()
    torch.testing.assert_close(runs[0], runs[1], atol=0, rtol=0)
    assert not torch.equal(runs[0], runs[2])
    with pytest.raises(ValueError, match="dummy"):
        make_runner(str(tmp_path))  # auto finds no weights and says how to go without


def test_sizes_and_attributes(runners):
    runner = runners["llama-gqa-tied"]
    config = runner.hf_config
    head_dim = config.hidden_size // config.num_attention_heads
    assert runner.kv_bytes_per_token() == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert runner.num_layers == config.num_hidden_layers and runner.vocab_size == config.vocab_size
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    # Tied embeddings count once.
    assert runner.weight_bytes() == 4 * sum(p.numel() for p in runner.model.parameters())
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    assert runner.kv_cache.shape == (2, config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, 2, head_dim)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_cpu_kv_pool_takes_memory_only_as_it_is_written(tiny_model_paths, kv_dtype):
    """A CPU worker's pool is sized from physical memory (up to 4 GiB), but only the KV it writes
    is resident: several CPU workers on one machine (tests, demos) do not each hold 4 GiB."""
    runner = make_runner(str(tiny_model_paths["llama-gqa-tied"]), max_model_len=64)
    runner.kv_dtype = kv_dtype
    before = _resident_bytes()
    runner.allocate_kv_cache(256 * 1024)  # 4M tokens: 0.75-3 GiB for this model by KV dtype
    pool = runner.kv_cache
    assert pool.dtype == kv_dtype and pool.is_contiguous() and pool.nbytes >= 512 * 2**20
    assert _resident_bytes() - before < 64 * 2**20
    assert not pool[:, :, -1].float().any()  # reads as zeros, still not resident
    pool[0, 0, 7].fill_(1)
    assert pool[0, 0, 7].float().eq(1).all() and not pool[1, 0, 7].float().any()
    assert _resident_bytes() - before < 64 * 2**20


def test_clear_errors(tiny_model_paths, tmp_path):
    path = str(tiny_model_paths["llama-gqa-tied"])
    with pytest.raises(ValueError, match="dtype"):
        make_runner(path, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="triton attention needs a CUDA device"):
            make_runner(path, attention_backend="triton")
    with pytest.raises(ValueError, match="not supported"):
        make_runner(path, device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            make_runner(path, device="cuda")
    with pytest.raises(ValueError, match="load_format"):
        make_runner(path, load_format="pt")
    config = (tiny_model_paths["llama-gqa-tied"] / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    from tokenspeed_worker.models.registry import supported_architectures

    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "LlamaForCausalLM",
            "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
            "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} == set(supported_architectures())
    with pytest.raises(ValueError, match="GPT2LMHeadModel'. is not supported; supported: "
                                         + ", ".join(supported_architectures())):
        make_runner(str(tmp_path), load_format="dummy")
    runner = make_runner(path)
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        runner.forward(PlanBuilder().plan([(Sequence(1, [3, 4]), 2)]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_matches_hf(name, tiny_model_paths, hf_models):
    runner = make_runner(str(tiny_model_paths[name]), dtype="float32", device="cuda", block_size=BLOCK_SIZE)
    runner.allocate_kv_cache(NUM_BLOCKS)
    num_decodes = 5
    seqs = random_sequences([20 + num_decodes, 50 + num_decodes, 3 + num_decodes], seed=2)
    builder = PlanBuilder(seed=2)
    for seq in seqs:  # hold the decode tokens back from the chunked prefill
        seq.tokens, held = seq.tokens[:-num_decodes], seq.tokens[-num_decodes:]
        seq.held = held
    budgeted_steps(builder, runner, seqs, budget=33)
    for step in range(num_decodes):
        for seq in seqs:
            seq.tokens.append(seq.held[step])
        builder.run(runner, [(s, 1) for s in seqs])
    for seq in seqs:
        torch.testing.assert_close(
            torch.stack(seq.logits).cpu(), hf_logits(hf_models[name], seq.tokens), atol=1e-4, rtol=1e-3
        )


def test_a_broken_checkpoint_is_named_in_its_own_terms(tiny_model_paths, tmp_path):
    """What a stranger's folder lacks, said with the checkpoint's names (not the fused parameter the
    worker builds) and the flag to type: a missing part of a fused projection, a repeated one, a
    folder of PyTorch pickles."""
    import safetensors.torch

    source = tiny_model_paths["llama-gqa-tied"]
    weights = safetensors.torch.load_file(str(source / "model.safetensors"))
    shutil.copy(source / "config.json", tmp_path / "config.json")
    gate = "model.layers.0.mlp.gate_proj.weight"
    broken = {k: v for k, v in weights.items() if k != gate}
    safetensors.torch.save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \(or repeats\) weights for: model\.layers\.0\.mlp\.gate_proj\.weight$"):
        make_runner(str(tmp_path))
    safetensors.torch.save_file(broken, str(tmp_path / "model.safetensors"))
    safetensors.torch.save_file({"model.layers.0.mlp.up_proj.weight": weights["model.layers.0.mlp.up_proj.weight"],
                                 gate: weights[gate]}, str(tmp_path / "model-extra.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight \(repeated\)$"):
        make_runner(str(tmp_path))
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    torch.save(weights, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin are PyTorch pickles: convert them to safetensors\); "
                                         r"only safetensors checkpoints load \(or use --load-format dummy"):
        make_runner(str(tmp_path))


def test_a_safetensors_file_that_is_not_one_is_named(tmp_path, tiny_model_paths):
    from tokenspeed_worker.model_executor.loader import iter_safetensors

    shutil.copy(tiny_model_paths["llama-gqa-tied"] / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=f"{tmp_path / 'model.safetensors'}: not a readable safetensors file"):
        list(iter_safetensors(tmp_path))
