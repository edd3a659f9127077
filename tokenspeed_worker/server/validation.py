"""Turn a GenerateRequest into an engine request, or a gRPC status naming the bad field.

Every check here runs before anything is registered, so a refused request
holds nothing. Messages name the field as it is spelled on the wire.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import grpc
import numpy as np

from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.server.model_info import ModelFacts


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _unimplemented(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNIMPLEMENTED, message)


MAX_SAMPLES = 128  # n beyond this is refused: one request should not occupy a whole worker


@dataclass
class ValidatedRequest:
    adds: list[AddRequest]  # one per sample (n)
    stream: bool
    n: int
    no_stop_trim: bool


_MASK63 = (1 << 63) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 keeps the seed
    itself (n=1 and n>1 agree on it), the others get a splitmix64 mix of (seed, index)."""
    if index == 0:
        return seed & _MASK63
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


def validate_generate(req, facts: ModelFacts) -> ValidatedRequest:
    if not req.request_id:
        raise _invalid("request_id: must not be empty")
    if req.HasField("mm_inputs"):
        raise _unimplemented("mm_inputs: multimodal inputs are not supported (text models only)")
    if req.HasField("encode_bootstrap_info"):
        raise _unimplemented("encode_bootstrap_info: encode/prefill disaggregation is not supported")
    if req.HasField("kv_bootstrap_info"):
        raise _unimplemented("kv_bootstrap_info: prefill/decode disaggregation is not supported")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise _invalid(f"data_parallel_rank: {req.data_parallel_rank} does not exist (this worker has rank 0 only)")
    if not req.HasField("tokenized"):
        raise _invalid("tokenized: missing (the worker takes token ids; tokenized.input_ids is required)")
    ids = np.fromiter(req.tokenized.input_ids, dtype=np.int64, count=len(req.tokenized.input_ids))
    if ids.size == 0:
        raise _invalid("tokenized.input_ids: must not be empty")
    if int(ids.max()) >= facts.vocab_size:
        bad = int(ids[ids >= facts.vocab_size][0])
        raise _invalid(f"tokenized.input_ids: token id {bad} is out of range (vocab_size {facts.vocab_size})")
    prompt_len = int(ids.size)
    if prompt_len >= facts.max_context_length:
        raise _invalid(
            f"tokenized.input_ids: prompt of {prompt_len} tokens leaves no room to generate "
            f"(context length {facts.max_context_length})"
        )

    # Output options that later work builds: refuse rather than ignore.
    if req.return_logprob:
        raise _invalid("return_logprob: logprobs are not supported yet")
    if req.top_logprobs_num:
        raise _invalid("top_logprobs_num: logprobs are not supported yet")
    if len(req.token_ids_logprob):
        raise _invalid("token_ids_logprob: logprobs are not supported yet")
    if req.HasField("logprob_start_len") and req.logprob_start_len >= 0:
        raise _invalid("logprob_start_len: prompt logprobs are not supported yet")

    sp = req.sampling_params
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    top_k = sp.top_k if sp.HasField("top_k") else -1
    min_p = sp.min_p if sp.HasField("min_p") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise _invalid(f"sampling_params.temperature: must be >= 0, got {temperature}")
    if not math.isfinite(top_p) or not (0.0 < top_p <= 1.0):
        raise _invalid(f"sampling_params.top_p: must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise _invalid(f"sampling_params.top_k: must be -1 (off) or >= 1, got {top_k}")
    if not math.isfinite(min_p) or not (0.0 <= min_p <= 1.0):
        raise _invalid(f"sampling_params.min_p: must be in [0, 1], got {min_p}")
    if sp.HasField("frequency_penalty") and sp.frequency_penalty != 0.0:
        raise _invalid("sampling_params.frequency_penalty: penalties are not supported yet")
    if sp.HasField("presence_penalty") and sp.presence_penalty != 0.0:
        raise _invalid("sampling_params.presence_penalty: penalties are not supported yet")
    if sp.HasField("repetition_penalty") and sp.repetition_penalty != 1.0:
        raise _invalid("sampling_params.repetition_penalty: penalties are not supported yet")
    if sp.min_new_tokens:
        raise _invalid("sampling_params.min_new_tokens: not supported yet")
    if len(sp.stop):
        raise _invalid("sampling_params.stop: stop strings are not supported yet (stop_token_ids are)")
    if len(sp.logit_bias):
        raise _invalid("sampling_params.logit_bias: not supported yet")
    if sp.HasField("custom_params") and len(sp.custom_params.fields):
        raise _invalid("sampling_params.custom_params: no custom parameters are supported")
    constraint = sp.WhichOneof("constraint")
    if constraint is not None:
        raise _unimplemented(f"sampling_params.{constraint}: structured output is not supported yet")
    n = sp.n or 1
    if n > MAX_SAMPLES:
        raise _invalid(f"sampling_params.n: at most {MAX_SAMPLES} samples per request (got {n})")

    stop_ids = [int(t) for t in sp.stop_token_ids]
    for t in stop_ids:
        if t >= facts.vocab_size:
            raise _invalid(f"sampling_params.stop_token_ids: token id {t} is out of range (vocab_size {facts.vocab_size})")
    if not sp.ignore_eos:
        stop_ids.extend(facts.eos_token_ids)
    stop_ids = sorted(set(stop_ids))

    # Unset max_new_tokens means up to the context limit; a larger one is clamped to it.
    room = facts.max_context_length - prompt_len
    if sp.HasField("max_new_tokens"):
        if sp.max_new_tokens == 0:
            raise _invalid("sampling_params.max_new_tokens: must be at least 1")
        max_new = min(int(sp.max_new_tokens), room)
    else:
        max_new = room

    seeded = sp.HasField("sampling_seed")
    prompt = ids.astype(np.int32)
    adds = [
        AddRequest(
            req_id=0,
            prompt_ids=prompt,
            max_new_tokens=max_new,
            stop_token_ids=stop_ids,
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            min_p=float(min_p),
            # The sampler hashes a non-negative int64; unseeded samples get a random seed each.
            seed=sample_seed(int(sp.sampling_seed), i) if seeded else secrets.randbits(63),
        )
        for i in range(n)
    ]
    return ValidatedRequest(adds=adds, stream=bool(req.stream), n=n, no_stop_trim=bool(sp.no_stop_trim))
