"""Qwen2: the Llama decoder with a bias on the q/k/v projections (none on o_proj or the MLP)."""

from __future__ import annotations

from tokenspeed_worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(config) -> dict:
        return dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
