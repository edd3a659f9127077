"""Paged attention: one backend interface, several backends (torch reference now; triton, flashinfer later)."""

from tokenspeed_worker.layers.attention.backend import AttentionBackend, AttentionInputs
from tokenspeed_worker.layers.attention.layer import Attention
from tokenspeed_worker.layers.attention.torch_backend import TorchAttentionBackend

SUPPORTED_BACKENDS = ("torch",)
PLANNED_BACKENDS = ("triton", "flashinfer")


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    if name in PLANNED_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not supported yet (supported: {', '.join(SUPPORTED_BACKENDS)})")
    raise ValueError(f"unknown attention backend {name!r} (supported: {', '.join(SUPPORTED_BACKENDS)})")


__all__ = ["Attention", "AttentionBackend", "AttentionInputs", "TorchAttentionBackend", "get_attention_backend"]
