"""A Hugging Face hub id as the model (`tokenspeed-worker org/name`, as vLLM and SGLang users type it):
served from the local hub cache an earlier download filled, never downloaded; an id not there, or
--revision with a local folder, is one clear startup error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenspeed_worker.config.hub_cache import hub_cache_dir, resolve_model_source
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import REPO, Worker, free_port, tiny_models

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def fill_cache(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, refs: tuple[str, ...] = ("main",)) -> Path:
    """The layout `huggingface-cli download` leaves: files in blobs/, linked from snapshots/<commit>/,
    refs/<name> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in source.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot_by_branch_tag_or_commit(tmp_path: Path) -> None:
    source = tiny_models()["llama-gqa-tied"]
    main = fill_cache(tmp_path, "org/model", source)
    tagged = fill_cache(tmp_path, "org/model", source, commit=OTHER, refs=("v2",))
    assert resolve_model_source("org/model", None, str(tmp_path), "model") == str(main)
    assert resolve_model_source("org/model", "main", str(tmp_path), "model") == str(main)
    assert resolve_model_source("org/model", "v2", str(tmp_path), "model") == str(tagged)
    assert resolve_model_source("org/model", OTHER, str(tmp_path), "model") == str(tagged)
    assert resolve_model_source(str(source), None, None, "model") == str(source)  # a folder is itself


@pytest.mark.parametrize("source, revision, words", [
    ("org/absent", None, ["'org/absent' is not a local folder", "'main'", "huggingface-cli download org/absent"]),
    ("org/model", "v9", ["revision 'v9'"]),
    ("not-an-id", None, ["'not-an-id' is not a local folder (nor a Hugging Face hub id"]),
    ("a/b/c", None, ["'a/b/c' is not a local folder (nor a Hugging Face hub id"]),
])
def test_what_cannot_be_served_names_the_flag_and_the_cache(tmp_path: Path, source: str, revision: str | None,
                                                             words: list[str]) -> None:
    fill_cache(tmp_path, "org/model", tiny_models()["llama-gqa-tied"])
    with pytest.raises(ValueError) as error:
        resolve_model_source(source, revision, str(tmp_path), "model")
    assert str(error.value).startswith("argument model: ")
    for word in words:
        assert word in str(error.value)


def test_revision_with_a_local_folder_is_an_error_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only apply to a Hugging Face hub id"):
        resolve_model_source(str(tiny_models()["llama-gqa-tied"]), "v2", None, "model")


def test_the_cache_folder_is_found_as_huggingface_hub_finds_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path("~/.cache/huggingface/hub").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == tmp_path / "hub"
    assert hub_cache_dir(str(tmp_path / "given")) == tmp_path / "given"


def test_the_cli_serves_a_hub_id_from_the_cache_under_that_name(tmp_path: Path) -> None:
    """The real CLI given `org/name` with HF_HUB_CACHE set: it serves the cached snapshot, GetModelInfo
    names the model by its id (the gateway's model name) and points at the snapshot, and it generates."""
    snapshot = fill_cache(tmp_path / "hub", "tiny-org/llama", tiny_models()["llama-gqa-tied"])
    worker = Worker("tiny-org/llama", "--max-model-len", "128", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    try:
        info = worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.served_model_name == "tiny-org/llama"
        assert info.model_path == str(snapshot) and info.tokenizer_path == str(snapshot)
        request = pb.GenerateRequest(request_id="hub", tokenized=pb.TokenizedInput(input_ids=[1, 5, 9]),
                                     sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=4, n=1))
        done = [r.complete for r in worker.stub.Generate(request, timeout=60) if r.HasField("complete")]
        assert len(done) == 1 and len(done[0].output_ids) == 4
    finally:
        worker.stop()


@pytest.mark.parametrize("argv, words", [
    (["tiny-org/absent"], ["tiny-org/absent", "is not in the Hugging Face hub cache at", "never downloads"]),
    (["tiny-org/llama", "--revision", "v9"], ["revision 'v9'"]),
    ([str(REPO / "scripts"), "--revision", "main"], ["is a local folder; --revision"]),
])
def test_the_cli_refuses_what_it_cannot_serve_with_one_line(tmp_path: Path, argv: list[str], words: list[str]) -> None:
    fill_cache(tmp_path / "hub", "tiny-org/llama", tiny_models()["llama-gqa-tied"])
    (error,) = refused(argv, HF_HUB_CACHE=str(tmp_path / "hub"))
    for word in words:
        assert word in error, error


def refused(argv: list[str], **env: str) -> list[str]:
    """The CLI given `argv` (stdin closed: nothing may wait on a question) exits 2 without a traceback;
    its ERROR lines."""
    run = subprocess.run([sys.executable, "-m", "tokenspeed_worker", *argv, "--grpc-port", str(free_port())],
                         cwd=REPO, env=dict(os.environ, **env), capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    output = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in output, output
    return [line for line in output.splitlines() if " ERROR " in line]


@pytest.mark.e2e
def test_the_gateway_serves_a_hub_id_under_its_name(tmp_path: Path) -> None:
    """Behind the real smg gateway, given the snapshot the worker reports (GetModelInfo's model_path),
    the model is listed and chatted with by its hub id."""
    import json
    import urllib.request

    from worker_harness import Gateway

    snapshot = fill_cache(tmp_path / "hub", "tiny-org/llama", tiny_models()["llama-gqa-tied"])
    worker = Worker("tiny-org/llama", "--max-model-len", "128", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    try:
        gateway = Gateway(snapshot, [worker.address])
        try:
            with urllib.request.urlopen(gateway.url + "/v1/models", timeout=30) as r:
                assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-org/llama"]
            body = {"model": "tiny-org/llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}
            request = urllib.request.Request(gateway.url + "/v1/chat/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as r:
                reply = json.loads(r.read())
            assert reply["model"] == "tiny-org/llama" and reply["usage"]["completion_tokens"] == 4
        finally:
            gateway.stop()
    finally:
        worker.stop()


def test_a_folder_with_custom_code_is_refused_by_its_architecture_at_once(tmp_path: Path) -> None:
    """A checkpoint that needs its own code (auto_map, a model type transformers does not know), with
    or without --trust-remote-code: one line naming the architecture and what is supported, before
    an engine starts, and never transformers' question on stdin whether to run that code."""
    import json

    source = tiny_models()["llama-gqa-tied"]
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="my_custom", architectures=["MyModelForCausalLM"],
                  auto_map={"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    for flags in ([], ["--trust-remote-code"]):
        (error,) = refused([str(tmp_path), *flags])  # the server's line: no engine was spawned to fail
        assert "model architecture ['MyModelForCausalLM'] is not supported; supported: " in error, error


def test_a_folder_without_weights_is_refused_before_the_engine_starts(tmp_path: Path) -> None:
    """A config without safetensors: exit 2 at once naming the folder (it was exit 1 from the engine
    process seconds later, a code supervisors restart on); the pickles it holds are named."""
    import shutil

    model = tmp_path / "noweights"
    shutil.copytree(tiny_models()["llama-gqa-tied"], model, ignore=shutil.ignore_patterns("*.safetensors*"))
    (model / "pytorch_model.bin").write_bytes(b"")
    (error,) = refused([str(model), "--device", "cpu"])
    assert f"no safetensors weights in {model} (pytorch_model.bin are PyTorch pickles" in error, error
    from tokenspeed_worker.model_executor.checkpoint_files import check_weights_present

    check_weights_present(model, "dummy")  # random weights need none
