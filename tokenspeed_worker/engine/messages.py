"""Typed messages between the gRPC server process and the engine core process.

They travel pickled over a multiprocessing pipe. The engine sends exactly one
`StepOutput` per scheduler step (never one message per token); per-request data
in it is flat numpy arrays keyed by the integer ids the server assigned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenspeed_worker.sampling.params import SamplingParams

# Finish reasons as the native scheduler reports them (kept in one place).
FINISH_NONE = 0
FINISH_STOP = 1  # a stop token id (EOS unless ignore_eos, or stop_token_ids)
FINISH_LENGTH = 2  # max_new_tokens or the context limit
FINISH_ABORT = 3


# ---- server -> engine -------------------------------------------------------


@dataclass
class AddRequest:
    req_id: int  # engine id, assigned by the server, never reused
    prompt_ids: np.ndarray  # int32 [P]
    max_new_tokens: int  # already clamped to the context limit
    sampling_params: SamplingParams  # seed set (random when the client set none); stop ids include EOS
    # n > 1: the other samples wait for the first's prefill and share its prompt blocks.
    wait_for: int = -1  # engine id of the sample to wait for, -1 for none
    # Structured output: (kind, text) with kind one of engine/grammar.CONSTRAINT_KINDS, or None.
    constraint: tuple[str, str] | None = None


@dataclass
class AbortRequests:
    req_ids: list[int]


@dataclass
class Probe:
    """Answered between two steps: proves the loop is alive; carries loads back."""

    nonce: int


@dataclass
class FlushCache:
    nonce: int


@dataclass
class StartProfile:
    nonce: int
    output_dir: str
    num_steps: int | None = None  # stop by itself after this many steps
    activities: tuple[str, ...] = ("CPU", "GPU")
    with_stack: bool = False
    record_shapes: bool = False


@dataclass
class StopProfile:
    nonce: int


@dataclass
class Shutdown:
    pass


@dataclass
class Serving:
    """The worker serves (its warm-up generation passed, its port is open): from now on the engine
    captures the decode graphs its startup left while it idles. Not before: a capture begun as the
    engine became ready would hold the warm-up generation, and the port, behind it (on a cold start,
    one capture's kernel compiles)."""


# ---- engine -> server -------------------------------------------------------


@dataclass
class EngineReady:
    num_blocks: int
    block_size: int
    max_total_tokens: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_bytes: int
    weight_bytes: int
    device: str
    dtype: str
    graph_bytes: int = 0  # device memory the captured CUDA graphs took (0: none captured)
    decode_read_bytes: int = 0  # weight bytes a one-token step reads (ModelRunner.decode_read_bytes)
    # The longest request (prompt + output) the KV pool can ever hold: max_model_len, or fewer
    # tokens when the pool is smaller and no sliding window bounds what a request holds (0: unknown).
    max_request_tokens: int = 0


@dataclass
class StepOutput:
    """Everything one step produced. Rows of the arrays are sampling requests."""

    req_ids: np.ndarray  # int64 [S]
    tokens: np.ndarray  # int64 [S]; a request may appear several times (speculative decoding), in order
    finished_ids: np.ndarray  # int64 [F]
    finish_reasons: np.ndarray  # int32 [F]
    cached_tokens: np.ndarray | None = None  # int32 [S] prompt tokens served from the prefix cache
    # Logprobs (raw: log_softmax of the model's logits; sampling.sampler.SampleOutput's fields on the
    # host), present when a row asked for them; then they hold a value for every row. K / M: the
    # largest count any row asked for.
    logprobs: np.ndarray | None = None  # float32 [S] of the sampled token
    top_logprobs: np.ndarray | None = None  # float32 [S, K], descending
    top_logprob_ids: np.ndarray | None = None  # int64 [S, K]
    token_ids_logprobs: np.ndarray | None = None  # float32 [S, M] of the requested token ids
    token_ids_logprob_ids: np.ndarray | None = None  # int64 [S, M]
    token_ids_logprob_counts: np.ndarray | None = None  # int64 [S] how many of M are real
    step_seconds: float = 0.0
    # Requests scheduled into a forward batch for the first time in this step (their prefill
    # started here), and the wall-clock (time.time()) this step began: the server's queue time.
    scheduled_ids: np.ndarray | None = None  # int64 [N], None when N == 0
    step_start_ts: float = 0.0
    kv_events: "KvEvents | None" = None  # the turn's prefix-cache events, on its last output
    # Speculative decoding: the requests that verified a draft in this step (each once), its
    # length and how many of its tokens were kept and output. None when none did.
    spec_ids: np.ndarray | None = None  # int64 [D]
    spec_draft_tokens: np.ndarray | None = None  # int32 [D]
    spec_accepted_tokens: np.ndarray | None = None  # int32 [D]


@dataclass
class RequestFailed:
    req_id: int
    code: str  # a grpc.StatusCode name, e.g. "INVALID_ARGUMENT"
    message: str


@dataclass
class Loads:
    num_running: int
    num_waiting: int
    num_used_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    waiting_tokens: int
    num_preemptions: int
    gen_throughput: float  # output tokens / s over the last window
    cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens
    num_cached_blocks: int = 0
    num_grammar_waiting: int = 0  # requests waiting for their grammar to compile (not yet scheduled)
    num_retracted: int = 0  # waiting requests that were preempted and keep output to recompute
    # Speculative decoding since start: tokens output per verified row-step (kept drafts + 1), and
    # the fraction of draft tokens kept; None when off or before any draft.
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_undrafted_batches: int = 0  # steps whose batch was too large to draft for
    spec_backoff_steps: int = 0  # request-steps not drafted: backing off after rejected drafts


@dataclass
class KvEvents:
    """The prefix-cache events of one engine turn and the engine's loads then; only when there are
    events, riding on the turn's last StepOutput (or alone when the turn produced none). `data` is
    protobuf wire bytes, repeated field 3 of smg.grpc.common.KvEventBatch (Scheduler.
    drain_kv_events_wire), event ids already assigned; the server streams them on SubscribeKvEvents."""

    timestamp: float  # time.time() when drained
    data: bytes
    count: int  # KvCacheEvents in data
    loads: Loads | None  # the engine's loads then; None when it sent them less than 20 ms ago


@dataclass
class ProbeReply:
    nonce: int
    loads: Loads


@dataclass
class ProfileReply:
    nonce: int
    success: bool
    message: str


@dataclass
class FlushReply:
    nonce: int
    success: bool
    message: str


@dataclass
class EngineDead:
    message: str
    failed_ids: list[int] = field(default_factory=list)
