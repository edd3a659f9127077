"""EAGLE-3's draft head for Llama targets, in the layout its authors publish (config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).

One decoder layer over the pair (the embedding of a token, a hidden state): the target's residual
stream at three of its layers, fused by `fc` (3 x target hidden -> hidden), or, for the head's own
later steps, the pre-norm hidden state it produced at the position before. Its attention reads
both halves (q/k/v take 2 x hidden: the normed embedding and the normed hidden state side by side),
its residual is the hidden state, its MLP is Llama's. The LM head covers a reduced draft vocabulary;
`d2t[i]` maps draft id i to the target's id i + d2t[i]. The token embedding is the target's.

Checkpoint names: fc.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
lm_head.weight, d2t (int64), t2d (bool, unused); a leading "model." is accepted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

from tokenspeed_worker.layers.attention import Attention
from tokenspeed_worker.layers.layernorm import RMSNorm
from tokenspeed_worker.layers.rotary import get_rope
from tokenspeed_worker.models.llama import head_dim_of


def read_config(path: str):
    """The head's config (transformers' LlamaConfig over its config.json); ValueError if it is not an
    EAGLE-3 Llama head."""
    from transformers import LlamaConfig

    from tokenspeed_worker.config.worker import eagle3_head_config

    raw = eagle3_head_config(path)
    return LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})


class Eagle3Layer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, head_dim_of(config)
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            head_dim)
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * hidden, self.num_heads * head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * head_dim, bias=False)
        attn.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(hidden, config.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)
        self.mlp = mlp
        self.rotary_emb = get_rope(config, head_dim)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale=head_dim**-0.5)

    def forward(self, positions, embeds, hidden, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual) of one step's tokens."""
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        a = self.self_attn
        q = a.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = a.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = a.v_proj(x)
        out = a.o_proj(self.attn.forward_with_rotary(positions, q, k, v, self.rotary_emb, attn_metadata))
        x, residual = self.post_attention_layernorm(out, residual)
        m = self.mlp
        return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)), residual


class Eagle3Head(nn.Module):
    """The draft head; `forward` -> (draft-vocabulary logits, pre-norm hidden state) per token."""

    def __init__(self, config, target_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or target_hidden_size
        self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn_metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [T, hidden] (the target's embedding of each token); hidden [T, 3 x target hidden]
        (the target's captured states at the position before) or [T, hidden] (the head's own)."""
        if hidden.shape[-1] == 3 * self.target_hidden_size:
            hidden = self.fc(hidden)
        out, residual = self.midlayer(positions, embeds, hidden, attn_metadata)
        normed, pre_norm = self.norm(out, residual)
        return self.lm_head(normed).float(), pre_norm

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load(self, path: str) -> None:
        """The head's weights from its folder (safetensors, or PyTorch .bin as published)."""
        tensors: dict[str, torch.Tensor] = {}
        folder = Path(path)
        files = sorted(folder.glob("*.safetensors"))
        if files:
            from safetensors.torch import load_file

            for f in files:
                tensors.update(load_file(str(f)))
        else:
            for f in sorted(folder.glob("*.bin")):
                tensors.update(torch.load(str(f), map_location="cpu", weights_only=True))
        if not tensors:
            raise ValueError(f"--speculative-draft-model-path {path}: no *.safetensors or *.bin weights")
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in tensors.items():
            name = name.removeprefix("model.")
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.int64))
                continue
            if name in ("t2d", "embed_tokens.weight"):  # the target's embedding is used
                continue
            if name not in params:
                raise ValueError(f"--speculative-draft-model-path {path}: weight {name!r} has no place in the head")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"--speculative-draft-model-path {path}: weight {name!r} has shape "
                                 f"{tuple(tensor.shape)}, the head expects {tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"--speculative-draft-model-path {path}: missing weights {', '.join(missing)}")


def aux_layers(num_layers: int) -> list[int]:
    """The target layers whose incoming residual stream the head reads, in order: 2, L/2, L-3 (as
    EAGLE-3 was trained; clamped into a small model's layers)."""
    return sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))
