"""`tokenspeed.grpc.scheduler.TokenSpeedScheduler` over the engine process.

Every Generate ends with exactly one terminal message (a GenerateComplete) or
one error status; whichever way it ends, the engine is told to free the
request (Abort RPC, cancelled call, or a handler torn down mid-stream).
"""

from __future__ import annotations

import asyncio
import os
import dataclasses
import logging
import time
from datetime import datetime, timezone

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from tokenspeed_worker import env
from tokenspeed_worker import __version__
from tokenspeed_worker.engine.messages import FINISH_LENGTH
from tokenspeed_worker.proto import common_pb2, tokenspeed_scheduler_pb2 as pb, tokenspeed_scheduler_pb2_grpc as pb_grpc
from tokenspeed_worker.server.engine_client import EngineClient, EngineUnavailable, RequestState
from tokenspeed_worker.server.kv_event_hub import KvEventHub, SubscriberFellBehind
from tokenspeed_worker.server.model_info import ModelFacts
from tokenspeed_worker.server.sample_stream import SampleStream
from tokenspeed_worker.server.validation import RequestError, validate_generate

logger = logging.getLogger(__name__)

SERVICE_NAME = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"
# The gateway's HealthCheck timeout is 5 s; answer well inside it.
HEALTH_PROBE_TIMEOUT_S = 3.0
# A step (or an idle capture) running longer than this without the loop answering is taken for a
# hang: the health check turns unhealthy. Shorter ones (a long prompt chunk on a CPU takes tens of
# seconds) count as work, as vLLM's health counts a live engine.
BUSY_STEP_HEALTHY_S = 300.0
LOADS_TIMEOUT_S = 5.0
# Writing a trace can take a while (minutes for a long GPU profile).
PROFILE_TIMEOUT_S = 600.0

def _json_safe(obj):
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if isinstance(obj, (list, tuple, set)):
        return [_json_safe(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    return str(obj)


class TokenSpeedSchedulerServicer(pb_grpc.TokenSpeedSchedulerServicer):
    def __init__(self, engine: EngineClient, facts: ModelFacts, server_args) -> None:
        self.engine = engine
        self.facts = facts
        self.server_args = server_args
        self.stream_interval = max(1, int(server_args.stream_interval or 1))
        # --enable-cache-report: the prefix-cache hit of each request goes to the gateway (which puts it
        # into usage.prompt_tokens_details.cached_tokens); off, 0 does. Metrics and logs count it either way.
        self.cache_report = bool(server_args.enable_cache_report)
        self.max_queued_requests = server_args.max_queued_requests
        self.active_calls = 0  # Generate handlers running (the drain waits for them)
        self.tokenizer = None
        self._special_token_ids: frozenset[int] | None = None
        if facts.has_tokenizer:
            from tokenspeed_worker.server.stop_strings import load_tokenizer

            self.tokenizer = load_tokenizer(facts.tokenizer_path)
        self.start_time = time.time()
        self.serving = False  # True once warm; False again while shutting down
        self.kv_hub = KvEventHub(engine)  # SubscribeKvEvents' stream (and its load records)

    # ---- Generate -------------------------------------------------------------

    async def Generate(self, request, context):
        rid = request.request_id
        try:
            v = validate_generate(request, self.facts)
        except RequestError as e:
            await self._reject(context, rid, e.code, e.message)
        rid = v.request_id
        if not self.serving:
            await self._reject(context, rid, grpc.StatusCode.UNAVAILABLE,
                               "worker is not serving (starting up or shutting down)")
        if self.engine.in_flight(rid):
            await self._reject(context, rid, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already in flight")
        # The bound counts samples (n > 1 queues n of them). A request with more samples than the
        # bound could never be taken, idle or not: INVALID_ARGUMENT, not a 429 every worker repeats.
        if self.max_queued_requests is not None and v.n > self.max_queued_requests:
            await self._reject(
                context, rid, grpc.StatusCode.INVALID_ARGUMENT,
                f"sampling_params.n: {v.n} samples can never wait within --max-queued-requests "
                f"{self.max_queued_requests}",
            )
        if self.max_queued_requests is not None and self.engine.num_queued() + v.n > self.max_queued_requests:
            await self._reject(
                context,
                rid,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"queue full: {self.engine.num_queued()} samples waiting, {v.n} more asked (--max-queued-requests "
                f"{self.max_queued_requests}); retry on another worker",
            )
        if v.adds[0].max_new_tokens == 0:
            # The prompt back and nothing generated: every sample ends here, the engine never sees it
            # (metrics and request logs count it as a request that finished by length).
            prompt_len = len(v.adds[0].prompt_ids)
            obs = self.engine.observer
            if obs is not None:
                obs.on_arrival(rid, v.adds)
                now = time.time()
                for index in range(v.n):
                    obs.on_end(RequestState(engine_id=0, request_id=rid, prompt_len=prompt_len, index=index,
                                            finish_reason=FINISH_LENGTH, recv_ts=now))
            for index in range(v.n):
                yield pb.GenerateResponse(request_id=rid, complete=pb.GenerateComplete(
                    finish_reason="length", prompt_tokens=prompt_len, index=index))
            return
        try:
            # Wake the loop below as it has something to send: every step where a stop string must
            # be found as it forms, every `interval` tokens when streaming, else only at the end.
            wake = 1 if v.stop_strings else (self.stream_interval if v.stream else 0)
            states = self.engine.submit(rid, v.adds, v.dp_rank, wake_every=wake)
        except EngineUnavailable as e:
            await self._reject(context, rid, grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")

        samples = [SampleStream(st, v, self._stop_matcher(v, st), self.cache_report) for st in states]
        interval = self.stream_interval
        event = states[0].event
        open_samples = set(range(len(states)))
        # Non-streaming, the completes go out in index order, each once every lower index is done:
        # smg (1.13) numbers a unary response's choices by the order its completes arrive, so a
        # sample that finished first (shorter, or speculation accepting more of it) would take
        # choice 0, unlike the same seeded request streamed. The client waits for all of them anyway.
        held: dict[int, pb.GenerateComplete] = {}
        next_held = 0
        self.active_calls += 1
        try:
            while open_samples:
                await event.wait()
                event.clear()
                for i in sorted(open_samples):
                    out = samples[i]
                    st = out.state
                    if st.error is not None:
                        code, message = st.error
                        await context.abort(getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL), message)
                    if not out.take_new(self.engine):
                        continue
                    finished = out.finish_reason is not None
                    if v.stream:
                        # A chunk every `interval` tokens; the first and the last are never held back.
                        if out.ready and (len(out.ready) >= interval or finished or not out.sent):
                            yield pb.GenerateResponse(request_id=rid, chunk=out.chunk())
                    if finished:
                        open_samples.discard(i)
                        if v.stream:
                            yield pb.GenerateResponse(request_id=rid, complete=out.complete(True))
                        else:
                            held[i] = out.complete(False)
                while next_held in held:
                    yield pb.GenerateResponse(request_id=rid, complete=held.pop(next_held))
                    next_held += 1
        finally:
            self.active_calls -= 1
            # Cancelled call, a dropped stream, or an error above: free them in the engine.
            self.engine.abort(states)

    async def _reject(self, context, rid: str, code: grpc.StatusCode, message: str):
        """End a Generate before it reached the engine (counted in tokenspeed:request_errors_total)."""
        obs = self.engine.observer
        if obs is not None:
            if obs.metrics is not None:
                obs.metrics.error(code.name)
            if obs.log_requests:
                logger.info("Req: %s Rejected! %s: %s", rid, code.name, message)
        await context.abort(code, message)

    def _stop_matcher(self, v, st):
        if not v.stop_strings:
            return None
        from tokenspeed_worker.server.stop_strings import StopStringMatcher

        return StopStringMatcher(
            self.tokenizer,
            v.stop_strings,
            prompt_ids=v.adds[0].prompt_ids[-8:].tolist(),
            skip_special_tokens=v.skip_special_tokens,
            spaces_between_special_tokens=v.spaces_between_special_tokens,
            no_stop_trim=v.no_stop_trim,
            special_ids=self._special_ids(),
            min_tokens=v.adds[0].sampling_params.min_new_tokens,  # stop strings wait for it too
        )

    def _special_ids(self) -> frozenset[int]:
        """The tokenizer's special ids, computed once (not per request and sample)."""
        if self._special_token_ids is None:
            from tokenspeed_worker.server.stop_strings import special_token_ids

            self._special_token_ids = special_token_ids(self.tokenizer)
        return self._special_token_ids

    # ---- Abort ------------------------------------------------------------------

    async def Abort(self, request, context):
        states = self.engine.by_request_id.get(request.request_id)
        if states is None or not self.engine.abort(states):
            return pb.AbortResponse(success=False, message=f"request {request.request_id!r} not found")
        logger.info("aborted %s (%s)", request.request_id, request.reason or "no reason given")
        return pb.AbortResponse(success=True, message=f"aborted {request.request_id}")

    # ---- health and facts --------------------------------------------------------------

    async def HealthCheck(self, request, context):
        if not self.serving:
            return pb.HealthCheckResponse(healthy=False, message="not serving (starting up or shutting down)")
        try:
            replies = await self.engine.probe_each(HEALTH_PROBE_TIMEOUT_S)
        except EngineUnavailable as e:
            return pb.HealthCheckResponse(healthy=False, message=f"engine unavailable: {e}")
        busy = []
        for k, reply in enumerate(replies):
            if isinstance(reply, EngineUnavailable):
                return pb.HealthCheckResponse(healthy=False, message=f"engine unavailable: {reply}")
            if isinstance(reply, BaseException):  # no answer in time: healthy only inside a step short of the limit
                seconds = self.engine.busy_seconds(k)
                if seconds is None or seconds > BUSY_STEP_HEALTHY_S:
                    where = "" if len(replies) == 1 else f" (data-parallel replica {k})"
                    state = "between steps" if seconds is None else f"in one step for {seconds:.0f}s"
                    return pb.HealthCheckResponse(healthy=False, message=(
                        f"engine loop did not answer within {HEALTH_PROBE_TIMEOUT_S:.0f}s{where}, {state}"))
                busy.append(seconds)
        if busy:  # a long step (a long prompt chunk on a CPU) is work, not a hang
            return pb.HealthCheckResponse(healthy=True, message=f"ok (busy: one step running for {max(busy):.0f}s)")
        return pb.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request, context):
        f = self.facts
        return pb.GetModelInfoResponse(
            model_path=f.model_path,
            tokenizer_path=f.tokenizer_path,
            served_model_name=f.served_model_name,
            model_type=f.model_type,
            architectures=f.architectures,
            max_context_length=f.max_context_length,
            max_req_input_len=f.max_context_length - 1,
            vocab_size=f.vocab_size,
            eos_token_ids=f.eos_token_ids,
            pad_token_id=f.pad_token_id,
            bos_token_id=f.bos_token_id,
            default_sampling_params_json=f.default_sampling_params_json,
            supports_vision=False,
            supports_multimodal=False,
            model_dtype=f.dtype,
        )

    def _scheduler_info(self) -> dict:
        r = self.engine.ready
        return {
            "num_blocks": r.num_blocks,
            "block_size": r.block_size,
            "max_total_num_tokens": r.max_total_tokens,
            "max_num_seqs": r.max_num_seqs,
            "max_model_len": r.max_model_len,
            "device": r.device,
            "dtype": r.dtype,
            "kv_cache_bytes": r.kv_cache_bytes,
            "weight_bytes": r.weight_bytes,
            "decode_read_bytes": r.decode_read_bytes,
            "engine_pid": self.engine.pid,
        }

    async def GetServerInfo(self, request, context):
        args = dataclasses.asdict(self.server_args) if dataclasses.is_dataclass(self.server_args) else dict(
            vars(self.server_args)
        )
        args.pop("api_key", None)
        args["context_length"] = self.facts.max_context_length
        args["served_model_name"] = self.facts.served_model_name
        server_args = Struct()
        server_args.update(_json_safe(args))
        scheduler_info = Struct()
        scheduler_info.update(_json_safe(self._scheduler_info()))
        start = Timestamp()
        start.FromSeconds(int(self.start_time))
        return pb.GetServerInfoResponse(
            server_args=server_args,
            scheduler_info=scheduler_info,
            active_requests=len(self.engine.requests),
            is_paused=False,
            uptime_seconds=time.time() - self.start_time,
            max_total_num_tokens=self.engine.ready.max_total_tokens,
            tokenspeed_version=__version__,
            start_time=start,
            constrained_decoding="requested" if getattr(self.facts, "structured_output", False) else "",
        )

    async def GetLoads(self, request, context):
        dp_size = self.engine.data_parallel_size
        if request.HasField("dp_rank") and not 0 <= request.dp_rank < dp_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank: {request.dp_rank} does not exist (ranks 0..{dp_size - 1})")
        sections = {s.lower() for s in request.include} or {"core"}
        unknown = sections - {"core", "memory", "queues", "disagg", "all"}
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"include: unknown section(s) {sorted(unknown)}; use core, memory, queues or all",
            )
        try:
            per_replica = await self.engine.probe_all(LOADS_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "engine did not report its loads in time")
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
        loads = [self._scheduler_load(rank, x, sections) for rank, x in enumerate(per_replica)]
        if request.HasField("dp_rank"):
            loads = [loads[request.dp_rank]]
        n = len(loads)
        running = sum(x.num_running_reqs for x in loads)
        waiting = sum(x.num_waiting_reqs for x in loads)
        return pb.GetLoadsResponse(
            timestamp=datetime.now(timezone.utc).isoformat(),
            version=__version__,
            dp_rank_count=dp_size,
            loads=loads,
            aggregate=pb.AggregateMetrics(
                total_running_reqs=running,
                total_waiting_reqs=waiting,
                total_reqs=running + waiting,
                avg_token_usage=sum(x.token_usage for x in loads) / n,
                avg_throughput=sum(x.gen_throughput for x in loads) / n,
                avg_utilization=sum(x.utilization for x in loads) / n,
            ),
        )

    def _scheduler_load(self, dp_rank: int, loads, sections: set[str]) -> pb.SchedulerLoad:
        r = self.engine.ready
        capacity = loads.num_total_blocks * loads.block_size
        usage = loads.num_used_tokens / capacity if capacity else 0.0
        load = pb.SchedulerLoad(
            dp_rank=dp_rank,
            num_running_reqs=loads.num_running,
            num_waiting_reqs=loads.num_waiting,
            num_total_reqs=loads.num_running + loads.num_waiting,
            num_used_tokens=loads.num_used_tokens,
            max_total_num_tokens=capacity,
            max_running_requests=r.max_num_seqs,
            num_waiting_uncached_tokens=loads.waiting_tokens,
            token_usage=usage,
            active_token_usage=usage,
            gen_throughput=loads.gen_throughput,
            cache_hit_rate=loads.cache_hit_rate,
            utilization=loads.num_running / r.max_num_seqs if r.max_num_seqs else 0.0,
        )
        if sections & {"memory", "all"}:
            load.memory.CopyFrom(
                pb.MemoryMetrics(
                    weight_gb=r.weight_bytes / 1e9,
                    kv_cache_gb=r.kv_cache_bytes / 1e9,
                    graph_gb=r.graph_bytes / 1e9,
                    token_capacity=capacity,
                )
            )
        if sections & {"queues", "all"}:
            # paused: the worker has no pause (no PauseGeneration RPC), so always 0.
            load.queues.CopyFrom(pb.QueueMetrics(waiting=loads.num_waiting, grammar=loads.num_grammar_waiting,
                                                 paused=0, retracted=loads.num_retracted))
        return load

    # ---- admin --------------------------------------------------------------------

    async def FlushCache(self, request, context):
        timeout = max(5.0, float(request.timeout_s) + 5.0)
        try:
            reply = await self.engine.flush_cache(timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"flush did not finish within {timeout:.0f}s")
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
        return common_pb2.FlushCacheResponse(success=reply.success, message=reply.message)

    async def GetTokenizer(self, request, context):
        from tokenspeed_worker.server.tokenizer_bundle import iter_tokenizer_chunks

        loop = asyncio.get_running_loop()
        try:
            chunks = await loop.run_in_executor(None, lambda: list(iter_tokenizer_chunks(self.facts.tokenizer_path)))
        except FileNotFoundError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"tokenizer files not found: {e}")
        for data, sha256 in chunks:
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)

    async def StartProfile(self, request, context):
        """torch.profiler over the engine process; the trace lands in output_dir
        (default $TOKENSPEED_PROFILE_DIR or /tmp/tokenspeed_profiles)."""
        output_dir = request.output_dir if request.HasField("output_dir") else env.PROFILE_DIR.get()
        if not os.path.isabs(output_dir):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"output_dir: must be an absolute path, got {output_dir!r}")
        if request.HasField("num_steps") and request.num_steps < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_steps: must be >= 0")
        if request.HasField("start_step") or request.profile_by_stage:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "start_step / profile_by_stage: not supported (the profile starts at once)")
        try:
            reply = await self.engine.start_profile(
                PROFILE_TIMEOUT_S,
                output_dir=output_dir,
                num_steps=request.num_steps if request.HasField("num_steps") else None,
                activities=tuple(request.activities) or ("CPU", "GPU"),
                with_stack=request.with_stack if request.HasField("with_stack") else False,
                record_shapes=request.record_shapes if request.HasField("record_shapes") else False,
            )
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not answer StartProfile in time")
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
        return common_pb2.ProfileResponse(success=reply.success, message=reply.message)

    async def StopProfile(self, request, context):
        try:
            reply = await self.engine.stop_profile(PROFILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the engine did not answer StopProfile in time")
        except EngineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
        return common_pb2.ProfileResponse(success=reply.success, message=reply.message)

    async def SubscribeKvEvents(self, request, context):
        # The gateway gives the call 2 s to answer (else it marks the worker unreachable and
        # retries): send the response headers now, before the first batch exists.
        await context.send_initial_metadata(())
        try:  # until the client cancels (which cancels this generator)
            async for batch in self.kv_hub.subscribe(request):
                yield batch
        except SubscriberFellBehind as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"SubscribeKvEvents: {e}")
