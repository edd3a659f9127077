"""Tensor parallelism across engine processes: rank 0 is the engine process the server talks to; the
server also starts ranks 1..N-1 (this module's `follower_main`), and all of them meet over
torch.distributed (distributed.py). Rank 0 owns the scheduler, the sampler and the pipe to the server; before each
forward it broadcasts the step's plan on the gloo control group, every rank runs the same forward
over its shard of the weights (the model's collectives keep them in lockstep), and after sampling
rank 0 broadcasts the sampled tokens so every rank holds them for the next plan's pending input
ids (overlap scheduling).

Failure: a rank that dies closes its sockets, so the others' next collective fails; rank 0 then
reports the engine dead (the server fails every request and exits 1) and the followers exit
non-zero. A follower whose rank 0 went away exits the same way.

Signals: the ranks ignore SIGTERM and SIGINT and die with the process that started them
(engine/lifetime.py); they exit when rank 0 broadcasts stop, which it does when the server shuts
it down.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys

from tokenspeed_worker import bytecode
from tokenspeed_worker.config import EngineConfig
from tokenspeed_worker.engine import lifetime

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ranks(cfg: EngineConfig, node_rank: int) -> range:
    """The tensor-parallel ranks node `node_rank` runs (tensor_parallel_size / nnodes consecutive ones)."""
    per_node = cfg.parallel.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def start_followers(cfg: EngineConfig, log_level: str = "info", node_rank: int = 0) -> tuple[EngineConfig, list]:
    """Start this node's follower ranks (on node 0, all its ranks but rank 0); returns the config
    the ranks meet with, for rank 0 to use too, and the processes. Without a rendezvous address
    it picks a free loopback port (one node)."""
    if not cfg.parallel.dist_init_method:
        cfg = cfg.replace(dist_init_method=f"tcp://127.0.0.1:{free_port()}")
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in node_ranks(cfg, node_rank):
        if rank == 0:
            continue
        rank_cfg = cfg.replace(tp_rank=rank)
        proc = ctx.Process(target=follower_main, args=(rank_cfg, log_level), name=f"tokenspeed-tp{rank}", daemon=True)
        lifetime.start(proc)
        procs.append(proc)
    return cfg, procs


def join_group(cfg: EngineConfig) -> None:
    """Join the tensor-parallel group as `cfg`'s rank, on its device (distributed.init)."""
    import torch

    from tokenspeed_worker import distributed

    parallel = cfg.parallel
    distributed.init(parallel.tp_rank, parallel.tensor_parallel_size, parallel.dist_init_method,
                     torch.device(cfg.rank_device))


def run_node(cfg: EngineConfig, node_rank: int, log_level: str = "info") -> int:
    """A node other than 0 (`--node-rank N`): run its ranks until they end (node 0 stops them, or the
    group fails). Returns 0 when every rank stopped cleanly, else 1.

    SIGTERM/SIGINT (to this process or its group): the ranks keep serving node 0, which drains and
    then stops them, so a whole cluster being stopped drains; a second signal kills them now (the
    group then fails on node 0) and returns 0."""
    signals = []

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        if len(signals) == 1:
            logger.info("node %d: %s: the ranks exit when node 0 stops them (a second signal kills them now)",
                        node_rank, signal.Signals(signum).name)
        else:
            logger.warning("node %d: %s again: killing the ranks", node_rank, signal.Signals(signum).name)
            lifetime.kill_all()

    for sig in lifetime.STOP_SIGNALS:
        signal.signal(sig, on_signal)
    cfg, procs = start_followers(cfg, log_level, node_rank)
    logger.info("node %d of %d: ranks %s started, meeting at %s", node_rank, cfg.parallel.nnodes,
                list(node_ranks(cfg, node_rank)), cfg.parallel.dist_init_method)
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    logger.info("node %d: ranks ended with exit codes %s", node_rank, codes)
    if len(signals) > 1:
        return 0
    return 0 if all(code == 0 for code in codes) else 1


def follower_main(cfg: EngineConfig, log_level: str = "info") -> None:
    """Ranks 1..N-1: build the same runner in lockstep with rank 0, then run every plan it broadcasts."""
    lifetime.guard()  # first: ignore the service's stop signals, die with the server
    bytecode.inherit()  # before the engine's imports
    rank, size = cfg.parallel.tp_rank, cfg.parallel.tensor_parallel_size
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from tokenspeed_worker import kernel_cache

    kernel_cache.use_triton_cache(cfg.model.cache_dir)  # before anything compiles
    from tokenspeed_worker.engine.engine_core import build_runner

    try:
        join_group(cfg)
        runner, _ = build_runner(cfg)
        lifetime.still_guarded()
        logger.info("tensor-parallel rank %d of %d ready on %s (pid %d)", rank, size, runner.device, os.getpid())
        run_follower(runner)
    except Exception as exc:  # rank 0 went away, or this rank failed: the others notice through their collectives
        logger.error("tensor-parallel rank %d stopping: %s: %s", rank, type(exc).__name__, exc)
        os._exit(1)
    os._exit(0)


def run_follower(runner) -> None:
    from tokenspeed_worker import distributed

    while True:
        message = distributed.broadcast_object(None)
        if message[0] == "stop":
            return
        _, plan, num_samples = message
        runner.forward(plan)
        if num_samples:
            distributed.broadcast_tensor(runner.last_sampled[:num_samples])
