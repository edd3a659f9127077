"""Llama (and the decoder Qwen2 and Qwen3 share with it): pre-norm, GQA attention with rotary, SiLU-gated MLP.

Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up are
fused into `qkv_proj` and `gate_up_proj`; `load_weights` maps the checkpoint's
separate matrices into them (`stacked_params_mapping`).

Each norm before a sublayer is handed to that sublayer's first projection (RMSNorm.defer), which
may fold it into its own kernel (layers/linear.py); the residual add is fused into the norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenspeed_worker.layers import moe, rotary
from tokenspeed_worker.layers.activation import SiluAndMul
from tokenspeed_worker.layers.attention import Attention
from tokenspeed_worker.layers.layernorm import PendingNorm, RMSNorm
from tokenspeed_worker.layers.linear import (
    MergedLinear,
    ParallelLMHead,
    QKVLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_into,
)
from tokenspeed_worker.layers.quantization import kv_scales
from tokenspeed_worker.layers.rotary import RotaryEmbedding, get_rope


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_window(config, index: int) -> int | None:
    """Layer `index`'s sliding window, as transformers applies it: config.sliding_window on every
    layer (Mistral, Mixtral, Phi-3), or on the layers `layer_types` marks "sliding_attention"
    (Qwen2/3 with use_sliding_window, whose configs set sliding_window only then; Gemma); None for
    full attention, and where the window covers every served position (it would mask nothing)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types and layer_types[index] != "sliding_attention"):
        return None
    served = rotary.served_length() or config.max_position_embeddings
    return window if window < served else None


class LlamaAttention(nn.Module):
    def __init__(
        self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool, prefix: str = "",
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        # This rank's heads (all of them without tensor parallelism): QKVLinear decides the split.
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, bias=qkv_bias, prefix=f"{prefix}.qkv_proj",
                                  shard_names=[f"{prefix}.{n}_proj" for n in "qkv"])
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb
        self.qk_norm = qk_norm
        if qk_norm:  # Qwen3: RMSNorm over each head of q and k, before rotary
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5,
                              sliding_window=sliding_window)

    @torch.no_grad()
    def fold_kv_cache_scales(self, k_scale: float, v_scale: float) -> None:
        """Make the KV cache hold k / k_scale and v / v_scale while the layer computes what it did
        (layers/quantization/kv_scales.py): q and k take k_scale and 1 / k_scale (in their norms
        with q/k norm, as a norm's output ignores its input's scale), v takes 1 / v_scale and the
        output projection v_scale (not its bias)."""
        q, kv = self.q_size, self.kv_size
        if self.qk_norm:
            for norm, factor in ((self.q_norm, k_scale), (self.k_norm, 1.0 / k_scale)):
                norm.weight.data = (norm.weight.data.float() * factor).to(norm.weight.dtype)
        else:
            self.qkv_proj.scale_output_rows(k_scale, slice(0, q))
            self.qkv_proj.scale_output_rows(1.0 / k_scale, slice(q, q + kv))
        self.qkv_proj.scale_output_rows(1.0 / v_scale, slice(q + kv, q + 2 * kv))
        self.o_proj.scale_output_rows(v_scale, bias=False)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | PendingNorm,
                attn_metadata: object) -> torch.Tensor:
        if not self.qk_norm:
            # One kernel may do the pending norm, q/k/v, rotary and the KV write: attention only attends.
            q = self.qkv_proj.forward_rotary(hidden_states, positions, self.rotary_emb, self.attn, attn_metadata)
            if q is not None:
                return self.o_proj(self.attn.attend_prewritten(q, attn_metadata))
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        # q/k norms, rotary, the KV-cache write and attention (fused as the backend allows:
        # Attention.forward_with_rotary).
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.o_proj(self.attn.forward_with_rotary(positions, q, k, v, self.rotary_emb, attn_metadata, *norms))


class LlamaMLP(nn.Module):
    """silu(gate) * up, then down; intermediate_size defaults to the config's (a shared expert's
    differs: Qwen2-MoE's shared_expert_intermediate_size)."""

    def __init__(self, config, bias: bool = False, prefix: str = "", intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (supported: silu)")
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=bias, prefix=f"{prefix}.gate_up_proj",
                                         shard_names=[f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor | PendingNorm, reduce: bool = True) -> torch.Tensor:
        """reduce=False under tensor parallelism: this rank's partial sum (RowParallelLinear.forward)."""
        return self.down_proj(self.gate_up_proj(x, activation=self.act_fn), reduce=reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 mlp: nn.Module, mlp_name: str = "mlp", prefix: str = "", sliding_window: int | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                                        prefix=f"{prefix}.self_attn", sliding_window=sliding_window)
        self.mlp_name = mlp_name  # the checkpoint's name of the MLP ("block_sparse_moe" in Mixtral)
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, attn_metadata: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.input_layernorm.defer(hidden_states, residual)
        hidden_states = self.self_attn(positions, x, attn_metadata)
        x = self.post_attention_layernorm.defer(hidden_states, x.residual)
        hidden_states = getattr(self, self.mlp_name)(x)
        return hidden_states, x.residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 make_mlp: Callable[[int, str], tuple[str, nn.Module]]) -> None:
        """make_mlp(layer index, layer prefix) -> (the MLP's checkpoint name, the MLP)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config, head_dim_of(config))  # one cos/sin table shared by all layers
        layers = []
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            mlp_name, mlp = make_mlp(i, prefix)
            layers.append(LlamaDecoderLayer(config, rotary_emb, qkv_bias, o_bias, qk_norm, mlp, mlp_name, prefix,
                                            sliding_window=layer_window(config, i)))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Layers whose incoming residual stream each forward keeps in `aux_hidden` ([T, len x hidden],
    # in this order), for an EAGLE-3 draft head (engine/eagle3.py); empty: none kept.
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: object) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        aux = []
        for i, layer in enumerate(self.layers):
            for _ in range(self.aux_layers.count(i)):
                aux.append(hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        if self.aux_layers:
            self.aux_hidden = torch.cat(aux, dim=-1)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # (fused parameter, checkpoint name, shard id)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        # The checkpoint's FP8 KV-cache scales, layer -> {"k"/"v"/"kv": scale} (load_weights); the
        # runner folds them in with an FP8 cache (fold_kv_cache_scales).
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}
        options = self.layer_options(config)
        mlp_bias = options.pop("mlp_bias")
        self.model = LlamaModel(config, **options, make_mlp=lambda i, prefix: self.make_mlp(config, i, prefix, mlp_bias))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size,
                                      embedding=self.model.embed_tokens if self.tie_word_embeddings else None)

    @staticmethod
    def layer_options(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False)

    @staticmethod
    def make_mlp(config, index: int, prefix: str, bias: bool) -> tuple[str, nn.Module]:
        """Layer `index`'s MLP and its checkpoint name (models with experts override this)."""
        return "mlp", LlamaMLP(config, bias=bias, prefix=f"{prefix}.mlp")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: object) -> torch.Tensor:
        """Final hidden states [T, hidden]; the LM head runs only on the rows that sample (compute_logits)."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def fold_kv_cache_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Fold each layer's (k_scale, v_scale) into its weights (LlamaAttention.fold_kv_cache_scales)."""
        for i, layer in enumerate(self.model.layers):
            k_scale, v_scale = scales.get(i, (1.0, 1.0))
            if (k_scale, v_scale) != (1.0, 1.0):
                layer.self_attn.fold_kv_cache_scales(k_scale, v_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the parameters; every parameter must be filled exactly once."""
        params = dict(self.named_parameters())  # a tied lm_head appears only as embed_tokens
        loaded_numel = dict.fromkeys(params, 0)
        shards_seen: dict[str, list] = {}  # a fused parameter -> the shard ids its checkpoint parts filled
        for name, tensor in weights:
            try:
                self._load_one(name, tensor, params, loaded_numel, shards_seen)
            except ValueError as e:  # a shape or scale that does not fit: say which checkpoint tensor
                if name in str(e):
                    raise
                raise ValueError(f"checkpoint weight {name!r}: {e}") from None
        incomplete = [name for name, param in params.items() if loaded_numel[name] != param.numel()]
        if incomplete:
            raise ValueError("checkpoint is missing (or repeats) weights for: "
                             + ", ".join(self._checkpoint_names(name, shards_seen.get(name, [])) for name in incomplete))

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict, loaded_numel: dict, shards_seen: dict) -> None:
        """One checkpoint tensor into its parameter (load_weights' loop body)."""
        if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return
        kv_scale = kv_scales.checkpoint_scale(name)
        if kv_scale is not None:
            if tensor.numel() != 1:
                raise ValueError(f"checkpoint weight {name!r}: per-head KV-cache scales are not supported "
                                 f"(one scale per layer; shape {tuple(tensor.shape)})")
            self.checkpoint_kv_scales.setdefault(kv_scale[0], {})[kv_scale[1]] = float(tensor.float().item())
            return
        expert = moe.EXPERT_WEIGHT.match(name)
        if expert is not None and expert["name"] in moe.PARTS:
            stem = moe.expert_param_name(expert["kind"], moe.PARTS[expert["name"]])
            if stem is None:  # a static input scale of FP8 experts: not used
                return
            param_name = f"{expert['prefix']}.experts.{stem}"
            if param_name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            param = params[param_name]
            loaded_numel[param_name] += param.expert_loader(param, tensor, int(expert["expert"]),
                                                            moe.PARTS[expert["name"]])
            return
        for fused, shard_name, shard_id in self.stacked_params_mapping:
            if f".{shard_name}." in name:
                param_name = name.replace(f".{shard_name}.", f".{fused}.")
                if param_name not in params:
                    raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
                filled = params[param_name].weight_loader(params[param_name], tensor, shard_id)
                shards_seen.setdefault(param_name, []).append(shard_id)
                break
        else:
            param_name = name
            if param_name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self).__name__}")
            filled = load_into(params[param_name], tensor)
        loaded_numel[param_name] += filled  # this rank's part (all of it without tensor parallelism)

    def _checkpoint_names(self, param_name: str, shards_seen: list) -> str:
        """What the checkpoint lacks (or repeats) for `param_name`, by the checkpoint's own names: a fused
        parameter's parts that never came, or came twice; its own name otherwise."""
        parts = [(param_name.replace(f".{fused}.", f".{shard_name}."), shard_id)
                 for fused, shard_name, shard_id in self.stacked_params_mapping if f".{fused}." in param_name]
        if not parts:
            return param_name
        named = [f"{name} (repeated)" if shards_seen.count(shard_id) > 1 else name
                 for name, shard_id in parts if shards_seen.count(shard_id) != 1]
        return ", ".join(named) or param_name
