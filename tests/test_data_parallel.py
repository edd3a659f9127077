"""Data-parallel replicas (`--data-parallel-size`): independent engines behind one gRPC port. New
requests spread over the replicas, `data_parallel_rank` pins one, GetLoads reports each, outputs
equal Hugging Face's on every replica, and a dead replica ends every request with a status."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from test_grpc_sampling import complete, gen
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import Worker, child_pids, hf_greedy, needs_devices, tiny_models

PROMPT = list(range(30, 94))  # 64 tokens: 4 full blocks of 16 to hit in the prefix cache


@pytest.fixture(scope="module", autouse=True)
def enough_devices():
    """The replicas pick CUDA when it is there (one GPU each)."""
    needs_devices(2)


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models()["llama-gqa-tied"]


@pytest.fixture(scope="module")
def worker(model_dir):
    # OMP_NUM_THREADS unset (scripts/test.sh sets it): the replicas share the cores themselves.
    w = Worker(model_dir, "--max-model-len", "1024", "--max-total-tokens", "8192", "--dp-size", "2",
               env={"OMP_NUM_THREADS": None})
    yield w
    assert w.stop() == 0, w.log()


def loads(worker, **kwargs):
    return worker.stub.GetLoads(pb.GetLoadsRequest(**kwargs), timeout=10)


def test_get_loads_reports_every_replica(worker):
    r = loads(worker, include=["all"])
    assert r.dp_rank_count == 2
    assert [x.dp_rank for x in r.loads] == [0, 1]
    assert all(x.max_total_num_tokens > 0 and x.HasField("memory") for x in r.loads)
    one = loads(worker, dp_rank=1)
    assert [x.dp_rank for x in one.loads] == [1]
    with pytest.raises(grpc.RpcError) as e:
        loads(worker, dp_rank=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in e.value.details()


def test_concurrent_requests_spread_over_both_replicas(worker, model_dir):
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(tuple(x.num_running_reqs + x.num_waiting_reqs for x in loads(worker).loads))
            time.sleep(0.05)

    results = {}

    def one(i: int) -> None:
        c, _ = complete(worker, gen([7 + i, 8, 9, 10], max_new_tokens=300))
        results[i] = list(c.output_ids)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    watcher.join()
    assert any(a > 0 and b > 0 for a, b in seen), seen  # both replicas worked at once
    assert max(max(a, b) for a, b in seen) <= 3  # and neither took all four
    for i, out in results.items():
        assert out == hf_greedy(model_dir, [7 + i, 8, 9, 10], 300)


def test_data_parallel_rank_pins_the_replica(worker, model_dir):
    # The same prompt three times on replica 1: its prefix cache hits, replica 0's never sees it.
    before = [x.cache_hit_rate for x in loads(worker).loads]
    for _ in range(3):
        req = gen(PROMPT, max_new_tokens=4)
        req.data_parallel_rank = 1
        c, _ = complete(worker, req)
        assert list(c.output_ids) == hf_greedy(model_dir, PROMPT, 4)
    after = [x.cache_hit_rate for x in loads(worker).loads]
    assert after[1] > before[1] and after[0] == before[0], (before, after)
    bad = gen(PROMPT, max_new_tokens=4)
    bad.data_parallel_rank = 5
    with pytest.raises(grpc.RpcError) as e:
        complete(worker, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data_parallel_rank" in e.value.details()


def test_a_dead_replica_ends_every_request_and_the_worker_exits_non_zero(model_dir):
    w = Worker(model_dir, "--max-model-len", "4096", "--max-total-tokens", "16384", "--dp-size", "2")
    codes: list = []

    def stream(rank: int) -> None:
        req = gen([5, 6, 7], max_new_tokens=4000, stream=True)
        req.data_parallel_rank = rank
        try:
            for _ in w.stub.Generate(req, timeout=120):
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            codes.append(error.code())

    try:
        engines = child_pids(w.proc.pid)
        assert len(engines) >= 2
        threads = [threading.Thread(target=stream, args=(k % 2,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        os.kill(max(engines), signal.SIGKILL)  # the replica started last
        for t in threads:
            t.join(60)
        assert codes == [grpc.StatusCode.INTERNAL] * 4, (codes, w.log())
        w.proc.wait(60)
        assert w.proc.returncode not in (0, None), w.log()
    finally:
        if w.proc.poll() is None:
            w.stop()


def test_combinations_not_supported_yet_are_refused():
    from tokenspeed_worker.config import UnsupportedOptionError, check_supported, parse_args

    check_supported(parse_args(["m", "--dp", "2", "--tp", "2", "--device", "cpu"]))  # 4 GPUs on a GPU machine
    with pytest.raises(UnsupportedOptionError, match="--kv-events-config with --data-parallel-size"):
        check_supported(parse_args(["m", "--dp-size", "2", "--kv-events-config", '{"enable_kv_cache_events": true}']))
    with pytest.raises(UnsupportedOptionError, match="--data-parallel-size > 1 with --nnodes"):
        check_supported(parse_args(["m", "--data-parallel-size", "2", "--tp", "2", "--nnodes", "2",
                                    "--dist-init-addr", "h:1"]))


def test_on_a_cpu_the_engine_processes_share_the_cores(worker, monkeypatch):
    """Each CPU engine process would take every core: two replicas then spin twice the threads the
    machine has and thrash. Each gets its share, unless OMP_NUM_THREADS
    says how many; one process, or a GPU, keeps torch's default."""
    from tokenspeed_worker.config import EngineConfig
    from tokenspeed_worker.server.engine_client import cpu_threads_per_process, replica_config

    cores = len(os.sched_getaffinity(0))
    if worker.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args["device"] == "cpu":
        assert worker.log_path.read_text(errors="replace").count(f"CPU: {max(1, cores // 2)} intra-op threads") == 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = EngineConfig.build(str(tiny_models()["llama-gqa-tied"]), device="cpu")
    assert cpu_threads_per_process(cpu, 1) == 0
    assert cpu_threads_per_process(cpu, 2) == max(1, cores // 2)
    assert cpu_threads_per_process(cpu.replace(tensor_parallel_size=2), 2) == max(1, cores // 4)
    assert [replica_config(cpu, k, 2).model.cpu_threads for k in (0, 1)] == [max(1, cores // 2)] * 2
    assert cpu_threads_per_process(cpu.replace(device="cuda"), 2) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_process(cpu, 2) == 0
