"""What a start leaves for the next one (`--cache-dir`): compiled kernels and timed kernel choices.

    <cache dir>/triton/                      Triton's compiled kernels (TRITON_CACHE_DIR, unless set)
    <cache dir>/<device key>/small_batch_gemv.json
                                             the small-batch GEMV chooser's choices by site and shape
    <cache dir>/<device key>/decode_attention.json
                                             the decode attention's split thresholds by shape and batch
    <cache dir>/<device key>/fused_moe.json  the MoE grouped GEMMs' tiles by shape and pair count
                                             (tuned by scripts/bench_moe.py --tune, kernels/moe.py)

Triton keys its own entries by source, options, target and version, so one folder serves every
GPU. The timed choices are only valid on the GPU, driver and code that timed them: their folder is
named by the GPU, its compute capability, the driver, CUDA, torch, triton and this package's
version (`device_key`). A choice is taken again only if it is still one of the site's
configurations and still agrees with the unfused path (layers/small_batch_gemv.py); anything else
is timed as on a first start (the attention's thresholds: where every batch size of the start
has one, a valid one). Writes are atomic (a temporary file renamed), merged with what
another worker wrote meanwhile.

The package ships choices timed on the GPUs it was measured on (`kernel_choices/<GPU>-sm<cc>/`, the
same two files, for the model shapes of its benchmarks): a first start on such a GPU takes them as
it takes its own from an earlier start (checked the same way), so it compiles and times only what
they do not cover. A start's own choices, in the cache dir, take precedence over them.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CHOICES_FILE = "small_batch_gemv.json"
ATTENTION_FILE = "decode_attention.json"
MOE_FILE = "fused_moe.json"
SHIPPED_DIR = Path(__file__).parent / "kernel_choices"  # the package's own, by gpu_key
NONE = "none"


def resolve_cache_dir(value: str | None) -> str | None:
    """--cache-dir as a path: the value (~ expanded), "none" for no cache (None), or by default
    $XDG_CACHE_HOME/tokenspeed-worker (~/.cache/tokenspeed-worker)."""
    if value is not None and value.strip().lower() == NONE:
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenspeed-worker")


def usable_cache_dir(cache_dir: str | None) -> str | None:
    """cache_dir (from resolve_cache_dir) when it can be created and written; otherwise (a read-only
    file system, a container's unwritable home) a new temporary folder for this start, with a
    warning: a start must not fail for want of a cache, and Triton needs a folder to compile into."""
    if cache_dir is None:
        return None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=cache_dir, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
        return cache_dir
    except OSError as error:
        fallback = tempfile.mkdtemp(prefix="tokenspeed-worker-cache-")
        # No later start reads it: removed when this process (the server, whose engines end first) exits.
        atexit.register(shutil.rmtree, fallback, True)
        logger.warning("the cache folder %s (--cache-dir, by default $XDG_CACHE_HOME or ~/.cache, then "
                       "tokenspeed-worker) cannot be written (%s): this start compiles and times into %s, which no "
                       "later start reads; give the worker a writable --cache-dir to start faster next time",
                       cache_dir, error, fallback)
        return fallback


def use_triton_cache(cache_dir: str | None) -> str | None:
    """Point Triton's kernel cache into cache_dir (before any compile), unless TRITON_CACHE_DIR is
    set already; returns the folder Triton uses (None: its own default)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    if cache_dir is None:
        return None
    folder = os.path.join(cache_dir, "triton")
    os.environ["TRITON_CACHE_DIR"] = folder
    return folder


def _driver_version() -> str:
    """The NVIDIA kernel driver's version (Linux: /proc/driver/nvidia/version), or "unknown"."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text) or re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return found.group(1) if found else "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def device_key(device: Any) -> str:
    """A folder name for what the timed choices depend on (device: a CUDA torch.device): the GPU,
    its compute capability, the driver, CUDA, torch, triton and this package's version."""
    import torch  # here, not at import: the CLI's parsing resolves --cache-dir without torch

    parts = [f"driver{_driver_version()}", f"cuda{torch.version.cuda}", f"torch{torch.__version__}",
             f"triton{_version('triton')}", f"tsw{_version('tokenspeed-worker')}"]
    return "-".join([gpu_key(device), _folder_name("-".join(parts))])


def gpu_key(device: Any) -> str:
    """A folder name for the GPU model alone (its name and compute capability): the package's
    shipped choices are looked up by it; device_key begins with it."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return _folder_name(f"{props.name}-sm{props.major}{props.minor}")


def _folder_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text)


def stored_choices(path: Path | None, device: Any, name: str = CHOICES_FILE) -> dict[str, str]:
    """The choices a start begins with: the package's shipped ones for this GPU model (name: which
    file), overridden by those in `path` (an earlier start's, choices_path); {} off CUDA."""
    if device.type != "cuda":
        return load_choices(path)
    return {**load_choices(SHIPPED_DIR / gpu_key(device) / name), **load_choices(path)}


def choices_path(cache_dir: str | None, device: Any, name: str = CHOICES_FILE) -> Path | None:
    """The timed-choices file `name` (CHOICES_FILE, ATTENTION_FILE, MOE_FILE) of this device, or None (no
    cache dir, not a GPU)."""
    if cache_dir is None or device.type != "cuda":
        return None
    return Path(cache_dir) / device_key(device) / name


def load_choices(path: Path | None) -> dict[str, str]:
    """The stored choices {site key: choice name}; {} when there is no file or it cannot be read."""
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("kernel choices in %s unreadable (%s): timing them again", path, error)
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def save_choices(path: Path | None, choices: dict[str, str]) -> None:
    """Merge `choices` into the file (atomically); a failure to write is logged, never raised."""
    if path is None or not choices:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**load_choices(path), **choices}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".choices-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("cannot keep the kernel choices in %s: %s", path, error)
