"""One request's sampling parameters, from validation to the sampler under the same names.

The server (server/validation.py) builds a `SamplingParams` per sample from the gRPC request,
`AddRequest` carries it to the engine whole, `SamplingState.add_row` stores it in per-row arrays,
and `SamplingBatch` (sampling/sampler.py) holds a step's rows of it as device tensors under the
same field names. Values arrive validated: nothing here checks ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # <= 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int = 0  # non-negative, < 2**63 (the sampler hashes its low 62 bits)
    frequency_penalty: float = 0.0  # OpenAI, over output tokens: logit -= f * count
    presence_penalty: float = 0.0  # OpenAI, over output tokens: logit -= p * (count > 0)
    repetition_penalty: float = 1.0  # HF, over prompt and output tokens; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_new_tokens: int = 0  # stop_token_ids get -inf while fewer outputs exist
    # The ids that finish the request (the scheduler) and that min_new_tokens masks (the sampler):
    # EOS ∪ the request's stop_token_ids, EOS left out with ignore_eos.
    stop_token_ids: Sequence[int] = ()
    return_logprob: bool = False  # logprob of each sampled token
    top_logprobs_num: int = 0  # top-K logprobs per sampled token
    token_ids_logprob: Sequence[int] = ()  # logprobs of these ids at each sampled token

    @property
    def uses_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

