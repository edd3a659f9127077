"""Make tiny random-weight Hugging Face models (with real BPE tokenizers) for tests.

Each model is a plain folder as `save_pretrained` writes it: config.json,
safetensors weights, generation_config.json, tokenizer.json and
tokenizer_config.json (bos/eos and a small chat template). Weights and the
tokenizer come from fixed seeds and fixed local text, so every run makes the
same models. Making them is idempotent: a finished folder is left alone.

    python scripts/make_tiny_models.py [out_dir]      # default: .cache/tiny_models
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

VOCAB_SIZE = 512
MAX_POSITIONS = 4096  # room for long-running test requests (drain, abort, soak)
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

# name -> (architecture, extra config, save_pretrained kwargs)
SPECS: dict[str, tuple[str, dict, dict]] = {
    "llama-gqa-tied": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            # original_max_position_embeddings is small so llama3 scaling touches
            # low, medium and high frequencies of a 16-wide head.
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        {},
    ),
    "qwen2-bias": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False), {}),
    "qwen3-qknorm": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32), {}),
    # Same architecture as qwen3-qknorm, saved in many shards with an index file.
    "qwen3-sharded": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32), dict(max_shard_size="100KB")),
    # Mixtures of experts: a dense layer (1) among sparse ones; top-2 of 8 renormalized (Qwen3-MoE),
    # top-2 of 4 (Mixtral).
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(tie_word_embeddings=False, head_dim=32, num_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=32,
                                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True), {}),
    "mixtral": ("MixtralForCausalLM", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size=48), {}),
    # Qwen2-MoE: a shared expert beside top-2 of 8 (not renormalized, as Qwen1.5-MoE), a dense layer (1).
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False), {}),
    # Mistral: head_dim apart from hidden / heads (as Mistral-Nemo), a window covering every position.
    "mistral": ("MistralForCausalLM", dict(tie_word_embeddings=False, head_dim=32, sliding_window=MAX_POSITIONS), {}),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj in the checkpoint, partial rotary (3/4 of a
    # 16-wide head), longrope with short factors (the served length is within the original one).
    "phi3": ("Phi3ForCausalLM", dict(
        tie_word_embeddings=False, original_max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             original_max_position_embeddings=MAX_POSITIONS,
                             short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 5.0], long_factor=[2.0, 3.0, 4.0, 6.0, 8.0, 16.0])),
        {}),
    # Gemma 2: sliding (window 8, shorter than the test prompts) and full layers alternating, both
    # soft-caps set low enough to bind, query_pre_attn_scalar apart from head_dim.
    "gemma2": ("Gemma2ForCausalLM", dict(
        tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=0.2, final_logit_softcapping=0.1, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]), {}),
    # Gemma 3 (text): q/k norms, local layers with their own rope base, the global one linearly scaled.
    "gemma3": ("Gemma3ForCausalLM", dict(
        tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}), {}),
}
# A multimodal Gemma 3 checkpoint (its language model as gemma3's, a one-layer vision tower), saved
# with the Hub's names (language_model.model.*, vision_tower.*): the worker serves its text part.
SPECS["gemma3-multimodal"] = ("Gemma3ForConditionalGeneration", SPECS["gemma3"][1], {})
SEEDS = {"llama-gqa-tied": 1, "qwen2-bias": 2, "qwen3-qknorm": 3, "qwen3-sharded": 3, "qwen3-moe": 4, "mixtral": 5,
         "mistral": 6, "phi3": 7, "gemma2": 8, "gemma3": 9, "gemma3-multimodal": 10, "qwen2-moe": 11}
# Routers scaled up from the 0.02 init: decisive top-k choices, not near-ties that rounding could flip.
ROUTER_SCALE = 50.0


def _training_text(max_bytes: int = 2_000_000) -> list[str]:
    """Python source from the standard library: local, fixed, plenty of text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(glob.glob(str(stdlib / "*.py"))):
        text = Path(path).read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def make_tokenizer():
    """A byte-level BPE with exactly VOCAB_SIZE tokens, wrapped for save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=MAX_POSITIONS
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(name: str, out: Path, tokenizer) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    arch, extra, save_kwargs = SPECS[name]
    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "Gemma3ForConditionalGeneration": transformers.Gemma3Config,
    }[arch]
    if arch == "Gemma3ForConditionalGeneration":
        config = config_cls(text_config={**COMMON, **extra}, mm_tokens_per_image=4,
                            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14))
    else:
        config = config_cls(**{**COMMON, **extra})
    config.architectures = [arch]
    torch.manual_seed(SEEDS[name])
    model = getattr(transformers, arch)(config).to(torch.float32)
    # Random init gives zero biases and unit norms; perturb them so tests see them.
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
            elif pname.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                param.mul_(ROUTER_SCALE)
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2, do_sample=False).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja; other readers
    # (the gateway among them) look for it in tokenizer_config.json, so put it there too.
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")


def _is_complete(path: Path) -> bool:
    has_weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    return has_weights and (path / "config.json").exists() and (path / "tokenizer.json").exists()


def make_all(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Make every tiny model under out_dir (skipping finished ones); name -> folder."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in SPECS}
    missing = [name for name, path in paths.items() if not _is_complete(path)]
    if missing:
        tokenizer = make_tokenizer()
        for name in missing:
            # Build in a temporary folder and rename, so a crash or a concurrent
            # maker never leaves a half-written model that looks finished.
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir))
            make_model(name, tmp, tokenizer)
            try:
                os.rename(tmp, paths[name])
            except OSError:  # someone else finished it first
                shutil.rmtree(tmp, ignore_errors=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parent.parent / ".cache" / "tiny_models"
    parser.add_argument("out_dir", nargs="?", default=str(default), help=f"where to put the models (default {default})")
    args = parser.parse_args(argv)
    for name, path in make_all(args.out_dir).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
