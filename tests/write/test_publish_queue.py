"""PublishQueue and snapshot(): ordering, policies, failures surfaced, snapshots isolated."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from deltastore.errors import ConflictError, StorageError, VersionSkippedError
from deltastore.write.policy import AsyncPolicy
from deltastore.write.queue import PublishQueue, snapshot


class Recorder:
    """A publish function that records what it was given and can be held or made to fail."""

    def __init__(self):
        self.calls: list[tuple[int | None, dict[str, torch.Tensor]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on: set[int] = set()

    def __call__(self, state, *, step=None):
        self.started.set()
        self.gate.wait(10)
        if step in self.fail_on:
            raise ConflictError(f"step {step} lost a race")
        self.calls.append((step, {k: v.clone() for k, v in state.items()}))
        return step


def test_snapshot_is_a_copy_in_the_served_dtype():
    w = torch.randn(4, 3)
    ids = torch.arange(5)
    snap = snapshot({"w": w, "ids": ids}, torch.bfloat16)
    assert snap["w"].dtype == torch.bfloat16 and snap["ids"].dtype == torch.int64
    expected = w.to(torch.bfloat16)
    w.add_(1.0)
    ids.add_(1)
    assert torch.equal(snap["w"], expected)
    assert torch.equal(snap["ids"], torch.arange(5))
    same = snapshot({"w": w})
    assert same["w"].dtype == torch.float32 and same["w"].data_ptr() != w.data_ptr()


def test_publishes_in_order_and_results_arrive():
    rec = Recorder()
    q = PublishQueue(rec, AsyncPolicy(max_pending=8))
    futures = [q.submit({"x": torch.full((2,), float(i))}, step=i) for i in range(6)]
    q.flush()
    assert [f.result() for f in futures] == list(range(6))
    assert [s for s, _ in rec.calls] == list(range(6))
    assert all(torch.equal(st["x"], torch.full((2,), float(i))) for i, (_, st) in enumerate(rec.calls))
    q.close()


def test_block_policy_bounds_waiting_snapshots():
    rec = Recorder()
    rec.gate.clear()
    q = PublishQueue(rec, AsyncPolicy("block", max_pending=1))
    q.submit({"x": torch.zeros(1)}, step=0)
    assert rec.started.wait(5)  # step 0 is being published (held)
    q.submit({"x": torch.zeros(1)}, step=1)  # waits in the queue
    returned = threading.Event()

    def third():
        q.submit({"x": torch.zeros(1)}, step=2)
        returned.set()

    t = threading.Thread(target=third)
    t.start()
    time.sleep(0.2)
    assert not returned.is_set(), "a third snapshot must wait while one is published and one waits"
    assert q.pending == 2
    rec.gate.set()
    t.join(5)
    assert returned.is_set()
    q.close()
    assert [s for s, _ in rec.calls] == [0, 1, 2]


def test_latest_policy_skips_the_replaced_snapshot_and_says_so():
    rec = Recorder()
    rec.gate.clear()
    q = PublishQueue(rec, AsyncPolicy("latest", max_pending=1))
    f0 = q.submit({"x": torch.zeros(1)}, step=0)
    assert rec.started.wait(5)
    f1 = q.submit({"x": torch.zeros(1)}, step=1)
    f2 = q.submit({"x": torch.zeros(1)}, step=2)  # replaces step 1, returns at once
    with pytest.raises(VersionSkippedError, match="step 1"):
        f1.result(5)
    rec.gate.set()
    q.flush()  # a skip is not a failure: flush does not raise
    assert f0.result() == 0 and f2.result() == 2
    assert [s for s, _ in rec.calls] == [0, 2]
    q.close()


def test_a_background_failure_resolves_its_future_and_is_raised_once_by_the_next_call():
    rec = Recorder()
    rec.fail_on = {1}
    q = PublishQueue(rec, AsyncPolicy(max_pending=4))
    f0 = q.submit({"x": torch.zeros(1)}, step=0)
    f1 = q.submit({"x": torch.zeros(1)}, step=1)
    with pytest.raises(ConflictError):
        f1.result(5)
    assert f0.result() == 0
    with pytest.raises(ConflictError, match="step 1"):
        q.submit({"x": torch.zeros(1)}, step=2)
    f3 = q.submit({"x": torch.zeros(1)}, step=3)  # reported once; the queue goes on
    q.flush()
    assert f3.result() == 3
    q.close()


def test_close_drains_and_raises_an_unreported_failure():
    rec = Recorder()
    rec.fail_on = {2}
    q = PublishQueue(rec, AsyncPolicy(max_pending=4))
    for i in range(3):
        q.submit({"x": torch.zeros(1)}, step=i)
    with pytest.raises(ConflictError):
        q.close()
    assert [s for s, _ in rec.calls] == [0, 1]
    with pytest.raises(StorageError, match="closed"):
        q.submit({"x": torch.zeros(1)}, step=9)
    q.close()  # idempotent, and the failure was already reported


def test_flush_raises_the_failure():
    rec = Recorder()
    rec.fail_on = {0}
    q = PublishQueue(rec)
    q.submit({"x": torch.zeros(1)}, step=0)
    with pytest.raises(ConflictError):
        q.flush()
    q.flush()  # once
    q.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="async mode"):
        AsyncPolicy("newest")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_pending"):
            AsyncPolicy(max_pending=bad)
