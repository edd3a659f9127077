"""The tensor-parallel all-reduce's choice of path (distributed.py): the one-shot kernel over peer
memory for small messages where every rank can take it, the group's backend otherwise.

On CPU (CI) two gloo ranks check the choice itself: what turns the path off and says why, that
the ranks agree (one rank's failure sends both to the backend), and that once chosen only the
messages it takes go through it, with the right sums. The kernel runs on the GPU machine:
test_one_shot_equals_nccl (two GPUs) against NCCL, eager and inside a CUDA graph."""

from __future__ import annotations

import multiprocessing
import queue
import traceback

import pytest
import torch

from tokenspeed_worker import distributed
from worker_harness import free_port, needs_devices


def _rank_main(rank: int, size: int, port: int, device: str, scenario: str, results) -> None:
    try:
        dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
        distributed.init(rank, size, f"tcp://127.0.0.1:{port}", dev)
        results.put((rank, globals()[scenario](rank, size, dev)))
    except BaseException:  # noqa: BLE001 -- reported to the test, which fails with it
        results.put((rank, "error: " + traceback.format_exc()))
    finally:
        distributed.shutdown()


def run_ranks(scenario: str, size: int = 2, device: str = "cpu", timeout: float = 120.0) -> list:
    """Each rank's return value of `scenario(rank, size, device)`, run in `size` processes."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, size, port, device, scenario, results))
             for rank in range(size)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(size):
            rank, value = results.get(timeout=timeout)
            got[rank] = value
    except queue.Empty:
        pytest.fail(f"{scenario}: ranks {sorted(set(range(size)) - set(got))} did not finish in {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(size):
        assert not str(got[rank]).startswith("error: "), got[rank]
    return [got[rank] for rank in range(size)]


class LocalPeer:
    """Stands in for PeerAllReduce on CPU: sums setup's probe from every rank's known probe (no
    communication, so a rank whose stand-in fails does not leave the other inside a collective),
    and any other message through gloo. `fail` and `wrong` make one rank's stand-in misbehave."""

    fail_rank: int | None = None
    wrong_rank: int | None = None
    calls = 0

    def __init__(self, group, dtype, device, max_bytes=distributed.ONE_SHOT_MAX_BYTES) -> None:
        if distributed.rank() == self.fail_rank:
            raise RuntimeError("cannot map the peers' buffers")
        self.dtype, self.device, self.max_bytes = dtype, device, max_bytes

    takes = distributed.PeerAllReduce.takes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if distributed.rank() == self.wrong_rank:
            return x.clone()
        if x.shape == distributed.probe_rows(0, x.device, x.dtype).shape:
            return sum(distributed.probe_rows(r, x.device, x.dtype) for r in range(distributed.size()))
        y = x.clone()
        torch.distributed.all_reduce(y)
        return y


def _with_local_peer(fail_rank=None, wrong_rank=None):
    distributed._peer_obstacle = lambda dtype, device, one_host: None
    LocalPeer.fail_rank, LocalPeer.wrong_rank = fail_rank, wrong_rank
    distributed.PeerAllReduce = LocalPeer


def cpu_ranks_keep_gloo(rank, size, device):
    return [distributed.setup_peer_all_reduce(torch.float32, device), distributed._PEER is None,
            distributed.setup_peer_all_reduce(torch.float32, device, enabled=False)]


def peer_path_routes_small_messages(rank, size, device):
    _with_local_peer()
    choice = distributed.setup_peer_all_reduce(torch.bfloat16, device, max_bytes=4096)
    LocalPeer.calls = 0
    small = torch.full((2, 8), rank + 1.0, dtype=torch.bfloat16)  # 32 bytes: the peer path
    large = torch.full((4, 1024), rank + 1.0, dtype=torch.bfloat16)  # 8 KiB: past max_bytes
    other_dtype = torch.full((2, 8), rank + 1.0)  # float32: not the path's dtype
    odd = torch.full((3,), rank + 1.0, dtype=torch.bfloat16)  # 6 bytes: not a multiple of 4
    sums = [distributed.all_reduce(t).float().unique().tolist() for t in (small, large, other_dtype, odd)]
    return [choice, LocalPeer.calls, sums, small.float().unique().tolist()]


def one_rank_fails_to_map(rank, size, device):
    _with_local_peer(fail_rank=1)
    return [distributed.setup_peer_all_reduce(torch.bfloat16, device), distributed._PEER is None]


def one_rank_sums_wrong(rank, size, device):
    _with_local_peer(wrong_rank=0)
    return [distributed.setup_peer_all_reduce(torch.bfloat16, device), distributed._PEER is None]


def test_cpu_ranks_keep_the_backend_and_say_why():
    for choice, no_peer, off in run_ranks("cpu_ranks_keep_gloo"):
        assert choice == "GLOO (the device is cpu)" and no_peer
        assert off == "GLOO (turned off (--disable-custom-all-reduce))"


def test_once_chosen_only_the_messages_it_takes_go_the_one_shot_way():
    for choice, calls, sums, small_after in run_ranks("peer_path_routes_small_messages"):
        assert choice == "one-shot over peer memory up to 4 KiB, NCCL above"
        assert calls == 1  # only `small`; setup's probe was counted before the reset
        assert sums == [[3.0], [3.0], [3.0], [3.0]]  # 1 + 2 on every path
        assert small_after in ([1.0], [2.0])  # the one-shot path leaves its input as it was


def test_a_rank_that_cannot_map_sends_every_rank_to_the_backend():
    results = run_ranks("one_rank_fails_to_map")
    assert results[1] == ["GLOO (its setup failed: RuntimeError: cannot map the peers' buffers)", True]
    assert results[0] == ["GLOO (the one-shot path failed on another rank)", True]


def test_wrong_sums_on_one_rank_send_every_rank_to_the_backend():
    results = run_ranks("one_rank_sums_wrong")
    assert results[0] == ["GLOO (its test all-reduce differed from NCCL's)", True]
    assert results[1] == ["GLOO (the one-shot path failed on another rank)", True]


def test_the_flag_turns_the_path_off():
    from tokenspeed_worker.config import parse_args, WorkerConfig

    def parallel(*flags):
        return WorkerConfig.from_args(parse_args(["/m", "--device", "cpu", "--tp", "2", *flags])).engine.parallel

    assert parallel().custom_all_reduce and not parallel("--disable-custom-all-reduce").custom_all_reduce


# ---- GPU machine (two GPUs)

def one_shot_against_nccl(rank, size, device):
    torch.cuda.set_device(device)
    choice = distributed.setup_peer_all_reduce(torch.bfloat16, device)
    peer = distributed._PEER
    assert peer is not None, choice
    mismatches = []
    generator = torch.Generator(device=device).manual_seed(rank)
    for rows, hidden in ((1, 4096), (3, 4096), (16, 8192), (32, 8192), (64, 4096), (1, 2048)):
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, generator=generator)
        ref = x.clone()
        torch.distributed.all_reduce(ref)
        got = distributed.all_reduce(x.clone())
        # Two ranks: a + b is the same bits in any order; more ranks may round differently.
        if not (torch.equal(got, ref) if size == 2 else torch.allclose(got, ref, atol=1e-2, rtol=1e-2)):
            mismatches.append(("eager", rows, hidden))
    # Inside a CUDA graph: captured once, replayed on new inputs, next to an NCCL all-reduce.
    static = torch.zeros(8, 4096, device=device, dtype=torch.bfloat16)
    big = torch.zeros(512, 4096, device=device, dtype=torch.bfloat16)  # 4 MiB: NCCL
    for _ in range(2):  # warm-up outside the capture
        distributed.all_reduce(static)
        distributed.all_reduce(big.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_small = distributed.all_reduce(static)
        out_big = distributed.all_reduce(big)
    for step in range(5):
        static.copy_(torch.randn(8, 4096, device=device, generator=generator))
        big.copy_(torch.randn(512, 4096, device=device, generator=generator))
        ref_small, ref_big = static.clone(), big.clone()
        torch.distributed.all_reduce(ref_small)
        torch.distributed.all_reduce(ref_big)
        graph.replay()
        if not torch.equal(out_small, ref_small):
            mismatches.append(("graph small", step))
        if not torch.allclose(out_big, ref_big, atol=1e-2, rtol=1e-2):
            mismatches.append(("graph large", step))
    torch.cuda.synchronize()
    return [choice, mismatches]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runs on GPUs (two)")
def test_one_shot_equals_nccl():
    needs_devices(2)
    for choice, mismatches in run_ranks("one_shot_against_nccl", device="cuda", timeout=300):
        assert choice.startswith("one-shot"), choice
        assert mismatches == []
