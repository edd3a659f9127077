"""A plain install serves what a default deployment behind smg uses (issue 22).

A fresh venv gets `pip install torch==2.13.0` (the CPU build; a bare `torch` could pull a CUDA
build) and then `pip install <clean copy of the repo>` with no extras and normal build isolation,
as a stranger would. That venv's `tokenspeed-worker` serves SmolLM2-135M-Instruct behind the real
smg gateway (from the dev venv: smg is a test tool, not a dependency), and through the OpenAI HTTP
API: response_format json_schema, tool_choice "required" and a named function (the gateway turns
each into a constraint; without xgrammar the worker refuses them and the client gets HTTP 501),
plus the --enable-metrics endpoint (prometheus-client). Nothing is cached between runs: the native
extension is built and every dependency resolved from the package registry each time."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from test_gateway_e2e import post
from test_structured_output import WEATHER, chat_body, check_person, person_format
from worker_harness import CACHE, REPO, Gateway, free_port, smollm2_dir

INSTALL_TIMEOUT = 900  # seconds for each pip step


def _clean_env(venv: Path) -> dict[str, str]:
    """The environment a stranger's shell has: nothing of the dev venv or of the test setup."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TRITON_INTERPRET")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _source_copy(dest: Path) -> Path:
    """The repo as a clone has it (tracked and untracked-not-ignored files): no build/ folder of the
    dev venv's editable install is reused, and the fresh build leaves the checkout alone."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                         capture_output=True, check=True).stdout
    for rel in filter(None, out.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _pip(venv: Path, log, *args: str) -> float:
    start = time.monotonic()
    log.write(f"\n$ pip install {' '.join(args)}\n".encode())
    log.flush()
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", *args], stdout=log,
                       stderr=subprocess.STDOUT, env=_clean_env(venv), cwd=venv.parent, timeout=INSTALL_TIMEOUT)
    if r.returncode != 0:
        log.flush()
        tail = Path(log.name).read_text(errors="replace").strip().splitlines()[-3:]
        free = shutil.disk_usage(venv.parent).free / 2**30
        # The disk is named: a full disk (a session's leftovers in /tmp) once failed this as ENOSPC.
        pytest.fail(f"pip install {' '.join(args)} failed with {free:.1f} GiB free under {venv.parent}; see "
                    f"{log.name}; its last lines: {' | '.join(tail)}")
    return time.monotonic() - start


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


class PlainWorker:
    """The fresh venv's `tokenspeed-worker` console script, run outside the checkout in its own
    process group; stopped with SIGTERM like a supervisor would."""

    def __init__(self, venv: Path, model: Path, *extra: str, startup_timeout: float = 240.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = CACHE / "logs" / f"plain-worker-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        cmd = [str(venv / "bin" / "tokenspeed-worker"), str(model), "--host", "127.0.0.1",
               "--grpc-port", str(self.port), *extra]
        # Models are local folders; HF_HUB_OFFLINE keeps the test off the internet whatever happens.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=venv.parent,
                                     env=dict(_clean_env(venv), HF_HUB_OFFLINE="1"), start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while self.proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(grpc.RpcError):
                    r = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.2)
        code = self.stop()
        raise RuntimeError(f"worker not ready after {startup_timeout}s (exit code {code}):\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # leave nothing of it behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.smollm2
@pytest.mark.timeout(1500)
def test_plain_pip_install_serves_structured_output_and_tool_choice_behind_smg(capsys):
    t0 = time.monotonic()
    model = smollm2_dir()
    tmp = Path(tempfile.mkdtemp(prefix="tokenspeed-plain-install-"))
    log_path = CACHE / "logs" / f"plain-install-{tmp.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    worker = gateway = None
    try:
        with open(log_path, "wb") as log:
            src = _source_copy(tmp / "src")
            venv = tmp / "venv"
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
            times["venv"] = time.monotonic() - start
            times["pip install torch==2.13.0"] = _pip(venv, log, "torch==2.13.0")
            size_torch = _tree_bytes(venv)
            times["pip install . (no extras)"] = _pip(venv, log, str(src))
        size = _tree_bytes(venv)
        # What a plain install has: the base dependencies, not the ZMQ publisher's.
        probe = subprocess.run(
            [str(venv / "bin" / "python"), "-c",
             "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None "
             "for m in ('xgrammar', 'prometheus_client', 'zmq', 'msgpack', 'triton')}))"],
            capture_output=True, text=True, env=_clean_env(venv), cwd=tmp, check=True)
        present = json.loads(probe.stdout)
        assert present["xgrammar"] and present["prometheus_client"], present

        start = time.monotonic()
        metrics_port = free_port()
        worker = PlainWorker(venv, model, "--served-model-name", "smollm2", "--max-model-len", "2048",
                             "--enable-metrics", "--metrics-port", str(metrics_port))
        times["worker ready"] = time.monotonic() - start
        gateway = Gateway(model, [worker.address])

        start = time.monotonic()
        # (a) response_format json_schema: the answer is JSON matching the schema.
        r = post(gateway, "/v1/chat/completions", chat_body("A person as JSON.", response_format=person_format()))
        assert r["choices"][0]["finish_reason"] == "stop", r
        check_person(r["choices"][0]["message"]["content"])
        # (b) tool_choice "required" and (c) a named function: 200 with tool calls whose arguments parse.
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, max_tokens in (("required", 400), (named, 96)):
            r = post(gateway, "/v1/chat/completions", chat_body("What is the weather in Paris?", tools=[WEATHER],
                                                                tool_choice=choice, max_tokens=max_tokens))
            out = r["choices"][0]
            calls = out["message"].get("tool_calls") or []
            assert out["finish_reason"] == "tool_calls" and calls, (choice, out)
            for call in calls:
                assert call["function"]["name"] == "get_weather"
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
        # --enable-metrics works on a plain install.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as m:
            assert b"tokenspeed:" in m.read()
        times["requests"] = time.monotonic() - start
    except Exception:
        if worker is not None:
            print(worker.log())
        print(log_path.read_text(errors="replace")[-6000:] if log_path.exists() else "")
        raise
    finally:
        try:
            if gateway is not None:
                gateway.stop()
        finally:
            try:
                code = worker.stop() if worker is not None else 0
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, worker.log()
    assert not tmp.exists()
    times["total"] = time.monotonic() - t0
    with capsys.disabled():
        print(f"\nplain install: venv {size / 2**30:.2f} GiB ({(size - size_torch) / 2**30:.2f} GiB besides torch), "
              f"present {present}; " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
