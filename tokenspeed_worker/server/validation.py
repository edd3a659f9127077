"""Turn a GenerateRequest into an engine request, or a gRPC status naming the bad field.

Every check here runs before anything is registered, so a refused request
holds nothing. Messages name the field as it is spelled on the wire.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np

from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.sampling.params import SamplingParams
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
MAX_TOP_LOGPROBS = 20  # as OpenAI and vLLM's default max_logprobs
MAX_TOKEN_IDS_LOGPROB = 256
MAX_LOGIT_BIAS = 1024
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
# Stop strings: OpenAI takes 4; these bound the matcher's automaton (one state per character, shared
# by a request's samples) and the time its build holds the server's event loop.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 16384


@dataclass
class ValidatedRequest:
    request_id: str  # as sent, or generated when the client left it empty
    adds: list[AddRequest]  # one per sample (n)
    stream: bool
    n: int
    no_stop_trim: bool
    stop_strings: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: bool = False  # any logprob output asked for
    top_logprobs_num: int = 0
    dp_rank: int | None = None  # data_parallel_rank: the replica the client pinned, if any


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
    """Proto3 cannot tell an unset plain scalar from its zero: every such field's zero means that
    field's default (the table in docs/parameters.md): an empty request_id gets a generated one,
    n 0 is one sample, top_k 0 is off. Explicit optional fields are taken as sent; a
    max_new_tokens of 0 is a real request (the prompt back, no output: the servicer ends it at once).
    The checks run in a fixed order; the first that fails names its field."""
    request_id = req.request_id or f"gen-{uuid.uuid4().hex}"
    _refuse_unsupported(req, facts)
    prompt = _prompt_ids(req, facts)
    logprob_ids = _token_ids_logprob(req, facts)
    sp = req.sampling_params
    params = _sampling_params(sp, facts)
    stop_strings = list(sp.stop)
    if any(not s for s in stop_strings):
        raise _invalid("sampling_params.stop: stop strings must not be empty")
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise _invalid(f"sampling_params.stop: at most {MAX_STOP_STRINGS} stop strings (got {len(stop_strings)})")
    stop_chars = sum(len(s) for s in stop_strings)
    if stop_chars > MAX_STOP_CHARS:
        raise _invalid(f"sampling_params.stop: at most {MAX_STOP_CHARS} characters in all (got {stop_chars})")
    if stop_strings and not facts.has_tokenizer:
        raise _invalid("sampling_params.stop: this worker has no tokenizer.json to detect stop strings with")
    if sp.HasField("custom_params") and len(sp.custom_params.fields):
        raise _invalid("sampling_params.custom_params: no custom parameters are supported")
    constraint = _constraint(sp, facts)
    n = sp.n or 1  # proto3's 0 is an unset n
    if n > MAX_SAMPLES:
        raise _invalid(f"sampling_params.n: at most {MAX_SAMPLES} samples per request (got {n})")
    params.stop_token_ids = _stop_token_ids(sp, facts)

    # Unset max_new_tokens means up to the context limit; a larger one is clamped to it; 0 asks for
    # the prompt back and nothing else (scoring clients: /v1/completions echo with max_tokens 0).
    room = facts.max_context_length - len(prompt)
    max_new = min(int(sp.max_new_tokens), room) if sp.HasField("max_new_tokens") else room
    if sp.HasField("max_new_tokens") and sp.min_new_tokens > sp.max_new_tokens:  # as vLLM and SGLang refuse it
        raise _invalid(f"sampling_params.min_new_tokens: must be at most max_new_tokens ({sp.max_new_tokens}), "
                       f"got {sp.min_new_tokens}")
    params.min_new_tokens = min(int(sp.min_new_tokens), max_new)  # the context's clamp of max_new_tokens
    # Any logprob option needs the sampled token's logprob too (OutputLogProbs aligns on it).
    logprobs = bool(req.return_logprob or req.top_logprobs_num or logprob_ids)
    params.return_logprob = logprobs
    params.top_logprobs_num = int(req.top_logprobs_num)
    params.token_ids_logprob = tuple(logprob_ids)

    # The sampler hashes a non-negative int64; unseeded samples get a random seed each.
    seeded = sp.HasField("sampling_seed")
    seeds = [sample_seed(int(sp.sampling_seed), i) if seeded else secrets.randbits(63) for i in range(n)]
    # One SamplingParams per sample (each its own seed); the last sample takes `params` itself
    # (dataclasses.replace is ~8 us a copy: most requests are one sample).
    params.seed = seeds[-1]
    adds = [AddRequest(0, prompt, max_new, dataclasses.replace(params, seed=seed) if i < n - 1 else params,
                       constraint=constraint) for i, seed in enumerate(seeds)]
    return ValidatedRequest(
        request_id=request_id,
        adds=adds,
        stream=bool(req.stream),
        n=n,
        no_stop_trim=bool(sp.no_stop_trim),
        stop_strings=stop_strings,
        skip_special_tokens=bool(sp.skip_special_tokens),
        spaces_between_special_tokens=bool(sp.spaces_between_special_tokens),
        logprobs=logprobs,
        top_logprobs_num=int(req.top_logprobs_num),
        dp_rank=int(req.data_parallel_rank) if req.HasField("data_parallel_rank") else None,
    )


def _refuse_unsupported(req, facts: ModelFacts) -> None:
    if req.HasField("mm_inputs"):
        raise _unimplemented("mm_inputs: multimodal inputs are not supported (text models only)")
    if req.HasField("encode_bootstrap_info"):
        raise _unimplemented("encode_bootstrap_info: encode/prefill disaggregation is not supported")
    if req.HasField("kv_bootstrap_info"):
        raise _unimplemented("kv_bootstrap_info: prefill/decode disaggregation is not supported")
    dp_size = getattr(facts, "data_parallel_size", 1)
    if req.HasField("data_parallel_rank") and not 0 <= req.data_parallel_rank < dp_size:
        raise _invalid(f"data_parallel_rank: {req.data_parallel_rank} does not exist "
                       f"(this worker has ranks 0..{dp_size - 1})")


def _prompt_ids(req, facts: ModelFacts) -> np.ndarray:
    """tokenized.input_ids as int32, in the vocabulary and leaving room to generate."""
    if not req.HasField("tokenized"):
        raise _invalid("tokenized: missing (the worker takes token ids; tokenized.input_ids is required)")
    # np.asarray, not np.fromiter: the protobuf runtime's repeated field hands numpy its values at once
    # (__array__): 3 us for any length, where iterating costs ~35 ns an id (300 us for 8k ids).
    ids = np.asarray(req.tokenized.input_ids, dtype=np.int64)
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
    return ids.astype(np.int32)


def _token_ids_logprob(req, facts: ModelFacts) -> list[int]:
    """The logprob options checked; returns token_ids_logprob."""
    if req.top_logprobs_num < 0 or req.top_logprobs_num > MAX_TOP_LOGPROBS:
        raise _invalid(f"top_logprobs_num: must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs_num}")
    logprob_ids = [int(t) for t in req.token_ids_logprob]
    for t in logprob_ids:
        if t >= facts.vocab_size:
            raise _invalid(f"token_ids_logprob: token id {t} is out of range (vocab_size {facts.vocab_size})")
    if len(logprob_ids) > MAX_TOKEN_IDS_LOGPROB:
        raise _invalid(f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} ids")
    if req.HasField("logprob_start_len") and req.logprob_start_len < -1:
        raise _invalid(f"logprob_start_len: must be -1 (no prompt logprobs) or unset, got {req.logprob_start_len}")
    if req.HasField("logprob_start_len") and req.logprob_start_len >= 0:
        # GenerateComplete/GenerateStreamChunk carry output_logprobs only: the TokenSpeed wire has
        # no field for prompt (input) logprobs, so they could not reach the client.
        raise _unimplemented(
            "logprob_start_len: prompt logprobs cannot be returned (the TokenSpeed wire has no input-logprobs "
            "field); use -1"
        )
    return logprob_ids


def _sampling_params(sp, facts: ModelFacts) -> SamplingParams:
    """The filters, penalties and logit_bias of sampling_params; the caller sets the rest."""
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    top_k = sp.top_k if sp.HasField("top_k") else -1
    if top_k == 0:  # 0 disables top-k, as in transformers and vLLM
        top_k = -1
    min_p = sp.min_p if sp.HasField("min_p") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise _invalid(f"sampling_params.temperature: must be finite and >= 0, got {temperature}")
    if temperature < GREEDY_BELOW:  # logits / 1e-40 overflow to inf: greedy, as vLLM and SGLang take it
        temperature = 0.0
    if not math.isfinite(top_p) or not (0.0 < top_p <= 1.0):
        raise _invalid(f"sampling_params.top_p: must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise _invalid(f"sampling_params.top_k: must be -1 or 0 (off) or >= 1, got {top_k}")
    if not math.isfinite(min_p) or not (0.0 <= min_p <= 1.0):
        raise _invalid(f"sampling_params.min_p: must be in [0, 1], got {min_p}")
    frequency_penalty = sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0
    presence_penalty = sp.presence_penalty if sp.HasField("presence_penalty") else 0.0
    repetition_penalty = sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if not math.isfinite(value) or not (-2.0 <= value <= 2.0):
            raise _invalid(f"sampling_params.{name}: must be in [-2, 2], got {value}")
    if not math.isfinite(repetition_penalty) or not (0.0 < repetition_penalty <= 2.0):
        raise _invalid(f"sampling_params.repetition_penalty: must be in (0, 2], got {repetition_penalty}")
    logit_bias: dict[int, float] = {}
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise _invalid(f"sampling_params.logit_bias: at most {MAX_LOGIT_BIAS} entries")
    for key, bias in sp.logit_bias.items():
        # Plain ASCII digits only (OpenAI's keys are token ids as decimal strings): int() would also
        # take " 1", "1_0" and other scripts' digits.
        if not (key.isascii() and key.isdigit()):
            raise _invalid(f"sampling_params.logit_bias: key {key!r} is not a token id")
        token = int(key)
        if not (0 <= token < facts.vocab_size):
            raise _invalid(f"sampling_params.logit_bias: token id {token} is out of range (vocab_size {facts.vocab_size})")
        if not math.isfinite(bias) or not (-100.0 <= bias <= 100.0):
            raise _invalid(f"sampling_params.logit_bias: bias of token {token} must be in [-100, 100], got {bias}")
        logit_bias[token] = float(bias)
    return SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        min_p=float(min_p),
        frequency_penalty=float(frequency_penalty),
        presence_penalty=float(presence_penalty),
        repetition_penalty=float(repetition_penalty),
        logit_bias=logit_bias,
    )


def _constraint(sp, facts: ModelFacts) -> tuple[str, str] | None:
    """The structured-output constraint (kind, text), or None."""
    constraint = sp.WhichOneof("constraint")
    if constraint is None:
        return None
    text = getattr(sp, constraint)
    if not getattr(facts, "structured_output", False):
        raise _unimplemented(f"sampling_params.{constraint}: structured output is off on this worker "
                             "(--grammar-backend none, no tokenizer, or the xgrammar package is missing)")
    if not text.strip():
        raise _invalid(f"sampling_params.{constraint}: must not be empty")
    if constraint in ("json_schema", "structural_tag"):
        try:
            json.loads(text)
        except ValueError as exc:
            raise _invalid(f"sampling_params.{constraint}: not valid JSON ({exc})") from None
    return constraint, text


def _stop_token_ids(sp, facts: ModelFacts) -> list[int]:
    """stop_token_ids ∪ EOS (unless ignore_eos), sorted."""
    stop_ids = [int(t) for t in sp.stop_token_ids]
    for t in stop_ids:
        if t >= facts.vocab_size:
            raise _invalid(f"sampling_params.stop_token_ids: token id {t} is out of range (vocab_size {facts.vocab_size})")
    if not sp.ignore_eos:
        stop_ids.extend(facts.eos_token_ids)
    return sorted(set(stop_ids))
