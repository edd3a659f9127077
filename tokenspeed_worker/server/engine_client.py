"""The server's handle on the engine processes: start them, send to them, route what they send back.

Each engine process (one per data-parallel replica, `--data-parallel-size`; each may lead its own
tensor-parallel ranks) has a pipe the asyncio loop never blocks on: a `PipeSender` writes to it
from the loop while it has room and through a writer thread when it has not (a long prompt can
exceed the pipe buffer while the engine is mid-step), and a `PipeReader` delivers every inbound
message on the loop as it arrives (no thread between: see server/pipe_sender.py). Each request in
flight has a `RequestState` the Generate handler waits on; one `StepOutput` from an engine touches
many states but wakes each handler once. Engine-side request ids are unique across replicas.

Replicas: a new request goes to the replica with the fewest requests in flight (ties: the next
one in turn), or to `data_parallel_rank` when the client pins it; all n samples of a request go
to the same replica (they share its prefill). Probes, flushes and profiles go to every replica.
If any replica dies, every request fails and the worker exits (as with one engine).

Every child (engines, tensor-parallel ranks) is started through engine/lifetime.py: it ignores
SIGTERM and SIGINT, so a stop signal to the whole process group reaches only the server, which
drains; the children exit when `shutdown` tells them to, when they are killed, or within a second
of the server's death.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field

from tokenspeed_worker.engine import lifetime
from tokenspeed_worker.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    FINISH_ABORT,
    FlushCache,
    FlushReply,
    KvEvents,
    Loads,
    Probe,
    ProbeReply,
    ProfileReply,
    RequestFailed,
    Serving,
    Shutdown,
    StartProfile,
    StepOutput,
    StopProfile,
)
from tokenspeed_worker.server.pipe_sender import PipeReader, PipeSender

logger = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    pass


class StartCancelled(Exception):
    """`cancel_start` was called (a stop signal) while the engine processes were starting."""


@dataclass(eq=False)
class RequestState:
    """One request as the server sees it while the engine works on it."""

    engine_id: int
    request_id: str
    prompt_len: int
    index: int = 0  # which of the request's n samples
    cached_tokens: int = 0
    top_logprobs_num: int = 0
    wants_logprobs: bool = False
    new_tokens: list[int] = field(default_factory=list)
    # With logprobs: one (logprob, top values, top ids) per new token, aligned with new_tokens.
    new_logprobs: list[tuple[float, list[float], list[int]]] = field(default_factory=list)
    replica: int = 0  # the data-parallel replica (engine process) serving it
    finish_reason: int | None = None  # a FINISH_* code once finished
    error: tuple[str, str] | None = None  # (grpc status code name, message)
    num_output_tokens: int = 0
    # Speculative decoding: drafts verified for it, of them kept, and the steps that verified one.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    # When a step's tokens wake the handler (`event`): 1, every step that brings some; k > 1, once k
    # wait (and at the first token); 0, only when it ends. Errors and the end always wake it.
    wake_every: int = 1
    # Host wall-clock timestamps, kept only with an observer (server/metrics.py).
    recv_ts: float = 0.0
    commit_ts: float = 0.0
    first_ts: float = 0.0
    last_ts: float = 0.0
    output_ids: list[int] = field(default_factory=list)  # only with --log-requests-level >= 2

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class _Replica:
    """One engine process (a data-parallel replica) and its pipe, sender and tensor-parallel followers."""

    def __init__(self, index: int, cfg) -> None:
        self.index = index
        self.cfg = cfg
        self.proc = None
        self.conn = None
        self.followers: list = []  # tensor-parallel ranks 1..N-1 (engine/tp_worker.py)
        self.sender: PipeSender | None = None  # from `attach` on; before it, `conn.send` (startup)
        self.reader: PipeReader | None = None  # from `attach` on; before it, `conn.recv` (startup)
        self.ready: EngineReady | None = None
        self.in_flight = 0  # request states submitted to it and not finished
        self.busy = None  # the engine loop's shared "in a step since" (engine_main's `busy`), from start

    def kill_followers(self) -> None:
        for proc in self.followers:
            if proc.is_alive():
                proc.kill()
            proc.join(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.pid is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(5)
        self.kill_followers()


def cpu_threads_per_process(cfg, count: int = 1) -> int:
    """torch's intra-op threads for each of the node's engine processes (`count` replicas of
    ranks_per_node ranks) on a CPU: the cores this process may run on, shared out (each would
    otherwise take every core, and N processes spinning N x cores threads thrash; docs/benchmarks.md
    has the figures). 0 (torch's default) for one process, on a GPU, or where OMP_NUM_THREADS says
    how many."""
    processes = count * cfg.parallel.ranks_per_node
    if cfg.model.device != "cpu" or processes <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return 0
    return max(1, len(os.sched_getaffinity(0)) // processes)


def replica_config(cfg, index: int, count: int = 1):
    """Replica `index` of `count`'s engine config: on GPUs its own block of tensor_parallel_size
    devices; on a CPU its share of the cores (cpu_threads_per_process); KV event ids of its own
    (index, index + count, ...)."""
    if count > 1:
        cfg = cfg.replace(kv_event_id_offset=index, kv_event_id_stride=count)
    threads = cpu_threads_per_process(cfg, count)
    if threads:
        cfg = cfg.replace(cpu_threads=threads)
    if index == 0:
        return cfg
    device = cfg.model.device  # "cpu", "cuda" or "cuda:N" (no torch here: the server process never imports it)
    if device.startswith("cuda"):
        device = f"cuda:{int(device.partition(':')[2] or 0) + index * cfg.parallel.tensor_parallel_size}"
    return cfg.replace(device=device, dist_init_method=None)


class EngineClient:
    def __init__(self, engine_cfg, log_level: str = "info", data_parallel_size: int = 1) -> None:
        self._cfg = engine_cfg
        self._log_level = log_level
        self._ids = itertools.count(1)
        self._nonces = itertools.count(1)
        self.requests: dict[int, RequestState] = {}
        # request_id -> its n samples (one state each), while any of them is in flight
        self.by_request_id: dict[str, list[RequestState]] = {}
        self._waiters: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready: EngineReady | None = None  # replica 0's (every replica has the same shape)
        self.dead_message: str | None = None
        self.data_parallel_size = max(1, int(data_parallel_size))
        self._replicas = [_Replica(k, replica_config(engine_cfg, k, self.data_parallel_size))
                          for k in range(self.data_parallel_size)]
        self._turn = 0  # round-robin among equally loaded replicas
        self._closing = False
        self._start_cancelled = False
        self.on_dead = None  # optional callback(message) run on the loop
        # Optional callback(replica index, KvEvents) run on the loop (server/kv_event_hub.KvEventHub).
        self.on_kv_events = None
        # Each replica's latest loads and when they arrived (time.monotonic()), from a probe or
        # a KvEvents message; None before the first.
        self.latest_loads: list[tuple[Loads, float] | None] = [None] * self.data_parallel_size
        self._prefill_pending = 0  # prefill_pending_tokens()
        # Optional server/metrics.RequestObserver (metrics, request stats, request logs);
        # None: no timestamp, no per-token work.
        self.observer = None
        # The watchdog's clock: the last time the engine showed progress (a step output, or the
        # moment work arrived at an idle engine).
        self.last_progress = 0.0

    # ---- lifecycle ---------------------------------------------------------

    def start(self, timeout: float | None = None) -> EngineReady:
        """Spawn the engine processes and block until each reports ready (or one failed); raises
        StartCancelled, with every process started so far killed, after `cancel_start`."""
        try:
            for replica in self._replicas:
                self._start_replica(replica, timeout)
        except EngineUnavailable:
            self.shutdown(5.0)
            raise
        except BaseException:  # StartCancelled, KeyboardInterrupt: nothing is in flight, kill at once
            for replica in self._replicas:
                replica.kill()
            raise
        self.ready = self._replicas[0].ready
        return self.ready

    def cancel_start(self) -> None:
        """Make a `start` in progress stop within a fraction of a second (safe in a signal handler)."""
        self._start_cancelled = True

    def _check_cancelled(self) -> None:
        if self._start_cancelled:
            raise StartCancelled("stopped during startup")

    def _start_replica(self, replica: _Replica, timeout: float | None) -> None:
        from tokenspeed_worker.engine.process import engine_main

        ctx = mp.get_context("spawn")
        cfg = replica.cfg
        if cfg.parallel.tensor_parallel_size > 1:  # ranks 1..N-1 first; rank 0 (the engine) joins them
            from tokenspeed_worker.engine.tp_worker import start_followers

            cfg, replica.followers = start_followers(cfg, self._log_level)
        self._check_cancelled()
        parent, child = ctx.Pipe(duplex=True)
        name = "tokenspeed-engine" if self.data_parallel_size == 1 else f"tokenspeed-engine-dp{replica.index}"
        replica.busy = ctx.RawValue("d", 0.0)
        replica.proc = ctx.Process(target=engine_main, args=(cfg, child, self._log_level, time.time(), replica.busy),
                                   name=name, daemon=True)
        lifetime.start(replica.proc)
        child.close()
        replica.conn = parent
        where = "" if self.data_parallel_size == 1 else f" (data-parallel replica {replica.index})"
        while True:
            self._check_cancelled()
            if not parent.poll(timeout if timeout is not None else 0.25):
                if timeout is not None or not replica.proc.is_alive():
                    replica.proc.kill()
                    replica.kill_followers()
                    raise EngineUnavailable(f"engine process did not become ready{where}")
                continue
            try:
                msg = parent.recv()
            except EOFError:
                replica.kill_followers()
                raise EngineUnavailable(
                    f"engine process exited during startup (code {replica.proc.exitcode}){where}")
            if isinstance(msg, EngineDead):
                replica.proc.join(5)
                replica.kill_followers()
                raise EngineUnavailable(msg.message + where)
            if isinstance(msg, EngineReady):
                replica.ready = msg
                return

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the pipes' senders and readers; messages are delivered on `loop` from now on."""
        self._loop = loop
        for replica in self._replicas:
            replica.sender = PipeSender(replica.conn, name=f"engine-writer-{replica.index}")
            replica.reader = PipeReader(replica.conn, loop, lambda msg, i=replica.index: self._on_message(msg, i),
                                        lambda r=replica: self._on_pipe_closed(r))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell every engine to stop (each stops its tensor-parallel ranks) and wait for them; kill
        what is still alive after `timeout` s."""
        self._closing = True
        for replica in self._replicas:
            if replica.proc is not None and replica.proc.is_alive():
                if replica.sender is None:  # not attached yet (stopped before serving)
                    try:
                        replica.conn.send(Shutdown())
                    except (OSError, ValueError, AttributeError):
                        pass
                else:
                    replica.sender.send(Shutdown())
        for replica in self._replicas:
            if replica.proc is None:
                continue
            replica.proc.join(timeout)
            if replica.proc.is_alive():
                replica.proc.kill()
                replica.proc.join(5)
            for proc in replica.followers:  # told to stop by rank 0; otherwise they see it gone
                proc.join(max(1.0, timeout / 2))
            replica.kill_followers()
            if replica.sender is not None:
                replica.sender.close()
            if replica.reader is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(replica.reader.close)

    def kill_now(self) -> None:
        """SIGKILL every engine process and tensor-parallel rank, without waiting (safe in a signal
        handler): a stop signal during `shutdown`."""
        lifetime.kill_all()

    @property
    def alive(self) -> bool:
        return self.dead_message is None and all(r.proc is not None and r.proc.is_alive() for r in self._replicas)

    @property
    def pid(self) -> int | None:
        return self._replicas[0].proc.pid if self._replicas[0].proc else None

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self._replicas if r.proc is not None]

    # ---- the pipe's end ------------------------------------------------------

    def _on_pipe_closed(self, replica: _Replica) -> None:
        """The engine's end of the pipe is gone (on the loop): unless shutting down, the engine died;
        its exit code is waited for (at most 1 s) off the loop, then every request fails."""
        if self._closing:
            return
        where = "" if self.data_parallel_size == 1 else f" (data-parallel replica {replica.index})"

        def died() -> None:
            self._on_message(EngineDead(f"engine process exited unexpectedly (exit code {replica.proc.exitcode})"
                                        f"{where}"), replica.index)

        self._loop.run_in_executor(None, replica.proc.join, 1.0).add_done_callback(lambda _f: died())

    # ---- inbound (runs on the event loop) -----------------------------------

    def _on_message(self, msg, replica: int = 0) -> None:
        if isinstance(msg, (StepOutput, RequestFailed)):
            self.last_progress = time.monotonic()
        if isinstance(msg, StepOutput):
            if msg.kv_events is not None:  # first: its loads are those of the step it rides on
                self._on_kv_events(replica, msg.kv_events)
            touched = []
            requests = self.requests
            cached = msg.cached_tokens.tolist() if msg.cached_tokens is not None else [0] * len(msg.req_ids)
            for i, (engine_id, token, num_cached) in enumerate(
                zip(msg.req_ids.tolist(), msg.tokens.tolist(), cached)
            ):
                st = requests.get(engine_id)
                if st is not None:
                    st.new_tokens.append(token)
                    if st.num_output_tokens == 0 and st.index == 0:
                        self._prefill_pending -= st.prompt_len
                    st.num_output_tokens += 1
                    st.cached_tokens = num_cached
                    if st.wants_logprobs:
                        st.new_logprobs.append(_logprob_entry(msg, i, st.top_logprobs_num))
                    touched.append(st)
            if msg.spec_ids is not None:
                for engine_id, drafted, kept in zip(msg.spec_ids.tolist(), msg.spec_draft_tokens.tolist(),
                                                    msg.spec_accepted_tokens.tolist()):
                    st = requests.get(engine_id)
                    if st is not None:
                        st.spec_draft_tokens += drafted
                        st.spec_accepted_tokens += kept
                        st.spec_verify_steps += 1
            if self.observer is not None:
                self._observe_step(msg, touched)
            for engine_id, reason in zip(msg.finished_ids.tolist(), msg.finish_reasons.tolist()):
                st = requests.get(engine_id)
                if st is not None and st.finish_reason is None:
                    st.finish_reason = int(reason)
                    self._forget(st)
            for st in touched:  # each brought at least one new token
                waiting = len(st.new_tokens)
                if st.done or (st.wake_every and (waiting >= st.wake_every or waiting == st.num_output_tokens)):
                    st.event.set()  # the end, k tokens waiting, or the first token(s)
        elif isinstance(msg, RequestFailed):
            st = self.requests.get(msg.req_id)
            if st is not None and not st.done:
                st.error = (msg.code, msg.message)
                self._forget(st)
                st.event.set()
        elif isinstance(msg, KvEvents):
            self._on_kv_events(replica, msg)
        elif isinstance(msg, (ProbeReply, FlushReply, ProfileReply)):
            if isinstance(msg, ProbeReply):
                self.latest_loads[replica] = (msg.loads, time.monotonic())
            fut = self._waiters.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EngineDead):
            self._fail_everything(msg.message)

    def _on_kv_events(self, replica: int, msg: KvEvents) -> None:
        if msg.loads is not None:
            self.latest_loads[replica] = (msg.loads, time.monotonic())
        if self.on_kv_events is not None:
            self.on_kv_events(replica, msg)

    def _observe_step(self, msg: StepOutput, touched: list[RequestState]) -> None:
        obs = self.observer
        requests = self.requests
        if msg.scheduled_ids is not None:
            for engine_id in msg.scheduled_ids.tolist():
                st = requests.get(engine_id)
                if st is not None:
                    obs.on_scheduled(st, msg.step_start_ts)
        obs.on_step(msg, len(touched))
        now = time.time()
        for st in touched:
            obs.on_token(st, st.new_tokens[-1], now)

    def _fail_everything(self, message: str) -> None:
        if self.dead_message is not None:
            return
        self.dead_message = message
        logger.error("engine is dead: %s; failing %d request(s)", message, len(self.requests))
        for st in list(self.requests.values()):
            # The engine's own messages already begin "engine failed" (engine/process.py).
            st.error = ("INTERNAL", message if message.startswith("engine") else f"engine failed: {message}")
            st.event.set()
            if self.observer is not None:
                self.observer.on_end(st)
        self.requests.clear()
        self._prefill_pending = 0
        self.by_request_id.clear()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(message))
        self._waiters.clear()
        if self.on_dead is not None:
            self.on_dead(message)

    def _forget(self, st: RequestState) -> None:
        if self.requests.pop(st.engine_id, None) is not None:
            self._replicas[st.replica].in_flight -= 1
            if st.num_output_tokens == 0 and st.index == 0:
                self._prefill_pending -= st.prompt_len
            if self.observer is not None:
                self.observer.on_end(st)
        group = self.by_request_id.get(st.request_id)
        if group is not None and st in group and all(s.done for s in group):
            del self.by_request_id[st.request_id]

    # ---- outbound -----------------------------------------------------------

    def pick_replica(self, dp_rank: int | None = None) -> int:
        """`dp_rank` when given, else the replica with the fewest requests in flight (ties in turn)."""
        if dp_rank is not None:
            if not 0 <= dp_rank < self.data_parallel_size:
                raise ValueError(f"data_parallel_rank: {dp_rank} does not exist (ranks 0..{self.data_parallel_size - 1})")
            return dp_rank
        n = self.data_parallel_size
        order = [(self._turn + k) % n for k in range(n)]
        best = min(order, key=lambda k: self._replicas[k].in_flight)
        self._turn = (best + 1) % n
        return best

    def submit(self, request_id: str, adds: list[AddRequest], dp_rank: int | None = None,
               wake_every: int = 1) -> list[RequestState]:
        """Register and send a request's samples (n >= 1; `req_id`s are filled in here) to one replica
        (`pick_replica`).

        Samples after the first wait for the first's prefill and share its prompt blocks.
        All samples share one event, so the handler wakes once per step for all of them, and only
        as `wake_every` asks (RequestState): a handler that sends nothing until the end need not run
        at every token.
        """
        if self.dead_message is not None:
            raise EngineUnavailable(self.dead_message)
        replica = self._replicas[self.pick_replica(dp_rank)]
        if not self.requests:
            self.last_progress = time.monotonic()
        event = asyncio.Event()
        obs = self.observer
        recv_ts = time.time() if obs is not None else 0.0
        states = []
        for index, add in enumerate(adds):
            add.req_id = next(self._ids)
            if index > 0:
                add.wait_for = adds[0].req_id
            st = RequestState(engine_id=add.req_id, request_id=request_id, prompt_len=int(len(add.prompt_ids)),
                              index=index, event=event, top_logprobs_num=add.sampling_params.top_logprobs_num,
                              wants_logprobs=add.sampling_params.return_logprob, recv_ts=recv_ts, replica=replica.index,
                              wake_every=wake_every)
            self.requests[st.engine_id] = st
            states.append(st)
        replica.in_flight += len(states)
        self._prefill_pending += states[0].prompt_len
        self.by_request_id[request_id] = states
        if obs is not None:
            obs.on_arrival(request_id, adds)
        for add in adds:
            replica.sender.send(add)
        return states

    def prefill_pending_tokens(self) -> int:
        """Prompt tokens of requests handed to the engine that have produced no output yet (a
        request's later samples share its first's prefill and are not counted again); kept as
        requests come, produce their first token and end, for the pushed load of every KV batch."""
        return self._prefill_pending

    def num_queued(self) -> int:
        """Samples submitted that have not produced a token yet (waiting or prefilling)."""
        return sum(1 for st in self.requests.values() if st.num_output_tokens == 0)

    def fail_everything(self, message: str) -> None:
        """End every request with INTERNAL and stop the engine process (watchdog)."""
        self._fail_everything(message)
        for replica in self._replicas:
            if replica.proc is not None and replica.proc.is_alive():
                replica.proc.kill()

    def in_flight(self, request_id: str) -> bool:
        return request_id in self.by_request_id

    def finish_early(self, st: RequestState, reason: int) -> None:
        """The server ended a sample itself (a stop string matched): free it in the engine."""
        if st.done:
            return
        st.finish_reason = reason
        self._forget(st)
        self._replicas[st.replica].sender.send(AbortRequests([st.engine_id]))

    def abort(self, states: list[RequestState]) -> bool:
        """End every unfinished sample with finish reason abort and free them in the engine.

        False if all were already done."""
        live = [st for st in states if not st.done]
        for st in live:
            st.finish_reason = FINISH_ABORT
        for st in live:
            self._forget(st)
        if live:
            for replica in {st.replica for st in live}:
                self._replicas[replica].sender.send(
                    AbortRequests([st.engine_id for st in live if st.replica == replica]))
            live[0].event.set()
            for st in live[1:]:
                if st.event is not live[0].event:
                    st.event.set()
        return bool(live)

    async def _ask(self, make, timeout: float, replica: int = 0):
        if self.dead_message is not None:
            raise EngineUnavailable(self.dead_message)
        nonce = next(self._nonces)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[nonce] = fut
        self._replicas[replica].sender.send(make(nonce))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiters.pop(nonce, None)

    def serving(self) -> None:
        """Tell every replica the worker serves: each then captures its decode graphs left while idle
        (messages.Serving)."""
        for replica in self._replicas:
            replica.sender.send(Serving())

    async def _ask_all(self, make, timeout: float) -> list:
        return list(await asyncio.gather(*(self._ask(make, timeout, k) for k in range(self.data_parallel_size))))

    async def probe_all(self, timeout: float) -> list[Loads]:
        """Round trip through every replica's engine loop (proves each is stepping); their loads in rank order."""
        return [reply.loads for reply in await self._ask_all(Probe, timeout)]

    async def probe_each(self, timeout: float) -> list:
        """Each replica's probe: its Loads, or the exception its round trip raised (a timeout)."""
        return list(await asyncio.gather(*(self._ask(Probe, timeout, k) for k in range(self.data_parallel_size)),
                                         return_exceptions=True))

    def busy_seconds(self, replica: int) -> float | None:
        """How long the replica's engine loop has been inside one step (or one idle capture), or None
        when it is between steps or its process is gone."""
        r = self._replicas[replica]
        since = r.busy.value if r.busy is not None else 0.0
        if not since or r.proc is None or not r.proc.is_alive():
            return None
        return max(0.0, time.time() - since)

    async def probe(self, timeout: float) -> Loads:
        """Round trip through every engine loop; the loads of all replicas together (sums; the hit
        rate and throughput as the replicas' mean and sum)."""
        return combine_loads(await self.probe_all(timeout))

    async def flush_cache(self, timeout: float) -> FlushReply:
        return _combined(await self._ask_all(FlushCache, timeout))

    async def start_profile(self, timeout: float, **options) -> ProfileReply:
        return _combined(await self._ask_all(lambda nonce: StartProfile(nonce, **options), timeout))

    async def stop_profile(self, timeout: float) -> ProfileReply:
        return _combined(await self._ask_all(StopProfile, timeout))


def combine_loads(loads: list[Loads]) -> Loads:
    """The replicas' loads as one: counts and throughput summed, the hit rate their mean."""
    if len(loads) == 1:
        return loads[0]
    total = dataclasses.replace(loads[0])
    for name in ("num_running", "num_waiting", "num_used_tokens", "num_free_blocks", "num_total_blocks",
                 "waiting_tokens", "num_preemptions", "gen_throughput", "num_cached_blocks",
                 "num_grammar_waiting", "num_retracted", "spec_undrafted_batches", "spec_backoff_steps"):
        setattr(total, name, sum(getattr(x, name) for x in loads))
    total.cache_hit_rate = sum(x.cache_hit_rate for x in loads) / len(loads)
    for name in ("spec_accept_length", "spec_accept_rate"):
        known = [getattr(x, name) for x in loads if getattr(x, name) is not None]
        setattr(total, name, sum(known) / len(known) if known else None)
    return total


def _combined(replies: list):
    """One reply for every replica's: success if all succeeded, their messages joined (with ranks)."""
    if len(replies) == 1:
        return replies[0]
    message = "; ".join(f"replica {k}: {r.message}" for k, r in enumerate(replies))
    return type(replies[0])(replies[0].nonce, all(r.success for r in replies), message)


def _logprob_entry(msg: StepOutput, i: int, top_k: int) -> tuple[float, list[float], list[int]]:
    """Row i's logprobs from a step: the sampled token's, then its top-k and requested ids
    (the wire has one per-position list, TopLogProbs, for both: top-k first, then the
    requested ids not already among them)."""
    logprob = float(msg.logprobs[i]) if msg.logprobs is not None else float("nan")
    values: list[float] = []
    ids: list[int] = []
    if top_k and msg.top_logprobs is not None:
        values = msg.top_logprobs[i, :top_k].tolist()
        ids = msg.top_logprob_ids[i, :top_k].tolist()
    if msg.token_ids_logprob_counts is not None and msg.token_ids_logprob_counts[i]:
        count = int(msg.token_ids_logprob_counts[i])
        seen = set(ids)
        requested = zip(msg.token_ids_logprobs[i, :count].tolist(), msg.token_ids_logprob_ids[i, :count].tolist())
        for value, token in requested:
            if token not in seen:
                values.append(value)
                ids.append(token)
                seen.add(token)
    return logprob, values, ids
