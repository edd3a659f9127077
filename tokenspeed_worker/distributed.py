"""Tensor-parallel state of this process: its rank, the group size, and the collectives the model uses.

One engine process per rank (engine/tp_worker.py): rank 0 schedules and samples, every rank runs
the forward over its shard of the weights. Two process groups: the *device* group (NCCL on GPUs,
gloo on CPU) for the model's collectives, and a gloo *control* group on which rank 0 broadcasts
each step's plan (a pickled host object) to the others.

With a group size of 1 (the default) nothing is initialized and every collective is the identity,
so single-process code paths pay nothing.
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
    global _RANK, _SIZE, _CONTROL
    if _SIZE > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _CONTROL = 0, 1, None


def rank() -> int:
    return _RANK


def size() -> int:
    return _SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (row-parallel layers, the vocabulary-parallel embedding)."""
    if _SIZE > 1:
        dist.all_reduce(x)
    return x


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
