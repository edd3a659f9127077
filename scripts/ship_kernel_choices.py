"""Ship a GPU run's timed kernel choices with the package (tokenspeed_worker/kernel_choices/).

A start keeps its choices in <cache dir>/<device key>/ (kernel_cache.py); gpu_check.sh sends those
folders back in $OUT/kernel_choices.tgz (a device key's `+` is not a name the device tool returns). This takes the entries of model-sized shapes
(tests' tiny models share the GPU machine's cache folder: their shapes are left out) and merges
them into the package's folder for that GPU model (the device key up to its driver part).

    python scripts/ship_kernel_choices.py /work/.device/N/kernel_choices.tgz [--min-dim 1024]
    python scripts/ship_kernel_choices.py CACHE_DIR/<device key> ...   (folders work too)
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tokenspeed_worker import kernel_cache  # noqa: E402  (imports no torch)


def model_sized(name: str, key: str, min_dim: int) -> bool:
    """Whether a stored key is of a model-sized shape: small_batch_gemv's site/rows/N/K/dtypes with N
    and K at least min_dim; decode_attention's heads/kv_heads/head_dim/... with heads x head_dim;
    fused_moe's experts/hidden/intermediate/dtype/pairs with hidden."""
    parts = key.split("/")
    try:
        if name == kernel_cache.CHOICES_FILE:
            return int(parts[2]) >= min_dim and int(parts[3]) >= min_dim
        if name == kernel_cache.MOE_FILE:
            return int(parts[1]) >= min_dim
        return int(parts[0]) * int(parts[2]) >= min_dim
    except (IndexError, ValueError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path,
                        help="cache folders named by their device key, or a .tgz of them (gpu_check.sh's)")
    parser.add_argument("--min-dim", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as unpacked:
        for folder in _folders(args.folders, Path(unpacked)):
            _ship(folder, args.min_dim)


def _folders(paths: list[Path], unpack_to: Path) -> list[Path]:
    """The device-key folders: each path itself, or those a .tgz holds (unpacked under unpack_to)."""
    folders = []
    for path in paths:
        if path.is_file() and path.name.endswith((".tgz", ".tar.gz")):
            target = unpack_to / path.name
            with tarfile.open(path) as tar:
                tar.extractall(target, filter="data")
            folders += sorted(p for p in target.iterdir() if p.is_dir())
        else:
            folders.append(path)
    return folders


def _ship(folder: Path, min_dim: int) -> None:
    """Merge one device-key folder's model-sized entries into the package's folder for its GPU."""
    gpu = folder.name.split("-driver")[0]  # device_key begins with gpu_key, then the driver part
    for name in (kernel_cache.CHOICES_FILE, kernel_cache.ATTENTION_FILE, kernel_cache.MOE_FILE):
        source = folder / name
        kept = {k: v for k, v in kernel_cache.load_choices(source).items() if model_sized(name, k, min_dim)}
        target = kernel_cache.SHIPPED_DIR / gpu / name
        kernel_cache.save_choices(target, kept)  # merged into what is shipped already
        shown = target.relative_to(REPO) if target.is_relative_to(REPO) else target
        print(f"{shown}: {len(kept)} of {source}'s entries, "
              f"{len(kernel_cache.load_choices(target))} in all")


if __name__ == "__main__":
    main()
