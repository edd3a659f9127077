"""Mistral: the Llama decoder (no biases, head_dim may differ from hidden / heads, as in
Mistral-Nemo), with a `sliding_window` on every layer where the config has one (llama.layer_window)."""

from __future__ import annotations

from tokenspeed_worker.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(config) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
