"""Paged attention: one backend interface, several backends (torch reference, triton, flashinfer)."""

from __future__ import annotations

import torch

from tokenspeed_worker.layers.attention.backend import AttentionBackend, AttentionInputs, GraphHoles
from tokenspeed_worker.layers.attention.flashinfer_backend import FlashInferAttentionBackend
from tokenspeed_worker.layers.attention.layer import Attention
from tokenspeed_worker.layers.attention.torch_backend import TorchAttentionBackend
from tokenspeed_worker.layers.attention.triton_backend import TritonAttentionBackend, triton_attention_kernels

SUPPORTED_BACKENDS = ("torch", "triton", "flashinfer")


def resolve_attention_backend_name(name: str, device: str | torch.device = "cpu") -> str:
    """"auto": triton on a CUDA device when its kernels can run, else torch; other names unchanged."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and triton_attention_kernels()[0] is not None:
        return "triton"
    return "torch"


def get_attention_backend(name: str, device: str | torch.device = "cpu") -> AttentionBackend:
    name = resolve_attention_backend_name(name, device)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend(device)  # ValueError without CUDA or triton
    if name == "flashinfer":
        return FlashInferAttentionBackend(device)  # ValueError without CUDA or flashinfer
    raise ValueError(f"unknown attention backend {name!r} (supported: auto, {', '.join(SUPPORTED_BACKENDS)})")


__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionInputs",
    "FlashInferAttentionBackend",
    "GraphHoles",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "get_attention_backend",
    "resolve_attention_backend_name",
]
