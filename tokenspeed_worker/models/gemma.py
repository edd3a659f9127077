"""Gemma 2 and Gemma 3 (text): the decoder with norms around both sublayers.

    x = x + post_attention_norm(attention(input_norm(x)))
    x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))

What sets them apart from Llama, each as transformers computes it:
- RMSNorm scales by (1 + w), in float32, rounded once to the activations' dtype (`GemmaRMSNorm`);
- the embeddings are multiplied by sqrt(hidden_size), rounded to the activations' dtype;
- attention scales scores by query_pre_attn_scalar ** -0.5; Gemma 2 caps them with
  attn_logit_softcapping * tanh(scores / attn_logit_softcapping), and its logits with
  final_logit_softcapping likewise; Gemma 3 normalizes each head of q and k (before rotary);
- `layer_types` interleave sliding-window layers (the last `sliding_window` positions) with full
  ones; Gemma 3's local layers have their own rope (rope_parameters per layer type);
- the MLP gates with GELU (tanh approximation).

Each norm, the residual add and the next norm run as one step (RMSNorm.defer_after: a sublayer's
output normalized, added to the stream, normalized for the next sublayer), left pending for the
next projection: at a few rows the small-batch GEMV takes all three into its prologue (and the
gated GELU into gate_up's epilogue), else one norm kernel runs them (RMSNorm.forward_after), and
the gated GELU another (layers/activation.GeluTanhAndMul).

Windowed and soft-capped layers need an attention backend that takes them (torch or Triton;
model_runner checks). A window at least as long as the served length (--max-model-len) is
dropped: it then masks nothing, and any backend serves those layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenspeed_worker.layers.activation import GeluTanhAndMul
from tokenspeed_worker.layers.attention import Attention
from tokenspeed_worker.layers.layernorm import GemmaRMSNorm, PendingNorm
from tokenspeed_worker.layers.linear import MergedLinear, ParallelLMHead, QKVLinear, RowParallelLinear, VocabParallelEmbedding
from tokenspeed_worker.layers.rotary import RotaryEmbedding, get_rope, served_length
from tokenspeed_worker.models.llama import LlamaForCausalLM


class GemmaAttention(nn.Module):
    def __init__(self, config, layer_type: str, rotary_emb: RotaryEmbedding, qk_norm: bool, prefix: str) -> None:
        super().__init__()
        head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads,
                                  bias=bias, prefix=f"{prefix}.qkv_proj", shard_names=[f"{prefix}.{n}_proj" for n in "qkv"])
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        window = config.sliding_window if layer_type == "sliding_attention" else None
        served = served_length() or config.max_position_embeddings
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale=config.query_pre_attn_scalar**-0.5,
                              sliding_window=window if window and window < served else None,
                              logit_softcap=getattr(config, "attn_logit_softcapping", None))

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm, attn_metadata: object) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.o_proj(self.attn.forward_with_rotary(positions, q, k, v, self.rotary_emb, attn_metadata, *norms))


class GemmaMLP(nn.Module):
    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=False, prefix=f"{prefix}.gate_up_proj",
                                         shard_names=[f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x, activation=self.act_fn))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, rotary_emb: RotaryEmbedding, qk_norm: bool, prefix: str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_type, rotary_emb, qk_norm, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: PendingNorm, attn_metadata: object) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: this layer's input norm, pending (its `residual` is the stream once applied).
        Returns (the MLP's output before post_feedforward_layernorm, the stream it is added to):
        the next layer (or the final norm) does the post norm, the add and its own norm in one
        step (`RMSNorm.defer_after`)."""
        attn = self.self_attn(positions, hidden, attn_metadata)
        pending = self.pre_feedforward_layernorm.defer_after(self.post_attention_layernorm, attn, hidden.residual)
        out = self.mlp(pending)
        return out, pending.residual


class GemmaModel(nn.Module):
    def __init__(self, config, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.normalizer = config.hidden_size**0.5
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported (full_attention, sliding_attention)")
        ropes = {t: get_rope(config, config.head_dim, layer_type=t) for t in set(layer_types)}
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, t, ropes[t], qk_norm, f"model.layers.{i}")
                                    for i, t in enumerate(layer_types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: object) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        hidden = self.layers[0].input_layernorm.defer(x * torch.tensor(self.normalizer, dtype=x.dtype))
        for i, layer in enumerate(self.layers):
            out, residual = layer(positions, hidden, attn_metadata)
            # x + post_feedforward_layernorm(out), normalized by the next layer's input norm (or the final one)
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden = after.defer_after(layer.post_feedforward_layernorm, out, residual)
        return hidden.apply()


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (module docstring); the checkpoint loads as Llama's does (q/k/v and gate/up fused)."""

    qk_norm = False

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}
        self.model = GemmaModel(config, qk_norm=self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size,
                                      embedding=self.model.embed_tokens if self.tie_word_embeddings else None)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def fold_kv_cache_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        if any(pair != (1.0, 1.0) for pair in scales.values()):
            raise ValueError(f"{type(self).__name__}: FP8 KV-cache scales are not supported yet")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): q/k norms, a rope per layer type, no soft-capping (module docstring). Also the
    language model of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration, 4B to 27B;
    models/registry.language_model_config): its text weights renamed, the vision tower and the
    projector skipped (the worker serves token ids: images are not supported)."""

    qk_norm = True
    # checkpoint prefix -> ours: the multimodal checkpoints' language model (as saved on the Hub,
    # and as transformers 5 names it in memory)
    RENAMES = (("language_model.model.", "model."), ("model.language_model.", "model."),
               ("language_model.lm_head.", "lm_head."))
    SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def text_weights():
            for name, tensor in weights:
                if name.startswith(self.SKIPPED):
                    continue
                for old, new in self.RENAMES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                yield name, tensor

        super().load_weights(text_weights())
