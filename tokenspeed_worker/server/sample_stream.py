"""One sample's way from the engine's tokens to the gRPC responses of a Generate call."""

from __future__ import annotations

from tokenspeed_worker.engine.messages import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from tokenspeed_worker.proto import tokenspeed_scheduler_pb2 as pb

_FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORT: "abort"}


class SampleStream:
    """One sample's way out: trims a matched stop token, holds back text that may be the start
    of a stop string, batches tokens per --stream-interval, and builds chunks and the complete.
    Token ids and their logprob entries travel together so they stay aligned."""

    def __init__(self, state, v, matcher, cache_report: bool = True) -> None:
        self.state = state
        self.matcher = matcher
        self.cache_report = cache_report  # --enable-cache-report: else cached_tokens go out as 0
        self.no_stop_trim = v.no_stop_trim
        self.logprobs = v.logprobs
        self.pending: list[tuple[int, tuple | None]] = []  # held back by the stop-string matcher
        # Released and not yet sent: a chunk's worth (stream interval), or everything when not streaming.
        self.ready: list[tuple[int, tuple | None]] = []
        self.finish_reason: int | None = None
        self.matched_token: int | None = None
        self.matched_str: str | None = None
        self.sent = False  # a chunk has gone out

    def take_new(self, engine) -> bool:
        """Move what the engine produced into `ready`. False when there is nothing new."""
        st = self.state
        tokens, st.new_tokens = st.new_tokens, []
        entries = st.new_logprobs
        st.new_logprobs = []
        reason = st.finish_reason
        if not tokens and reason is None:
            return False
        items = list(zip(tokens, entries if self.logprobs else [None] * len(tokens)))
        if reason == FINISH_STOP and items:
            self.matched_token = items[-1][0]
            if not self.no_stop_trim:
                items.pop()
        if self.matcher is None:
            self.ready.extend(items)
        else:
            self.pending.extend(items)
            result = self.matcher.push([t for t, _ in items])
            released = len(result.emit)
            self.ready.extend(self.pending[:released])
            del self.pending[:released]
            if result.matched is not None:
                # The stop string ends the sample right here: free it in the engine. Tokens that came
                # after it in the same step (speculative decoding keeps several; steps can pile up
                # before this runs) are not output: not counted either.
                st.num_output_tokens -= result.unused
                self.matched_str = result.matched
                self.matched_token = None
                self.pending.clear()
                engine.finish_early(st, FINISH_STOP)
                reason = FINISH_STOP
            elif reason is not None:
                self.matcher.flush()
                self.ready.extend(self.pending)
                self.pending.clear()
        self.finish_reason = reason
        return True

    def _logprobs(self, items) -> pb.OutputLogProbs | None:
        if not self.logprobs or not items:
            return None
        return pb.OutputLogProbs(
            token_logprobs=[e[0] for _, e in items],
            token_ids=[t for t, _ in items],
            top_logprobs=[pb.TopLogProbs(values=e[1], token_ids=e[2]) for _, e in items],
        )

    def chunk(self) -> pb.GenerateStreamChunk:
        items, self.ready = self.ready, []
        self.sent = True
        st = self.state
        return pb.GenerateStreamChunk(
            token_ids=[t for t, _ in items],
            prompt_tokens=st.prompt_len,
            completion_tokens=st.num_output_tokens,
            cached_tokens=st.cached_tokens if self.cache_report else 0,
            output_logprobs=self._logprobs(items),
            index=st.index,
        )

    def complete(self, stream: bool) -> pb.GenerateComplete:
        st = self.state
        # Streaming: every token already went out in chunks.
        items = [] if stream else self.ready
        complete = pb.GenerateComplete(
            output_ids=[t for t, _ in items],
            finish_reason=_FINISH_NAMES[self.finish_reason],
            prompt_tokens=st.prompt_len,
            completion_tokens=st.num_output_tokens,
            cached_tokens=st.cached_tokens if self.cache_report else 0,
            output_logprobs=self._logprobs(items),
            index=st.index,
            spec_accepted_tokens=st.spec_accepted_tokens,
            spec_draft_tokens=st.spec_draft_tokens,
        )
        if self.matched_str is not None:
            complete.matched_stop_str = self.matched_str
        elif self.matched_token is not None:
            complete.matched_token_id = self.matched_token
        return complete
