"""Tensor-parallel state of this process: its rank, the group size, and the collectives the model uses.

One engine process per rank (engine/tp_worker.py): rank 0 schedules and samples, every rank runs
the forward over its shard of the weights. Two process groups: the *device* group (NCCL on GPUs,
gloo on CPU) for the model's collectives, and a gloo *control* group on which rank 0 broadcasts
each step's plan (a pickled host object) to the others.

With a group size of 1 (the default) nothing is initialized and every collective is the identity,
so single-process code paths pay nothing.

All-reduce, chosen by size (`all_reduce`): where the ranks share a host and their GPUs reach each
other's memory, a message of at most ONE_SHOT_MAX_BYTES goes through a one-shot all-reduce over
peer memory (`PeerAllReduce`: each rank copies its rows into a buffer every peer has mapped, the
ranks meet at a flag barrier, and each sums every peer's copy itself: one kernel, no NCCL
protocol), larger ones through NCCL. Both are captured in CUDA graphs.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from tokenspeed_worker import env

# NVLink multicast stays off unless the operator turned it on explicitly: it is not needed for
# these collectives, and on shared hosts a program using it can take the GPUs out of service.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_RANK = 0
_SIZE = 1
_CONTROL = None  # gloo group for host objects (plans)
_PEER: PeerAllReduce | None = None  # the one-shot path for small messages (setup_peer_all_reduce)

# Messages up to this size take the one-shot path (where it is set up), larger ones NCCL: the
# one-shot reads every peer's whole message, NCCL's ring only its share, so past some size NCCL
# wins; this bound covers every decode step up to 64 rows of an 8B model's hidden size (and 32 of a
# 70B's). Measured crossover: docs/benchmarks.md (scripts/bench_allreduce.py).
ONE_SHOT_MAX_BYTES = 512 * 1024

# How long a collective may wait for a peer before the rank gives up (a dead peer normally closes
# its sockets first, which fails the collective at once).
DEFAULT_TIMEOUT_S = env.DIST_TIMEOUT_S.get()


def init(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the tensor-parallel group (size > 1): NCCL for CUDA devices, gloo otherwise."""
    global _RANK, _SIZE, _CONTROL
    _RANK, _SIZE = int(rank), int(size)
    if _SIZE == 1:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        for name, value in MULTICAST_OFF.items():
            os.environ.setdefault(name, value)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=_RANK, world_size=_SIZE, timeout=timeout)
    _CONTROL = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD


def shutdown() -> None:
    global _RANK, _SIZE, _CONTROL, _PEER
    _PEER = None  # its buffer goes before the group it was mapped through
    if _SIZE > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _CONTROL = 0, 1, None


def rank() -> int:
    return _RANK


def size() -> int:
    return _SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (row-parallel layers, the vocabulary-parallel embedding): the result, which is
    x itself (summed in place, NCCL) or a new tensor (the one-shot path): use the return value."""
    if _SIZE > 1:
        if _PEER is not None and _PEER.takes(x):
            return _PEER.all_reduce(x)
        dist.all_reduce(x)
    return x


class PeerAllReduce:
    """The one-shot all-reduce of small messages over peer memory, on torch's symmetric memory
    (torch.distributed._symmetric_memory: a buffer of `max_bytes` that every rank of `group` has
    mapped, with signal pads for the barrier) and its `one_shot_all_reduce_copy` kernel: each rank's
    blocks copy its message into its own buffer, signal every peer's pad and wait for theirs, sum
    the same range of every peer's buffer into the output, then meet again before the buffer may be
    written. One launch, no host work: captured in CUDA graphs like any kernel. Peer loads and
    stores only: no NVLink multicast (MULTICAST_OFF).

    torch's kernel is used because it is this algorithm (vLLM's and TensorRT-LLM's custom
    all-reduce) kept by the library whose allocator and IPC it needs anyway; nothing is written
    by hand here but the choice of when to use it."""

    def __init__(self, group, dtype: torch.dtype, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.device, self.max_bytes = dtype, device, int(max_bytes)
        self.group_name = group.group_name
        try:  # peer memory through the CUDA driver's IPC (not NVSHMEM, where torch has it): one host
            if symm_mem.get_backend(device) is None:
                symm_mem.set_backend("CUDA")
        except (AttributeError, RuntimeError):  # an older torch has one backend
            pass
        self.buffer = symm_mem.empty(self.max_bytes // dtype.itemsize, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group)  # collective: every rank of the group

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes this way: this dtype, on the GPU, contiguous, at most max_bytes, and aligned
        as the kernel needs (its start at 16 bytes, its size a multiple of 4 bytes)."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype == self.dtype and x.device == self.device and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 4 == 0 and (x.storage_offset() * x.element_size()) % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in a new tensor (x is left as it was)."""
        out = torch.empty_like(x)
        staging = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)


def _peer_obstacle(dtype: torch.dtype, device: torch.device, one_host: bool) -> str | None:
    """Why this rank cannot take the one-shot path (None: it can), before any rank maps anything.
    Every rank reaches the same return (the same configuration and install), so the last check,
    which gathers the ranks' GPUs over the control group, is reached by all or none."""
    if device.type != "cuda":
        return f"the device is {device.type}"
    if not one_host:
        return "the ranks span several nodes"
    if dtype not in (torch.bfloat16, torch.float32):  # the dtypes torch's one-shot kernel is built for
        return f"the model's dtype is {str(dtype).removeprefix('torch.')}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
            return "this torch has no one-shot all-reduce kernel"
    except Exception as exc:  # a torch built without symmetric memory
        return f"torch's symmetric memory is missing ({exc})"
    mine = device.index if device.index is not None else torch.cuda.current_device()
    gpus = [None] * _SIZE
    dist.all_gather_object(gpus, mine, group=_CONTROL)
    blind = [gpu for gpu in gpus if gpu != mine and not torch.cuda.can_device_access_peer(mine, gpu)]
    return f"GPU {mine} cannot reach the memory of GPU {blind[0]}" if blind else None


def _all_agree(ok: bool) -> bool:
    """Whether every rank says ok (a MIN over the control group)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_CONTROL)
    return bool(flag.item())


def probe_rows(rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s message in setup's test all-reduce: small integers, which every order of
    summing adds to the same bits, so the two paths must agree exactly."""
    generator = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-8, 8, (3, 1000), generator=generator).to(device, dtype)


def setup_peer_all_reduce(dtype: torch.dtype, device: torch.device, enabled: bool = True,
                          one_host: bool = True, max_bytes: int = ONE_SHOT_MAX_BYTES) -> str:
    """Set up the one-shot path for messages of `dtype` (collective: every rank calls it, after
    init, before any CUDA graph is captured). It is taken only where every rank can: `enabled`
    (--disable-custom-all-reduce turns it off), the ranks on one host, a CUDA device whose peers'
    memory it can reach, a dtype the kernel has; and only once a test all-reduce through it gave
    exactly NCCL's sums on every rank. Otherwise every all-reduce stays on the group's backend
    (NCCL; gloo on CPU). Returns what was chosen, in words, for the startup log."""
    global _PEER
    _PEER = None
    if _SIZE == 1:
        return "none (one rank)"
    obstacle = None if enabled else "turned off (--disable-custom-all-reduce)"
    if obstacle is None:
        obstacle = _peer_obstacle(dtype, device, one_host)
    fallback = str(dist.get_backend()).upper()  # NCCL on GPUs, GLOO on CPU
    if not _all_agree(obstacle is None):
        return f"{fallback} ({obstacle or 'another rank cannot take the one-shot path'})"
    # The reference sums first (NCCL), so that no rank is inside a collective while another maps.
    probe = probe_rows(_RANK, device, dtype)
    expected = probe.clone()
    dist.all_reduce(expected)
    peer = None
    try:
        peer = PeerAllReduce(dist.group.WORLD, dtype, device, max_bytes)
        if not torch.equal(peer.all_reduce(probe), expected):
            obstacle = "its test all-reduce differed from NCCL's"
    except Exception as exc:  # noqa: BLE001 -- any failure to map or run leaves NCCL in charge
        obstacle = f"its setup failed: {type(exc).__name__}: {exc}"
    if not _all_agree(obstacle is None):
        return f"{fallback} ({obstacle or 'the one-shot path failed on another rank'})"
    _PEER = peer
    return f"one-shot over peer memory up to {max_bytes // 1024} KiB, NCCL above"


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' tensors along the last dimension (the vocabulary-parallel LM head)."""
    if _SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's values into x on every rank (the sampled tokens the next step's inputs may need)."""
    if _SIZE > 1:
        dist.broadcast(x, src=0)
    return x


def broadcast_object(obj=None):
    """Rank 0 sends obj (any picklable host object) on the control group; the others receive it."""
    if _SIZE == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def shard_range(total: int, tp_rank: int | None = None, tp_size: int | None = None) -> tuple[int, int]:
    """(start, size) of this rank's equal share of `total` (which must divide evenly)."""
    tp_rank = _RANK if tp_rank is None else tp_rank
    tp_size = _SIZE if tp_size is None else tp_size
    if total % tp_size:
        raise ValueError(f"{total} does not divide evenly over tensor-parallel size {tp_size}")
    per = total // tp_size
    return tp_rank * per, per
