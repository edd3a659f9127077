"""Start a real `tokenspeed-worker` process (and the real smg gateway) for tests.

Nothing here is mocked: the worker runs as users run it, on a free loopback
port, and is stopped with SIGTERM like a supervisor would. Tests that drive a model
runner alone build it with `make_runner`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("TOKENSPEED_TEST_CACHE", REPO / ".cache"))


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_models() -> dict[str, Path]:
    return _load_script("make_tiny_models").make_all(CACHE / "tiny_models")


def smollm2_dir() -> Path:
    return Path(_load_script("prepare_smollm2").prepare())


def needs_devices(n: int) -> None:
    """Workers pick CUDA when it is there (one GPU per rank or replica): skip where there are fewer
    than n GPUs. On CPU the ranks share the machine (gloo), so nothing is skipped."""
    import pytest
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")


# A worker on a GPU sizes its KV pool to --gpu-memory-utilization of the whole card (0.9): a tiny
# model's pool would take ~70 GiB, and the GPU suite runs a dozen test processes on one card, so
# the next worker or graph capture beside it finds no memory left. A test that gives neither flag
# gets this fixed pool there instead (the CPU's automatic sizing is already a bounded share). Under
# pytest only: the benchmarks start their workers through this harness too, sized as users run them.
GPU_POOL_TOKENS = "65536"


def _bounded_pool(extra: tuple[str, ...]) -> tuple[str, ...]:
    if "PYTEST_CURRENT_TEST" not in os.environ or {"--max-total-tokens", "--gpu-memory-utilization"} & {
            a.split("=", 1)[0] for a in extra}:
        return extra
    import torch

    if not torch.cuda.is_available():
        return extra
    return (*extra, "--max-total-tokens", GPU_POOL_TOKENS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The engine's log lines (model_runner) that say decode sizes were left for after startup, and that
# they are all captured: Worker.wait_graphs_captured (test_cuda_graph_logic checks both are logged).
GRAPHS_LEFT_LINE = "while the engine idles or needs them"
GRAPHS_DONE_LINE = "decode batch sizes captured after startup"
# The piecewise graphs' token counts (prefill and mixed steps) likewise, all captured after startup.
PIECEWISE_LEFT_LINE = "captured while the engine idles or as steps need them"
PIECEWISE_DONE_LINE = "token counts captured after startup"
PIECEWISE_OFF_LINE = "piecewise CUDA graphs off:"  # a capture's check failed: none left to wait for


class Worker:
    """A worker subprocess; `stub` talks TokenSpeedScheduler to it.

    `new_session=True` starts it in its own session and process group (as a service manager or a
    terminal would), for `signal_group`; `stop` then also SIGKILLs whatever of the group is left."""

    def __init__(self, model: Path | str, *extra: str, startup_timeout: float = 240.0,
                 env: dict[str, str | None] | None = None, new_session: bool = False) -> None:
        self.new_session = new_session
        # free_port's port is free when picked, not when the worker binds it: another process (a
        # parallel test run) may take it between the two. A worker that could not bind starts again
        # on another port.
        for attempt in range(3):
            self._launch(model, extra, env)
            try:
                self._wait_ready(startup_timeout)
                return
            except RuntimeError as error:
                if attempt == 2 or "cannot listen on" not in str(error):
                    raise

    def _launch(self, model: Path | str, extra: tuple[str, ...], env: dict[str, str | None] | None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = CACHE / "logs" / f"worker-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "tokenspeed_worker", str(model), "--host", "127.0.0.1",
               "--grpc-port", str(self.port), *_bounded_pool(extra)]
        environment = {k: v for k, v in dict(os.environ, **(env or {})).items() if v is not None}  # None: unset
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=environment, start_new_session=self.new_session)
        # Reconnect within 0.1 s while the port is not yet bound: grpc's default backoff (1 s, growing) would
        # see the worker healthy up to seconds after it is (startup figures are read through this).
        self.channel = grpc.insecure_channel(self.address, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 200)])
        from tokenspeed_worker.proto import tokenspeed_scheduler_pb2_grpc as pb_grpc

        self.stub = pb_grpc.TokenSpeedSchedulerStub(self.channel)

    def _wait_ready(self, timeout: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        # SERVING alone may come from another test's worker that took the port first (tests run in
        # parallel; this worker binds only after its engine started, and then fails to): the
        # worker's own line for its port says the server answering is this one.
        own_line = f"(port {self.port}), ready"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING and own_line in self.log_path.read_text(errors="replace"):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"worker not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_graphs_captured(self, timeout: float = 300.0) -> float | None:
        """Wait until the engine has captured the graphs it left for after startup (a GPU start
        captures the few-row decode sizes first; the other decode sizes and the piecewise token
        counts while idle), so a benchmark times the steady state. The seconds waited, or None when
        the start left none (CPU, tensor parallelism)."""
        text = self.log_path.read_text(errors="replace")
        waits = [done for left, done in ((GRAPHS_LEFT_LINE, GRAPHS_DONE_LINE), (PIECEWISE_LEFT_LINE, PIECEWISE_DONE_LINE))
                 if left in text]
        if not waits:
            return None
        t0 = time.monotonic()
        for done in waits:
            while not any(line in self.log_path.read_text(errors="replace")
                          for line in (done, PIECEWISE_OFF_LINE if done == PIECEWISE_DONE_LINE else done)):
                if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"graphs not all captured after {time.monotonic() - t0:.0f} s:\n{self.log()}")
                time.sleep(0.2)
        return time.monotonic() - t0

    def signal_group(self, sig: int) -> None:
        """`kill -SIG -- -PGID`: the signal to every process of the worker's group (new_session=True)."""
        assert self.new_session, "signal_group needs Worker(..., new_session=True)"
        os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.new_session:  # leave nothing behind, whatever the test found
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


class Gateway:
    """The real smg gateway in front of one or more workers, on loopback."""

    def __init__(self, model_dir: Path, worker_addresses: list[str], startup_timeout: float = 90.0,
                 extra_args: list[str] | tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = CACHE / "logs" / f"gateway-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        smg = Path(sys.executable).with_name("smg")
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        cmd = [str(smg) if smg.exists() else "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *[f"grpc://{a}" for a in worker_addresses], "--model-path", str(model_dir),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
               "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1", *extra_args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/readiness", timeout=2) as r:
                    if r.status == 200:
                        return
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"gateway not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics(self) -> str:
        """The gateway's Prometheus exposition text."""
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


_HF_CACHE: dict[str, object] = {}


def hf_greedy(model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Hugging Face transformers' greedy continuation in float32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    model = _HF_CACHE[key]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=list(eos_ids) or None, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


# ---- process memory (fuzz and soak tests) ------------------------------------------


def make_runner(model_path: Path | str, *, attention_backend="torch", emulate_cuda_graphs: bool = False,
                **settings):
    """A ModelRunner of the model at `model_path`; `settings` are engine settings as
    `EngineConfig.build` takes them (dtype, device, block_size, max_num_seqs, ...).
    `attention_backend`: a backend name, or an instance to run instead (default: the torch
    reference). Unset, max_model_len is the model's max_position_embeddings."""
    import json

    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.model_executor.model_runner import ModelRunner

    backend = None
    if isinstance(attention_backend, str):
        settings["attention_backend"] = attention_backend
    else:
        backend = attention_backend
    if "device" in settings:
        settings["device"] = str(settings["device"])  # a torch.device names its string
    if "max_model_len" not in settings:
        config = Path(model_path) / "config.json"
        positions = json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
        if positions:
            settings["max_model_len"] = positions
    cfg = EngineConfig.build(str(model_path), **settings)
    graph_class = None
    if emulate_cuda_graphs:  # CPU tests of the graph path: replays re-run the captured step
        try:
            from emulated_graph import EmulatedGraph
        except ImportError:  # imported as tests.worker_harness (scripts)
            from tests.emulated_graph import EmulatedGraph

        graph_class = EmulatedGraph
    return ModelRunner(cfg, attention_backend=backend, graph_class=graph_class)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/PID/task/*/children, else a scan of /proc)."""
    kids: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            with contextlib.suppress(OSError):
                kids.extend(int(x) for x in (task / "children").read_text().split())
    except OSError:
        pass
    if kids:
        return sorted(set(kids))
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
    return sorted(kids)


def rss_kb(pid: int) -> int:
    """VmRSS of one process in kB (0 if it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def process_tree_rss_kb(pid: int) -> dict[int, int]:
    """VmRSS in kB of `pid` and every descendant (the worker: server + engine + helpers)."""
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out[p] = rss_kb(p)
        todo.extend(child_pids(p))
    return out


def wait_idle(worker: "Worker", timeout: float = 10.0):
    """Until the engine holds no request and no KV block; returns the last SchedulerLoad."""
    from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        load = worker.stub.GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=5).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"worker not idle after {timeout}s: {load}")
        time.sleep(0.1)
