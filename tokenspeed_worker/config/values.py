"""Values the command line accepts: the parsers of typed flags and the --kv-events-config settings.

Each parser raises `argparse.ArgumentTypeError`, which argparse reports as
"argument --flag: <message>"; the same parsers check --config entries (config/parsing.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

# Values of --dtype, with the aliases other engines accept, mapped to the torch dtype name.
DTYPE_ALIASES: dict[str, str] = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
}
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")



def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def model_len(text: str) -> int:
    """A sequence length: at least one prompt token and one output token."""
    value = integer(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a prompt token and an output token), got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


# The largest integer a flag takes: the engine's arrays index with int32 and torch's sizes are int64;
# a value past this is a typo, refused here rather than as an overflow deep in the engine.
MAX_INTEGER = 2**31 - 1


def integer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if abs(value) > MAX_INTEGER:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INTEGER} in size, got {text!r}")
    return value


def port(text: str) -> int:
    value = integer(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in 1..65535, got {text!r}")
    return value


def chunk_size(text: str) -> int:
    value = integer(text)
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or -1 (no chunking), got {text!r}")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def fraction(text: str) -> float:
    value = number(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = number(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def dtype(text: str) -> str:
    canonical = DTYPE_ALIASES.get(text.lower())
    if canonical is None:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(DTYPE_ALIASES)})"
        )
    return canonical


def log_level(text: str) -> str:
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return level


# Keys of --kv-events-config and their defaults (as TokenSpeed's KVEventsConfig).
KV_EVENTS_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "topic": "",
}
KV_EVENTS_PUBLISHERS: tuple[str, ...] = ("zmq", "null")


def kv_events_settings(text: str | None) -> dict[str, Any]:
    """--kv-events-config as a dict with every key (defaults filled in); raises ValueError
    naming the offending key. None or empty: the defaults (events off)."""
    if not text:
        return dict(KV_EVENTS_DEFAULTS)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at position {exc.pos}), got {text!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(data) - set(KV_EVENTS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown key {unknown[0]!r} (known keys: {', '.join(KV_EVENTS_DEFAULTS)})"
        )
    out = dict(KV_EVENTS_DEFAULTS)
    for key, value in data.items():
        if key == "enable_kv_cache_events":
            if not isinstance(value, bool):
                raise ValueError(f"key 'enable_kv_cache_events' must be true or false, got {value!r}")
        elif key == "publisher":
            if value not in KV_EVENTS_PUBLISHERS:
                raise ValueError(f"key 'publisher' must be one of {', '.join(KV_EVENTS_PUBLISHERS)}, got {value!r}")
        elif key == "endpoint":
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"key 'endpoint' must be a ZMQ endpoint such as 'tcp://*:5557', got {value!r}")
        elif key == "topic":
            if not isinstance(value, str):
                raise ValueError(f"key 'topic' must be a string, got {value!r}")
        out[key] = value
    return out


def kv_events_enabled(text: str | None) -> bool:
    """Whether --kv-events-config turns publishing on (enabled and publisher 'zmq')."""
    cfg = kv_events_settings(text)
    return bool(cfg["enable_kv_cache_events"]) and cfg["publisher"] == "zmq"


def kv_events_config(text: str) -> str:
    """Validates --kv-events-config; keeps the canonical JSON with every key filled in."""
    try:
        return json.dumps(kv_events_settings(text), separators=(",", ":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

