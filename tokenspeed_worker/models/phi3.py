"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama decoder whose checkpoints hold q/k/v fused as
`qkv_proj` and gate/up as `gate_up_proj` (split here into the shards the layers load, so tensor
parallelism takes each rank's heads and rows), with partial rotary (`partial_rotary_factor`) and
longrope scaling (layers/rotary.py), and a `sliding_window` on every layer where the config has one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenspeed_worker.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def layer_options(config) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's fused matrices as the separate ones Llama's loader maps (rows: q, k, v;
        gate, up). Quantized fused matrices (their scales cannot be split the same way) are refused."""
        config = self.config
        head_dim = head_dim_of(config)
        q_rows = config.num_attention_heads * head_dim
        kv_rows = config.num_key_value_heads * head_dim
        for name, tensor in weights:
            if name.endswith(".qkv_proj.weight"):
                stem = name[: -len("qkv_proj.weight")]
                for part, rows in zip("qkv", tensor.split([q_rows, kv_rows, kv_rows], dim=0)):
                    yield f"{stem}{part}_proj.weight", rows
            elif name.endswith(".gate_up_proj.weight"):
                stem = name[: -len("gate_up_proj.weight")]
                gate, up = tensor.chunk(2, dim=0)
                yield f"{stem}gate_proj.weight", gate
                yield f"{stem}up_proj.weight", up
            elif ".qkv_proj." in name or ".gate_up_proj." in name:
                raise ValueError(f"checkpoint weight {name!r}: quantized fused Phi-3 projections are not supported")
            else:
                yield name, tensor
