"""The engine core's parts on their own: the row table, the throughput window, the grammar queue
and the fault-injection spec."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from tokenspeed_worker.engine import faults, throughput
from tokenspeed_worker.engine.grammar import GrammarQueue
from tokenspeed_worker.engine.messages import AddRequest
from tokenspeed_worker.engine.rows import RowTable
from tokenspeed_worker.sampling.params import SamplingParams
from tokenspeed_worker.sampling.state import SamplingState


def test_rows_grow_are_recycled_and_a_refused_request_holds_no_row():
    table = RowTable(SamplingState(2, 50), capacity=2)
    rows = [table.add(100 + i, np.array([1]), SamplingParams()) for i in range(5)]
    assert len(set(rows)) == 5 and table.server_id.shape[0] == 8 and table.sampling.capacity >= 8
    assert table.row_of(103) == rows[3] and 103 in table and len(table) == 5
    assert table.first_scheduled(np.array(rows[:2])).tolist() == rows[:2]
    assert table.first_scheduled(np.array(rows[:3])).tolist() == [rows[2]]  # the first two already ran
    table.release(rows[1])
    assert table.row_of(101) is None and table.server_id[rows[1]] == -1
    assert table.add(200, np.array([1]), SamplingParams()) == rows[1]  # recycled, and fresh again
    assert table.first_scheduled(np.array([rows[1]])).tolist() == [rows[1]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        table.add(300, np.array([1]), SamplingParams(logit_bias={50: 1.0}))
    assert 300 not in table and len(table) == 5


def test_throughput_is_tokens_over_the_window(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: now[0])
    window = throughput.ThroughputWindow(window_s=10.0)
    assert window.rate() == 0.0
    window.add(50)
    assert window.rate() == 0.0  # one step: no span yet
    now[0] = 102.0
    window.add(30)
    now[0] = 104.0
    assert window.rate() == pytest.approx(80 / 4.0)
    now[0] = 111.0  # the first step left the window: one step, no span
    assert window.rate() == 0.0
    window.add(20)
    now[0] = 111.5
    assert window.rate() == pytest.approx(50 / 9.5)
    now[0] = 200.0
    assert window.rate() == 0.0


def test_grammar_queue_yields_finished_compilations_in_arrival_order():
    queue = GrammarQueue()
    futures = [Future() for _ in range(3)]
    for i, future in enumerate(futures):
        queue.add(AddRequest(i, np.array([1], np.int32), 4, SamplingParams(), constraint=("regex", "a+")), future)
    futures[2].set_result("compiled-2")
    futures[0].set_exception(RuntimeError("[12:00:00] /x/y.cc:1: bad regex"))
    taken = [(req.req_id, compiled, error) for req, compiled, error in queue.take_compiled()]
    assert taken == [(0, None, "sampling_params.regex: bad regex"), (2, "compiled-2", None)]
    assert len(queue) == 1 and 1 in queue
    assert queue.discard(1) and not queue.discard(1) and len(queue) == 0


def test_fault_spec_parses_and_strikes_at_its_step():
    assert faults.parse("") is None
    assert faults.parse("hang@3") == faults.Fault("hang", 3, 3600.0)
    assert faults.parse("hang@3:0.5") == faults.Fault("hang", 3, 0.5)
    for bad in ("oom", "oom@x", "oom@2:1", "boom@2", "hang@2:-1"):
        with pytest.raises(ValueError, match="TOKENSPEED_FAULT_INJECT"):
            faults.parse(bad)
    calls = []
    step = faults.parse("oom@2").wrap(lambda *args: calls.append(args) or len(calls))
    assert step("a") == 1
    with pytest.raises(Exception, match="injected by TOKENSPEED_FAULT_INJECT"):
        step("b")
    assert step("c") == 2 and calls == [("a",), ("c",)]
