"""Model classes by the Hugging Face `architectures` name in config.json."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server process checks architectures without importing torch
    from torch import nn

# architecture -> (module under tokenspeed_worker.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
}


# A multimodal architecture whose language model the worker serves alone (token ids in and out):
# architecture -> the text architecture its text_config is built as.
_LANGUAGE_MODELS: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_LANGUAGE_MODELS])


def language_model_config(config):
    """The config the model is built from: a multimodal checkpoint's text_config (as its text
    architecture), else the config itself."""
    for arch in list(getattr(config, "architectures", None) or []):
        if arch in _LANGUAGE_MODELS:
            text = config.get_text_config()
            text.architectures = [_LANGUAGE_MODELS[arch]]
            return text
    return config


def check_architectures(architectures: list[str]) -> None:
    """ValueError naming what is supported unless one of config.json's `architectures` is (read
    before transformers parses the config: a folder with custom code then gets this answer, not
    transformers' prompt to run that code)."""
    if not any(arch in _MODELS or arch in _LANGUAGE_MODELS for arch in architectures):
        raise ValueError(_unsupported(architectures))


def _unsupported(architectures: list[str]) -> str:
    return (f"model architecture {architectures or '(none in config.json)'} is not supported; "
            f"supported: {', '.join(supported_architectures())}")


def get_model_class(config) -> type[nn.Module]:
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"tokenspeed_worker.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(_unsupported(architectures))


def check_parallel_fit(config: dict, tp: int, ep: int) -> None:
    """ValueError naming the flag when --tensor-parallel-size / --ep-size cannot split the model
    whose config.json is `config` (a dict; a multimodal one's text_config counts): attention heads
    and key/value heads over the tensor-parallel ranks, experts over the expert-parallel groups,
    the MLP rows over the ranks that split them. Run before any rank is spawned; the layers check
    the same as they split (and what this leaves out, such as FP8 blocks)."""
    text = config.get("text_config") or {}

    def get(key: str):
        return text.get(key, config.get(key))

    if tp > 1:
        heads = get("num_attention_heads")
        if heads and heads % tp:
            raise ValueError(f"--tensor-parallel-size {tp}: the model's {heads} attention heads "
                             f"(num_attention_heads) do not split evenly over {tp} ranks")
        kv = get("num_key_value_heads") or heads
        if kv and kv % tp and tp % kv:
            raise ValueError(f"--tensor-parallel-size {tp}: the model's {kv} key/value heads (num_key_value_heads) "
                             f"neither split evenly over {tp} ranks nor divide it")
    experts = get("num_experts") or get("num_local_experts")
    if experts and ep > 1 and experts % ep:
        raise ValueError(f"--ep-size {ep}: the model's {experts} experts cannot be dealt evenly to {ep} "
                         f"expert-parallel groups")
    rows = []  # (MLP rows, the ranks splitting them, what they are)
    if experts:
        rows.append((get("moe_intermediate_size") or get("intermediate_size"), tp // max(ep, 1),
                     "each expert's intermediate rows"))
        rows.append((get("shared_expert_intermediate_size"), tp, "the shared expert's intermediate rows"))
        if get("mlp_only_layers") or (get("decoder_sparse_step") or 1) > 1:
            rows.append((get("intermediate_size"), tp, "the dense layers' intermediate rows"))
    else:
        rows.append((get("intermediate_size"), tp, "the MLP's intermediate rows (intermediate_size)"))
    for size, ranks, what in rows:
        if size and ranks > 1 and size % ranks:
            flags = "--tensor-parallel-size" if ranks == tp else "--tensor-parallel-size / --ep-size"
            raise ValueError(f"{flags} {tp}{'' if ranks == tp else f' / {ep}'}: {what} ({size}) do not split "
                             f"evenly over {ranks} ranks")
