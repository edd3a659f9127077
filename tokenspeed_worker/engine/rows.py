"""The engine's row table: which request each row holds.

The native scheduler and the sampling state know a request by its *row*, a small integer that
indexes per-row arrays (here the server's id; in `SamplingState` everything sampling needs), so a
step gathers its rows' data with one numpy fancy-index, never a per-request loop. Rows are
recycled after a request ends; the server's ids never are. The table grows by doubling and grows
the sampling state with it.
"""

from __future__ import annotations

import numpy as np

from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.sampling.state import SamplingState


class RowTable:
    def __init__(self, sampling: SamplingState, capacity: int = 64) -> None:
        self.sampling = sampling
        self.server_id = np.full(capacity, -1, dtype=np.int64)  # row -> the server's id; -1: free
        self.was_scheduled = np.zeros(capacity, dtype=bool)  # row already in a forward batch once
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._row_of: dict[int, int] = {}  # the server's id -> row
        sampling.ensure_capacity(capacity)

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._row_of

    def active_rows(self) -> list[int]:
        return list(self._row_of.values())

    def row_of(self, req_id: int) -> int | None:
        return self._row_of.get(req_id)

    def add(self, req_id: int, prompt_ids: np.ndarray, params: SamplingParams) -> int:
        """A free row for the request, its sampling state stored. Raises what
        `SamplingState.add_row` raises (ValueError naming the problem), holding nothing then."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        try:
            self.sampling.add_row(row, prompt_ids, params)
        except Exception:
            self._free.append(row)
            raise
        self._row_of[req_id] = row
        self.server_id[row] = req_id
        self.was_scheduled[row] = False
        return row

    def release(self, row: int) -> None:
        """Forget the row's request (and its sampling state); the row is free again."""
        self._row_of.pop(int(self.server_id[row]), None)
        self.server_id[row] = -1
        self.sampling.remove_row(row)
        self._free.append(row)

    def first_scheduled(self, rows: np.ndarray) -> np.ndarray:
        """The rows among `rows` whose first forward this is, marked scheduled now (a boolean gather)."""
        fresh = rows[~self.was_scheduled[rows]]
        if fresh.shape[0]:
            self.was_scheduled[fresh] = True
        return fresh

    def _grow(self) -> None:
        old = self.server_id.shape[0]
        new = old * 2
        self.server_id = np.concatenate([self.server_id, np.full(new - old, -1, dtype=np.int64)])
        self.was_scheduled = np.concatenate([self.was_scheduled, np.zeros(new - old, dtype=bool)])
        self.sampling.ensure_capacity(new)
        self._free.extend(range(new - 1, old - 1, -1))
