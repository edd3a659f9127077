"""Which files of a model folder are its weights, without torch: the loader (loader.py) reads them,
and the server checks them before any engine starts (server/launch.py)."""

from __future__ import annotations

import json
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else every *.safetensors in the folder."""
    model_path = Path(model_path)
    index = model_path / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    return sorted(model_path.glob("*.safetensors"))


def check_weights_present(model_path: str | Path, load_format: str) -> None:
    """ValueError naming the folder (and any PyTorch pickles in it) where a load format that reads
    weights ("auto", "safetensors") finds no safetensors files; "dummy" needs none."""
    if load_format == "dummy" or safetensors_files(model_path):
        return
    pickled = sorted(p.name for p in Path(model_path).iterdir() if p.suffix in (".bin", ".pt"))
    found = f" ({', '.join(pickled[:3])} are PyTorch pickles: convert them to safetensors)" if pickled else ""
    raise ValueError(f"no safetensors weights in {model_path}{found}; only safetensors checkpoints load "
                     "(or use --load-format dummy for random weights)")
