"""Tensor parallelism on CPU (gloo), through the gRPC worker: `--tensor-parallel-size 2` (and 4, where
the two KV heads of the tiny models are replicated) gives Hugging Face's greedy tokens and its
logprobs for every model family; a rank killed mid-request ends every request with a status and
the worker exits non-zero; the per-layer TP flags are accepted only at the TP size."""

from __future__ import annotations

import re
import signal
import os
import threading
import time

import grpc
import numpy as np
import pytest

from test_grpc_sampling import complete, gen, hf_log_softmax
from tokenspeed_worker.config import check_supported, parse_args, UnsupportedOptionError
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb
from worker_harness import Worker, hf_greedy, needs_devices, tiny_models

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 300], [9, 8, 7], list(range(20, 61))]


FLAGS = ("--max-model-len", "256", "--max-total-tokens", "4096")


def check_against_transformers(worker: Worker, model_dir, max_new: int = 10) -> None:
    for prompt in PROMPTS:
        c, _ = complete(worker, gen(prompt, max_new_tokens=max_new, logprobs=True, top=3))
        out = list(c.output_ids)
        assert out == hf_greedy(model_dir, prompt, max_new), prompt
        ref = hf_log_softmax(model_dir, prompt + out)
        for i, token in enumerate(out):
            row = ref[len(prompt) - 1 + i]
            assert c.output_logprobs.token_logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
            top_values, top_ids = row.topk(3)
            assert list(c.output_logprobs.top_logprobs[i].token_ids[:3]) == top_ids.tolist()
            assert np.allclose(c.output_logprobs.top_logprobs[i].values[:3], top_values.numpy(), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias", "qwen3-qknorm", "phi3", "gemma2"])
def test_tp2_equals_transformers(name):
    needs_devices(2)
    model_dir = tiny_models()[name]
    w = Worker(model_dir, *FLAGS, "--tensor-parallel-size", "2")
    try:
        assert "tensor-parallel rank 1 of 2 ready" in w.log()
        check_against_transformers(w, model_dir)
        # A batch of concurrent streams (mixed prefill and decode steps) gives the same tokens.
        results: dict[int, list[int]] = {}

        def one(i: int) -> None:
            c, _ = complete(w, gen(PROMPTS[i % 3], max_new_tokens=8))
            results[i] = list(c.output_ids)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, out in results.items():
            assert out == hf_greedy(model_dir, PROMPTS[i % 3], 8)
        load = w.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        assert load.num_used_tokens == 0
    finally:
        assert w.stop() == 0, w.log()


@pytest.mark.slow
def test_tp4_replicates_kv_heads_and_equals_transformers():
    # Two KV heads over four ranks: each rank holds the one its query heads use.
    needs_devices(4)
    model_dir = tiny_models()["llama-gqa-tied"]
    w = Worker(model_dir, *FLAGS, "--tp", "4", env={"TOKENSPEED_OVERLAP_SCHEDULE": "1"})
    try:
        check_against_transformers(w, model_dir, max_new=6)
    finally:
        assert w.stop() == 0, w.log()


@pytest.mark.slow
def test_killing_a_rank_ends_every_request_and_the_worker_exits_non_zero():
    needs_devices(2)
    model_dir = tiny_models()["llama-gqa-tied"]
    w = Worker(model_dir, "--max-model-len", "4096", "--max-total-tokens", "16384", "--tp", "2")
    codes: list = []

    def stream() -> None:
        try:
            for _ in w.stub.Generate(gen(PROMPTS[0], max_new_tokens=4000, stream=True), timeout=120):
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            codes.append(error.code())

    try:
        pid = int(re.search(r"tensor-parallel rank 1 of 2 ready on \S+ \(pid (\d+)\)", w.log()).group(1))
        threads = [threading.Thread(target=stream) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert codes == [grpc.StatusCode.INTERNAL] * 3, (codes, w.log())
        w.proc.wait(60)
        assert w.proc.returncode not in (0, None), w.log()
    finally:
        if w.proc.poll() is None:
            w.stop()


def test_expert_parallel_flags_are_checked_against_the_tp_size():
    from tokenspeed_worker.config import WorkerConfig

    def engine_parallel(*flags):
        args = parse_args(["m", "--device", "cpu", *flags])
        check_supported(args)
        return WorkerConfig.from_args(args).engine.parallel

    parallel = engine_parallel("--tp", "4", "--enable-expert-parallel")
    assert (parallel.expert_parallel_size, parallel.moe_tp_size) == (4, 1)
    parallel = engine_parallel("--tp", "4", "--ep-size", "2", "--moe-tp-size", "2")
    assert (parallel.expert_parallel_size, parallel.moe_tp_size) == (2, 2)
    assert engine_parallel("--tp", "2", "--expert-parallel-size", "2", "--enable-expert-parallel").moe_tp_size == 1
    assert engine_parallel("--tp", "2").expert_parallel_size == 1
    for flags, message in ((("--tp", "4", "--ep-size", "3"), "--ep-size 3 must divide --tensor-parallel-size 4"),
                           (("--ep-size", "2"), "--ep-size 2 must divide --tensor-parallel-size 1"),
                           (("--tp", "4", "--enable-expert-parallel", "--ep-size", "2"),
                            "--enable-expert-parallel deals the experts over all 4"),
                           (("--tp", "4", "--ep-size", "2", "--moe-tp-size", "4"),
                            "--moe-tp-size 4 times the expert parallel size 2 must equal --tensor-parallel-size 4 "
                            "\\(try --moe-tp-size 2\\)"),
                           (("--tp", "2", "--enable-expert-parallel", "--moe-tp-size", "2"), "--moe-tp-size 2 times")):
        with pytest.raises(UnsupportedOptionError, match=message):
            check_supported(parse_args(["m", "--device", "cpu", *flags]))


def test_per_layer_tp_sizes_are_accepted_only_at_the_tp_size():
    # --device cpu: the checks are of the flags, whatever GPUs this machine has.
    args = parse_args(["m", "--device", "cpu", "--tp", "2", "--attn-tp-size", "2", "--dense-tp-size", "2",
                       "--moe-tp-size", "2"])
    check_supported(args)
    assert args.tensor_parallel_size == 2
    with pytest.raises(UnsupportedOptionError, match="--attn-tp-size 4 differs from --tensor-parallel-size 2"):
        check_supported(parse_args(["m", "--device", "cpu", "--tp", "2", "--attn-tp-size", "4"]))
    with pytest.raises(UnsupportedOptionError, match="--dense-tp-size 2 differs"):
        check_supported(parse_args(["m", "--dense-tp-size", "2"]))


@pytest.mark.slow
def test_two_nodes_over_loopback_serve_requests():
    # Two processes play two nodes: node 0 (rank 0, gRPC) and node 1 (rank 1, no gRPC), meeting at
    # --dist-init-addr. Node 1 exits cleanly when node 0 stops.
    import subprocess
    import sys

    from worker_harness import REPO, free_port

    needs_devices(2)
    model_dir = tiny_models()["qwen2-bias"]
    addr = f"127.0.0.1:{free_port()}"
    dist = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", addr)
    log = open(REPO / ".cache" / "logs" / f"node1-{addr.split(':')[1]}.log", "wb")
    # One machine plays both nodes: on GPUs, "node 1" takes the second GPU (each node's ranks start at
    # its --base-gpu-id, 0 by default, as on separate machines).
    import torch

    gpu = ("--base-gpu-id", "1") if torch.cuda.is_available() else ()
    node1 = subprocess.Popen([sys.executable, "-m", "tokenspeed_worker", str(model_dir), *FLAGS, *dist, "--node-rank", "1", *gpu],
                             stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        w = Worker(model_dir, *FLAGS, *dist, "--node-rank", "0")
        try:
            assert "tensor-parallel rank 1 of 2 ready" not in w.log()  # that rank runs on "node 1"
            check_against_transformers(w, model_dir, max_new=6)
        finally:
            assert w.stop() == 0, w.log()
        assert node1.wait(60) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
        log.close()


def test_multi_node_flags_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["m", "--tp", "2", "--nnodes", "2"])  # no --dist-init-addr
    with pytest.raises(SystemExit):
        parse_args(["m", "--tp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"])  # 3 ranks over 2 nodes
    with pytest.raises(SystemExit):
        parse_args(["m", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1", "--tp", "2"])
    with pytest.raises(SystemExit):
        parse_args(["m", "--dist-init-addr", "nocolon"])
    args = parse_args(["m", "--device", "cpu", "--tp", "4", "--nnodes", "2", "--node-rank", "1",
                       "--dist-init-addr", "10.0.0.1:29500"])
    check_supported(args)


def test_nvlink_multicast_is_off_by_default_for_nccl(monkeypatch):
    # init() on a CUDA device sets these before NCCL starts; checked without a GPU by stubbing the
    # device and process-group calls. An operator's explicit setting is kept.
    import torch

    from tokenspeed_worker import distributed

    for name in distributed.MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", device)))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(torch.distributed, "new_group", lambda **kw: "control")
    try:
        distributed.init(1, 2, "tcp://127.0.0.1:1", torch.device("cuda", 1))
        assert calls == [("device", torch.device("cuda", 1)), "nccl"]
        assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert os.environ["NVSHMEM_DISABLE_NVLS"] == "0"
        assert distributed.rank() == 1 and distributed.size() == 2
    finally:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
        distributed.shutdown()
    assert distributed.size() == 1


def test_parallel_sizes_that_cannot_split_the_model_are_named_before_any_rank_starts():
    """config.json against --tensor-parallel-size / --ep-size: heads, key/value heads, experts and
    MLP rows that do not split are one error naming the flag (the CLI exits 2 before spawning)."""
    from tokenspeed_worker.models.registry import check_parallel_fit

    dense = {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    for tp in (1, 2, 4, 8, 16, 32):
        check_parallel_fit(dense, tp, 1)  # 16 and 32 ranks share the 8 key/value heads
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: the model's 32 attention heads"):
        check_parallel_fit(dense, 3, 1)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4: the model's 6 key/value heads"):
        check_parallel_fit(dict(dense, num_key_value_heads=6), 4, 1)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 8: the MLP's intermediate rows"):
        check_parallel_fit(dict(dense, intermediate_size=1004), 8, 1)
    qwen3_moe = {"num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                 "moe_intermediate_size": 768, "intermediate_size": 6144, "mlp_only_layers": [],
                 "decoder_sparse_step": 1}
    check_parallel_fit(qwen3_moe, 8, 8)
    check_parallel_fit(dict(qwen3_moe, intermediate_size=1004), 8, 1)  # no dense layer uses it
    with pytest.raises(ValueError, match=r"--ep-size 3: the model's 128 experts cannot be dealt evenly"):
        check_parallel_fit(dict(qwen3_moe, num_attention_heads=48, num_key_value_heads=6), 6, 3)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size / --ep-size 16 / 2: each expert's intermediate"):
        check_parallel_fit(dict(qwen3_moe, num_attention_heads=64, moe_intermediate_size=100), 16, 2)
    with pytest.raises(ValueError, match=r"the dense layers' intermediate rows \(1004\)"):
        check_parallel_fit(dict(qwen3_moe, intermediate_size=1004, mlp_only_layers=[0]), 8, 8)
    mixtral = {"num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "intermediate_size": 14336}
    with pytest.raises(ValueError, match=r"--ep-size 16: the model's 8 experts"):
        check_parallel_fit(mixtral, 16, 16)
    with pytest.raises(ValueError, match=r"the shared expert's intermediate rows \(100\)"):
        check_parallel_fit(dict(qwen3_moe, shared_expert_intermediate_size=100), 8, 1)
    gemma3 = {"architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 15360}}
    with pytest.raises(ValueError, match=r"the model's 8 attention heads"):
        check_parallel_fit(gemma3, 16, 1)

    from test_hub_cache import refused

    # On CPU: on a machine with fewer GPUs than ranks, the GPU count is refused first (parsing.py).
    (error,) = refused([str(tiny_models()["llama-gqa-tied"]), "--tensor-parallel-size", "3", "--device", "cpu"])
    assert "--tensor-parallel-size 3: the model's 4 attention heads (num_attention_heads)" in error, error
