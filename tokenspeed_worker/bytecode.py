"""Python's bytecode for packages installed without it, kept in the cache folder (`--cache-dir`).

A package installed with `pip install --no-compile` (PIP_NO_COMPILE, common in slim images) has no
`__pycache__` beside its sources, and with PYTHONDONTWRITEBYTECODE=1 (`-B`, set by many Dockerfiles)
or a read-only site-packages Python cannot write one: every process of every start then compiles
torch's and transformers' sources again, each time (docs/benchmarks.md has what it cost on the GPU
machine, which is such an install). When torch's own bytecode is missing and Python cannot write it
beside the sources, `use_bytecode_cache` points Python's bytecode cache into `<cache dir>/pycache`
(`sys.pycache_prefix`) and lets this process write there; its processes inherit the folder
(PYTHONPYCACHEPREFIX, with a marker saying the worker set it, which `inherit` reads).

Written by hand: Python has the mechanism (PYTHONPYCACHEPREFIX, since 3.8) but nothing decides
when a program should use it. A prefix the user set is left alone, and so is their `-B` then; an
install that has its bytecode (pip's default) is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from tokenspeed_worker import env

PREFIX_ENV = "PYTHONPYCACHEPREFIX"
FOLDER = "pycache"


def _bytecode_missing(package: str) -> bool:
    """Whether `package`'s __init__ has no bytecode beside it and Python will not write one there:
    without importing it (importlib's finder only)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return False
    if os.path.exists(importlib.util.cache_from_source(origin)):  # beside it: no prefix is set here
        return False
    return sys.dont_write_bytecode or not os.access(os.path.dirname(origin), os.W_OK)


def use_bytecode_cache(cache_dir: str | None, probe: str = "torch") -> str | None:
    """Keep bytecode in `<cache_dir>/pycache` when `probe` (a package every start imports) has none
    beside its sources and Python cannot write it there; returns the worker's folder in use (None:
    Python's own behaviour, unchanged, or the prefix the user set: PYTHONPYCACHEPREFIX, -X
    pycache_prefix). Call before the heavy imports; processes spawned afterwards inherit it."""
    if os.environ.get(PREFIX_ENV) or sys.pycache_prefix:  # the user's prefix (or a worker's, inherited)
        return inherit()
    if cache_dir is None or not _bytecode_missing(probe):
        return None
    folder = os.path.join(cache_dir, FOLDER)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    os.environ[PREFIX_ENV] = os.environ[env.PYCACHE.name] = folder
    return inherit()


def inherit() -> str | None:
    """In a worker's process: use the bytecode folder the worker chose (its marker in the environment),
    writing there even under `-B` (multiprocessing passes the parent's -B to a spawned child); returns
    it (None: no folder of the worker's)."""
    folder = env.PYCACHE.get()
    if not folder or os.environ.get(PREFIX_ENV) != folder:
        return None
    sys.pycache_prefix = folder
    sys.dont_write_bytecode = False
    return folder
