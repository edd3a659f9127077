"""From the command line to resolved `ServerArgs`: the argparse parser, the --config YAML file,
the defaults that depend on other values or on the machine, and the support check.

Imports only the standard library (PyYAML only when --config is given; never torch, which the
server process does not need: the GPUs are counted through the CUDA driver, `_cuda_device_count`),
so `tokenspeed-worker --help` and the server's part of startup stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from collections.abc import Sequence
from typing import Any

from tokenspeed_worker import __version__
from tokenspeed_worker.config.parameters import (
    GROUP_DESCRIPTIONS,
    GROUPS,
    MODEL_LOADING,
    OPTIONS,
    OPTIONS_BY_DEST,
    PROG,
    Option,
    ServerArgs,
    Status,
)

class _ParseError(Exception):
    """A parser error raised instead of exiting (used while reading --config)."""


# Flags of vLLM and SGLang that have no flag of that name here but an equivalent: named in the
# "unrecognized arguments" error, so a command brought over from a peer says what to type instead.
PEER_FLAG_HINTS: dict[str, str] = {
    "--mem-fraction-static": "--gpu-memory-utilization",
    "--max-num-batched-tokens": "--chunked-prefill-size (the tokens one step may compute)",
    "--enable-chunked-prefill": "nothing: chunked prefill is on (--chunked-prefill-size sets its budget)",
    "--disable-radix-cache": "--no-enable-prefix-caching",
    "--disable-cuda-graph": "--enforce-eager",
    "--cuda-graph-max-bs": "--max-cudagraph-capture-size",
    "--disable-log-requests": "nothing: requests are not logged unless --enable-log-requests",
    "--max-running-requests": "--max-num-seqs",
    "--page-size": "--block-size",
    "--tokenizer-path": "--tokenizer",
    "--cuda-graph-bs": "--cudagraph-capture-sizes (the decode batch sizes captured)",
}


class _Parser(argparse.ArgumentParser):
    raise_errors = False

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            given = [word.split("=", 1)[0] for word in message.split(":", 1)[1].split()]
            hints = [f"{flag}: use {PEER_FLAG_HINTS[flag]}" for flag in given if flag in PEER_FLAG_HINTS]
            if hints:
                message += " (" + "; ".join(hints) + ")"
        if self.raise_errors:
            raise _ParseError(message)
        super().error(message)


def _help_text(option: Option) -> str:
    text = f"{option.spec.help} (default: {option.default_text()})"
    if option.spec.status is Status.NOT_YET:
        text += " [not supported yet]"
    elif option.spec.status is Status.GATEWAY:
        text += " [handled by the smg gateway]"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The worker's argument parser, grouped like TokenSpeed's parameter reference."""
    parser = _Parser(
        prog=PROG,
        usage="%(prog)s [model] [--grpc-port PORT] [--host HOST] [--config FILE.yaml] [options]",
        description="Serve one model over gRPC to the smg gateway.",
        epilog="Parameters marked [not supported yet] are accepted with their default value only; "
        "see docs/parameters.md.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    groups = {name: parser.add_argument_group(name, GROUP_DESCRIPTIONS.get(name)) for name in GROUPS}
    # Defaults are SUPPRESSed so the namespace holds only what was given; `parse_args`
    # layers the command line over --config over the dataclass defaults.
    groups[MODEL_LOADING].add_argument(
        "positional_model", nargs="?", metavar="model", default=argparse.SUPPRESS, help="Model path (same as --model)."
    )
    for option in OPTIONS:
        group = groups[option.spec.group]
        common: dict[str, Any] = dict(dest=option.dest, default=argparse.SUPPRESS, help=_help_text(option))
        if option.kind is bool:
            action = argparse.BooleanOptionalAction if option.spec.negatable else "store_true"
            group.add_argument(*option.flags, action=action, **common)
            continue
        if option.kind is list:
            common["nargs"] = "+"
        group.add_argument(
            *option.flags,
            type=option.item_parse,
            choices=option.spec.choices,
            metavar=option.spec.metavar,
            **common,
        )
    return parser


# --------------------------------------------------------------------------- --config


# The options whose value is JSON text: in a --config file they may be written as YAML mappings or
# lists. Any other option given one is refused (a list for --host would become '["..."]').
_JSON_OPTIONS = frozenset({"hf_overrides", "speculative_config", "kv_events_config",
                           "kvstore_storage_backend_extra_config"})


def _config_tokens(key: str, option: Option, value: Any, as_written: Any = None) -> list[str]:
    """Command-line tokens equivalent to one --config entry (so it is validated the same way):
    `value` as YAML typed it, `as_written` the same entry with every scalar as its text."""
    if option.kind is bool:
        if not isinstance(value, bool):
            raise _ParseError(f"key {key!r} must be a YAML boolean (true/false), got {value!r}")
        if value:
            return [option.flag]
        return ["--no-" + option.flag[2:]] if option.spec.negatable else []
    if isinstance(value, bool):
        raise _ParseError(f"key {key!r} takes a {option.kind.__name__}, got the boolean {value!r}")
    if option.kind is list:
        if not isinstance(value, list) or not value:
            raise _ParseError(f"key {key!r} must be a non-empty YAML list, got {value!r}")
        items = as_written if isinstance(as_written, list) and len(as_written) == len(value) else value
        return [option.flag, *(str(item) for item in items)]
    if isinstance(value, dict | list):
        if option.dest not in _JSON_OPTIONS:
            kind = "plain string" if option.kind is str else option.kind.__name__
            raise _ParseError(f"key {key!r} takes a {kind}, got the YAML {type(value).__name__} {value!r}")
        value = json.dumps(value)  # JSON-valued options may be written as YAML mappings
    elif isinstance(as_written, str):
        value = as_written
    return [f"{option.flag}={value}"]


def _config_keys() -> dict[str, Option]:
    keys: dict[str, Option] = {}
    for option in OPTIONS:
        for flag in option.flags:
            keys[flag[2:].replace("_", "-")] = option
    return keys


def load_config_file(path: str) -> dict[str, Any]:
    """Values of a --config YAML file, keyed by `ServerArgs` attribute, validated like flags.

    Raises `ValueError` naming the file and the offending key."""
    import yaml  # only needed when --config is used

    class UniqueKeys(yaml.SafeLoader):
        """safe_load, refusing a key written twice (YAML keeps the last in silence)."""

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1})", None)
            seen.add(key)
        return loader.construct_mapping(node, deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.load(text, Loader=UniqueKeys)
        # The same document with every scalar as the text written (YAML 1.1 would read `api-key: 0123`
        # as the octal 83 and `served-model-name: 1.10` as 1.1): values are taken as written and
        # parsed like the flag's own text; YAML's types decide only booleans, nulls and lists.
        raw_data = yaml.load(text, Loader=yaml.BaseLoader)
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: invalid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of parameter names to values")

    keys = _config_keys()
    parser = build_parser()
    assert isinstance(parser, _Parser)
    parser.raise_errors = True
    values: dict[str, Any] = {}
    raw_values = list(raw_data.values()) if isinstance(raw_data, dict) else [None] * len(data)
    for (raw_key, value), as_written in zip(data.items(), raw_values):
        key = str(raw_key).replace("_", "-")
        option = keys.get(key)
        try:
            if option is None:
                raise _ParseError(f"unknown key {raw_key!r}")
            if option.dest == "config":
                raise _ParseError("a config file cannot name another config file")
            if option.dest in values:
                raise _ParseError(f"key {raw_key!r} sets {option.flag} a second time")
            if value is None:  # `key: null` (or an empty value) keeps the default
                values[option.dest] = option.default
                continue
            namespace = parser.parse_args(_config_tokens(str(raw_key), option, value, as_written))
            values[option.dest] = getattr(namespace, option.dest, option.default)
        except _ParseError as exc:
            raise ValueError(f"--config {path}: {exc}") from None
    return values


# --------------------------------------------------------------------------- parse_args


def _torch_is_a_cuda_build() -> bool:
    """Whether the installed torch was built for CUDA, read from its version file (torch.version.cuda)
    without importing torch. True where the file cannot be read (the driver then decides)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return True
    found = re.search(r"^cuda\b[^=\n]*=\s*(\S+)", text, re.MULTILINE)
    return found is None or found.group(1) != "None"


def _cuda_device_count() -> int:
    """The CUDA devices torch will see in the engine processes (CUDA_VISIBLE_DEVICES applies), counted
    here without importing torch: 0 where torch is not a CUDA build, where the NVIDIA driver's
    library is missing, or where it finds no device. The server process needs nothing else of torch,
    whose import takes seconds (more on a fresh GPU machine), so it asks the driver itself, as
    torch.cuda.device_count() does underneath (cuInit, cuDeviceGetCount; no context is created).
    Written here because the library that wraps this (NVML's nvidia-ml-py) is not a dependency."""
    if not _torch_is_a_cuda_build():
        return 0
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _cuda_available() -> bool:
    return _cuda_device_count() > 0


_SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens")


def _resolve_speculative_config(args: ServerArgs) -> None:
    """--speculative-config's JSON into the flags it stands for (explicit flags win), as TokenSpeed
    reads it: method -> --speculative-algorithm, model -> --speculative-draft-model-path,
    num_speculative_tokens -> --speculative-num-steps."""
    try:
        config = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"argument --speculative-config: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError("argument --speculative-config: expected a JSON object")
    unknown = sorted(set(config) - set(_SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"argument --speculative-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(_SPECULATIVE_CONFIG_KEYS)})")
    if config.get("method") is not None and args.speculative_algorithm is None:
        method = str(config["method"]).upper()
        choices = OPTIONS_BY_DEST["speculative_algorithm"].spec.choices
        if method not in choices:
            raise ValueError(f"argument --speculative-config: method {config['method']!r} is not one of "
                             f"{', '.join(c.lower() for c in choices)}")
        args.speculative_algorithm = method
    if config.get("model") is not None and args.speculative_draft_model_path is None:
        args.speculative_draft_model_path = str(config["model"])
    if args.speculative_algorithm is None and any(config.get(k) is not None for k in ("model", "num_speculative_tokens")):
        raise ValueError("argument --speculative-config: its model and num_speculative_tokens need a method "
                         "(or --speculative-algorithm)")
    if config.get("num_speculative_tokens") is not None:
        count = config["num_speculative_tokens"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"argument --speculative-config: num_speculative_tokens must be a positive integer, "
                             f"got {count!r}")
        # The flag wins where it was set to other than its default (argparse does not say whether it was typed).
        if args.speculative_num_steps == OPTIONS_BY_DEST["speculative_num_steps"].default:
            args.speculative_num_steps = count


# The speculative flags and the algorithms that read them: one given (not at its default) without
# any of them would be ignored in silence (an operator who forgot --speculative-algorithm believes
# speculation is on), so it is refused, naming the flag.
_SPECULATIVE_FLAG_USERS = {
    "speculative_draft_model_path": ("EAGLE3",),
    "speculative_num_steps": ("NGRAM", "EAGLE3"),
    "speculative_num_draft_tokens": ("NGRAM", "EAGLE3"),
    "speculative_eagle_topk": ("EAGLE3",),
    "eagle3_layers_to_capture": ("EAGLE3",),
    "speculative_ngram_min_match_window_size": ("NGRAM",),
    "speculative_ngram_max_match_window_size": ("NGRAM",),
}


def _check_speculative_flags(args: ServerArgs) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    algorithm = args.speculative_algorithm
    for dest, users in _SPECULATIVE_FLAG_USERS.items():
        if getattr(args, dest) != defaults[dest] and algorithm not in users:
            flag = OPTIONS_BY_DEST[dest].flag
            now = "it is not set" if algorithm is None else f"not with {algorithm}"
            raise ValueError(f"argument {flag}: only used with --speculative-algorithm {' or '.join(users)}; {now}")


def _check_piecewise_flags(args: ServerArgs) -> None:
    """The piecewise graphs' counts are refused with --no-enable-piecewise-cuda-graph (they would be
    ignored in silence), and must leave at least one count."""
    given = [dest for dest in ("piecewise_cuda_graph_max_tokens", "piecewise_cuda_graph_tokens")
             if getattr(args, dest) != OPTIONS_BY_DEST[dest].default]
    if given and not args.enable_piecewise_cuda_graph:
        raise ValueError(f"argument {OPTIONS_BY_DEST[given[0]].flag}: not used with --no-enable-piecewise-cuda-graph "
                         "(piecewise CUDA graphs off)")
    tokens, limit = args.piecewise_cuda_graph_tokens, args.piecewise_cuda_graph_max_tokens
    if tokens is not None and not any(t <= limit for t in tokens):
        raise ValueError(f"argument --piecewise-cuda-graph-tokens: none of {', '.join(map(str, tokens))} is at most "
                         f"--piecewise-cuda-graph-max-tokens {limit}")


def _resolve(args: ServerArgs) -> None:
    """Fill the defaults that depend on other values or on the machine."""
    if args.speculative_config is not None:
        _resolve_speculative_config(args)
    _check_speculative_flags(args)
    _check_piecewise_flags(args)
    if args.eagle3_layers_to_capture is not None:
        try:
            [int(x) for x in args.eagle3_layers_to_capture.split(",")]
        except ValueError:
            raise ValueError(f"argument --eagle3-layers-to-capture: expected comma-separated layer indices, got "
                             f"{args.eagle3_layers_to_capture!r}") from None
    if args.tokenizer is None:
        args.tokenizer = args.model
    if args.served_model_name is None:
        args.served_model_name = args.model
    if args.device == "auto":
        args.device = "cuda" if _cuda_available() else "cpu"
    elif args.device == "cuda" and not _cuda_available():
        raise ValueError("argument --device: cuda was requested but no CUDA device is available")
    if args.attention_backend is None:
        # Triton kernels on a GPU (when triton imports); the torch reference backend on a CPU.
        args.attention_backend = "triton" if args.device == "cuda" and _triton_importable() else "torch"
    elif args.attention_backend in ("triton", "flashinfer") and args.device != "cuda":
        raise ValueError(f"argument --attention-backend: {args.attention_backend} needs --device cuda")
    elif args.attention_backend == "flashinfer" and not _flashinfer_importable():
        raise ValueError("argument --attention-backend: flashinfer is not installed (pip install flashinfer-python)")
    if args.sampling_backend == "triton" and args.device != "cuda":
        raise ValueError("argument --sampling-backend: triton needs --device cuda")
    if args.nnodes > 1:
        if args.tensor_parallel_size % args.nnodes:
            raise ValueError(f"argument --nnodes: --tensor-parallel-size {args.tensor_parallel_size} must be a "
                             f"multiple of --nnodes {args.nnodes}")
        if not args.dist_init_addr:
            raise ValueError("argument --dist-init-addr: required with --nnodes > 1 (host:port of node 0)")
    if args.node_rank >= args.nnodes:
        raise ValueError(f"argument --node-rank: {args.node_rank} must be below --nnodes {args.nnodes}")
    if args.dist_init_addr is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", args.dist_init_addr):
        raise ValueError(f"argument --dist-init-addr: expected host:port, got {args.dist_init_addr!r}")
    per_node = args.tensor_parallel_size // args.nnodes
    if args.device == "cuda" and per_node * args.data_parallel_size > 1:
        visible = _cuda_device_count()
        if visible < args.base_gpu_id + per_node * args.data_parallel_size:
            raise ValueError(f"argument --tensor-parallel-size: {per_node * args.data_parallel_size} ranks on this "
                             f"node from --base-gpu-id {args.base_gpu_id} need as many GPUs, {visible} visible")


def _flashinfer_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> ServerArgs:
    """Parse the command line (and its --config file) into resolved `ServerArgs`.

    Errors exit with status 2 and a message naming the flag, as argparse does. Values the
    worker does not implement are left in place: call `check_supported` to reject them."""
    parser = parser or build_parser()
    given = vars(parser.parse_args(argv))
    positional = given.pop("positional_model", None)

    from_file: dict[str, Any] = {}
    if given.get("config"):
        try:
            from_file = load_config_file(given["config"])
        except ValueError as exc:
            parser.error(str(exc))

    cli_model = given.pop("model", None)
    if positional is not None and cli_model is not None and positional != cli_model:
        parser.error(f"the positional model {positional!r} and --model {cli_model!r} differ; give only one")
    model = positional or cli_model or from_file.get("model")
    if not model:
        parser.error("a model is required: give it as the positional argument or with --model")

    values = {**from_file, **given, "model": model}
    args = ServerArgs(**values)
    try:
        _resolve(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


# --------------------------------------------------------------------------- support check


class UnsupportedOptionError(ValueError):
    """A parameter was given a value the worker does not implement."""


def unsupported_settings(args: ServerArgs) -> list[str]:
    """One message per parameter whose value the worker does not implement, in table order."""
    messages = [
        option.unsupported_message(getattr(args, option.dest))
        for option in OPTIONS
        if option.is_offending(getattr(args, option.dest))
    ]
    if args.data_parallel_size > 1 and args.kv_events_config:
        messages.append("--kv-events-config with --data-parallel-size > 1 is not supported yet "
                        "(one event stream per replica)")
    if args.data_parallel_size > 1 and args.nnodes > 1:
        messages.append("--data-parallel-size > 1 with --nnodes > 1 is not supported yet")
    tp = args.tensor_parallel_size
    for dest, value in (("attn_tp_size", args.attn_tp_size), ("dense_tp_size", args.dense_tp_size)):
        if value is not None and value != tp:
            flag = "--" + dest.replace("_", "-")
            messages.append(f"{flag} {value} differs from --tensor-parallel-size {tp}: not supported yet "
                            "(only one tensor-parallel size for attention and dense layers)")
    messages.extend(_expert_parallel_messages(args))
    return messages


def _expert_parallel_messages(args: ServerArgs) -> list[str]:
    """What is wrong with --enable-expert-parallel, --ep-size and --moe-tp-size against --tp."""
    tp, ep = args.tensor_parallel_size, args.expert_parallel_size
    if args.enable_expert_parallel and ep not in (1, tp):
        return [f"--enable-expert-parallel deals the experts over all {tp} tensor-parallel ranks, but --ep-size "
                f"is {ep}: give one of them (or --ep-size {tp})"]
    if ep > 1 and tp % ep:
        return [f"--ep-size {ep} must divide --tensor-parallel-size {tp} (the experts are dealt to groups of the "
                f"tensor-parallel ranks)"]
    ep = tp if args.enable_expert_parallel else ep
    if args.moe_tp_size is not None and args.moe_tp_size * ep != tp:
        return [f"--moe-tp-size {args.moe_tp_size} times the expert parallel size {ep} must equal "
                f"--tensor-parallel-size {tp} (try --moe-tp-size {tp // ep})"]
    return []


def check_supported(args: ServerArgs) -> None:
    """Raise `UnsupportedOptionError` (one line naming every offending flag) if any."""
    messages = unsupported_settings(args)
    if messages:
        raise UnsupportedOptionError("; ".join(messages))

