"""Per-row sampling state of the engine: parameters, output positions and penalty counts.

The engine knows requests by *row*. This class owns, per row, everything sampling needs (the
request's `SamplingParams`, stored at `add_row`) and turns a step's rows into one `SamplingBatch`
with a few numpy gathers and host-to-device copies, so no per-request Python runs inside a step
(per-request work happens at `add_row`).

What lives where:
- Host (numpy, [capacity] or [capacity, width]): the scalar parameters, the output position
  (how many tokens the row has sampled), and the ragged lists padded to a common width:
  logit_bias ids/values, stop ids (for min_new_tokens), logprob token ids. A step copies the
  basic parameters as two packed arrays, the ragged ones only for rows that use them.
- Device, in a *penalty slot pool* allocated only for rows with a repetition, frequency or
  presence penalty: output token counts int32 [slots, V] and a prompt-token mask bool
  [slots, V] — 5 bytes x V per slot (640 KiB at V = 128k; 160 MiB for 256 penalized rows).
  The pool grows by doubling, a removed row's slot is reused by the next penalized row, and
  the whole pool is freed when no row uses a penalty any more. Counts are updated for all
  penalized rows of a step with one scatter (`update`).

Rows grow automatically (`add_row` past the capacity doubles it); `ensure_capacity` grows
ahead of time. A preempted request keeps its row and its state: nothing to do on
preemption or resumption, its output position and counts continue where they were.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.sampling.sampler import _MASK62, SamplingBatch, basic_flags

# Columns of the packed per-row parameter arrays (one host-to-device copy each per step).
_F_TEMPERATURE, _F_TOP_P, _F_MIN_P = 0, 1, 2
_I_TOP_K, _I_SEED, _I_OUT_POS = 0, 1, 2
_P_REPETITION, _P_FREQUENCY, _P_PRESENCE = 0, 1, 2


class _Ragged:
    """Per-row lists padded to a common width on the host: ids int64 (+ optional float32 values).

    Padding repeats the row's own ids with value 0 (its first id when it is set, its last entry when
    another row widens the table), so a scatter (add 0 / set the same value) over the whole padded
    row is harmless; counts say how many entries are real.
    """

    def __init__(self, capacity: int, with_values: bool) -> None:
        self.ids = np.zeros((capacity, 0), np.int64)
        self.values = np.zeros((capacity, 0), np.float32) if with_values else None
        self.counts = np.zeros(capacity, np.int64)

    def grow_rows(self, capacity: int) -> None:
        extra = capacity - self.counts.shape[0]
        self.ids = np.pad(self.ids, ((0, extra), (0, 0)))
        if self.values is not None:
            self.values = np.pad(self.values, ((0, extra), (0, 0)))
        self.counts = np.pad(self.counts, (0, extra))

    def set(self, row: int, ids: np.ndarray, values: np.ndarray | None = None) -> None:
        n = ids.shape[0]
        if n > self.ids.shape[1]:
            width = max(n, 2 * self.ids.shape[1])
            # The other rows' new columns repeat their last entry (one of their ids), not 0: a zero
            # there would be a real token id in their padding (a stop id masked that is not theirs).
            self.ids = np.pad(self.ids, ((0, 0), (0, width - self.ids.shape[1])),
                              mode="edge" if self.ids.shape[1] else "constant")
            if self.values is not None:
                self.values = np.pad(self.values, ((0, 0), (0, width - self.values.shape[1])))
        self.counts[row] = n
        self.ids[row] = ids[0] if n else 0
        self.ids[row, :n] = ids
        if self.values is not None:
            self.values[row] = 0.0
            self.values[row, :n] = values

    def clear(self, row: int) -> None:
        self.counts[row] = 0

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        width = int(self.counts[rows].max()) if rows.shape[0] else 0
        ids = self.ids[rows, :width]
        return ids, (self.values[rows, :width] if self.values is not None else None)


class SamplingState:
    def __init__(self, max_rows: int, vocab_size: int, device: str | torch.device = "cpu") -> None:
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        capacity = max(1, int(max_rows))
        self._active = np.zeros(capacity, bool)
        self._floats = np.zeros((capacity, 3), np.float32)  # temperature, top_p, min_p
        self._ints = np.zeros((capacity, 3), np.int64)  # top_k (0 = off), seed, output position
        self._penalties = np.zeros((capacity, 3), np.float32)  # repetition, frequency, presence
        self._slot = np.full(capacity, -1, np.int64)  # penalty pool slot, -1 = none
        self._min_new_tokens = np.zeros(capacity, np.int64)
        self._return_logprob = np.zeros(capacity, bool)
        self._top_logprobs = np.zeros(capacity, np.int64)
        self._bias = _Ragged(capacity, with_values=True)
        self._stops = _Ragged(capacity, with_values=False)
        self._logprob_ids = _Ragged(capacity, with_values=False)
        # How many active rows use each extra: a step skips the gathers of unused ones.
        self._num_bias = self._num_penalty = self._num_min_tokens = self._num_logprobs = 0
        # The penalty slot pool (device); None while no row uses a penalty.
        self._output_counts: torch.Tensor | None = None  # int32 [slots, V]
        self._prompt_mask: torch.Tensor | None = None  # bool [slots, V]
        self._free_slots: list[int] = []

    # ---- capacity ---------------------------------------------------------

    @property
    def capacity(self) -> int:
        return int(self._active.shape[0])

    def ensure_capacity(self, rows: int) -> None:
        """Make rows 0..rows-1 addressable (doubling, so repeated growth stays cheap)."""
        if rows <= self.capacity:
            return
        capacity = self.capacity
        while capacity < rows:
            capacity *= 2
        extra = capacity - self.capacity
        self._active = np.pad(self._active, (0, extra))
        self._floats = np.pad(self._floats, ((0, extra), (0, 0)))
        self._ints = np.pad(self._ints, ((0, extra), (0, 0)))
        self._penalties = np.pad(self._penalties, ((0, extra), (0, 0)))
        self._slot = np.pad(self._slot, (0, extra), constant_values=-1)
        self._min_new_tokens = np.pad(self._min_new_tokens, (0, extra))
        self._return_logprob = np.pad(self._return_logprob, (0, extra))
        self._top_logprobs = np.pad(self._top_logprobs, (0, extra))
        for ragged in (self._bias, self._stops, self._logprob_ids):
            ragged.grow_rows(capacity)

    # ---- rows -------------------------------------------------------------

    def add_row(self, row: int, prompt_ids: np.ndarray, params: SamplingParams) -> None:
        """Admit a request at `row` (output position 0). Raises ValueError for ids outside the
        vocabulary or a row already in use; nothing is changed then."""
        row = int(row)
        if row < 0:
            raise ValueError(f"row {row} is negative")
        self.ensure_capacity(row + 1)
        if self._active[row]:
            raise ValueError(f"row {row} is already in use")
        bias_ids = np.fromiter((int(k) for k in params.logit_bias), np.int64, len(params.logit_bias))
        bias_values = np.fromiter((float(v) for v in params.logit_bias.values()), np.float32, len(params.logit_bias))
        stop_ids = np.unique(np.asarray(params.stop_token_ids, np.int64)) if params.min_new_tokens > 0 else None
        logprob_ids = np.asarray(params.token_ids_logprob, np.int64).reshape(-1)
        for what, ids in (("logit_bias", bias_ids), ("stop_token_ids", stop_ids), ("token_ids_logprob", logprob_ids)):
            if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise ValueError(f"{what} has a token id outside the vocabulary of {self.vocab_size}")
        prompt_ids = np.asarray(prompt_ids, np.int64).reshape(-1)
        # Like HF: prompt ids the LM head cannot produce (embedding vocab > logits vocab) are ignored.
        prompt_ids = prompt_ids[(prompt_ids >= 0) & (prompt_ids < self.vocab_size)]
        if params.repetition_penalty <= 0.0:
            raise ValueError("repetition_penalty must be positive")

        self._active[row] = True
        self._floats[row] = (params.temperature, params.top_p, params.min_p)
        self._ints[row] = (max(int(params.top_k), 0), int(params.seed) & _MASK62, 0)
        self._penalties[row] = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        if bias_ids.size:
            self._bias.set(row, bias_ids, bias_values)
            self._num_bias += 1
        if stop_ids is not None and stop_ids.size:
            self._stops.set(row, stop_ids)
            self._min_new_tokens[row] = params.min_new_tokens
            self._num_min_tokens += 1
        self._return_logprob[row] = params.return_logprob
        self._top_logprobs[row] = max(int(params.top_logprobs_num), 0)
        if logprob_ids.size:
            self._logprob_ids.set(row, logprob_ids)
        if params.return_logprob or self._top_logprobs[row] or logprob_ids.size:
            self._num_logprobs += 1
        if params.uses_penalty:
            slot = self._take_slot()
            self._slot[row] = slot
            self._output_counts[slot].zero_()
            self._prompt_mask[slot].zero_()
            if params.repetition_penalty != 1.0 and prompt_ids.size:
                self._prompt_mask[slot, torch.from_numpy(prompt_ids).to(self.device)] = True
            self._num_penalty += 1

    def remove_row(self, row: int) -> None:
        """Forget the request at `row`; its penalty slot (if any) goes back to the pool."""
        row = int(row)
        if not (0 <= row < self.capacity and self._active[row]):
            raise ValueError(f"row {row} is not in use")
        self._active[row] = False
        if self._bias.counts[row]:
            self._bias.clear(row)
            self._num_bias -= 1
        if self._stops.counts[row]:
            self._stops.clear(row)
            self._min_new_tokens[row] = 0
            self._num_min_tokens -= 1
        if self._return_logprob[row] or self._top_logprobs[row] or self._logprob_ids.counts[row]:
            self._num_logprobs -= 1
        self._return_logprob[row] = False
        self._top_logprobs[row] = 0
        self._logprob_ids.clear(row)
        if self._slot[row] >= 0:
            self._free_slots.append(int(self._slot[row]))
            self._slot[row] = -1
            self._num_penalty -= 1
            if self._num_penalty == 0:  # nobody penalized: give the pool's memory back
                self._output_counts = self._prompt_mask = None
                self._free_slots = []

    def is_active(self, row: int) -> bool:
        return 0 <= row < self.capacity and bool(self._active[row])

    def output_positions(self, rows: np.ndarray) -> np.ndarray:
        """How many tokens each row has sampled (int64, a copy)."""
        return self._ints[np.asarray(rows, np.int64), _I_OUT_POS].copy()

    def output_counts(self, row: int) -> torch.Tensor | None:
        """int32 [V] counts of the row's output tokens (None when the row has no penalty slot)."""
        slot = int(self._slot[row])
        return None if slot < 0 else self._output_counts[slot]

    @property
    def num_penalty_slots(self) -> int:
        """Slots allocated in the penalty pool (in use or free)."""
        return 0 if self._output_counts is None else int(self._output_counts.shape[0])

    @property
    def penalty_pool_bytes(self) -> int:
        if self._output_counts is None:
            return 0
        return self._output_counts.nbytes + self._prompt_mask.nbytes

    def _take_slot(self) -> int:
        if not self._free_slots:
            old = self.num_penalty_slots
            new = max(4, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            mask = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            if old:
                counts[:old] = self._output_counts
                mask[:old] = self._prompt_mask
            self._output_counts, self._prompt_mask = counts, mask
            self._free_slots = list(range(new - 1, old - 1, -1))
        return self._free_slots.pop()

    # ---- per step ---------------------------------------------------------

    def update(self, rows: np.ndarray, sampled: torch.Tensor | np.ndarray, repeated: bool = False) -> None:
        """After a step: rows [S] sampled tokens [S] (device tensor or numpy). Advances every row's
        output position and adds the tokens to the penalized rows' counts (one scatter). `repeated`:
        a row may appear several times (a speculative step's kept tokens, in order)."""
        rows = np.asarray(rows, np.int64)
        if repeated:
            np.add.at(self._ints[:, _I_OUT_POS], rows, 1)
        else:
            self._ints[rows, _I_OUT_POS] += 1
        if self._num_penalty == 0 or rows.shape[0] == 0:
            return
        slots = self._slot[rows]
        where = np.flatnonzero(slots >= 0)
        if where.shape[0] == 0:
            return
        if isinstance(sampled, torch.Tensor):
            tokens = sampled.to(self.device)[torch.from_numpy(where).to(self.device)]
        else:
            tokens = torch.from_numpy(np.asarray(sampled, np.int64)[where]).to(self.device)
        slot_index = torch.from_numpy(slots[where]).to(self.device)
        ones = torch.ones(where.shape[0], dtype=torch.int32, device=self.device)
        self._output_counts.index_put_((slot_index, tokens), ones, accumulate=True)

    def batch(self, rows: np.ndarray, offsets: np.ndarray | None = None,
              inputs: np.ndarray | None = None) -> SamplingBatch:
        """The SamplingBatch of these rows, in this order (they must all be active). `offsets`: each
        entry draws its row's output token that many places past the next (a speculative step's
        drafted positions; rows repeat then); `inputs`, with them, the draft each entry follows (its
        row's earlier entries' drafts count as output tokens for its penalties)."""
        rows = np.asarray(rows, np.int64)
        floats = self._floats[rows]
        ints = self._ints[rows]
        if offsets is not None:
            ints[:, _I_OUT_POS] += offsets
        flags = basic_flags(floats[:, _F_TEMPERATURE], ints[:, _I_TOP_K], floats[:, _F_TOP_P], floats[:, _F_MIN_P])
        if flags["all_greedy"]:  # nothing reads the basic tensors: no copies
            batch = SamplingBatch(None, None, None, None, None, None, **flags)
        else:
            floats_dev = self._to_device(floats)
            ints_dev = self._to_device(ints)
            batch = SamplingBatch(
                temperature=floats_dev[:, _F_TEMPERATURE],
                top_k=ints_dev[:, _I_TOP_K],
                top_p=floats_dev[:, _F_TOP_P],
                min_p=floats_dev[:, _F_MIN_P],
                seed=ints_dev[:, _I_SEED],
                output_positions=ints_dev[:, _I_OUT_POS],
                **flags,
            )
        if self._num_bias:
            positions = np.flatnonzero(self._bias.counts[rows] > 0)
            if positions.shape[0]:
                ids, values = self._bias.gather(rows[positions])
                batch.logit_bias_positions = self._to_device(positions)
                batch.logit_bias_ids = self._to_device(ids)
                batch.logit_bias_values = self._to_device(values)
        if self._num_penalty:
            slots = self._slot[rows]
            positions = np.flatnonzero(slots >= 0)
            if positions.shape[0]:
                coefficients = self._penalties[rows[positions]]
                coefficients_dev = self._to_device(coefficients)
                batch.penalty_positions = self._to_device(positions)
                batch.penalty_slots = self._to_device(slots[positions])
                batch.output_counts = self._output_counts
                batch.prompt_mask = self._prompt_mask
                batch.repetition_penalty = coefficients_dev[:, _P_REPETITION]
                batch.frequency_penalty = coefficients_dev[:, _P_FREQUENCY]
                batch.presence_penalty = coefficients_dev[:, _P_PRESENCE]
                batch.any_repetition = bool((coefficients[:, _P_REPETITION] != 1.0).any())
                batch.any_frequency_presence = bool((coefficients[:, _P_FREQUENCY:] != 0.0).any())
                if offsets is not None and inputs is not None:
                    self._draft_counts(batch, positions, offsets, inputs)
        if self._num_min_tokens:
            positions = np.flatnonzero(self._min_new_tokens[rows] > ints[:, _I_OUT_POS])
            if positions.shape[0]:
                ids, _ = self._stops.gather(rows[positions])
                batch.stop_positions = self._to_device(positions)
                batch.stop_token_ids = self._to_device(ids)
        if self._num_logprobs:
            batch.return_logprob = bool(self._return_logprob[rows].any())
            batch.top_logprobs_num = int(self._top_logprobs[rows].max()) if rows.shape[0] else 0
            counts = self._logprob_ids.counts[rows]
            if counts.any():
                ids, _ = self._logprob_ids.gather(rows)
                batch.token_ids_logprob = self._to_device(ids)
                batch.token_ids_logprob_counts = self._to_device(counts.copy())
        return batch

    def _draft_counts(self, batch: SamplingBatch, positions: np.ndarray, offsets: np.ndarray,
                      inputs: np.ndarray) -> None:
        """For penalized entries past their row's first: the drafts before them, as extra counts."""
        later = np.flatnonzero(offsets[positions] > 0)
        if not later.shape[0]:
            return
        depth = offsets[positions[later]]
        extra_rows = np.repeat(later, depth)
        # Entry b at offset j follows the drafts at entries b - j + 1 .. b (inputs: the draft each follows).
        ends = np.repeat(positions[later], depth)
        back = np.arange(extra_rows.shape[0]) - np.repeat(np.cumsum(depth) - depth, depth)
        tokens = inputs[ends - back]
        batch.penalty_extra_rows = self._to_device(extra_rows.astype(np.int64))
        batch.penalty_extra_tokens = self._to_device(tokens.astype(np.int64))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
