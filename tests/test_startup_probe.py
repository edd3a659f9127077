"""scripts/startup_probe.py on the CPU machine: each step of an engine process's first seconds timed
in fresh processes, both modes, and its summary line (the GPU machine adds the driver's steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_probe_times_each_step_in_fresh_processes(tmp_path, tiny_model_paths):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, "scripts/startup_probe.py", "--model", str(tiny_model_paths["llama-gqa-tied"]),
                    "--repeats", "1", "--out", str(out)], cwd=REPO, check=True, capture_output=True, timeout=600)  # 300 s ran out in a GPU suite at -n 14
    result = json.loads(out.read_text())
    for mode in ("sequential", "driver_beside_torch_import"):
        (run,) = result["runs"][mode]
        assert {"import_torch_s", "import_transformers_s", "autoconfig_from_pretrained_s", "interpreter_s",
                "total_in_process_s", "wall_s"} <= set(run)
        assert all(v >= 0 for v in run.values()) and run["wall_s"] >= run["total_in_process_s"]
    for variant in ("as_is", "hf_hub_offline"):  # AutoConfig under cProfile: its seconds and where they went
        profiled = result["autoconfig_profile"][variant]
        # The 25 rows of largest cumulative time. Not necessarily from_pretrained's own: where Python
        # compiles every module (the GPU machine), torch's recursive registration wrappers count more.
        assert profiled["autoconfig_from_pretrained_s"] > 0 and len(profiled["top_cumulative"]) >= 25
        assert any("cumtime" in x for x in profiled["top_cumulative"])
    line = subprocess.run([sys.executable, "scripts/bench_summary.py", "--line", "startup", str(out), "probe"],
                          cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert "sequential import_torch_s" in line and "driver_beside_torch_import autoconfig_from_pretrained_s" in line


def test_the_startup_bench_starts_cold_then_warm_from_one_cache_folder(tmp_path, tiny_model_paths):
    """scripts/bench_startup.py through the real CLI: an empty --cache-dir, then the same again (twice: the
    warm figure is their median); each start healthy, then serving its first request, with the worker's own
    phase line."""
    out = tmp_path / "startup.json"
    subprocess.run([sys.executable, "scripts/bench_startup.py", "--model", str(tiny_model_paths["llama-gqa-tied"]),
                    "--warm-repeats", "2", "--out", str(out)], cwd=REPO, check=True, capture_output=True,
                   timeout=600)  # 300 s ran out in a GPU suite at -n 14
    runs = json.loads(out.read_text())["models"]["llama-gqa-tied"]
    assert list(runs) == ["cold", "warm"]
    assert len(runs["warm"]["healthy_s_all"]) == 2 and runs["warm"]["healthy_s"] in runs["warm"]["healthy_s_all"]
    for run in runs.values():
        assert run["healthy_s"] > 0 and run["first_request_tokens"] == 16
        assert run["worker_ready_s"] is not None and "weight load" in run["phases"]
    line = subprocess.run([sys.executable, "scripts/bench_summary.py", "--line", "startup", str(out), "start"],
                          cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert "llama-gqa-tied cold" in line and "llama-gqa-tied warm" in line
