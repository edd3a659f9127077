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
