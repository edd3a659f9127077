"""Thin Python face of the native scheduler core (csrc/scheduler).

The engine loop is `plan = scheduler.schedule()` → forward(plan) → sample the rows
`plan.sample_rows` → `scheduler.advance(sampled)`. Everything that grows with the
number of tokens or requests stays in C++; only numpy arrays cross the boundary.

A step fills in this order: one token for every decoding request (preempting the
newest running request by recompute when the pool is out of blocks), the next
chunk of every request mid-prefill, then waiting requests admitted in FIFO order.

Prefix caching: a *full* block is named by a chain hash of its tokens and its
prefix (`block_hash`). Once a block's K/V is computed (prompt or output) it is
registered; a request admitted later starts on the longest chain of cached blocks
equal to its tokens (at least one token is always left to compute) and its plan's
context_lens/positions/slots start after them. Released cached blocks stay
matchable, least recently used evicted first, until a new allocation needs them.
Matches compare stored tokens, never only hashes, so a collision cannot give wrong K/V.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import numpy as np

from tokenspeed_worker import _scheduler_core
from tokenspeed_worker.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenspeed_worker.scheduler.plan import SchedulePlan

ROOT_BLOCK_HASH: int = _scheduler_core.ROOT_BLOCK_HASH


def ngram_draft(tokens: np.ndarray, min_match: int, max_match: int, max_tokens: int) -> np.ndarray:
    """int64: at most `max_tokens` tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` of min_match..max_match tokens; empty when no suffix of min_match
    occurred before. The scheduler's n-gram drafter (csrc/scheduler/scheduler.cpp)."""
    return _scheduler_core.ngram_draft(np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1),
                                       int(min_match), int(max_match), int(max_tokens))


def block_hash(parent_hash: int | None, token_ids: np.ndarray | Iterable[int]) -> int:
    """Chain hash (signed int64) of one full block of `token_ids` whose parent block
    has hash `parent_hash` (None for a sequence's first block). Deterministic in
    every process: `h = parent (or ROOT_BLOCK_HASH); for t in tokens: h =
    splitmix64(h ^ t)` over unsigned 64-bit words (csrc/scheduler/block_hash.hpp).
    The same values appear in KV events."""
    if not isinstance(token_ids, np.ndarray):
        token_ids = list(token_ids)
    tokens = np.ascontiguousarray(token_ids, dtype=np.int64).reshape(-1)
    return _scheduler_core.block_hash(None if parent_hash is None else int(parent_hash), tokens)


class FinishReason(enum.IntEnum):
    """Codes returned by `Scheduler.advance` for finished requests."""

    STOP = _scheduler_core.FINISH_STOP  # sampled one of the request's stop tokens
    LENGTH = _scheduler_core.FINISH_LENGTH  # produced max_new_tokens tokens


class Scheduler:
    """Continuous batching with chunked prefill over a paged KV cache of `num_blocks`
    blocks of `block_size` slots. The engine builds it from its config sections
    (`from_config`); the constructor takes the native core's parameters one by one.

    `token_budget` caps the tokens computed in one step (--chunked-prefill-size);
    decode rows always run, prefill chunks share what they leave. With
    `chunked_prefill=False` prompts are never split: a step admits whole prompts up
    to `max_prefill_tokens` in total (default `token_budget`), and a single larger
    prompt alone.

    `enable_prefix_caching` (default on) keeps computed full blocks matchable for
    later requests; off, blocks are shared only between siblings (`wait_for`) and a
    block nobody holds is freed at once. `enable_kv_events` records the cache's
    stored/removed/cleared events for `drain_kv_events()` (cache-aware routing).
    `_hash_bits` < 64 narrows block hashes to force collisions in tests only.

    `sliding_window` > 0: every layer of the model attends to its last sliding_window positions
    only, so a running request's blocks wholly before every future query's window are released
    as it goes (the table keeps their places, shown as block 0 in plans): its KV grows with the
    window, not with its length. Released blocks that are cached stay matchable.

    `num_speculative_tokens` > 0 (speculative decoding): a decoding
    request added with `speculates=True` gets a draft of up to that many tokens each step, from
    its own tokens by n-gram match when `ngram_max_match` > 0 (`ngram_draft`); its plan row then
    computes 1 + draft tokens (`SchedulePlan.draft_lens`) and the step is finished by
    `resolve_verified` with the tokens the sampler kept. A draft never passes max_new_tokens and
    is dropped rather than preempting anyone for its blocks. A step with more than
    `max_speculative_batch` decoding requests (when > 0) drafts for none; a request whose drafts
    were all rejected skips 2^misses - 1 steps (at most 16) before drafting again. A request
    whose last token is pending (overlap) gets no draft: `may_draft` says whether the next step
    could draft once the pending step is resolved.

    `schedule_conservativeness` > 0 (the engine's --schedule-conservativeness, default 1)
    makes admission keep room for the running requests' expected output: a waiting
    request is admitted only if its first chunk, plus the blocks its own rest and every
    running request's rest are expected to need, fit in the free blocks. A request's rest
    is its remaining prompt plus r x its remaining output (max_new_tokens clipped to 4,096),
    r = min(1, conservativeness x `expected_output_ratio`), the running mean of the fraction
    of their output budget that finished requests used (1 until one finishes). With nothing
    running a request is always admitted; preemption stays the safety net. 0 turns the
    reservation off (admit whenever the first chunk fits).
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
        enable_prefix_caching: bool = True,
        enable_kv_events: bool = False,
        _hash_bits: int = 64,
        schedule_conservativeness: float = 0.0,
        sliding_window: int = 0,
        num_speculative_tokens: int = 0,
        ngram_min_match: int = 1,
        ngram_max_match: int = 0,
        max_speculative_batch: int = 0,
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
            enable_prefix_caching=enable_prefix_caching,
            enable_kv_events=enable_kv_events,
            hash_bits=_hash_bits,
            schedule_conservativeness=float(schedule_conservativeness),
            sliding_window=int(sliding_window),
            num_speculative_tokens=int(num_speculative_tokens),
            ngram_min_match=int(ngram_min_match),
            ngram_max_match=int(ngram_max_match),
            max_speculative_batch=int(max_speculative_batch),
        )

    @classmethod
    def from_config(cls, scheduler: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                    sliding_window: int = 0, speculative: SpeculativeConfig | None = None) -> Scheduler:
        """The engine's scheduler: its limits from the scheduler section, the pool's block size,
        prefix caching and event recording from the cache section, over `num_blocks` blocks;
        sliding_window: the model's, where every layer has the same one (else 0)."""
        return cls(
            num_blocks=num_blocks,
            block_size=cache.block_size,
            max_num_seqs=scheduler.max_num_seqs,
            max_model_len=scheduler.max_model_len,
            token_budget=scheduler.token_budget,
            chunked_prefill=scheduler.chunked_prefill,
            max_prefill_tokens=scheduler.max_prefill_tokens,
            enable_prefix_caching=cache.enable_prefix_caching,
            enable_kv_events=cache.records_kv_events,
            schedule_conservativeness=scheduler.schedule_conservativeness,
            sliding_window=sliding_window,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative and speculative.enabled else 0,
            ngram_min_match=speculative.ngram_min_match if speculative else 1,
            ngram_max_match=(speculative.ngram_max_match
                             if speculative and speculative.speculative_algorithm == "NGRAM" else 0),
            max_speculative_batch=speculative.max_speculative_batch if speculative else 0,
        )

    # -- requests -------------------------------------------------------------------

    def add_request(
        self,
        req_id: int,
        prompt_ids: np.ndarray,
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | np.ndarray = (),
        wait_for: int = -1,
        speculates: bool = False,
    ) -> None:
        """Queues a request (FIFO). Raises ValueError for a duplicate id, an empty
        prompt, max_new_tokens < 1, a request that could never fit (more than
        max_model_len tokens, or more blocks than the whole pool), or wait_for == req_id.

        `wait_for` = the id of a live request P makes this a *sibling* (one of the n
        samples of one prompt): it is not admitted while P is waiting or prefilling
        (requests queued behind it still are), and once P decodes it shares P's
        computed prompt blocks, even with prefix caching off, so the prompt is
        prefilled once. An unknown, finished or aborted P leaves nothing to wait for.

        `speculates`: the request gets drafts (when the scheduler drafts at all)."""
        prompt = np.ascontiguousarray(prompt_ids, dtype=np.int64)
        if prompt.ndim != 1:
            raise ValueError(f"request {req_id}: prompt_ids must be 1-D, got shape {prompt.shape}")
        if not isinstance(stop_token_ids, np.ndarray):
            stop_token_ids = list(stop_token_ids)
        stops = np.ascontiguousarray(stop_token_ids, dtype=np.int64).reshape(-1)
        self._core.add_request(int(req_id), prompt, int(max_new_tokens), stops, int(wait_for), bool(speculates))

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

    # -- overlap scheduling (see csrc/scheduler/scheduler.hpp) -----------------

    def commit(self) -> None:
        """Records the last plan as computed before its sampled tokens are known (they are
        *pending*); the next schedule() may already run. A request whose output is then
        complete (max_new_tokens) is not scheduled again. At most two committed steps may
        be unresolved; schedule() refuses to run with two."""
        self._core.commit()

    def resolve(self, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens of the oldest committed step (one per its sample rows, in order).
        Returns (finished_req_ids int64[F], reasons int32[F], live bool[S]): live[i] is False
        when sample i belongs to a request aborted, or finished by an earlier step, since it
        was scheduled: that token must be dropped."""
        finished, reasons, live = self._core.resolve(np.ascontiguousarray(sampled, dtype=np.int64).reshape(-1))
        return finished, reasons, live.astype(bool, copy=False)

    def set_draft(self, req_id: int, tokens: np.ndarray) -> None:
        """A draft for the request's next step from a drafter outside the scheduler: the next
        schedule() uses it (clipped to num_speculative_tokens and max_new_tokens) instead of an
        n-gram draft, if the request decodes and speculates then; else it is dropped. KeyError for
        an unknown request."""
        try:
            self._core.set_draft(int(req_id), np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1))
        except IndexError as error:
            raise KeyError(str(error)) from None

    def resolve_verified(self, tokens: np.ndarray, counts: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`resolve` of a step with drafts: sample row i kept the next counts[i] of `tokens`
        (1 <= counts[i] <= 1 + its draft length: the drafts the sampler agreed with, then the token
        it sampled after them). Returns (finished_req_ids, reasons, live bool[S], used int32[S]):
        used[i] of row i's tokens are output (fewer when a stop or max_new_tokens came first; 0 when
        not live). Rejected drafts' blocks are freed."""
        finished, reasons, live, used = self._core.resolve_verified(
            np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1),
            np.ascontiguousarray(counts, dtype=np.int32).reshape(-1))
        return finished, reasons, live.astype(bool, copy=False), used

    def drop_plan(self) -> None:
        """Forgets the scheduled, uncommitted plan once every request in it was aborted (a failed step)."""
        self._core.drop_plan()

    @property
    def num_unresolved(self) -> int:
        """Committed steps whose sampled tokens were not resolved yet."""
        return self._core.num_unresolved

    # -- state ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return self._core.num_waiting

    @property
    def num_running(self) -> int:
        return self._core.num_running

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can get without preempting anyone: free blocks
        plus evictable cached blocks (kept for reuse, evicted on demand)."""
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
    def expected_output_ratio(self) -> float:
        """Running mean of the fraction of their clipped max_new_tokens finished requests produced
        (1.0 until one finishes); admission reserves it x schedule_conservativeness."""
        return self._core.expected_output_ratio

    @property
    def reserved_blocks(self) -> int:
        """Blocks the running requests are expected to need beyond those they hold (0 when off)."""
        return self._core.reserved_blocks

    @property
    def waiting_tokens(self) -> int:
        """Tokens waiting requests still have to compute (prompt, plus the output
        of a preempted request)."""
        return self._core.waiting_tokens

    @property
    def num_retracted(self) -> int:
        """Waiting requests that were preempted (they keep their output and recompute it)."""
        return self._core.num_retracted

    # -- prefix cache ---------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Registered (matchable) blocks, held by live requests or evictable."""
        return self._core.num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request holds: matchable until an allocation evicts them."""
        return self._core.num_evictable_blocks

    @property
    def prefix_query_tokens(self) -> int:
        """Prompt tokens of every first admission since start."""
        return self._core.prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        """Of prefix_query_tokens, those matched in the cache (or from a sibling's parent)."""
        return self._core.prefix_hit_tokens

    def may_draft(self) -> bool:
        """Whether the next schedule() could draft for some request were no step pending (a
        speculating decoding request out of back-off, with room, in a batch no larger than
        max_speculative_batch). False: the next step drafts for none whatever is pending."""
        return self._core.may_draft()

    @property
    def num_undrafted_batches(self) -> int:
        """Steps whose decoding batch was larger than max_speculative_batch: none of it drafted."""
        return self._core.num_undrafted_batches

    @property
    def num_backoff_steps(self) -> int:
        """Request-steps that drafted nothing because the request was backing off after a verified
        step that kept none of its drafts."""
        return self._core.num_backoff_steps

    @property
    def cache_hit_rate(self) -> float:
        """prefix_hit_tokens / prefix_query_tokens; 0.0 before any admission."""
        query = self._core.prefix_query_tokens
        return self._core.prefix_hit_tokens / query if query else 0.0

    def cached_tokens(self, req_ids: np.ndarray) -> np.ndarray:
        """int32 [N]: tokens each request matched at its first admission (0 while it
        waits for it, and for unknown ids; a finished request is forgotten by
        advance(), so read this before then, e.g. for the plan's req_ids)."""
        ids = np.ascontiguousarray(req_ids, dtype=np.int64).reshape(-1)
        return self._core.cached_tokens(ids)

    def flush_prefix_cache(self) -> int:
        """Unregisters every cached block and returns how many: evictable ones become
        free, blocks running requests hold stay theirs but are no longer matchable
        (and their later blocks are not registered). Safe while requests run."""
        return self._core.flush_prefix_cache()

    def drain_kv_events(self) -> list[tuple]:
        """Returns and clears the recorded KV events (enable_kv_events), in order:
        ("stored", block_hash, parent_hash | None, token_ids: list[int], block_size)
        when a block is registered, ("removed", block_hash) when one is evicted or
        unregistered, ("cleared",) on flush_prefix_cache(). Hashes are signed int64."""
        return self._core.drain_kv_events()

    def drain_kv_events_wire(self, first_event_id: int = 0, id_stride: int = 1) -> tuple[bytes, int]:
        """Returns and clears the recorded KV events as protobuf wire bytes: repeated field 3
        (`events`) of smg.grpc.common.KvEventBatch, so `KvEventBatch.FromString(data)` holds them;
        and how many KvCacheEvents that is. A run of stored blocks that chain is one `stored` event;
        event i's event_id is first_event_id + i * id_stride."""
        data, count = self._core.drain_kv_events_wire(first_event_id, id_stride)
        return data, int(count)

    def debug_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int32 per block: (reference counts, evictable 0/1, registered 0/1). For tests."""
        return self._core.debug_blocks()

    def debug_cached_block(self, block: int) -> tuple[int, int | None, np.ndarray] | None:
        """A registered block's (hash, parent hash or None, token ids); None if not
        registered. For tests."""
        return self._core.debug_cached_block(int(block))

    # -- state ----------------------------------------------------------------------

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
