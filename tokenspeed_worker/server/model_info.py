"""Facts about the served model, read once at startup from its folder.

Sources: config.json (architecture, context length, vocabulary, special ids),
generation_config.json (extra EOS ids, sampling defaults), and the tokenizer
(its EOS/BOS/PAD tokens). GetModelInfo and request validation both use these.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


@dataclass
class ModelFacts:
    model_path: str
    tokenizer_path: str
    served_model_name: str
    model_type: str
    architectures: list[str]
    vocab_size: int
    max_context_length: int
    eos_token_ids: list[int]
    bos_token_id: int
    pad_token_id: int
    dtype: str
    default_sampling_params: dict = field(default_factory=dict)
    has_tokenizer: bool = False  # a tokenizer.json to detokenize with (stop strings)
    data_parallel_size: int = 1  # engine replicas behind this worker (--data-parallel-size)
    structured_output: bool = False  # constraints are applied (--grammar-backend xgrammar, its package, a tokenizer)

    @property
    def default_sampling_params_json(self) -> str:
        return json.dumps(self.default_sampling_params) if self.default_sampling_params else ""


# Sampling defaults the gateway applies from generation_config.json to fields a client left unset.
_DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_model_facts(
    model_path: str,
    tokenizer_path: str | None,
    served_model_name: str | None,
    max_model_len: int | None,
    dtype: str,
) -> ModelFacts:
    config = _read_json(os.path.join(model_path, "config.json"))
    if not config:
        raise FileNotFoundError(f"{model_path!r} has no config.json (a local model folder is required)")
    text_config = config.get("text_config") or config
    gen = _read_json(os.path.join(model_path, "generation_config.json"))
    tok_path = tokenizer_path or model_path

    eos = _as_ids(text_config.get("eos_token_id")) + _as_ids(gen.get("eos_token_id"))
    bos = text_config.get("bos_token_id", gen.get("bos_token_id"))
    pad = text_config.get("pad_token_id", gen.get("pad_token_id"))
    # The tokenizer's own special tokens (a chat model's end-of-turn token is often only there).
    try:
        from tokenizers import Tokenizer

        tok_cfg = _read_json(os.path.join(tok_path, "tokenizer_config.json"))
        tok_file = os.path.join(tok_path, "tokenizer.json")
        if os.path.exists(tok_file):
            tok = Tokenizer.from_file(tok_file)

            def token_id(entry):
                if isinstance(entry, dict):
                    entry = entry.get("content")
                return tok.token_to_id(entry) if isinstance(entry, str) else None

            eos_tok = token_id(tok_cfg.get("eos_token"))
            if eos_tok is not None:
                eos.append(eos_tok)
            if bos is None:
                bos = token_id(tok_cfg.get("bos_token"))
            if pad is None:
                pad = token_id(tok_cfg.get("pad_token"))
    except Exception as exc:  # the tokenizer is a nicety here; config ids suffice
        logger.warning("could not read tokenizer special tokens from %s: %s", tok_path, exc)
    eos_ids = sorted(set(eos))

    context = max_model_len or text_config.get("max_position_embeddings") or 2048
    defaults = {k: gen[k] for k in _DEFAULT_SAMPLING_KEYS if k in gen and gen[k] is not None}
    return ModelFacts(
        model_path=os.path.abspath(model_path),
        tokenizer_path=os.path.abspath(tok_path),
        served_model_name=served_model_name or model_path,
        model_type=str(text_config.get("model_type", config.get("model_type", ""))),
        architectures=list(config.get("architectures") or []),
        vocab_size=int(text_config["vocab_size"]),
        max_context_length=int(context),
        eos_token_ids=eos_ids,
        bos_token_id=int(bos) if bos is not None else 0,
        pad_token_id=int(pad) if pad is not None else 0,
        dtype=dtype,
        default_sampling_params=defaults,
        has_tokenizer=os.path.exists(os.path.join(tok_path, "tokenizer.json")),
    )
