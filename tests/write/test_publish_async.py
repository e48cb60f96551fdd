"""Publisher.publish_async / flush / close: snapshots isolated, order kept, failures surfaced.

Every published version is compared bit for bit with the state at its ``publish_async`` call,
while the caller goes on modifying its tensors in place right after each call and the store is
held slow, so the background always lags behind the caller.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

import pytest
import torch

import deltastore.write.publisher as publish_module
from deltastore import Publisher, Subscriber
from deltastore.errors import (
    CommitUnknownError,
    FencedError,
    InvalidStateDictError,
    LayoutMismatchError,
    StorageError,
    VersionSkippedError,
)
from deltastore.fleet.ledger import HeartbeatWriter
from deltastore.format.keys import HEAD_KEY
from deltastore.storage import open_store
from deltastore.storage.base import ObjectMeta, PutMode
from deltastore.write import commit as commit_module
from deltastore.write.policy import AsyncPolicy, LayoutPolicy, WriterPolicy
from testkit.stores import WrappedStore, check_invariants
from testkit.tensors import SMALL_CHUNK_BYTES, assert_bits_equal
from testkit.tensors import snapshot as copy_state

#: How long a test waits for the background before it calls the pipeline stuck.
WAIT_S = 30.0


class SlowPuts(WrappedStore):
    """Sleeps ``delay_s`` before each pack upload (the bulk of a publish on a real network)."""

    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        if key.endswith(".pack") or key.startswith("blobs/"):  # schema 3 or 1/2 pack keys
            time.sleep(self.delay_s)
        return super().put(key, data, mode=mode)


class GatedPuts(WrappedStore):
    """Pack uploads wait for ``gate``; ``entered`` is set once one is waiting. ``fail`` makes
    them raise StorageError instead (nothing stored)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        if key.endswith(".pack") or key.startswith("blobs/"):  # schema 3 or 1/2 pack keys
            self.entered.set()
            if not self.gate.wait(WAIT_S):
                raise AssertionError("gate never opened")
            if self.fail:
                raise StorageError(f"injected: uploading {key} to {self.url} failed")
        return super().put(key, data, mode=mode)


def make_state(seed: int = 0, rows: int = 48) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w32": torch.randn(rows, 8, generator=g),
        "w16": torch.randn(rows, 4, generator=g).to(torch.bfloat16),
        "h16": torch.randn(rows // 2, 8, generator=g).half(),
        "ids": torch.randint(-1000, 1000, (rows,), generator=g),
        "scale": torch.tensor(1.5),
    }


def modify_in_place(state: dict[str, torch.Tensor]) -> None:
    """The trainer's next step: +1 in place on the first half of every tensor's rows (so some
    chunks change and some do not)."""
    for t in state.values():
        if t.dim() == 0:
            t.add_(1)
        else:
            t[: max(1, t.shape[0] // 2)].add_(1)


def served(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {n: t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone() for n, t in state.items()}


def pull_versions(url: str, versions, storage_options=None) -> list[dict[str, torch.Tensor]]:
    with Subscriber(url, storage_options=storage_options, threads=2) as sub:
        return [sub.pull(v) for v in versions]


# --- order and bit-exactness -------------------------------------------------------------------


def test_each_version_is_the_state_at_its_call_while_the_caller_modifies_its_tensors(any_store_target) -> None:
    store = SlowPuts(any_store_target.open(), delay_s=0.05)  # the background lags behind the caller
    state = make_state()
    expected, futures = [], []
    with Publisher(any_store_target.url, store=store, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for step in range(5):
            expected.append(copy_state(state))
            futures.append(pub.publish_async(state, step=step))
            modify_in_place(state)  # at once: the snapshot must already be taken
        assert not all(f.done() for f in futures), "the store was meant to hold the background behind"
    infos = [f.result(0) for f in futures]
    assert [i.version for i in infos] == [1, 2, 3, 4, 5]
    assert [i.step for i in infos] == [0, 1, 2, 3, 4]
    # the first version is an anchor and the second a delta; later ones follow the anchor
    # policy (bytes written), not the queue
    assert [i.kind for i in infos[:2]] == ["anchor", "delta"]
    pulled = pull_versions(any_store_target.url, range(1, 6), any_store_target.storage_options)
    for v, (got, want) in enumerate(zip(pulled, expected), start=1):
        assert_bits_equal(got, want, f"version {v}")
    assert check_invariants(store) == [1, 2, 3, 4, 5]
    store.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_served_dtype_from_fp32_masters_is_the_cast_of_the_state_at_each_call(dtype) -> None:
    url = f"memory://async-dtype-{dtype}"
    g = torch.Generator().manual_seed(1)
    masters = {"w": torch.randn(64, 16, generator=g) * 0.02, "b": torch.randn(64, generator=g), "n": torch.arange(7)}
    expected, futures = [], []
    with Publisher(url, dtype=dtype, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for step in range(4):
            expected.append(served(masters, dtype))
            futures.append(pub.publish_async(masters, step=step))
            for t in masters.values():  # an optimizer step on the fp32 masters, in place
                t.add_(torch.randn(t.shape, generator=g) * 1e-3 if t.is_floating_point() else 1)
        info = pub.publish(masters, step=4)  # the synchronous path serves the same dtype
        expected.append(served(masters, dtype))
    assert [f.result(0).version for f in futures] + [info.version] == [1, 2, 3, 4, 5]
    pulled = pull_versions(url, range(1, 6))
    for v, (got, want) in enumerate(zip(pulled, expected), start=1):
        assert got["w"].dtype == dtype and got["n"].dtype == torch.int64
        assert_bits_equal(got, want, f"version {v}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_masters_snapshot_before_the_next_kernel_touches_them() -> None:
    url = "memory://async-cuda"
    g = torch.Generator(device="cuda").manual_seed(2)
    masters = {"w": torch.randn(1024, 256, device="cuda", generator=g), "n": torch.arange(9, device="cuda")}
    expected, futures = [], []
    with Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=2),
                   async_policy=AsyncPolicy(max_pending=2)) as pub:
        for step in range(4):
            expected.append({n: served({n: t}, torch.bfloat16)[n].cpu() for n, t in masters.items()})
            futures.append(pub.publish_async(masters, step=step))
            for t in masters.values():  # queued on the stream right after the call returns
                t.add_(1)
    assert [f.result(0).version for f in futures] == [1, 2, 3, 4]
    for v, (got, want) in enumerate(zip(pull_versions(url, range(1, 5)), expected), start=1):
        assert_bits_equal(got, want, f"version {v}")


def test_publish_after_publish_async_keeps_call_order() -> None:
    url = "memory://async-then-sync"
    store = GatedPuts(open_store(url))
    state = make_state(2)
    expected = []
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES), async_policy=AsyncPolicy(max_pending=4)) as pub:
        store.gate.clear()
        futures = []
        for step in range(3):
            expected.append(copy_state(state))
            futures.append(pub.publish_async(state, step=step))
            modify_in_place(state)
        threading.Timer(0.3, store.gate.set).start()
        expected.append(copy_state(state))
        info = pub.publish(state, step=3)  # waits for the three queued versions first
        assert all(f.done() for f in futures)
        assert [f.result().version for f in futures] == [1, 2, 3] and info.version == 4
    assert_bits_equal(pull_versions(url, [4])[0], expected[3])
    assert [(i.version, i.step) for i in Subscriber(url).log()] == [(1, 0), (2, 1), (3, 2), (4, 3)]


def test_close_drains_every_queued_publish_and_refuses_more() -> None:
    url = "memory://async-close-drains"
    store = SlowPuts(open_store(url), delay_s=0.05)
    state = make_state(3)
    pub = Publisher(url, store=store, writer_policy=WriterPolicy(threads=2),
                    layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES), async_policy=AsyncPolicy(max_pending=8))
    futures = []
    for step in range(4):
        futures.append(pub.publish_async(state, step=step))
        modify_in_place(state)
    pub.close()
    assert [f.result(0).version for f in futures] == [1, 2, 3, 4]
    assert check_invariants(store) == [1, 2, 3, 4]
    with pytest.raises(StorageError, match="closed"):
        pub.publish_async(state)
    pub.close()  # idempotent


# --- bad input is refused in the caller's thread ------------------------------------------------


def test_bad_input_raises_at_once_and_queues_nothing() -> None:
    url = "memory://async-bad-input"
    state = make_state(4)
    with Publisher(url, writer_policy=WriterPolicy(threads=2, skip_unchanged=False),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:  # republishes `bigger`
        pub.publish_async(state, step=0).result(WAIT_S)
        with pytest.raises(InvalidStateDictError, match="'oops'"):
            pub.publish_async({**state, "oops": [1, 2]})
        with pytest.raises(InvalidStateDictError, match="step"):
            pub.publish_async(state, step="one")
        with pytest.raises(InvalidStateDictError, match="JSON"):
            pub.publish_async(state, metadata={"x": object()})
        bigger = {**state, "extra": torch.zeros(3)}
        with pytest.raises(LayoutMismatchError, match="'extra'"):
            pub.publish_async(bigger)
        pub.flush()
        assert pub.version == 1
        # A layout change with anchor=True is accepted, and the next call is checked against it.
        assert pub.publish_async(bigger, anchor=True).result(WAIT_S).kind == "anchor"
        with pytest.raises(LayoutMismatchError, match="'extra'"):
            pub.publish_async(state)
        assert pub.publish_async(bigger).result(WAIT_S).version == 3


def test_bad_constructor_arguments_fail_before_any_io(tmp_path) -> None:
    missing = str(tmp_path / "nope")  # opening it would raise BucketNotFoundError
    with pytest.raises(ValueError, match="dtype"):
        Publisher(missing, dtype=torch.int32)
    with pytest.raises(ValueError, match="async mode"):
        AsyncPolicy("newest")
    with pytest.raises(ValueError, match="max_pending"):
        AsyncPolicy(max_pending=0)
    with pytest.raises(TypeError, match="async_policy"):
        Publisher(missing, async_policy="latest")  # a string, not a policy: refused before the store opens


# --- failures in the background ------------------------------------------------------------------


def test_fencing_in_the_background_resolves_the_future_and_is_raised_once(any_store_target) -> None:
    url, opts = any_store_target.url, any_store_target.storage_options
    state = make_state(5)
    pub = Publisher(url, storage_options=opts, writer_policy=WriterPolicy(threads=2),
                    layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES))
    assert pub.publish_async(state, step=0).result(WAIT_S).version == 1
    Publisher(url, storage_options=opts, writer_policy=WriterPolicy(threads=1)).close()  # a newer publisher takes the store over
    modify_in_place(state)
    failed = pub.publish_async(state, step=1)
    assert isinstance(failed.exception(WAIT_S), FencedError)
    with pytest.raises(FencedError) as raised:
        pub.publish_async(state, step=2)  # the next call reports it; its own state is not queued
    assert raised.value is failed.exception()
    pub.flush()  # reported once: flush does not raise it again
    with pytest.raises(FencedError) as again:
        pub.publish_async(state, step=3)  # a fenced publisher never commits again: said at once
    assert again.value is not failed.exception()
    pub.close()  # nothing unreported is left
    with Subscriber(url, storage_options=opts) as sub:
        assert sub.latest().version == 1


def test_a_failing_store_resolves_the_future_is_raised_once_and_the_next_publish_recovers() -> None:
    url = "memory://async-store-fails"
    store = GatedPuts(open_store(url))
    state = make_state(6)
    expected = {}
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        expected[1] = copy_state(state)
        pub.publish_async(state, step=0)
        pub.flush()
        modify_in_place(state)
        store.fail = True
        failed = pub.publish_async(state, step=1)
        assert isinstance(failed.exception(WAIT_S), StorageError)
        store.fail = False
        modify_in_place(state)
        with pytest.raises(StorageError, match="injected") as raised:
            pub.publish_async(state, step=2)
        assert raised.value is failed.exception()
        expected[2] = copy_state(state)
        info = pub.publish_async(state, step=2).result(WAIT_S)  # reported once: this one is queued
        assert info.version == 2
        pub.flush()
    # The failed encode advanced the reference copy; it was dropped, so version 2 is exact.
    pulled = pull_versions(url, [1, 2])
    assert_bits_equal(pulled[0], expected[1], "version 1")
    assert_bits_equal(pulled[1], expected[2], "version 2")


class HeadLandsUnreadable(WrappedStore):
    """While ``armed``: a HEAD write lands and then reports a reset, and HEAD cannot be read."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed = False

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        meta = super().put(key, data, mode=mode)
        if key == HEAD_KEY and self.armed:
            raise StorageError("HEAD: connection reset after the write landed (injected)")
        return meta

    def _unreadable(self, key: str) -> None:
        if key == HEAD_KEY and self.armed:
            raise StorageError("HEAD: 503 (injected on read-back)")

    def get(self, key, *, byte_range=None):
        self._unreadable(key)
        return super().get(key, byte_range=byte_range)

    def get_with_meta(self, key):
        self._unreadable(key)
        return super().get_with_meta(key)

    def get_if_changed(self, key, etag):
        self._unreadable(key)
        return super().get_if_changed(key, etag)


def test_an_unknown_commit_outcome_in_the_background_is_surfaced_then_settled(monkeypatch) -> None:
    monkeypatch.setattr(commit_module, "READBACK_BACKOFF_S", 0.001)
    url = "memory://async-commit-unknown"
    store = HeadLandsUnreadable(open_store(url))
    state = make_state(11)
    expected = {}
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        expected[1] = copy_state(state)
        pub.publish_async(state, step=0).result(WAIT_S)
        modify_in_place(state)
        expected[2] = copy_state(state)
        store.armed = True
        unknown = pub.publish_async(state, step=1)
        assert isinstance(unknown.exception(WAIT_S), CommitUnknownError)
        store.armed = False
        modify_in_place(state)
        with pytest.raises(CommitUnknownError) as raised:
            pub.publish_async(state, step=2)
        assert raised.value is unknown.exception()
        expected[3] = copy_state(state)
        info = pub.publish_async(state, step=2).result(WAIT_S)
    assert (info.version, info.parent) == (3, 2), "the landed version 2 is counted once"
    for v, got in zip((1, 2, 3), pull_versions(url, (1, 2, 3))):
        assert_bits_equal(got, expected[v], f"version {v}")


def test_close_raises_an_unreported_failure_but_never_masks_the_callers_exception(caplog) -> None:
    url = "memory://async-close-failure"
    store = GatedPuts(open_store(url))
    store.fail = True
    pub = Publisher(url, store=store, writer_policy=WriterPolicy(threads=2))
    pub.publish_async(make_state(7))
    with pytest.raises(StorageError, match="injected"):
        pub.close()

    pub = Publisher(url, store=store, writer_policy=WriterPolicy(threads=2))
    caplog.set_level(logging.ERROR, logger="deltastore.write.publisher")
    with pytest.raises(RuntimeError, match="trainer crashed"):
        with pub:
            pub.publish_async(make_state(7))
            raise RuntimeError("trainer crashed")
    assert any("injected" in r.getMessage() for r in caplog.records if r.name == "deltastore.write.publisher")


# --- slow stores: policies and memory ---------------------------------------------------------------


def test_latest_policy_skips_waiting_snapshots_and_their_futures_say_so() -> None:
    url = "memory://async-latest"
    store = GatedPuts(open_store(url))
    state = make_state(8)
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES), async_policy=AsyncPolicy("latest")) as pub:
        store.gate.clear()
        first = pub.publish_async(state, step=0)
        assert store.entered.wait(WAIT_S)  # step 0 is uploading (held)
        modify_in_place(state)
        skipped = pub.publish_async(state, step=1, anchor=True)
        modify_in_place(state)
        t0 = time.monotonic()
        newest = pub.publish_async(state, step=2)  # replaces step 1 without waiting
        assert time.monotonic() - t0 < 5.0
        expected = copy_state(state)
        modify_in_place(state)
        with pytest.raises(VersionSkippedError, match="step 1"):
            skipped.result(WAIT_S)
        assert not first.done()
        store.gate.set()
        pub.flush()  # a skip is not a failure
    assert first.result(0).version == 1
    info = newest.result(0)
    assert (info.version, info.step) == (2, 2)
    assert info.kind == "anchor", "the skipped call asked for an anchor: the one replacing it inherits it"
    assert_bits_equal(pull_versions(url, [2])[0], expected)


@pytest.mark.parametrize("policy, max_pending", [("block", 1), ("block", 2), ("latest", 1), ("latest", 2)])
def test_at_most_max_pending_plus_one_snapshots_are_alive(monkeypatch, policy: str, max_pending: int) -> None:
    url = f"memory://async-memory-{policy}-{max_pending}"
    alive: list[weakref.ref] = []
    peak = 0
    real_snapshot = publish_module.snapshot

    def counting_snapshot(state, dtype=None):
        nonlocal peak
        snap = real_snapshot(state, dtype)
        alive.append(weakref.ref(snap["w32"]))  # one tensor stands for its snapshot
        peak = max(peak, sum(r() is not None for r in alive))
        return snap

    monkeypatch.setattr(publish_module, "snapshot", counting_snapshot)
    store = GatedPuts(open_store(url))
    state = make_state(9)
    n_calls = max_pending + 4
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES),
                   async_policy=AsyncPolicy(policy, max_pending=max_pending)) as pub:
        pub.publish(state, step=0)  # the reference copy is the publisher's own, not a snapshot
        store.entered.clear()
        store.gate.clear()
        calls_done = threading.Event()

        def trainer():
            for step in range(1, n_calls + 1):
                pub.publish_async(state, step=step)
                modify_in_place(state)
            calls_done.set()

        t = threading.Thread(target=trainer)
        t.start()
        try:
            assert store.entered.wait(WAIT_S)
            if policy == "block":
                time.sleep(0.3)
                assert not calls_done.is_set(), "'block' must hold the trainer while the store is held"
            else:
                assert calls_done.wait(WAIT_S), "'latest' must never hold the trainer"
            gc.collect()
            held = sum(r() is not None for r in alive)
            assert held <= max_pending + 1, f"{held} snapshots alive while the store is held"
        finally:
            store.gate.set()
            t.join(WAIT_S)
        pub.flush()
    assert peak <= max_pending + 1, f"{peak} snapshots were alive at once"
    gc.collect()
    assert sum(r() is not None for r in alive) == 0, "a snapshot outlived its publish"


def test_publish_async_returns_quickly_compared_to_publish() -> None:
    url = "memory://async-return-time"
    store = SlowPuts(open_store(url), delay_s=0.3)
    state = make_state(10, rows=512)
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(state, step=0)
        modify_in_place(state)
        t0 = time.perf_counter()
        pub.publish(state, step=1)
        sync_s = time.perf_counter() - t0
        modify_in_place(state)
        t0 = time.perf_counter()
        future = pub.publish_async(state, step=2)
        async_s = time.perf_counter() - t0
        assert future.result(WAIT_S).version == 3
    assert async_s < 0.5 * sync_s, f"publish_async took {async_s:.3f} s, publish {sync_s:.3f} s"


# --- the fleet ledger -----------------------------------------------------------------------------


def test_oldest_live_version_reads_the_ledger(tmp_path) -> None:
    (tmp_path / "s").mkdir()
    url = str(tmp_path / "s")
    with Publisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        assert pub.oldest_live_version() is None
        HeartbeatWriter(pub.store, "worker-a").beat(5)
        HeartbeatWriter(pub.store, "worker-b").beat(3)
        assert pub.oldest_live_version() == 3
        assert pub.oldest_live_version(ttl_s=-1.0) is None  # nobody heard from within the TTL
