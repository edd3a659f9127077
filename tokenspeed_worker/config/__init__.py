"""Worker configuration: from the command line to one validated tree of settings.

- `parameters.py`: the parameter table, `ServerArgs` (one field per flag, TokenSpeed's set);
  `values.py` the parsers of its typed values.
- `parsing.py`: the command line and its --config YAML into resolved `ServerArgs`
  (`parse_args`), and `check_supported`.
- `docs.py`: the generated tables of docs/parameters.md (`python -m tokenspeed_worker.config`).
- `engine.py`: `EngineConfig`, what an engine process runs with (model, cache, scheduler and
  parallel sections); `worker.py`: `WorkerConfig`, that and the server's section, built once
  from `ServerArgs` (`WorkerConfig.from_args`).

Only the standard library is imported (PyYAML only when --config is given, torch only to
resolve `--device auto`), so `tokenspeed-worker --help` stays fast.
"""

from tokenspeed_worker.config.docs import render_markdown
from tokenspeed_worker.config.engine import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_dtype,
)
from tokenspeed_worker.config.parameters import GROUPS, OPTIONS, OPTIONS_BY_DEST, PROG, Option, ServerArgs, Status
from tokenspeed_worker.config.parsing import (
    UnsupportedOptionError,
    build_parser,
    check_supported,
    load_config_file,
    parse_args,
    unsupported_settings,
)
from tokenspeed_worker.config.values import kv_events_enabled, kv_events_settings
from tokenspeed_worker.config.worker import ServerConfig, WorkerConfig

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "GROUPS",
    "ModelConfig",
    "OPTIONS",
    "OPTIONS_BY_DEST",
    "Option",
    "PROG",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerArgs",
    "ServerConfig",
    "SpeculativeConfig",
    "Status",
    "UnsupportedOptionError",
    "WorkerConfig",
    "build_parser",
    "check_supported",
    "kv_events_enabled",
    "kv_events_settings",
    "load_config_file",
    "parse_args",
    "render_markdown",
    "resolve_dtype",
    "unsupported_settings",
]
