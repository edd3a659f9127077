"""The model runner: loads a model, owns its paged KV cache, and runs one SchedulePlan per forward.

Per step: each plan array goes to the device once, the attention backend builds its
metadata once, the model runs over all T tokens, and the LM head runs only on the
sampling rows (the last query token of each request in plan.sample_rows).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from tokenspeed_worker.layers.attention import Attention, AttentionInputs, get_attention_backend
from tokenspeed_worker.model_executor.loader import load_model_weights
from tokenspeed_worker.models.llama import head_dim_of
from tokenspeed_worker.models.registry import get_model_class
from tokenspeed_worker.scheduler.plan import SchedulePlan

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, hf_config) -> torch.dtype:
    """"auto" keeps the checkpoint's dtype (config `dtype`, or `torch_dtype` before transformers 5)."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported (supported: float32, bfloat16, float16)")
    if dtype == "auto":
        config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
        if isinstance(config_dtype, torch.dtype):
            config_dtype = str(config_dtype).removeprefix("torch.")
        return resolve_dtype(str(config_dtype), hf_config)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (supported: auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        raise ValueError(f"device {str(device)!r} is not supported (supported: cpu, cuda, cuda:N)")
    return device


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        device: str = "cpu",
        load_format: str = "auto",
        attention_backend: str = "torch",
        block_size: int = 16,
        seed: int = 0,
    ) -> None:
        from transformers import AutoConfig

        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model_path = str(model_path)
        if not (Path(self.model_path) / "config.json").exists():
            raise ValueError(f"no config.json in {self.model_path}")
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.hf_config)
        self.attention_backend = get_attention_backend(attention_backend)
        self.block_size = block_size
        self.seed = seed

        model_class = get_model_class(self.hf_config)
        torch.manual_seed(seed)
        with torch.device(self.device), _default_dtype(self.dtype):
            self.model = model_class(self.hf_config)
        self.load_format = load_model_weights(self.model, self.model_path, load_format, seed)
        self.model.eval()

        self.vocab_size: int = self.hf_config.vocab_size
        self.num_layers: int = self.hf_config.num_hidden_layers
        self.num_kv_heads: int = self.hf_config.num_key_value_heads
        self.head_dim: int = head_dim_of(self.hf_config)
        self.max_model_len: int = self.hf_config.max_position_embeddings
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0

    # -- memory ---------------------------------------------------------------------------

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor [2 (K, V), layers, *backend's per-layer shape]; each attention layer gets its slices."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        shape = self.attention_backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = None  # free the old pool before allocating the new one
        self.kv_cache = torch.zeros((2, self.num_layers, *shape), dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        for layer_index, attn in enumerate(self.attention_layers):
            attn.bind_kv_cache(self.kv_cache[0, layer_index], self.kv_cache[1, layer_index], self.attention_backend)

    # -- forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, plan: SchedulePlan) -> torch.Tensor:
        """float32 logits [S, V] of the plan's sampling rows, in sample_rows order."""
        hidden_states = self._hidden_states(plan)
        sample_index = self._to_device(plan.sample_token_index, np.int64)
        return self.model.compute_logits(hidden_states[sample_index]).float()

    @torch.inference_mode()
    def forward_all_logits(self, plan: SchedulePlan) -> torch.Tensor:
        """float32 logits [T, V] of every token of the step (for tests and prompt logprobs)."""
        return self.model.compute_logits(self._hidden_states(plan)).float()

    def _to_device(self, array: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).to(self.device, non_blocking=True)

    def _hidden_states(self, plan: SchedulePlan) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not allocated: call allocate_kv_cache(num_blocks) first")
        if plan.num_tokens == 0:
            raise ValueError("the plan has no tokens")
        inputs = AttentionInputs(
            plan=plan,
            query_lens=self._to_device(plan.query_lens, np.int32),
            context_lens=self._to_device(plan.context_lens, np.int32),
            slot_mapping=self._to_device(plan.slot_mapping, np.int64),
            block_tables=self._to_device(plan.block_tables, np.int32),
            block_size=self.block_size,
        )
        attn_metadata = self.attention_backend.build_metadata(inputs)
        input_ids = self._to_device(plan.input_ids, np.int64)
        positions = self._to_device(plan.positions, np.int64)
        return self.model(input_ids, positions, attn_metadata)
