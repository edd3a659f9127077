"""Model definitions (one file per family) and the registry keyed by the HF `architectures` name."""

from tokenspeed_worker.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
