
# --- tiny models (added by the model-runner work) -----------------------------------------
import importlib.util as _tiny_importlib_util
import os as _tiny_os
from pathlib import Path as _TinyPath

import pytest as _tiny_pytest


@_tiny_pytest.fixture(scope="session")
def tiny_model_paths() -> dict[str, _TinyPath]:
    """The tiny random HF models of scripts/make_tiny_models.py, made once into .cache/tiny_models."""
    repo = _TinyPath(__file__).resolve().parent.parent
    cache = _TinyPath(_tiny_os.environ.get("TOKENSPEED_TEST_CACHE", repo / ".cache"))
    spec = _tiny_importlib_util.spec_from_file_location("make_tiny_models", repo / "scripts" / "make_tiny_models.py")
    module = _tiny_importlib_util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_all(cache / "tiny_models")
