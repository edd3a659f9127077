#!/usr/bin/env python3
"""Regenerate the Python gRPC stubs in tokenspeed_worker/proto/ from proto/*.proto.

The GPU machine has no grpcio-tools, so the generated files live in the tree and
this script is how they are refreshed (needs `grpcio-tools`). protoc's output
is post-processed so the stubs work wherever the worker runs:

- imports between our modules become package-relative
  (`from . import common_pb2 as common__pb2`), since `proto/` is not on sys.path;
- protoc pins the protobuf runtime to >= the protoc release it shipped with
  (`_runtime_version.ValidateProtobufRuntimeVersion`) and grpcio to >= the
  grpcio-tools release (`GRPC_GENERATED_VERSION`); the stubs only use APIs that
  protobuf 6.x and grpcio >= 1.66 have, and the GPU machine runs an older
  grpcio than CI's grpcio-tools, so both checks are removed.

tests/test_proto_contract.py checks that the result imports on protobuf 6 and
7 and that the embedded descriptors match proto/*.proto.

Usage: python scripts/gen_proto.py [--check]
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
OUT_DIR = REPO_ROOT / "tokenspeed_worker" / "proto"
PROTO_FILES = ("common.proto", "tokenspeed_scheduler.proto")
MODULES = ("common", "tokenspeed_scheduler")

_HEADER = "# Post-processed by scripts/gen_proto.py: regenerate, do not edit.\n"

# `_runtime_version.ValidateProtobufRuntimeVersion(\n ... \n)` and its import.
_RUNTIME_CHECK = re.compile(
    r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:[^\n]*\n)*?\)\n", re.M
)
_RUNTIME_IMPORT = re.compile(r"^from google\.protobuf import runtime_version as _runtime_version\n", re.M)
# From `GRPC_GENERATED_VERSION = ...` through the closing `)` of the raise.
_GRPC_CHECK = re.compile(
    r"^GRPC_GENERATED_VERSION = .*?\n\s*\+ f' or downgrade your generated code[^\n]*\n\s*\)\n",
    re.M | re.S,
)
_LOCAL_IMPORT = re.compile(r"^import (%s)_pb2 as (\w+)$" % "|".join(MODULES), re.M)


def _sub_exactly_once(pattern: re.Pattern[str], repl: str, text: str, what: str, name: str) -> str:
    new_text, count = pattern.subn(repl, text)
    if count != 1:
        raise RuntimeError(f"{name}: expected one {what}, found {count}; protoc's output changed?")
    return new_text


def post_process(name: str, text: str) -> str:
    """Make one protoc output file portable (see the module docstring)."""
    text = _LOCAL_IMPORT.sub(r"from . import \1_pb2 as \2", text)
    if name.endswith("_pb2.py"):
        text = _sub_exactly_once(_RUNTIME_IMPORT, "", text, "runtime_version import", name)
        text = _sub_exactly_once(_RUNTIME_CHECK, "", text, "protobuf runtime check", name)
    elif name.endswith("_pb2_grpc.py"):
        text = _sub_exactly_once(_GRPC_CHECK, "", text, "grpc version check", name)
    if re.search(r"^import \w+_pb2 ", text, re.M) and not name.endswith(".pyi"):
        raise RuntimeError(f"{name}: a top-level import of a generated module survived")
    if re.search(r"ValidateProtobufRuntimeVersion|GRPC_GENERATED_VERSION", text):
        raise RuntimeError(f"{name}: a version check survived post-processing")
    return _HEADER + text


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into a temp dir, post-process, write into out_dir."""
    from grpc_tools import protoc  # only needed here, not at run time

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_DIR / f) for f in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        written = []
        for module in MODULES:
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                name = module + suffix
                text = post_process(name, (Path(tmp) / name).read_text())
                target = out_dir / name
                target.write_text(text)
                written.append(target)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a temp dir and fail if tokenspeed_worker/proto/ differs",
    )
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT_DIR):
            print(path.relative_to(REPO_ROOT))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh in generate(Path(tmp)):
            current = OUT_DIR / fresh.name
            old = current.read_text() if current.exists() else ""
            if old != fresh.read_text():
                stale.append(current.name)
                sys.stdout.writelines(
                    difflib.unified_diff(
                        old.splitlines(True), fresh.read_text().splitlines(True), str(current), "regenerated", n=1
                    )
                )
        if stale:
            print(f"stale generated files: {', '.join(stale)}; run scripts/gen_proto.py", file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0


if __name__ == "__main__":
    sys.exit(main())
