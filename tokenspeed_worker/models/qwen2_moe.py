"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v biases) whose MLPs are
mixtures of experts (layers/moe.py) with a shared expert: top-k of `num_experts` routed experts per
token (renormalized where `norm_topk_prob` says so), plus a dense MLP of
`shared_expert_intermediate_size` every token passes through, scaled by the sigmoid of its
one-row gate; a layer listed in `mlp_only_layers`, or off the `decoder_sparse_step` stride, keeps
a dense MLP of `intermediate_size`."""

from __future__ import annotations

from torch import nn

from tokenspeed_worker.models.llama import LlamaForCausalLM
from tokenspeed_worker.models.qwen3_moe import qwen_moe_mlp


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(config) -> dict:
        return dict(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False, mlp_bias=False, qk_norm=False)

    @staticmethod
    def make_mlp(config, index: int, prefix: str, bias: bool) -> tuple[str, nn.Module]:
        return qwen_moe_mlp(config, index, prefix, bias, getattr(config, "shared_expert_intermediate_size", 0))
