"""Mistral: the Llama decoder (no biases, head_dim may differ from hidden / heads, as in
Mistral-Nemo), with a `sliding_window` that serves where it covers every served sequence."""

from __future__ import annotations

from tokenspeed_worker.models.llama import LlamaForCausalLM, check_window_covers_the_served_length


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        check_window_covers_the_served_length(config, "MistralForCausalLM")
        super().__init__(config)

    @staticmethod
    def layer_options(config) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
