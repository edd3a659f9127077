"""tokenspeed-worker: an LLM inference worker serving one model over gRPC to the smg gateway."""

__version__ = "0.1.0"
