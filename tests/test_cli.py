"""Command line and --config of tokenspeed-worker: parsing, validation, the not-supported-yet
table, `--help`, and docs/parameters.md kept in sync with `ServerArgs`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest

import tokenspeed_worker
from tokenspeed_worker import cli, config
from tokenspeed_worker.config import OPTIONS, OPTIONS_BY_DEST, ServerArgs, Status, WorkerConfig, parsing

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs" / "parameters.md"


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve `--device auto` as on a CPU-only machine, without importing torch."""
    monkeypatch.setattr(parsing, "_cuda_available", lambda: False)


def parse(*argv: str) -> ServerArgs:
    return config.parse_args(list(argv))


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The error line of a parse that must exit with status 2."""
    with pytest.raises(SystemExit) as exc_info:
        config.parse_args(list(argv))
    assert exc_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "worker.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


# --------------------------------------------------------------------------- model and port


def test_positional_model_and_model_flag_are_equivalent() -> None:
    assert parse("/models/a").model == "/models/a"
    assert parse("--model", "/models/a").model == "/models/a"
    assert parse("--model-path", "/models/a").model == "/models/a"
    assert parse("/models/a", "--model", "/models/a").model == "/models/a"


def test_positional_and_model_flag_that_differ_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = parse_error(capsys, "/models/a", "--model", "/models/b")
    assert "--model" in line and "differ" in line


def test_missing_model_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "a model is required" in parse_error(capsys, "--grpc-port", "50052")


def test_tokenizer_and_served_model_name_default_to_the_model_path() -> None:
    args = parse("/models/a")
    assert args.tokenizer == "/models/a"
    assert args.served_model_name == "/models/a"
    args = parse("/models/a", "--tokenizer", "/tok", "--served-model-name", "qwen")
    assert (args.tokenizer, args.served_model_name) == ("/tok", "qwen")


def test_port_is_an_alias_of_grpc_port() -> None:
    assert parse("/m").grpc_port == 50051
    assert parse("/m", "--port", "6000").grpc_port == 6000
    assert parse("/m", "--grpc-port", "6001").grpc_port == 6001


@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_invalid_port_names_the_flag(capsys: pytest.CaptureFixture[str], port: str) -> None:
    assert "argument --grpc-port/--port" in parse_error(capsys, "/m", "--port", port)


def test_host_defaults_to_loopback() -> None:
    assert parse("/m").host == "127.0.0.1"
    assert parse("/m", "--host", "0.0.0.0").host == "0.0.0.0"


# --------------------------------------------------------------------------- working flags


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("auto", "auto"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("float16", "float16"),
        ("half", "float16"),
        ("float32", "float32"),
        ("float", "float32"),
        ("BF16", "bfloat16"),
    ],
)
def test_dtype_aliases_resolve_to_torch_names(given: str, canonical: str) -> None:
    assert parse("/m", "--dtype", given).dtype == canonical


def test_bad_dtype_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = parse_error(capsys, "/m", "--dtype", "int8")
    assert line.startswith("tokenspeed-worker: error: argument --dtype:")
    assert "'int8'" in line


def test_working_flags_parse_into_server_args() -> None:
    args = parse(
        "/m",
        "--device", "cpu",
        "--max-model-len", "4096",
        "--max-num-seqs", "8",
        "--max-total-tokens", "65536",
        "--block-size", "32",
        "--chunked-prefill-size", "-1",
        "--max-prefill-tokens", "2048",
        "--load-format", "dummy",
        "--attention-backend", "torch",
        "--log-level", "DEBUG",
        "--gpu-memory-utilization", "0.5",
        "--seed", "7",
        "--schedule-conservativeness", "0.3",
    )  # fmt: skip
    assert args.device == "cpu"
    assert args.max_model_len == 4096
    assert args.max_num_seqs == 8
    assert args.max_total_tokens == 65536
    assert args.block_size == 32
    assert args.chunked_prefill_size == -1
    assert args.max_prefill_tokens == 2048
    assert args.load_format == "dummy"
    assert args.attention_backend == "torch"
    assert args.log_level == "debug"
    assert args.gpu_memory_utilization == 0.5
    assert args.seed == 7
    assert args.schedule_conservativeness == 0.3
    config.check_supported(args)


def test_defaults_match_the_documented_values() -> None:
    args = parse("/m")
    assert args.dtype == "auto"
    assert args.max_model_len is None  # the engine takes it from the model config
    assert args.max_num_seqs == 256
    assert args.max_total_tokens is None  # sized automatically
    assert args.block_size == 16
    assert args.chunked_prefill_size == 8192
    assert args.max_prefill_tokens == 8192
    assert args.load_format == "auto"
    assert args.log_level == "info"
    assert args.gpu_memory_utilization == 0.9
    assert args.schedule_conservativeness == 1.0
    assert args.enable_prefix_caching is True
    assert args.seed == 0


def test_aliases_from_peer_engines() -> None:
    assert parse("/m", "--context-length", "2048").max_model_len == 2048
    assert parse("/m", "--random-seed", "3").seed == 3
    assert parse("/m", "--tp-size", "2", "--device", "cpu").tensor_parallel_size == 2


def test_a_peer_engines_flag_without_a_namesake_says_what_to_type(capsys: pytest.CaptureFixture[str]) -> None:
    """A command brought over from vLLM or SGLang: argparse's one line, plus the flag to use instead."""
    with pytest.raises(SystemExit) as exc:
        parse("/m", "--mem-fraction-static", "0.85", "--disable-radix-cache", "--max-num-batched-tokens=8192")
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("tokenspeed-worker: error: unrecognized arguments: --mem-fraction-static 0.85")
    for hint in ("--mem-fraction-static: use --gpu-memory-utilization", "--disable-radix-cache: use "
                 "--no-enable-prefix-caching", "--max-num-batched-tokens: use --chunked-prefill-size"):
        assert hint in line
    with pytest.raises(SystemExit):
        parse("/m", "--max-running-requests", "64", "--page-size", "16")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--max-running-requests: use --max-num-seqs" in line and "--page-size: use --block-size" in line
    for flag, hint in parsing.PEER_FLAG_HINTS.items():  # every flag named as the thing to use exists
        named = [w for w in hint.replace("(", " ").split() if w.startswith("--")]
        assert named and all(w in all_parser_flags() for w in named), (flag, hint)
    with pytest.raises(SystemExit):
        parse("/m", "--bogus")
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("unrecognized arguments: --bogus")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size", "-4"], "--block-size"),
        (["--max-model-len", "x"], "--max-model-len"),
        (["--max-model-len", "1"], "--max-model-len"),  # the engine needs a prompt token and an output token
        (["--max-total-tokens", "0"], "--max-total-tokens"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
        (["--max-prefill-tokens", "0"], "--max-prefill-tokens"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--log-level", "loud"], "--log-level"),
        (["--device", "tpu"], "--device"),
        (["--load-format", "gguf"], "--load-format"),
        (["--seed", "-1"], "--seed"),
        (["--schedule-conservativeness", "-0.5"], "--schedule-conservativeness"),
        (["--schedule-conservativeness", "lots"], "--schedule-conservativeness"),
    ],
)
def test_invalid_values_name_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    line = parse_error(capsys, "/m", *argv)
    assert line.startswith("tokenspeed-worker: error: argument " + flag)


def test_device_auto_resolves_to_cpu_without_cuda() -> None:
    assert parse("/m").device == "cpu"


def test_device_auto_resolves_to_cuda_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parsing, "_cuda_available", lambda: True)
    assert parse("/m").device == "cuda"


def test_device_cuda_without_cuda_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--device" in parse_error(capsys, "/m", "--device", "cuda")


def test_attention_backend_defaults_to_torch() -> None:
    assert parse("/m").attention_backend == "torch"


@pytest.mark.parametrize(("flag", "value"), [("--load-format", "pt"), ("--load-format", "npcache"),
                                             ("--load-format", "extensible"), ("--attention-backend", "fa3"),
                                             ("--attention-backend", "trtllm")])  # fmt: skip
def test_parsed_but_unimplemented_values_are_rejected(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    stderr = run_main_expecting_exit(capsys, "/m", flag, value)
    assert len(stderr) == 1
    assert stderr[0].startswith(f"tokenspeed-worker: error: {flag} {value} is not supported yet (supported: ")


# --------------------------------------------------------------------------- --config


def test_config_file_with_command_line_override(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
        model: /models/from-file
        port: 6000
        dtype: bf16
        max_num_seqs: 128
        max-model-len: 1024
        enable-prefix-caching: false
        host: 0.0.0.0
        """,
    )
    args = parse("--config", path, "--max-num-seqs", "64", "--grpc-port", "7000")
    assert args.model == "/models/from-file"
    assert args.max_num_seqs == 64  # command line wins
    assert args.grpc_port == 7000  # command line wins, through the other alias
    assert args.dtype == "bfloat16"  # validated and normalised like the flag
    assert args.max_model_len == 1024
    assert args.enable_prefix_caching is False
    assert args.host == "0.0.0.0"
    assert args.config == path
    config.check_supported(args)


def test_positional_model_wins_over_config_model(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "model: /models/from-file\n")
    assert parse("/models/cli", "--config", path).model == "/models/cli"
    assert parse("--config", path, "--model", "/models/cli").model == "/models/cli"


def test_config_lists_and_mappings(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
        model: /m
        cudagraph-capture-sizes: [1, 2, 4]
        hf_overrides: {}
        speculative-config: {method: ngram, num_speculative_tokens: 4}
        """,
    )
    args = parse("--config", path)
    assert args.cudagraph_capture_sizes == [1, 2, 4]
    assert args.hf_overrides == "{}"
    assert args.speculative_algorithm == "NGRAM" and args.speculative_num_steps == 4


def test_config_false_for_a_plain_flag_keeps_it_off(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "model: /m\nenforce_eager: false\n")
    assert parse("--config", path).enforce_eager is False


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("model: /m\nmax-seqs: 3\n", "unknown key 'max-seqs'"),
        ("model: /m\nenforce-eager: 1\n", "'enforce-eager' must be a YAML boolean"),
        ("model: /m\ncudagraph-capture-sizes: 4\n", "'cudagraph-capture-sizes' must be a non-empty YAML list"),
        ("model: /m\nmax-num-seqs: true\n", "'max-num-seqs' takes a int"),
        # a YAML list or mapping only for the options whose value is JSON text
        ("model: /m\nserved-model-name: [a, b]\n", "'served-model-name' takes a plain string, got the YAML list"),
        ("model: /m\nhost: [127.0.0.1]\n", "'host' takes a plain string, got the YAML list"),
        ("model: /m\napi-key: {a: 1}\n", "'api-key' takes a plain string, got the YAML dict"),
        ("model: /m\nmax-num-seqs: [3]\n", "'max-num-seqs' takes a int, got the YAML list"),
        ("model: /m\ndtype: int8\n", "argument --dtype: invalid choice: 'int8'"),
        ("model: /m\nport: 1\ngrpc_port: 2\n", "sets --grpc-port a second time"),
        ("model: /m\nmax-num-seqs: 3\nmax-num-seqs: 4\n", "key 'max-num-seqs' is given twice (line 3)"),
        ("model: /m\nconfig: other.yaml\n", "cannot name another config file"),
        ("- model\n", "expected a mapping"),
        ("model: [unclosed\n", "invalid YAML"),
    ],
)
def test_bad_config_files_are_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body: str, expected: str
) -> None:
    path = write_yaml(tmp_path, body)
    line = parse_error(capsys, "--config", path)
    assert line.startswith(f"tokenspeed-worker: error: --config {path}")
    assert expected in line


def test_missing_config_file_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "cannot read" in parse_error(capsys, "--config", str(tmp_path / "missing.yaml"))


def test_unsupported_value_from_config_is_rejected(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "model: /m\nworld-size: 2\n")
    stderr = run_main_expecting_exit(capsys, "--config", path)
    assert stderr == ["tokenspeed-worker: error: --world-size is not supported yet"]


# --------------------------------------------------------------------------- the not-supported table


def run_main_expecting_exit(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """stderr lines of `cli.main` that must exit with status 2 before serving."""
    with pytest.raises(SystemExit) as exc_info:
        cli.main(list(argv))
    assert exc_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def non_default_argv(option: config.Option) -> list[str] | None:
    """Command-line tokens giving `option` a value that is neither its default nor harmless."""
    default, spec = option.default, option.spec
    if option.kind is bool:
        value = not default
        if value in spec.harmless:
            return None
        return [option.flag] if value else ["--no-" + option.flag[2:]]
    candidates: list[Any]
    if spec.choices:
        candidates = list(spec.choices)
    elif option.kind is int or (option.kind is list and option.item_parse is not str):
        candidates = [2, 3, 4096] if default is None else [default + 1]
    elif option.kind is float:
        candidates = [0.5, 1.5]
    else:
        candidates = ["x.json", "debug"]
    for value in candidates:
        try:
            option.item_parse(str(value))
        except argparse.ArgumentTypeError:
            continue  # not a valid value of this flag at all
        if value != default and value not in spec.harmless:
            return [option.flag, str(value)]
    return None


NOT_SUPPORTED = [o for o in OPTIONS if o.spec.status is not Status.SUPPORTED]


def test_table_has_the_reference_parameters() -> None:
    assert OPTIONS_BY_DEST["world_size"].spec.status is Status.NOT_YET
    for dest in ("speculative_config", "speculative_algorithm", "speculative_draft_model_path"):
        assert OPTIONS_BY_DEST[dest].spec.status is Status.SUPPORTED
    for dest in ("chat_template", "reasoning_parser", "tool_call_parser"):
        assert OPTIONS_BY_DEST[dest].spec.status is Status.GATEWAY
    assert OPTIONS_BY_DEST["quantization"].spec.status is Status.SUPPORTED
    assert OPTIONS_BY_DEST["gpu_memory_utilization"].spec.status is Status.SUPPORTED
    for dest in ("enable_metrics", "metrics_reporters", "metrics_port", "metrics_host", "enable_log_requests",
                 "log_requests_level", "enable_log_request_stats"):
        assert OPTIONS_BY_DEST[dest].spec.status is Status.SUPPORTED
    assert OPTIONS_BY_DEST["kv_events_config"].spec.status is Status.SUPPORTED


# Flags for which every value is accepted (turning off what we don't do is harmless) have no
# refusing value; they are covered by test_unsupported_flag_given_its_default_is_accepted.
REFUSABLE = [o for o in NOT_SUPPORTED if non_default_argv(o) is not None]


@pytest.mark.parametrize("option", REFUSABLE, ids=lambda o: o.flag)
def test_unsupported_flag_with_non_default_value_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], option: config.Option
) -> None:
    argv = non_default_argv(option)
    stderr = run_main_expecting_exit(capsys, "/m", *argv)
    if option.spec.status is Status.GATEWAY:
        expected = f"tokenspeed-worker: error: {option.flag} is not supported: handled by the smg gateway"
        assert len(stderr) == 1 and stderr[0].startswith(expected)
    else:
        assert stderr == [f"tokenspeed-worker: error: {option.flag} is not supported yet"]


@pytest.mark.parametrize("option", NOT_SUPPORTED, ids=lambda o: o.flag)
def test_unsupported_flag_given_its_default_is_accepted(option: config.Option) -> None:
    argv = ["/m"]
    if option.kind is bool:
        if option.default:
            argv.append(option.flag)
    elif option.default is not None:
        argv += [option.flag, *map(str, option.default if option.kind is list else [option.default])]
    config.check_supported(parse(*argv))


def test_turning_off_prefix_caching_is_accepted() -> None:
    args = parse("/m", "--no-enable-prefix-caching")
    assert args.enable_prefix_caching is False
    config.check_supported(args)


def test_several_unsupported_flags_are_reported_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    stderr = run_main_expecting_exit(capsys, "/m", "--decode-log-interval", "7", "--world-size", "2")
    assert stderr == [
        "tokenspeed-worker: error: --world-size is not supported yet; "
        "--decode-log-interval is not supported yet"
    ]


def test_every_dataclass_field_is_in_the_table() -> None:
    import dataclasses

    assert [f.name for f in dataclasses.fields(ServerArgs)] == [o.dest for o in OPTIONS]


# --------------------------------------------------------------------------- main


def test_defaults_start_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[ServerArgs] = []

    def run_server(args: ServerArgs, launched: float | None = None) -> int:
        received.append(args)
        return 0

    fake = types.ModuleType("tokenspeed_worker.server.launch")
    fake.run_server = run_server  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tokenspeed_worker.server.launch", fake)
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["/m", "--seed", "5"])
    assert exc_info.value.code == 0
    assert len(received) == 1 and received[0].model == "/m" and received[0].seed == 5


def test_run_server_exit_code_is_the_process_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tokenspeed_worker.server.launch")
    fake.run_server = lambda args, launched=None: 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tokenspeed_worker.server.launch", fake)
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["/m"])
    assert exc_info.value.code == 3


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenspeed_worker", *argv], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=subprocess_env(), timeout=30)


def test_help_is_fast_and_grouped_like_the_reference() -> None:
    start = time.monotonic()
    result = run_cli("--help")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 3.0
    positions = [result.stdout.index(f"\n{group}:\n") for group in config.GROUPS]
    assert positions == sorted(positions)
    assert "--grpc-port GRPC_PORT, --port GRPC_PORT" in result.stdout


def test_version_prints_the_package_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"tokenspeed-worker {tokenspeed_worker.__version__}"


def test_parsing_does_not_import_torch() -> None:
    code = (
        "import sys; from tokenspeed_worker import config; "
        "config.parse_args(['/m', '--device', 'cpu']); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=subprocess_env(), timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_server_process_does_not_import_torch() -> None:
    """The server (gRPC, the engine pipes, the model's facts and its architecture check) leaves torch
    to the engine processes: its import costs a second and more of every start, and memory."""
    code = "import sys; import tokenspeed_worker.server.launch; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=subprocess_env(), timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# --------------------------------------------------------------------------- docs


def all_parser_flags() -> set[str]:
    parser = config.build_parser()
    flags = {flag for action in parser._actions for flag in action.option_strings}
    return flags - {"-h", "--help", "--version"}


def test_docs_list_every_flag() -> None:
    docs = DOCS.read_text()
    missing = sorted(flag for flag in all_parser_flags() if f"`{flag}`" not in docs)
    assert not missing, f"docs/parameters.md does not list {missing}"


def test_docs_tables_match_server_args() -> None:
    docs = DOCS.read_text()
    begin, end = "<!-- BEGIN GENERATED PARAMETERS -->\n", "<!-- END GENERATED PARAMETERS -->"
    generated = docs[docs.index(begin) + len(begin) : docs.index(end)]
    assert generated == config.render_markdown(), (
        "docs/parameters.md is stale: regenerate its tables with `python -m tokenspeed_worker.config`"
    )


def test_every_flag_is_a_known_option() -> None:
    known = {flag for o in OPTIONS for flag in o.flags}
    known |= {"--no-" + o.flag[2:] for o in OPTIONS if o.kind is bool and o.spec.negatable}
    assert all_parser_flags() == known
    assert isinstance(config.build_parser(), argparse.ArgumentParser)


def test_triton_attention_needs_a_gpu(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = run_main_expecting_exit(capsys, "/m", "--device", "cpu", "--attention-backend", "triton")
    assert stderr[-1] == "tokenspeed-worker: error: argument --attention-backend: triton needs --device cuda"
    assert parse("/m", "--device", "cpu").attention_backend == "torch"
    monkeypatch.setattr(parsing, "_cuda_available", lambda: True)
    monkeypatch.setattr(parsing, "_triton_importable", lambda: True)
    assert parse("/m").attention_backend == "triton"  # the GPU default
    monkeypatch.setattr(parsing, "_triton_importable", lambda: False)
    assert parse("/m").attention_backend == "torch"


def test_flashinfer_attention_needs_a_gpu_and_the_package(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = run_main_expecting_exit(capsys, "/m", "--device", "cpu", "--attention-backend", "flashinfer")
    assert stderr[-1] == "tokenspeed-worker: error: argument --attention-backend: flashinfer needs --device cuda"
    monkeypatch.setattr(parsing, "_cuda_available", lambda: True)
    monkeypatch.setattr(parsing, "_flashinfer_importable", lambda: False)
    stderr = run_main_expecting_exit(capsys, "/m", "--attention-backend", "flashinfer")
    assert stderr[-1] == ("tokenspeed-worker: error: argument --attention-backend: flashinfer is not installed "
                          "(pip install flashinfer-python)")
    monkeypatch.setattr(parsing, "_flashinfer_importable", lambda: True)
    assert parse("/m", "--attention-backend", "flashinfer").attention_backend == "flashinfer"


def test_schedule_conservativeness_reaches_the_engine_config() -> None:
    args = parse("/m", "--device", "cpu", "--schedule-conservativeness", "0")
    assert WorkerConfig.from_args(args).engine.scheduler.schedule_conservativeness == 0.0
    assert WorkerConfig.from_args(parse("/m", "--device", "cpu")).engine.scheduler.schedule_conservativeness == 1.0


# --------------------------------------------------------------------------- first-contact findings (2026-12-07)


def test_config_values_are_taken_as_written(tmp_path: Path) -> None:
    # YAML 1.1 reads 0123 as the octal 83 and 1.10 as the float 1.1: a key or a name must stay as typed.
    path = write_yaml(tmp_path, """
        api-key: 0123
        served-model-name: 1.10
        max-num-seqs: 8
        cudagraph-capture-sizes: [1, 2, 010]
    """)
    args = parse("/m", "--config", path)
    assert args.api_key == "0123" and args.served_model_name == "1.10"
    assert args.max_num_seqs == 8 and args.cudagraph_capture_sizes == [1, 2, 10]


def test_a_config_file_that_is_not_utf8_names_itself(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "worker.yaml"
    path.write_bytes(b"max-num-seqs: \xff\n")
    assert f"--config {path}: not UTF-8 text" in parse_error(capsys, "/m", "--config", str(path))


def test_an_integer_past_int32_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = parse_error(capsys, "/m", "--max-num-seqs", "999999999999999999999999")
    assert line.endswith("argument --max-num-seqs: must be at most 2147483647 in size, got '999999999999999999999999'")


def test_piecewise_graphs_are_on_and_their_counts_are_refused_when_turned_off(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert parse("/m").enable_piecewise_cuda_graph
    assert not parse("/m", "--no-enable-piecewise-cuda-graph").enable_piecewise_cuda_graph
    assert parse("/m", "--piecewise-cuda-graph-max-tokens", "512").piecewise_cuda_graph_max_tokens == 512
    for flag, value in (("--piecewise-cuda-graph-tokens", "16"), ("--piecewise-cuda-graph-max-tokens", "512")):
        assert parse_error(capsys, "/m", "--no-enable-piecewise-cuda-graph", flag, value).endswith(
            f"argument {flag}: not used with --no-enable-piecewise-cuda-graph (piecewise CUDA graphs off)")
    line = parse_error(capsys, "/m", "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-tokens", "64", "128",
                       "--piecewise-cuda-graph-max-tokens", "32")
    assert line.endswith("none of 64, 128 is at most --piecewise-cuda-graph-max-tokens 32")
    args = parse("/m", "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-tokens", "16", "64")
    assert args.enable_piecewise_cuda_graph and args.piecewise_cuda_graph_tokens == [16, 64]


@pytest.mark.usefixtures("no_cuda")
def test_triton_sampling_on_cpu_is_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_error(capsys, "/m", "--sampling-backend", "triton").endswith(
        "argument --sampling-backend: triton needs --device cuda")


def test_speculative_config_leaves_a_flag_given_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("/m", "--speculative-num-steps", "5", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2}')
    assert args.speculative_algorithm == "NGRAM" and args.speculative_num_steps == 5
    assert parse("/m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'
                 ).speculative_num_steps == 2
    assert parse_error(capsys, "/m", "--speculative-config", '{"num_speculative_tokens": 2}').endswith(
        "argument --speculative-config: its model and num_speculative_tokens need a method (or --speculative-algorithm)")


def test_the_sglang_cuda_graph_bs_hint_names_the_size_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--cuda-graph-bs: use --cudagraph-capture-sizes" in parse_error(capsys, "/m", "--cuda-graph-bs", "1", "2")


def _eagle3_config(tmp_path: Path, draft: Path, *extra: str) -> WorkerConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}')
    return WorkerConfig.from_args(parse(str(model), "--device", "cpu", "--speculative-algorithm", "EAGLE3",
                                        "--speculative-draft-model-path", str(draft), *extra))


@pytest.mark.parametrize("case,error", [
    ("empty", "no config.json"),
    ("bad json", "config.json is not readable JSON"),
    ("not a head", "architectures ['LlamaForCausalLM'] is not an EAGLE-3 Llama head"),
    ("two layers", "2 layers; an EAGLE-3 head with more than one layer is not supported yet"),
    ("no weights", "no *.safetensors or *.bin weights"),
])
def test_an_eagle3_head_folder_is_checked_before_any_engine_starts(tmp_path: Path, case: str, error: str) -> None:
    draft = tmp_path / "draft"
    draft.mkdir()
    config_text = {"bad json": "{bad", "not a head": '{"architectures": ["LlamaForCausalLM"]}',
                   "two layers": '{"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 2}',
                   "no weights": '{"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}'}.get(case)
    if config_text is not None:
        (draft / "config.json").write_text(config_text)
    with pytest.raises(ValueError) as raised:
        _eagle3_config(tmp_path, draft)
    assert str(raised.value).startswith(f"--speculative-draft-model-path {draft}: ") and error in str(raised.value)


def test_eagle3_layers_and_tensor_parallelism_are_checked_before_any_engine_starts(tmp_path: Path) -> None:
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1}')
    (draft / "model.safetensors").write_bytes(b"")
    assert _eagle3_config(tmp_path, draft).engine.speculative.speculative_algorithm == "EAGLE3"
    with pytest.raises(ValueError, match=r"--eagle3-layers-to-capture: 0,1,9: the head fuses three of the model's 4 "
                                         r"layers \(indices 0..3\)"):
        _eagle3_config(tmp_path, draft, "--eagle3-layers-to-capture", "0,1,9")
    with pytest.raises(ValueError, match="--eagle3-layers-to-capture: 0,1: the head fuses three"):
        _eagle3_config(tmp_path, draft, "--eagle3-layers-to-capture", "0,1")
    with pytest.raises(ValueError, match="EAGLE3 with --tensor-parallel-size > 1 is not supported yet"):
        _eagle3_config(tmp_path, draft, "--tensor-parallel-size", "2")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_before_the_server_handles_signals_exits_0(sig: str) -> None:
    # The entry point's first lines: a supervisor's stop during parsing or the imports is a clean stop.
    code = ("import os, signal, time; from tokenspeed_worker import cli; cli.stop_cleanly_until_served(); "
            f"os.kill(os.getpid(), signal.{sig}); time.sleep(30)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
