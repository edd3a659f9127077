"""Thin Python face of the native scheduler core (kernels/scheduler_core).

The engine loop is `plan = scheduler.schedule()` → forward(plan) → sample the rows
`plan.sample_rows` → `scheduler.advance(sampled)`. Everything that grows with the
number of tokens or requests stays in C++; only numpy arrays cross the boundary.

A step fills in this order: one token for every decoding request (preempting the
newest running request by recompute when the pool is out of blocks), the next
chunk of every request mid-prefill, then waiting requests admitted in FIFO order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import numpy as np

from tokenspeed_worker import _scheduler_core
from tokenspeed_worker.scheduler.plan import SchedulePlan


class FinishReason(enum.IntEnum):
    """Codes returned by `Scheduler.advance` for finished requests."""

    STOP = _scheduler_core.FINISH_STOP  # sampled one of the request's stop tokens
    LENGTH = _scheduler_core.FINISH_LENGTH  # produced max_new_tokens tokens


class Scheduler:
    """Continuous batching with chunked prefill over a paged KV cache of `num_blocks`
    blocks of `block_size` slots.

    `token_budget` caps the tokens computed in one step (--chunked-prefill-size);
    decode rows always run, prefill chunks share what they leave. With
    `chunked_prefill=False` prompts are never split: a step admits whole prompts up
    to `max_prefill_tokens` in total (default `token_budget`), and a single larger
    prompt alone.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        token_budget: int,
        chunked_prefill: bool = True,
        max_prefill_tokens: int | None = None,
    ) -> None:
        self.block_size = block_size
        self._core = _scheduler_core.SchedulerCore(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            token_budget=token_budget,
            chunked_prefill=chunked_prefill,
            max_prefill_tokens=token_budget if max_prefill_tokens is None else max_prefill_tokens,
        )

    # -- requests -------------------------------------------------------------------

    def add_request(
        self,
        req_id: int,
        prompt_ids: np.ndarray,
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | np.ndarray = (),
    ) -> None:
        """Queues a request (FIFO). Raises ValueError for a duplicate id, an empty
        prompt, max_new_tokens < 1, or a request that could never fit (more than
        max_model_len tokens, or more blocks than the whole pool)."""
        prompt = np.ascontiguousarray(prompt_ids, dtype=np.int64)
        if prompt.ndim != 1:
            raise ValueError(f"request {req_id}: prompt_ids must be 1-D, got shape {prompt.shape}")
        if not isinstance(stop_token_ids, np.ndarray):
            stop_token_ids = list(stop_token_ids)
        stops = np.ascontiguousarray(stop_token_ids, dtype=np.int64).reshape(-1)
        self._core.add_request(int(req_id), prompt, int(max_new_tokens), stops)

    def abort(self, req_id: int) -> bool:
        """Drops a request in any state and frees its blocks; False if unknown.
        Between schedule() and advance(), its sampled token is dropped by advance()."""
        return self._core.abort(int(req_id))

    # -- steps ----------------------------------------------------------------------

    def schedule(self) -> SchedulePlan:
        """The next step. A non-empty plan must be consumed by advance() before the
        next schedule() (RuntimeError otherwise); an empty plan needs no advance()."""
        arrays = self._core.schedule()
        if arrays is None:
            return SchedulePlan.empty()
        return SchedulePlan(*arrays)

    def advance(self, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Records the last plan as computed. `sampled` holds the int64 token of each
        plan.sample_rows entry, in order. Returns (finished_req_ids int64[F],
        reasons int32[F]) with reasons as FinishReason codes; finished requests have
        already released their blocks and are forgotten."""
        return self._core.advance(np.ascontiguousarray(sampled, dtype=np.int64).reshape(-1))

    # -- state ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._core.num_waiting

    @property
    def num_running(self) -> int:
        return self._core.num_running

    @property
    def num_free_blocks(self) -> int:
        return self._core.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self._core.num_total_blocks

    @property
    def num_used_tokens(self) -> int:
        """Tokens whose K/V running requests hold in the cache."""
        return self._core.num_used_tokens

    @property
    def num_preemptions(self) -> int:
        """Preemptions by recompute since start."""
        return self._core.num_preemptions

    @property
    def waiting_tokens(self) -> int:
        """Tokens waiting requests still have to compute (prompt, plus the output
        of a preempted request)."""
        return self._core.waiting_tokens

    def has_work(self) -> bool:
        return self._core.has_work()

    def contains(self, req_id: int) -> bool:
        return self._core.contains(int(req_id))

    def output_len(self, req_id: int) -> int:
        """Tokens generated so far by a live request (KeyError if unknown)."""
        return self._core.output_len(int(req_id))

    def token_ids(self, req_id: int) -> np.ndarray:
        """int64 copy of a live request's prompt followed by its output (KeyError if unknown)."""
        return self._core.token_ids(int(req_id))

    def block_ids(self, req_id: int) -> np.ndarray:
        """int32 copy of a live request's block table; empty while it waits."""
        return self._core.block_ids(int(req_id))
