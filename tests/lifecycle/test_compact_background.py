"""Compaction that keeps up with head (design 005 D5): the publisher's background
compactor (``Publisher(compact=...)``) and ``deltastore compact --follow``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.fleet.ledger import HeartbeatWriter
from deltastore.format.history import History
from deltastore.format.models import SquashRef
from deltastore.lifecycle.compact import BackgroundCompactor, CompactPolicy, CompactReport
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.stores import keys
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer, assert_bits_equal, snapshot

REPO = Path(__file__).resolve().parents[2]
#: Generous bound on one background run of these tiny models (a loaded 2-core machine).
IDLE_TIMEOUT_S = 60.0


def _publisher(url: str, **kw: Any) -> Publisher:
    return Publisher(url, writer_policy=WriterPolicy(threads=2), anchor_policy=AnchorPolicy(every=1000),
                     layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES), **kw)


def _index_refs(url: str) -> list[SquashRef]:
    store = open_store(url)
    try:
        history = History(store)
        got = history.read_head()
        assert got is not None
        index = history.index(got[0])
        return [] if index is None else list(index.squashes)
    finally:
        store.close()


def _index_squashes(url: str) -> list[tuple[int, int]]:
    return sorted((r.from_, r.to) for r in _index_refs(url))


def _beat(url: str, worker: str, version: int) -> None:
    store = open_store(url)
    try:
        assert HeartbeatWriter(store, worker).beat(version, force=True)
    finally:
        store.close()


def test_background_compaction_serves_a_live_worker_behind(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(5)
    states: dict[int, dict[str, torch.Tensor]] = {}
    with _publisher(url, compact=True) as pub:
        assert pub._compactor is not None
        state = trainer.export()
        for _ in range(3):
            states[pub.publish(state).version] = snapshot(state)
            state = trainer.step()
        sub = Subscriber(url, threads=2)
        target = sub.pull()
        assert sub.version == 3
        _beat(url, "w-behind", 3)  # what a following worker's heartbeat says
        for _ in range(5):
            states[pub.publish(state).version] = snapshot(state)
            state = trainer.step()
        assert pub._compactor.wait_idle(IDLE_TIMEOUT_S)
        assert pub._compactor.failures == 0
    squashes = _index_squashes(url)
    assert (3, 8) in squashes, squashes  # the live worker's version, to the newest head
    assert any(f == 1 for f, _ in squashes), squashes  # the anchor squash
    with caplog.at_level(logging.INFO, logger="deltastore.read"):
        before = sub.bytes_fetched
        assert sub.pull_into(target).version == 8
    assert_bits_equal(target, states[8], "caught up through the background squash")
    assert any("through squash 3→8" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    (sq_bytes,) = [r.bytes for r in _index_refs(url) if r.from_ == 3]
    assert sub.bytes_fetched - before <= sq_bytes
    sub.close()


def test_background_compaction_is_off_by_default(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(6)
    with _publisher(url) as pub:
        assert pub._compactor is None
        state = trainer.export()
        pub.publish(state)
        _beat(url, "w-behind", 1)
        for _ in range(4):
            state = trainer.step()
            pub.publish(state)
    store = open_store(url)
    try:
        assert not [k for k in keys(store, "objects/") if k.endswith(".squash.json.zst")]
    finally:
        store.close()
    assert _index_squashes(url) == []
    assert not [t for t in threading.enumerate() if t.name == "deltastore-compact"]


def test_a_failed_background_compaction_is_logged_and_publishing_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import deltastore.lifecycle.compact as compact_mod

    real = compact_mod.compact
    calls = []

    def flaky(*args: Any, **kw: Any) -> CompactReport:
        calls.append(kw)
        if len(calls) == 1:
            raise compact_mod.IntegrityError("injected: a composed chunk missed its digest")
        return real(*args, **kw)

    monkeypatch.setattr(compact_mod, "compact", flaky)
    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(7)
    with caplog.at_level(logging.WARNING, logger="deltastore.lifecycle.compact"), _publisher(url, compact=True) as pub:
        assert pub._compactor is not None
        pub.publish(trainer.export())
        assert pub._compactor.wait_idle(IDLE_TIMEOUT_S)
        assert pub._compactor.failures == 1
        assert any(r.levelno == logging.WARNING and "injected" in r.getMessage() for r in caplog.records)
        for _ in range(3):  # the next publishes work, and so do the next compactions
            assert pub.publish(trainer.step()).version >= 2
        assert pub._compactor.wait_idle(IDLE_TIMEOUT_S)
        assert pub._compactor.failures == 1
        assert pub._compactor.runs >= 2
    assert any(f == 1 for f, _ in _index_squashes(url)), _index_squashes(url)  # the anchor squash, after the failure


class _Gate:
    """A stand-in for compact() that blocks until released or asked to stop."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0
        self.stopped = False

    def __call__(self, store: Store, **kw: Any) -> CompactReport:
        self.calls += 1
        self.started.set()
        stop: threading.Event = kw["stop"]
        while not self.release.is_set():
            if stop.is_set():
                self.stopped = True
                break
            time.sleep(0.01)
        return CompactReport(store.url, 0, ())


def test_heads_landing_during_a_run_are_coalesced_into_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate()
    monkeypatch.setattr("deltastore.lifecycle.compact.compact", gate)
    store = open_store("memory://coalesce")
    bg = BackgroundCompactor(store, CompactPolicy())
    try:
        bg.submit(1)
        assert gate.started.wait(10)
        for v in range(2, 20):  # never a queue: one wanted head, the newest
            bg.submit(v)
        gate.release.set()
        assert bg.wait_idle(10)
        assert gate.calls == 2
        assert bg.runs == 2
    finally:
        bg.close()
        store.close()


def test_close_waits_for_the_running_compaction_then_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate()
    monkeypatch.setattr("deltastore.lifecycle.compact.compact", gate)
    store = open_store("memory://close")
    bg = BackgroundCompactor(store, CompactPolicy(close_timeout_s=0.3))
    bg.submit(1)
    assert gate.started.wait(10)
    bg.submit(2)  # wanted, never run: close() serves no further head
    t0 = time.monotonic()
    bg.close()
    assert time.monotonic() - t0 < 5
    assert gate.stopped and gate.calls == 1
    assert not [t for t in threading.enumerate() if t.name == "deltastore-compact"]
    bg.submit(3)  # after close: ignored, no new thread
    assert gate.calls == 1
    bg.close()  # idempotent
    store.close()


def test_publisher_close_is_clean_with_compaction_on(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(8)
    pub = _publisher(url, compact=CompactPolicy(threads=1, close_timeout_s=IDLE_TIMEOUT_S))
    state = trainer.export()
    for _ in range(4):
        pub.publish(state)
        state = trainer.step()
    pub.close()
    assert not [t for t in threading.enumerate() if t.name == "deltastore-compact"]
    pub.close()  # idempotent
    with pytest.raises(ValueError, match="anchor_every"):
        CompactPolicy(anchor_every=0)
    with pytest.raises(TypeError, match="compact must be"):
        _publisher(url, compact="yes")  # type: ignore[arg-type]


def test_the_anchor_squash_is_rewritten_every_anchor_squash_every_versions(tmp_path: Path) -> None:
    """With the cadence (--follow, background), S(anchor, head) is written when none exists,
    then again once the indexed one ends ANCHOR_SQUASH_EVERY versions before head."""
    from deltastore.lifecycle.compact import ANCHOR_SQUASH_EVERY, compact

    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(9)
    written: dict[int, list[tuple[int, int]]] = {}
    with _publisher(url) as pub:
        state = trainer.export()
        for _ in range(ANCHOR_SQUASH_EVERY + 4):
            v = pub.publish(state).version
            state = trainer.step()
            report = compact(url, threads=1, anchor_squash_every=ANCHOR_SQUASH_EVERY)
            written[v] = [(s.from_, s.to) for s in report.squashes]
    assert written[3] == [(1, 3)]
    assert all(written[v] == [] for v in range(4, 3 + ANCHOR_SQUASH_EVERY)), written
    assert written[3 + ANCHOR_SQUASH_EVERY] == [(1, 3 + ANCHOR_SQUASH_EVERY)]


def test_default_bases_already_squashed_to_head_are_not_written_again(tmp_path: Path) -> None:
    """A second compactor (or round) on the same head writes nothing: the index has them."""
    from deltastore.lifecycle.compact import compact

    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(11)
    with _publisher(url) as pub:
        state = trainer.export()
        for _ in range(5):
            pub.publish(state)
            state = trainer.step()
    _beat(url, "w-two", 2)
    first = compact(url, threads=1)
    assert sorted((s.from_, s.to) for s in first.squashes) == [(1, 5), (2, 5)]
    again = compact(url, threads=1)
    assert again.squashes == () and again.skipped == ()
    assert sorted((s.from_, s.to) for s in compact(url, bases=[2], threads=1).squashes) == [(2, 5)]  # asked: written


def test_cli_compact_follow_one_round_per_new_head_until_sigterm(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    trainer = TinyTrainer(10)
    pub = _publisher(url)
    try:
        state = trainer.export()
        for _ in range(3):
            pub.publish(state)
            state = trainer.step()
        _beat(url, "w-follow", 2)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltastore", "compact", url, "--follow", "--interval", "0.2", "--json"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stdout is not None
            first = json.loads(proc.stdout.readline())
            assert first["to"] == 3 and [(s["from"], s["to"]) for s in first["squashes"]] == [(1, 3)]
            pub.publish(state)  # HEAD moves: a second round, for the worker at 2
            second = json.loads(proc.stdout.readline())
            assert second["to"] == 4 and [(s["from"], s["to"]) for s in second["squashes"]] == [(2, 4)]
            assert second["registered"] is True
            time.sleep(0.5)  # polls while HEAD does not move (its own index write included): no round
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        assert out.strip() == "", out  # no third round
    finally:
        pub.close()
    assert (2, 4) in _index_squashes(url) and (1, 3) in _index_squashes(url)
