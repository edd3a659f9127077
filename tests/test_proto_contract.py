"""The worker's wire contract equals the one the smg gateway was built against.

proto/*.proto is our copy of smg-grpc-proto's published definitions. These tests
compile both with grpc_tools.protoc into FileDescriptorSets and compare them
field by field (smg_grpc_proto's generated modules and ours both define
`smg.grpc.common.*`, so they cannot share one process's default descriptor
pool). They also check that the committed stubs in tokenspeed_worker/proto/
match proto/*.proto, and that they import on protobuf 6 and 7 and on the
oldest grpcio we support.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the package may not be pip-installed
    sys.path.insert(0, str(REPO_ROOT))

OUR_PROTO_DIR = REPO_ROOT / "proto"
CONTRACT_FILES = ("common.proto", "tokenspeed_scheduler.proto")
CACHE_DIR = REPO_ROOT / ".cache" / "test_proto_contract"

grpc_tools = pytest.importorskip("grpc_tools")
from grpc_tools import protoc  # noqa: E402


# ----------------------------------------------------------------- helpers


def published_proto_dir() -> Path:
    spec = importlib.util.find_spec("smg_grpc_proto")
    assert spec is not None and spec.submodule_search_locations, "smg-grpc-proto is not installed"
    proto_dir = Path(spec.submodule_search_locations[0]) / "proto"
    assert (proto_dir / "tokenspeed_scheduler.proto").is_file(), proto_dir
    return proto_dir


def compile_descriptor_set(proto_dir: Path, files: tuple[str, ...] = CONTRACT_FILES) -> descriptor_pb2.FileDescriptorSet:
    """protoc `files` (and everything they import) into a FileDescriptorSet."""
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *(str(proto_dir / f) for f in files),
        ]
        assert protoc.main(args) == 0, f"protoc failed on {proto_dir}"
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _to_tree(message: Message) -> dict[str, Any]:
    """A descriptor proto as nested dicts, with named children keyed by name.

    Declaration order does not matter on the wire, so every repeated child that
    has a `name` (messages, fields, enums, values, oneofs, services, methods)
    becomes a dict keyed by that name; a field's `oneof_index` (a position in
    the parent's `oneof_decl`) becomes the oneof's name. Source locations and
    comments are dropped. Everything else is compared as set.
    """
    tree: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.name == "source_code_info":
            continue
        if field.message_type is None:
            tree[field.name] = list(value) if field.is_repeated else value
        elif not field.is_repeated:
            tree[field.name] = _to_tree(value)
        elif "name" in field.message_type.fields_by_name:
            keyed: dict[str, Any] = {}
            for child in value:
                assert child.name not in keyed, f"duplicate {field.name} {child.name!r}"
                keyed[child.name] = _to_tree(child)
            tree[field.name] = keyed
        else:  # e.g. reserved ranges, extension ranges
            tree[field.name] = [_to_tree(child) for child in value]
    if isinstance(message, descriptor_pb2.DescriptorProto):
        oneof_names = [oneof.name for oneof in message.oneof_decl]
        for field_tree in tree.get("field", {}).values():
            if "oneof_index" in field_tree:
                field_tree["oneof"] = oneof_names[field_tree.pop("oneof_index")]
    return tree


def _diff(ours: Any, theirs: Any, path: str, theirs_label: str = "published") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        problems = []
        for key in sorted(set(ours) | set(theirs)):
            where = f"{path}.{key}" if path else key
            if key not in theirs:
                problems.append(f"{where}: only in ours ({ours[key]!r})")
            elif key not in ours:
                problems.append(f"{where}: missing from ours ({theirs_label} {theirs[key]!r})")
            else:
                problems.extend(_diff(ours[key], theirs[key], where, theirs_label))
        return problems
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        problems = []
        for index, (a, b) in enumerate(zip(ours, theirs)):
            problems.extend(_diff(a, b, f"{path}[{index}]", theirs_label))
        return problems
    return [] if ours == theirs else [f"{path}: ours {ours!r} != {theirs_label} {theirs!r}"]


def contract_differences(
    ours: descriptor_pb2.FileDescriptorSet, published: descriptor_pb2.FileDescriptorSet
) -> list[str]:
    """Every difference between two descriptor sets, one line each ([] if equal)."""
    as_tree = lambda fds: {f.name: _to_tree(f) for f in fds.file}  # noqa: E731
    return _diff(as_tree(ours), as_tree(published), "")


def _field(fds: descriptor_pb2.FileDescriptorSet, file: str, message: str, field: str):
    file_proto = next(f for f in fds.file if f.name == file)
    message_proto = next(m for m in file_proto.message_type if m.name == message)
    return next(f for f in message_proto.field if f.name == field)


@pytest.fixture(scope="module")
def published_set() -> descriptor_pb2.FileDescriptorSet:
    return compile_descriptor_set(published_proto_dir())


@pytest.fixture(scope="module")
def our_set() -> descriptor_pb2.FileDescriptorSet:
    return compile_descriptor_set(OUR_PROTO_DIR)


# ------------------------------------------------------- contract equality


def test_our_proto_matches_published_contract(our_set, published_set):
    differences = contract_differences(our_set, published_set)
    assert not differences, "proto/ drifted from smg-grpc-proto:\n" + "\n".join(differences)


def test_contract_covers_service_and_packages(our_set):
    files = {f.name: f for f in our_set.file}
    assert files["common.proto"].package == "smg.grpc.common"
    scheduler = files["tokenspeed_scheduler.proto"]
    assert scheduler.package == "tokenspeed.grpc.scheduler"
    assert list(scheduler.dependency) == ["google/protobuf/timestamp.proto", "google/protobuf/struct.proto", "common.proto"]
    (service,) = scheduler.service
    assert service.name == "TokenSpeedScheduler"
    streaming = {m.name for m in service.method if m.server_streaming}
    assert streaming == {"Generate", "GetTokenizer", "SubscribeKvEvents"}
    assert len(service.method) == 11
    assert not any(m.client_streaming for m in service.method)


def test_comparator_reports_a_changed_field_number(published_set):
    mutated = descriptor_pb2.FileDescriptorSet()
    mutated.CopyFrom(published_set)
    _field(mutated, "tokenspeed_scheduler.proto", "SamplingParams", "top_k").number = 99

    differences = contract_differences(mutated, published_set)

    assert differences == [
        "tokenspeed_scheduler.proto.message_type.SamplingParams.field.top_k.number: ours 99 != published 3"
    ]


@pytest.mark.parametrize(
    "mutate, expected_fragment",
    [
        (lambda s: setattr(_field(s, "common.proto", "KvBlock", "lora_id"), "proto3_optional", False), "proto3_optional"),
        (lambda s: _field(s, "tokenspeed_scheduler.proto", "GenerateComplete", "matched_stop_str").ClearField("oneof_index"), "matched_stop_str.oneof"),
        (lambda s: setattr(_field(s, "tokenspeed_scheduler.proto", "TokenizedInput", "input_ids"), "type", descriptor_pb2.FieldDescriptorProto.TYPE_UINT64), "input_ids.type"),
        (lambda s: setattr(next(f for f in s.file if f.name == "tokenspeed_scheduler.proto").service[0].method[1], "server_streaming", True), "method.HealthCheck.server_streaming"),
        (lambda s: setattr(next(f for f in s.file if f.name == "common.proto").enum_type[0].value[1], "number", 7), "enum_type.KvCacheTier.value.KV_CACHE_TIER_DEVICE.number"),
        (lambda s: next(f for f in s.file if f.name == "common.proto").message_type[1].field.add(name="extra", number=9, type=9, label=1), "GetTokenizerChunk.field.extra: only in ours"),
        (lambda s: setattr(_field(s, "tokenspeed_scheduler.proto", "GenerateRequest", "tokenized"), "type_name", ".tokenspeed.grpc.scheduler.SamplingParams"), "tokenized.type_name"),
    ],
    ids=["proto3_optional", "oneof", "type", "streaming", "enum_value", "extra_field", "type_name"],
)
def test_comparator_reports_other_changes(published_set, mutate, expected_fragment):
    mutated = descriptor_pb2.FileDescriptorSet()
    mutated.CopyFrom(published_set)
    mutate(mutated)

    differences = contract_differences(mutated, published_set)

    assert differences and any(expected_fragment in line for line in differences), differences


# ------------------------------------------------- committed stubs are fresh


def _clear_json_names(message: Message) -> None:
    for field, value in message.ListFields():
        if field.name == "json_name":
            message.ClearField("json_name")
        elif field.message_type is not None:
            for child in value if field.is_repeated else [value]:
                _clear_json_names(child)


def test_generated_stubs_embed_what_proto_compiles_to(our_set):
    from tokenspeed_worker.proto import common_pb2, tokenspeed_scheduler_pb2

    for module in (common_pb2, tokenspeed_scheduler_pb2):
        embedded = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        compiled = next(f for f in our_set.file if f.name == embedded.name)
        compiled.ClearField("source_code_info")
        _clear_json_names(compiled)  # protoc leaves the derivable json_name out of gencode
        differences = _diff(_to_tree(embedded), _to_tree(compiled), embedded.name, "proto/")
        assert not differences, "stale stubs, run scripts/gen_proto.py:\n" + "\n".join(differences)
        assert module.DESCRIPTOR.serialized_pb == compiled.SerializeToString()


def test_generated_stubs_are_portable():
    stub_dir = REPO_ROOT / "tokenspeed_worker" / "proto"
    for path in sorted(stub_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        assert "ValidateProtobufRuntimeVersion" not in text, path.name
        assert "GRPC_GENERATED_VERSION" not in text, path.name
        for line in text.splitlines():
            assert not (line.startswith("import ") and "_pb2" in line), f"{path.name}: {line}"


# ---------------------------------------------- stubs import on each runtime

_IMPORT_PROBE = r"""
import sys
import google.protobuf, grpc
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb, tokenspeed_scheduler_pb2_grpc as pb_grpc
from tokenspeed_worker.proto import common_pb2, common_pb2_grpc

request = pb.GenerateRequest(request_id="chatcmpl-1", stream=True)
request.tokenized.input_ids.extend([1, 2, 3])
request.sampling_params.temperature = 0.0
request.sampling_params.stop.append("\n")
assert pb.GenerateRequest.FromString(request.SerializeToString()) == request
assert request.sampling_params.HasField("temperature")
assert not request.sampling_params.HasField("top_p")
chunk = common_pb2.GetTokenizerChunk(data=b"zip", sha256="ab")
assert common_pb2.GetTokenizerChunk.FromString(chunk.SerializeToString()).sha256 == "ab"
assert hasattr(pb_grpc, "add_TokenSpeedSchedulerServicer_to_server")
assert pb_grpc.TokenSpeedSchedulerStub(grpc.insecure_channel("localhost:1")).Generate is not None
print(google.protobuf.__version__, grpc.__version__)
"""


def _pip_target(name: str, requirement: str) -> Path:
    """`pip install --target` once into .cache/, reused by later runs."""
    target = CACHE_DIR / name
    if (target / ".complete").exists():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    staging = CACHE_DIR / f".{name}.{uuid.uuid4().hex}"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "--target", str(staging), requirement],
        check=True,
        timeout=300,
    )
    (staging / ".complete").write_text(requirement + "\n")
    try:
        staging.rename(target)
    except OSError:  # a concurrent run won the race; use its copy
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _run_probe(extra_paths: list[Path]) -> tuple[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_paths), str(REPO_ROOT)])
    env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    protobuf_version, grpc_version = result.stdout.split()
    return protobuf_version, grpc_version


@pytest.mark.slow
def test_stubs_import_on_protobuf_6():
    protobuf6 = _pip_target("protobuf6", "protobuf>=6.31,<7")

    protobuf_version, _ = _run_probe([protobuf6])

    assert protobuf_version.startswith("6."), protobuf_version


@pytest.mark.slow
def test_stubs_import_on_oldest_supported_grpcio_and_protobuf_6():
    protobuf6 = _pip_target("protobuf6", "protobuf>=6.31,<7")
    grpcio166 = _pip_target("grpcio166", "grpcio==1.66.*")

    protobuf_version, grpc_version = _run_probe([protobuf6, grpcio166])

    assert protobuf_version.startswith("6."), protobuf_version
    assert grpc_version.startswith("1.66."), grpc_version


def test_stubs_import_on_installed_protobuf_in_process():
    import google.protobuf
    import grpc

    namespace: dict[str, Any] = {}
    exec(_IMPORT_PROBE.replace("print(", "_printed = ("), namespace)  # same checks, this process
    assert google.protobuf.__version__.split(".")[0] in {"6", "7"}
    assert namespace["pb"].DESCRIPTOR.package == "tokenspeed.grpc.scheduler"
    assert grpc.__version__
