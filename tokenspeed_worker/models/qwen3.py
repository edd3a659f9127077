"""Qwen3: the Llama decoder with RMSNorm on each head of q and k (before rotary) and, by default, no biases."""

from __future__ import annotations

from tokenspeed_worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
