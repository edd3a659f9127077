"""--cache-dir: where it points, the timed-choices file (atomic, merged, unreadable = start over), and
the small-batch chooser taking a stored choice only where it still applies (untimed)."""

from __future__ import annotations

import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from tokenspeed_worker import kernel_cache
from tokenspeed_worker.config import parse_args
from tokenspeed_worker.config.worker import WorkerConfig
from tokenspeed_worker.layers import small_batch_gemv
from tokenspeed_worker.layers.small_batch_gemv import UNFUSED, SmallBatchGemv


def test_the_cache_dir_defaults_under_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.resolve_cache_dir(None) == str(tmp_path / "xdg" / "tokenspeed-worker")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.resolve_cache_dir(None) == str(tmp_path / "home" / ".cache" / "tokenspeed-worker")
    assert kernel_cache.resolve_cache_dir("~/kc") == str(tmp_path / "home" / "kc")
    assert kernel_cache.resolve_cache_dir("None") is None


def test_the_cli_flag_reaches_the_engine_config(tmp_path, tiny_model_paths):
    model = str(tiny_model_paths["llama-gqa-tied"])
    cfg = WorkerConfig.from_args(parse_args([model, "--cache-dir", str(tmp_path / "c"), "--device", "cpu"]))
    assert cfg.engine.model.cache_dir == str(tmp_path / "c")
    cfg = WorkerConfig.from_args(parse_args([model, "--cache-dir", "none", "--device", "cpu"]))
    assert cfg.engine.model.cache_dir is None


def test_a_cache_dir_that_cannot_be_written_becomes_a_temporary_one_with_a_warning(tmp_path, caplog,
                                                                                   tiny_model_paths):
    """A read-only file system or an unwritable home must not stop a start: the folder is replaced for
    this start by a temporary one (which Triton can compile into), and the warning names the flag."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder cannot be made under a file, whoever runs the test (root too)
    caplog.set_level(logging.WARNING, logger="tokenspeed_worker.kernel_cache")
    model = str(tiny_model_paths["llama-gqa-tied"])
    cfg = WorkerConfig.from_args(parse_args([model, "--cache-dir", str(blocked / "cache"), "--device", "cpu"]))
    fallback = cfg.engine.model.cache_dir
    assert fallback and Path(fallback).is_dir() and not fallback.startswith(str(blocked))
    assert "--cache-dir" in caplog.text and str(blocked / "cache") in caplog.text and fallback in caplog.text
    writable = tmp_path / "new" / "cache"
    assert kernel_cache.usable_cache_dir(str(writable)) == str(writable) and writable.is_dir()
    assert list(writable.iterdir()) == []  # the write test left nothing
    assert kernel_cache.usable_cache_dir(None) is None


def test_the_temporary_cache_dir_is_removed_when_the_process_exits(tmp_path):
    import subprocess

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    code = ("from tokenspeed_worker import kernel_cache; "
            f"print(kernel_cache.usable_cache_dir({str(blocked / 'cache')!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert folder.name.startswith("tokenspeed-worker-cache-") and not folder.exists()


def test_triton_keeps_its_kernels_in_the_cache_dir_unless_told_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert kernel_cache.use_triton_cache(None) is None
    assert kernel_cache.use_triton_cache(str(tmp_path)) == str(tmp_path / "triton")
    assert kernel_cache.use_triton_cache(str(tmp_path / "other")) == str(tmp_path / "triton")  # set once: kept
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert kernel_cache.use_triton_cache(str(tmp_path)) == "/elsewhere"


def test_choices_are_written_atomically_and_merged(tmp_path, caplog):
    path = tmp_path / "gpu-key" / kernel_cache.CHOICES_FILE
    assert kernel_cache.load_choices(path) == {}
    kernel_cache.save_choices(path, {"linear/1/4096/4096/bfloat16": "unfused"})
    kernel_cache.save_choices(path, {"linear/2/4096/4096/bfloat16": "Persistent(2, 4, 4)"})  # another worker
    assert kernel_cache.load_choices(path) == {"linear/1/4096/4096/bfloat16": "unfused",
                                               "linear/2/4096/4096/bfloat16": "Persistent(2, 4, 4)"}
    assert [p.name for p in path.parent.iterdir()] == [kernel_cache.CHOICES_FILE]  # no temporary left
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert kernel_cache.load_choices(path) == {}
    assert "timing them again" in caplog.text
    assert kernel_cache.choices_path(str(tmp_path), torch.device("cpu")) is None  # GPUs only
    assert kernel_cache.choices_path(None, torch.device("cuda", 0)) is None


def test_a_start_begins_with_the_shipped_choices_of_its_gpu_model_under_its_own(monkeypatch, tmp_path):
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(kernel_cache, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(kernel_cache, "gpu_key", lambda device: "Some_GPU-sm90")
    cuda = torch.device("cuda", 0)
    own = tmp_path / "cache" / kernel_cache.CHOICES_FILE
    assert kernel_cache.stored_choices(own, cuda) == {}  # neither exists
    (shipped / "Some_GPU-sm90").mkdir(parents=True)
    (shipped / "Some_GPU-sm90" / kernel_cache.CHOICES_FILE).write_text(json.dumps({"a/1": "unfused", "b/1": "X"}))
    (shipped / "Some_GPU-sm90" / kernel_cache.ATTENTION_FILE).write_text(json.dumps({"h/1": "256"}))
    assert kernel_cache.stored_choices(None, cuda) == {"a/1": "unfused", "b/1": "X"}  # also without a cache dir
    kernel_cache.save_choices(own, {"b/1": "Y", "c/1": "Z"})
    assert kernel_cache.stored_choices(own, cuda) == {"a/1": "unfused", "b/1": "Y", "c/1": "Z"}  # its own first
    assert kernel_cache.stored_choices(None, cuda, kernel_cache.ATTENTION_FILE) == {"h/1": "256"}
    assert kernel_cache.stored_choices(own, torch.device("cpu")) == kernel_cache.load_choices(own)  # off CUDA: none shipped


def test_the_package_ships_only_model_sized_choices_in_folders_named_by_gpu_model():
    """What scripts/ship_kernel_choices.py put in the package: each folder a GPU model's, each file one
    a start keeps, every key of a shape at least 1024 wide (no test model's)."""
    from worker_harness import _load_script

    model_sized = _load_script("ship_kernel_choices").model_sized
    folders = [p for p in kernel_cache.SHIPPED_DIR.iterdir() if p.is_dir()]
    for folder in folders:
        assert re.fullmatch(r"[A-Za-z0-9._+-]+-sm\d+", folder.name) and "driver" not in folder.name
        for path in folder.iterdir():
            assert path.name in (kernel_cache.CHOICES_FILE, kernel_cache.ATTENTION_FILE, kernel_cache.MOE_FILE)
            choices = kernel_cache.load_choices(path)
            assert choices
            for key in choices:
                assert model_sized(path.name, key, 1024), (path, key)


def test_the_ship_script_keeps_model_sized_keys_of_each_file():
    from worker_harness import _load_script

    model_sized = _load_script("ship_kernel_choices").model_sized
    assert model_sized(kernel_cache.CHOICES_FILE, "linear/1/4096/4096/bfloat16", 1024)
    assert not model_sized(kernel_cache.CHOICES_FILE, "linear/1/64/4096/bfloat16", 1024)
    assert model_sized(kernel_cache.ATTENTION_FILE, "32/8/128/torch.bfloat16/torch.bfloat16/16/8192/1", 1024)
    assert not model_sized(kernel_cache.ATTENTION_FILE, "4/2/16/torch.float32/torch.float32/16/256/1", 1024)
    assert model_sized(kernel_cache.MOE_FILE, "128/2048/768/bfloat16/4096", 1024)  # Qwen3-30B-A3B: narrow experts
    assert not model_sized(kernel_cache.MOE_FILE, "8/32/48/float32/64", 1024)
    assert not model_sized(kernel_cache.MOE_FILE, "not a key", 1024)


def test_the_ship_script_takes_the_gpu_runs_tar_of_device_key_folders(monkeypatch, tmp_path):
    """gpu_check.sh sends the cache folders back as one tar (a device key's `+` is not a name the
    device tool returns): the script unpacks it and ships each folder's model-sized entries under
    its GPU model's name."""
    import tarfile

    from worker_harness import _load_script

    ship = _load_script("ship_kernel_choices")
    key = "NVIDIA_H100_80GB_HBM3-sm90-driver580.159.04-cuda13.0-torch2.11.0+cu130-triton3.6.0-tsw0.1.0"
    cache = tmp_path / "cache"
    kernel_cache.save_choices(cache / key / kernel_cache.CHOICES_FILE,
                              {"linear/1/4096/4096/bfloat16": "gemv", "linear/1/64/32/float32": "unfused"})
    archive = tmp_path / "kernel_choices.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(cache / key / kernel_cache.CHOICES_FILE, arcname=f"./{key}/{kernel_cache.CHOICES_FILE}")
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(ship.kernel_cache, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(sys, "argv", ["ship_kernel_choices.py", str(archive)])
    ship.main()
    assert kernel_cache.load_choices(shipped / "NVIDIA_H100_80GB_HBM3-sm90" / kernel_cache.CHOICES_FILE) == {
        "linear/1/4096/4096/bfloat16": "gemv"}


def test_the_driver_version_is_read_from_the_kernel_module(monkeypatch, tmp_path):
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
                       "(dvs-builder@U22-I3-AF03-09-1)  Thu Oct  2 00:00:00 UTC 2025\nGCC version:  gcc 12\n")
    real = kernel_cache.Path
    monkeypatch.setattr(kernel_cache, "Path", lambda p: version if p == "/proc/driver/nvidia/version" else real(p))
    assert kernel_cache._driver_version() == "580.159.04"


class _Config:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


def _cuda_like(rows: int, hidden: int):
    """What _run reads of x (rows, shape, dtype, device index) as a CUDA tensor would give it."""
    return types.SimpleNamespace(shape=(rows, hidden), dtype=torch.bfloat16, is_cuda=True,
                                 device=types.SimpleNamespace(index=0), numel=lambda: rows * hidden)


def test_a_stored_choice_is_taken_untimed_where_it_still_applies(monkeypatch):
    """A site takes its stored configuration without timing if it is still offered and agrees with the
    unfused path; an unknown name, or a disagreeing output, is timed as on a first start."""
    monkeypatch.setattr(small_batch_gemv.torch.cuda, "is_current_stream_capturing", lambda: False)
    weight = torch.empty(64, 32, dtype=torch.bfloat16)
    configs = (_Config("A"), _Config("B"))
    reference = torch.ones(3)
    stored = {"linear/1/64/32/bfloat16": "B", "linear/2/64/32/bfloat16": "gone",
              "linear/3/64/32/bfloat16": "A", "linear/4/64/32/bfloat16": UNFUSED}
    chooser = SmallBatchGemv(stored)
    timed = []
    monkeypatch.setattr(chooser, "_choose", lambda key, *a, **k: timed.append(key[1]) or configs[0])

    def run(rows, outputs=None):
        def fused(config):
            return (outputs or {}).get(config.name, reference)
        return chooser._run("linear", _cuda_like(rows, 32), weight, None, fused, lambda: reference, configs)

    run(1)
    run(2)
    run(3, outputs={"A": torch.full((3,), 5.0)})  # now disagrees: refused, timed
    run(4)
    assert timed == [2, 3]
    assert chooser.reused == 2
    assert str(chooser.decisions[("linear", 1, 64, 32, "bfloat16", 0)]) == "B"
    assert chooser.decisions[("linear", 4, 64, 32, "bfloat16", 0)] == UNFUSED
    # what the next start gets: every decision, without the device index
    assert chooser.to_store() == {"linear/1/64/32/bfloat16": "B", "linear/2/64/32/bfloat16": "A",
                                  "linear/3/64/32/bfloat16": "A", "linear/4/64/32/bfloat16": UNFUSED}
    # stored choices are not refined in-step again: no site to tune at one row
    assert chooser.tune_in_step(1, lambda: pytest.fail("nothing to time")) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_second_start_takes_the_first_ones_choices_untimed(tmp_path, tiny_model_paths):
    """Two runners of one bf16 model with one cache dir: the first times its small-batch sites during
    graph capture and keeps them; the second takes every one of them without timing any."""
    from worker_harness import make_runner

    runners, attention = [], []
    for _ in range(2):
        runner = make_runner(str(tiny_model_paths["qwen2-bias"]), attention_backend="triton", dtype="bfloat16",
                             device="cuda", max_num_seqs=4, cache_dir=str(tmp_path))
        runner.allocate_kv_cache(64)
        attention.append((runner.tune_attention(), runner.attention_backend.tuning))
        runner.capture_cuda_graphs()
        runner.keep_kernel_choices()
        runners.append(runner.small_batch_gemv)
    first, second = runners
    # the decode attention's thresholds likewise: the second start times none of them
    assert attention[0][0] and attention[1] == (attention[0][0], {})
    assert first.decisions and first.timings and first.reused == 0
    # Every site the second start met took the first's choice untimed. It may meet fewer: the first's
    # in-step tuning tried the unfused path of a site it then kept fused, and that path's own
    # projection was timed then (a choice the second, taking the fused one, never needs).
    assert second.decisions and second.reused == len(second.decisions) and not second.timings, second.timings
    assert second.decisions.items() <= first.decisions.items()
    unmet = set(first.decisions) - set(second.decisions)
    assert all(key[0] == "linear" and key[1] in small_batch_gemv.IN_STEP_ROWS for key in unmet), unmet
    assert kernel_cache.load_choices(kernel_cache.choices_path(str(tmp_path), torch.device("cuda"))) == first.to_store()


def test_the_cli_serves_with_a_cache_dir_it_cannot_write(tmp_path, tiny_model_paths):
    from worker_harness import Worker

    from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    w = Worker(tiny_model_paths["llama-gqa-tied"], "--cache-dir", str(blocked / "cache"))
    try:
        request = pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                                     sampling_params=pb.SamplingParams(max_new_tokens=4, n=1, ignore_eos=True))
        (last,) = [r for r in w.stub.Generate(request, timeout=60) if r.HasField("complete")]
        assert len(last.complete.output_ids) == 4
        assert "cannot be written" in w.log()
    finally:
        assert w.stop() == 0
