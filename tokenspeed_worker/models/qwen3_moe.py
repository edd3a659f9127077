"""Qwen3-MoE: the Qwen3 decoder (q/k norm) whose MLPs are mixtures of experts (layers/moe.py): top-k
of `num_experts` routed experts per token, renormalized where `norm_topk_prob` says so; a layer
listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, keeps a dense MLP."""

from __future__ import annotations

from torch import nn

from tokenspeed_worker.layers.moe import SparseMoeBlock, is_sparse_layer
from tokenspeed_worker.models.llama import LlamaMLP
from tokenspeed_worker.models.qwen3 import Qwen3ForCausalLM


def qwen_moe_mlp(config, index: int, prefix: str, bias: bool, shared_expert_size: int = 0) -> tuple[str, nn.Module]:
    """Layer `index`'s MLP in a Qwen-MoE config (Qwen3-MoE, Qwen2-MoE): a dense MLP off the sparse
    layers (is_sparse_layer), else the experts, with a shared expert of shared_expert_size (Qwen2-MoE's
    shared_expert_intermediate_size) beside them where it is not 0."""
    if not is_sparse_layer(config, index):
        return "mlp", LlamaMLP(config, bias=bias, prefix=f"{prefix}.mlp")
    shared = None
    if shared_expert_size:
        shared = LlamaMLP(config, bias=bias, prefix=f"{prefix}.mlp.shared_expert", intermediate_size=shared_expert_size)
    return "mlp", SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, bool(config.norm_topk_prob), prefix=f"{prefix}.mlp",
                                 shared_expert=shared)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config, index: int, prefix: str, bias: bool) -> tuple[str, nn.Module]:
        return qwen_moe_mlp(config, index, prefix, bias)
