"""Mixtral: the Llama decoder whose MLPs (`block_sparse_moe`) are mixtures of experts
(layers/moe.py): the top 2 (num_experts_per_tok) of num_local_experts per token, their softmax
probabilities renormalized to sum to 1."""

from __future__ import annotations

from torch import nn

from tokenspeed_worker.layers.moe import SparseMoeBlock
from tokenspeed_worker.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(config) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)

    @staticmethod
    def make_mlp(config, index: int, prefix: str, bias: bool) -> tuple[str, nn.Module]:
        return "block_sparse_moe", SparseMoeBlock(config.hidden_size, config.intermediate_size,
                                                  config.num_local_experts, config.num_experts_per_tok, True,
                                                  prefix=f"{prefix}.block_sparse_moe")
