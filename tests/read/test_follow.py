"""Subscriber.stage/swap/follow: workers that follow, stage while serving, and
swap in a short pause; the worker cache; kills during the pause and the cache write."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltastore import (
    CachePolicy,
    FollowRecord,
    HeartbeatPolicy,
    PollPolicy,
    Publisher,
    StaleStageError,
    Subscriber,
    TargetModifiedError,
)
from deltastore.fleet.target import TARGET_KEY
from deltastore.format.keys import HEAD_KEY
from deltastore.layout.tensors import bits
from deltastore.read.cache import HELD_FILE, WorkerCache
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.manifest_docs import read_manifest_doc
from testkit.stores import HeadPutHook, WrappedStore
from testkit.targets import StoreTarget
from testkit.tensors import assert_bits_equal, bits_differ, small_state, snapshot, sparse_edit

ROOT = Path(__file__).resolve().parents[2]
#: Small chunks, so that a sparse edit changes some chunks of a tensor and not others.
CHUNK_BYTES = 128
#: A follow loop in a test never waits longer than this for a version.
DEADLINE_S = 60.0


def _publisher(t: StoreTarget, **kw: Any) -> Publisher:
    kw.setdefault("writer_policy", WriterPolicy(threads=2))
    return Publisher(t.url, storage_options=t.storage_options, layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES), **kw)


def _subscriber(t: StoreTarget, **kw: Any) -> Subscriber:
    return Subscriber(t.url, storage_options=t.storage_options, threads=2, **kw)


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = [small_state(seed, n=4, rows=32)]
    for _ in range(n - 1):
        out.append(sparse_edit(out[-1], rng, fraction=0.02))
    return out


def _publish_all(t: StoreTarget, states: list[dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    with _publisher(t) as pub:
        for s in states:
            out[pub.publish(s).version] = snapshot(s)
    return out


class WatchedPause:
    """A pause hook that checks the target is written only inside it: on enter, the target must
    still hold what it held at the last exit."""

    def __init__(self, target: dict[str, torch.Tensor]):
        self.target = target
        self.entered = 0
        self.at_exit = snapshot(target)
        self.inside = False

    def __enter__(self) -> None:
        diff = bits_differ(self.target, self.at_exit)
        assert diff is None, f"the target was written outside the pause: {diff}"
        self.entered += 1
        self.inside = True

    def __exit__(self, *exc: object) -> None:
        self.inside = False
        self.at_exit = snapshot(self.target)


def _check_changed(rec: FollowRecord, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """``changed`` lists exactly the chunks whose bits differ: each span differs, nothing outside."""
    for name in after:
        old, new = bits(before[name]), bits(after[name])
        outside = np.ones(old.size, dtype=bool)
        for a, b in rec.changed.get(name, []):
            assert not np.array_equal(old[a:b], new[a:b]), f"{name}[{a}:{b}] listed as changed but is not"
            outside[a:b] = False
        assert np.array_equal(old[outside], new[outside]), f"{name} changed outside the listed spans"


# --- follow: every version bit-exact, timings, changed spans, the pause -----------------------


def _follow_while_publishing(t: StoreTarget, n: int = 6) -> None:
    states = _states(n)
    # What each version holds, known before it is published: the follower may apply version v
    # (HEAD moved) before publish() of v has returned on the writer thread.
    published = {v: snapshot(s) for v, s in enumerate(states, start=1)}
    versions: list[int] = []
    with _publisher(t) as pub:
        versions.append(pub.publish(states[0]).version)

    def publish_rest() -> None:
        with _publisher(t) as pub:
            for s in states[1:]:
                time.sleep(0.15)
                versions.append(pub.publish(s).version)

    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    pause = WatchedPause(target)
    writer = threading.Thread(target=publish_rest)
    writer.start()
    records: list[FollowRecord] = []
    stop = threading.Event()
    threading.Timer(DEADLINE_S, stop.set).start()
    try:
        with _subscriber(t) as sub:
            before = snapshot(target)
            for rec in sub.follow(target, poll=PollPolicy(0.05), pause=pause, stop=stop, heartbeat=None):
                records.append(rec)
                assert_bits_equal(target, published[rec.info.version], f"version {rec.info.version}")
                if not rec.full_load:
                    _check_changed(rec, before, target)
                    assert rec.fetch_s > 0 and rec.decode_s > 0 and rec.pause_s > 0
                    assert rec.bytes_fetched > 0 and rec.from_version == records[-2].info.version
                before = snapshot(target)
                if rec.info.version == n:
                    break
    finally:
        stop.set()
        writer.join()
    assert versions == list(range(1, n + 1))  # states[i] is version i + 1, as ``published`` says
    assert records[0].full_load and records[0].from_version is None and records[0].info.version >= 1
    assert records[-1].info.version == n
    assert pause.entered == len(records), "the pause is entered once per version applied"
    assert len(records) >= 2


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_follow_applies_every_version_bit_exact_and_writes_only_in_the_pause(kind: str, tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store")) if kind == "file" else StoreTarget("memory", f"memory://follow-{os.getpid()}-{time.time_ns()}")
    _follow_while_publishing(t)


@pytest.mark.integration
def test_follow_on_seaweedfs(seaweedfs_s3_url: StoreTarget) -> None:
    _follow_while_publishing(seaweedfs_s3_url)


def test_follow_accepts_a_lock_or_a_callable_as_the_pause(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(2))
    lock = threading.Lock()
    entered = []

    class Hook:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            pass

    for pause in (lock, Hook):
        target = {k: torch.zeros_like(v) for k, v in small_state(0, n=4, rows=32).items()}
        with _subscriber(t) as sub:
            recs = list(sub.follow(target, poll=PollPolicy(0.01), pause=pause, heartbeat=None, max_versions=1))
        assert recs[0].info.version == 2 and recs[0].full_load
    assert not lock.locked() and entered == [1]


# --- stage / swap -----------------------------------------------------------------------------


def test_stage_touches_nothing_and_swap_applies_it(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    pub_states = _publish_all(t, _states(3))
    with _subscriber(t) as sub:
        target = sub.pull(1)
        before = snapshot(target)
        staged = sub.stage(target)
        assert staged is not None and staged.info.version == 3 and staged.from_version == 1
        assert_bits_equal(target, before, "stage wrote the target")
        assert staged.nbytes < sum(v.numel() * v.element_size() for v in target.values())  # sparse
        assert sub.version == 1
        assert sub.swap(staged, target) >= 0
        assert sub.version == 3
        assert_bits_equal(target, pub_states[3])
        assert sub.stage(target) is None  # current
        with pytest.raises(StaleStageError):
            sub.swap(staged, target)  # prepared against version 1


def test_stage_refuses_a_modified_target_and_swap_detects_a_write_in_between(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(2))
    with _subscriber(t) as sub:
        target = sub.pull(1)
        name = next(iter(target))
        bits(target[name])[0] ^= 1
        with pytest.raises(TargetModifiedError):
            sub.stage(target)
        bits(target[name])[0] ^= 1
        staged = sub.stage(target)
        assert staged is not None
        p = staged.patches[0]
        pos = p.span[0] + (0 if p.positions is None else int(p.positions[0]))
        before = snapshot(target)
        bits(target[p.name])[pos] ^= 1  # a foreign write at a position the swap replaces
        with pytest.raises(TargetModifiedError):
            sub.swap(staged, target)
        bits(target[p.name])[pos] ^= 1
        assert_bits_equal(target, before)  # nothing left applied
        assert sub.version == 1


# --- polls and faults -------------------------------------------------------------------------


class CountingStore(WrappedStore):
    """Counts calls and notes whether each conditional GET of HEAD moved a body."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        self.bodies: list[bool] = []

    def get_if_changed(self, key: str, etag: str | None) -> Any:
        res = super().get_if_changed(key, etag)
        if key == HEAD_KEY:
            self.bodies.append(res is not None)
        return res


def test_an_idle_poll_is_conditional_gets_of_head_and_the_fleet_target_without_a_body(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(2))
    store = CountingStore(open_store(t.url))
    target = {k: torch.zeros_like(v) for k, v in small_state(0, n=4, rows=32).items()}
    stop = threading.Event()
    seen: list[int] = []
    with Subscriber(t.url, store=store, threads=2) as sub:
        def run() -> None:
            for rec in sub.follow(target, poll=PollPolicy(0.05, jitter=0.0), stop=stop, heartbeat=None):
                seen.append(rec.info.version)
                with store._lock:
                    store.calls.clear()
                    store.bodies.clear()

        th = threading.Thread(target=run)
        th.start()
        time.sleep(1.0)
        stop.set()
        th.join()
    assert seen == [2]
    assert len(store.calls) >= 5, store.calls
    # HEAD by a conditional GET, the fleet target (there is none) by a HEAD request
    assert set(store.calls) == {("get_if_changed", HEAD_KEY), ("head", TARGET_KEY)}, store.calls
    assert not any(store.bodies)


def test_head_pointing_to_a_missing_manifest_keeps_the_last_good_version_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(3)
    published = _publish_all(t, states[:2])
    store = open_store(t.url)
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    stop = threading.Event()
    got: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with _subscriber(t) as sub:
                for rec in sub.follow(target, poll=PollPolicy(0.05, max_interval=0.2), stop=stop, heartbeat=None):
                    got.append(rec.info.version)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with caplog.at_level(logging.WARNING, logger="deltastore.read"):
        th = threading.Thread(target=run)
        th.start()
        _wait(lambda: got == [2])
        hidden: dict[str, bytes] = {}

        def hide_then_commit(key: str, data: bytes, mode: Any, put: Any) -> Any:
            # The manifest goes just before HEAD names it: the follower never sees version 3 whole.
            doc = json.loads(data)
            if doc["version"] == 3:  # (the publisher's claim of HEAD names version 2)
                hidden[doc["manifest"]] = store.get(doc["manifest"])
                store.delete(doc["manifest"])
            return put()

        with _publisher(t, store=HeadPutHook(store, hide_then_commit)) as pub:
            pub.publish(states[2])
        published[3] = snapshot(states[2])
        ((key, manifest),) = hidden.items()  # HEAD now names a missing manifest
        assert json.loads(store.get(HEAD_KEY))["manifest"] == key
        _wait(lambda: "NotFoundError" in caplog.text)
        time.sleep(0.5)  # several failed polls
        assert got == [2] and th.is_alive()
        assert_bits_equal(target, published[2], "the target keeps the last good version")
        store.put(key, manifest)
        _wait(lambda: got == [2, 3])
        stop.set()
        th.join()
    assert not errors, errors
    assert_bits_equal(target, published[3])
    assert key in caplog.text


def _wait(cond: Any, timeout: float = DEADLINE_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


# --- the worker cache ---------------------------------------------------------------------------


def test_a_restarted_worker_resumes_from_its_cache_without_fetching_that_version(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(3)
    published = _publish_all(t, states[:2])
    cache = tmp_path / "cache"
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    with _subscriber(t) as sub:
        assert [r.info.version for r in sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1)] == [2]
    assert (cache / HELD_FILE).exists()

    store = WrappedStore(open_store(t.url))
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    with Subscriber(t.url, store=store, threads=2) as sub:
        recs = list(sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1))
        assert recs[0].info.version == 2 and recs[0].bytes_fetched == 0 and recs[0].full_load
        assert not [k for v, k in store.calls if v == "get" and k.startswith("packs/")], store.calls
        assert_bits_equal(target, published[2])
        with _publisher(t) as pub:
            pub.publish(states[2])
        recs = list(sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1))
        assert recs[0].info.version == 3 and recs[0].from_version == 2 and not recs[0].full_load
    assert_bits_equal(target, states[2])
    assert WorkerCache(cache).load().version == 3  # saved when the loop ended


@pytest.mark.parametrize("damage", ["another store", "a flipped byte"])
def test_an_unusable_cache_is_rebuilt_with_a_log_line(damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = StoreTarget("file", str(tmp_path / "a"))
    b = StoreTarget("file", str(tmp_path / "b"))
    states_a, states_b = _states(2, seed=1), _states(2, seed=2)
    _publish_all(a, states_a)
    published_b = _publish_all(b, states_b)
    cache = tmp_path / "cache"
    source = a if damage == "another store" else b
    target = {k: torch.zeros_like(v) for k, v in states_a[0].items()}
    with _subscriber(source) as sub:
        list(sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1))
    if damage == "a flipped byte":
        f = next(cache.glob("state-*.safetensors"))
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x10  # inside the last tensor's data
        f.write_bytes(bytes(data))
    store = WrappedStore(open_store(b.url))
    target = {k: torch.zeros_like(v) for k, v in states_b[0].items()}
    with caplog.at_level(logging.WARNING, logger="deltastore.read"):
        with Subscriber(b.url, store=store, threads=2) as sub:
            recs = list(sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None, max_versions=1))
    assert "worker cache" in caplog.text and "not usable" in caplog.text, caplog.text
    assert recs[0].full_load and recs[0].bytes_fetched > 0
    assert_bits_equal(target, published_b[2])
    held = WorkerCache(cache).load()
    assert held is not None and held.url == store.url and held.version == 2
    assert_bits_equal(held.tensors, published_b[2])


def _follow_publishing(t: StoreTarget, states: list[dict[str, torch.Tensor]], **kw: Any) -> list[FollowRecord]:
    """Follow while publishing ``states`` one at a time: each yielded version brings the next."""
    _publish_all(t, states[:1])
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    recs: list[FollowRecord] = []
    with _subscriber(t) as sub:
        for rec in sub.follow(target, poll=PollPolicy(0.01), heartbeat=None, **kw):
            recs.append(rec)
            if len(recs) == len(states):
                break
            with _publisher(t) as pub:
                pub.publish(states[len(recs)])
    assert_bits_equal(target, states[-1])
    return recs


@pytest.mark.parametrize("error", ["SafetensorError", "ENOSPC"])
def test_a_cache_that_cannot_be_saved_is_a_warning_and_the_follower_goes_on(
    error: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def disk_full_after_the_first(tensors: Any, filename: str, metadata: Any = None) -> None:
        if not list(Path(filename).parent.glob("state-*.safetensors")):
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 100)  # half a file, then the disk is full
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)") \
            if error == "SafetensorError" else OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_after_the_first)
    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(4)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="deltastore.read"):
        recs = _follow_publishing(t, states, cache=CachePolicy(cache, every_s=0.0))
    assert [r.info.version for r in recs] == [1, 2, 3, 4]
    assert not list(cache.glob("*partial*")) and len(list(cache.glob("state-*"))) == 1
    assert caplog.text.count("without updating the worker cache") >= 3, caplog.text
    held = WorkerCache(cache).load()
    assert held is not None and held.version == 1  # the last good save, adopted as what it is
    assert_bits_equal(held.tensors, states[0])


def test_a_cache_on_a_full_tmpfs_is_a_warning_and_the_follower_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "tmpfs"
    cache.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(cache)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        t = StoreTarget("file", str(tmp_path / "store"))
        states = [{"w": torch.full((128, 256), float(i))} for i in range(3)]  # 128 KiB: never fits
        with caplog.at_level(logging.WARNING, logger="deltastore.read"):
            recs = _follow_publishing(t, states, cache=CachePolicy(cache, every_s=0.0))
        assert [r.info.version for r in recs] == [1, 2, 3]
        assert "No space left on device" in caplog.text, caplog.text
        assert sorted(p.name for p in cache.iterdir()) == []  # nothing half-written left on it
    finally:
        subprocess.run(["umount", str(cache)], check=True)


def test_follow_refuses_a_cache_path_that_is_a_file_before_fetching(tmp_path: Path) -> None:
    from deltastore.errors import WorkerCacheError

    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(1)
    _publish_all(t, states)
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")
    store = WrappedStore(open_store(t.url))
    with Subscriber(t.url, store=store, threads=2) as sub:
        target = {k: torch.zeros_like(v) for k, v in states[0].items()}
        with pytest.raises(WorkerCacheError, match=f"worker cache path {not_a_dir} is not a directory"):
            next(sub.follow(target, cache=CachePolicy(not_a_dir), heartbeat=HeartbeatPolicy("w-1")))
    assert store.calls == []  # nothing read, no heartbeat written



# --- kills: the pause, the cache write -----------------------------------------------------------

_WORKER = r"""
import os, sys, time, threading
import deltastore.read.cache
from deltastore import CachePolicy, PollPolicy, Subscriber
url, cache, marker, where = sys.argv[1:5]

if where == "cache":
    real = os.fsync
    def slow_fsync(fd):
        real(fd)
        if os.path.exists(marker + ".armed"):
            open(marker, "w").close()
            time.sleep(60)   # killed here, in the middle of WorkerCache.save
    deltastore.read.cache.os.fsync = slow_fsync

class Pause:
    def __enter__(self):
        if where == "pause" and os.path.exists(marker + ".armed"):
            self.hang = True
        else:
            self.hang = False
    def __exit__(self, *exc):
        if self.hang:  # the target is already written: killed inside the pause
            open(marker, "w").close()
            time.sleep(60)

import torch
sub = Subscriber(url, threads=2)
target = sub.allocate(1)
for rec in sub.follow(target, poll=PollPolicy(0.05), pause=Pause(), cache=CachePolicy(cache, every_s=0.0), heartbeat=None):
    print(rec.info.version, flush=True)
"""


@pytest.mark.parametrize("where", ["pause", "cache"])
def test_a_worker_killed_in_the_pause_or_the_cache_write_never_serves_a_mixed_state(where: str, tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(4)
    published = _publish_all(t, states[:2])
    cache = tmp_path / "cache"
    marker = tmp_path / "marker"
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), t.url, str(cache), str(marker), where],
                            stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"2"  # held version 2 (and cached it)
        _wait(lambda: WorkerCache(cache).load() is not None and WorkerCache(cache).load().version == 2)
        Path(f"{marker}.armed").touch()
        with _publisher(t) as pub:
            for s in states[2:]:
                published[pub.publish(s).version] = snapshot(s)
        _wait(lambda: marker.exists())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    held = WorkerCache(cache).load()
    if held is not None:  # the previous complete pair or the new one, never a mix
        assert held.version in published
        assert_bits_equal(held.tensors, published[held.version], f"cached version {held.version}")
    # Restart: resumes (or rebuilds) and reaches the latest version bit-exactly.
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    with _subscriber(t) as sub:
        recs = []
        for rec in sub.follow(target, poll=PollPolicy(0.01), cache=CachePolicy(cache), heartbeat=None):
            recs.append(rec)
            assert_bits_equal(target, published[rec.info.version], f"version {rec.info.version} after restart")
            if rec.info.version == 4:
                break
    if held is not None:
        assert recs[0].info.version == held.version and recs[0].bytes_fetched == 0


# --- heartbeats, a replaced history, a corrupt segment -------------------------------------------


class ReadOnlyLedger(WrappedStore):
    def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> Any:
        from deltastore.errors import AccessDeniedError

        if key.startswith("workers/"):
            raise AccessDeniedError(f"put {key!r}: access denied")
        return super().put(key, data, mode=mode)


def test_follow_writes_heartbeats_and_tolerates_read_only_credentials(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from deltastore.fleet.ledger import read_ledger

    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(2))
    target = {k: torch.zeros_like(v) for k, v in small_state(0, n=4, rows=32).items()}
    with _subscriber(t) as sub:
        list(sub.follow(target, poll=PollPolicy(0.01), heartbeat=HeartbeatPolicy("w-1"), max_versions=1))
    beats = read_ledger(open_store(t.url))
    assert [(b.worker, b.version) for b in beats] == [("w-1", 2)]

    store = ReadOnlyLedger(open_store(t.url))
    target = {k: torch.zeros_like(v) for k, v in small_state(0, n=4, rows=32).items()}
    with caplog.at_level(logging.INFO, logger="deltastore.fleet.ledger"):
        with Subscriber(t.url, store=store, threads=2) as sub:
            recs = list(sub.follow(target, poll=PollPolicy(0.01), heartbeat=HeartbeatPolicy("w-2"), max_versions=1))
    assert recs[0].info.version == 2
    assert caplog.text.count("read-only") == 1


def test_a_follower_that_ends_is_marked_stopped_with_its_last_version(tmp_path: Path) -> None:
    from deltastore.fleet.ledger import read_ledger

    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(2))
    target = {k: torch.zeros_like(v) for k, v in small_state(0, n=4, rows=32).items()}
    seen = []
    with _subscriber(t) as sub:
        for rec in sub.follow(target, poll=PollPolicy(0.01), heartbeat=HeartbeatPolicy("w-1")):
            _wait(lambda: [(b.worker, b.version, b.live()) for b in read_ledger(open_store(t.url))] == [("w-1", 2, True)])
            seen.append(rec.info.version)
            break  # the caller stops iterating: the generator is closed
    (beat,) = read_ledger(open_store(t.url))
    assert seen == [2] and (beat.worker, beat.version, beat.stopped, beat.live()) == ("w-1", 2, True, False)


def test_a_stage_and_swap_worker_appears_in_the_ledger_and_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltastore.cli import main
    from deltastore.fleet.ledger import read_ledger

    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(3)
    _publish_all(t, states[:1])
    ledger = open_store(t.url)

    def beats() -> list[tuple[str, int, bool]]:
        return [(b.worker, b.version, b.live()) for b in read_ledger(ledger)]

    with _subscriber(t) as sub:
        with sub.heartbeat("serve-1") as writer:  # what examples/serve.py does
            assert sub.heartbeat() is writer  # one writer per subscriber while it runs
            with pytest.raises(ValueError, match="already writes heartbeats as 'serve-1'"):
                sub.heartbeat("serve-2")
            target = sub.pull()
            _wait(lambda: beats() == [("serve-1", 1, True)])
            _publish_all(t, states[1:])
            lock = threading.Lock()
            staged = sub.stage(target)
            assert staged is not None
            with lock:  # the pause: the heartbeat is written by its own thread, not in here
                sub.swap(staged, target)
            _wait(lambda: beats() == [("serve-1", 3, True)])
            assert main(["status", t.url, "--json"]) == 0
            (w,) = json.loads(capsys.readouterr().out)["workers"]
            assert (w["worker"], w["version"], w["state"], w["live"]) == ("serve-1", 3, "live", True)
        assert beats() == [("serve-1", 3, False)] and read_ledger(ledger)[0].stopped
        sub.heartbeat("serve-1")  # a new writer after close (the subscriber's close() ends it)
        _wait(lambda: beats() == [("serve-1", 3, True)])
    assert beats() == [("serve-1", 3, False)]
    assert main(["status", t.url]) == 0
    assert re.search(r"serve-1 +v3 +current +seen \d+s ago +stopped ", capsys.readouterr().out)


def test_follow_loads_a_replaced_history_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    old = _publish_all(t, _states(2, seed=1))
    target = {k: torch.zeros_like(v) for k, v in old[1].items()}
    got: list[FollowRecord] = []
    stop = threading.Event()
    with _subscriber(t) as sub, caplog.at_level(logging.WARNING, logger="deltastore.read"):
        def run() -> None:
            for rec in sub.follow(target, poll=PollPolicy(0.05), stop=stop, heartbeat=None):
                got.append(rec)

        th = threading.Thread(target=run)
        th.start()
        _wait(lambda: [r.info.version for r in got] == [2])
        open_store(t.url).delete(HEAD_KEY)
        new = _publish_all(t, _states(3, seed=2))  # a new run: versions 1..3 of another history
        _wait(lambda: len(got) >= 2 and got[-1].info.version == 3)
        stop.set()
        th.join()
    # The follower may meet the new run at any of its versions (it polls while the run
    # publishes): the first record of the new history is a whole reload, then it follows.
    assert got[1].full_load and got[-1].info.version == 3
    assert all(not r.full_load for r in got[2:])
    assert_bits_equal(target, new[3])
    assert "replaced" in caplog.text


def test_a_corrupt_segment_while_following_is_logged_and_retried_and_the_target_keeps_its_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(3)
    published = _publish_all(t, states[:2])
    target = {k: torch.zeros_like(v) for k, v in states[0].items()}
    with _subscriber(t) as sub:
        assert [r.info.version for r in sub.follow(target, poll=PollPolicy(0.01), heartbeat=None, max_versions=1)] == [2]
        with _publisher(t) as pub:
            published[pub.publish(states[2]).version] = snapshot(states[2])
        store = open_store(t.url)
        head = json.loads(store.get(HEAD_KEY))
        m = read_manifest_doc(store, head["manifest"])
        pack = next(iter(m["blobs"].values()))["key"] if isinstance(m["blobs"], dict) else m["blobs"][0]["key"]
        good = store.get(pack)
        store.put(pack, bytes([good[0] ^ 1]) + good[1:])  # every segment at offset 0 of the pack is bad
        stop = threading.Event()
        got: list[int] = []
        with caplog.at_level(logging.WARNING):
            def run() -> None:
                for rec in sub.follow(target, poll=PollPolicy(0.05, max_interval=0.1), stop=stop, heartbeat=None):
                    got.append(rec.info.version)

            th = threading.Thread(target=run)
            th.start()
            _wait(lambda: caplog.text.count("retrying") >= 2)  # a delta has no full segment to fall back on
            assert not got and th.is_alive() and "IntegrityError" in caplog.text
            assert_bits_equal(target, published[2])
            store.put(pack, good)
            _wait(lambda: got == [3])
            stop.set()
            th.join()
    assert_bits_equal(target, published[3])


@pytest.mark.parametrize("how", ["garbage", "sha", "missing"])
def test_stage_falls_back_to_the_anchor_full_segment(tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    """As pull_into does (D10): a bad delta segment of an anchor is replaced by its full segment."""
    from testkit.stores import anchor_with_deltas, corrupt_anchor_delta

    url = str(tmp_path / "store")
    states = anchor_with_deltas(url)
    name, index = corrupt_anchor_delta(url, how)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(3)
        with caplog.at_level("WARNING", logger="deltastore.read.engine"):
            staged = sub.stage(target)
        assert staged is not None and staged.info.version == 4
        assert_bits_equal(target, states[2], "stage wrote nothing")
        sub.swap(staged, target)
    assert_bits_equal(target, states[3])
    assert any(f"{name}[{index}]" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_and_swap_into_a_cuda_target(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    published = _publish_all(t, _states(3))
    with _subscriber(t) as sub:
        target = {k: v.cuda() for k, v in sub.pull(1).items()}
        staged = sub.stage(target)
        assert staged is not None
        assert_bits_equal({k: v.cpu() for k, v in target.items()}, published[1], "stage wrote the target")
        sub.swap(staged, target)
    assert_bits_equal({k: v.cpu() for k, v in target.items()}, published[3])


@pytest.mark.parametrize("as_module", [True, False])
def test_follow_swap_by_rebinding_repoints_the_tensors_the_engine_reads(tmp_path: Path, as_module: bool) -> None:
    """swap_mode="rebind": each touched tensor is patched in a copy before the pause and only
    repointed in it; a module's parameters (what forward() reads) hold every version bit-exact."""
    t = StoreTarget("file", str(tmp_path / "store"))
    states = _states(4)
    published = _publish_all(t, states)
    model = torch.nn.Module()
    for name, v in states[0].items():  # names are plain identifiers ("t0", ...)
        model.register_parameter(name, torch.nn.Parameter(torch.zeros_like(v), requires_grad=False))
    target: Any = model if as_module else {k: torch.zeros_like(v) for k, v in states[0].items()}
    engine_view = dict(model.named_parameters()) if as_module else target  # the objects an engine reads
    with _subscriber(t) as sub:
        first = list(sub.follow(target, poll=PollPolicy(0.01), heartbeat=None, max_versions=1))
        assert first[0].info.version == 4 and first[0].full_load
    with _subscriber(t) as sub:
        sub.pull_into(target, 1)  # hold version 1, then follow 2..4 by rebinding
        ptrs = {k: v.data_ptr() for k, v in engine_view.items()}
        recs = []
        for rec in sub.follow(target, poll=PollPolicy(0.01), heartbeat=None, max_versions=1, swap_mode="rebind"):
            recs.append(rec)
        assert recs[0].info.version == 4 and not recs[0].full_load and recs[0].pause_s < 0.05
        assert_bits_equal({k: v.detach() for k, v in engine_view.items()}, published[4])
        assert any(engine_view[k].data_ptr() != ptrs[k] for k in recs[0].changed), "touched tensors were repointed"
    with _subscriber(t) as sub, pytest.raises(ValueError, match="swap_mode"):
        next(sub.follow(target, swap_mode="teleport"))


# --- the loop's settings: small validated values ------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: PollPolicy(0.0),
    lambda: PollPolicy(-1.0),
    lambda: PollPolicy(float("nan")),
    lambda: PollPolicy(float("inf")),
    lambda: PollPolicy(1.0, jitter=-0.1),
    lambda: PollPolicy(1.0, jitter=1.5),
    lambda: PollPolicy(2.0, max_interval=1.0),
    lambda: CachePolicy("/tmp/cache", every_s=-1.0),
    lambda: CachePolicy("/tmp/cache", every_s=float("nan")),
    lambda: HeartbeatPolicy(interval_s=0.0),
], ids=["zero interval", "negative interval", "nan interval", "endless interval", "negative jitter",
        "jitter over 1", "backoff cap under the interval", "negative cache period", "nan cache period",
        "zero heartbeat period"])
def test_follow_settings_refuse_a_value_out_of_range_when_made(make: Any) -> None:
    with pytest.raises(ValueError, match="must be"):
        make()


def test_follow_settings_default_to_the_documented_cadence() -> None:
    from deltastore.fleet.ledger import HEARTBEAT_INTERVAL_S

    assert (PollPolicy().interval, PollPolicy().jitter, PollPolicy().max_interval) == (2.0, 0.1, 60.0)
    assert CachePolicy("/tmp/cache").every_s == 300.0
    assert (HeartbeatPolicy().worker_id, HeartbeatPolicy().interval_s) == (None, HEARTBEAT_INTERVAL_S)
    steady = PollPolicy(0.5, jitter=0.0, max_interval=3.0)
    assert steady.wait_s() == 0.5
    assert [steady.backoff_s(n) for n in (1, 2, 3, 10)] == [1.0, 2.0, 3.0, 3.0]  # doubled, capped
    spread = PollPolicy(1.0, jitter=0.2)
    assert all(0.8 <= spread.wait_s() <= 1.2 for _ in range(100))


def test_follow_takes_its_settings_as_values_only(tmp_path: Path) -> None:
    """A clean break: the loop's old keywords are unknown, and a setting of the wrong type is
    refused before anything is read."""
    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(1))
    store = WrappedStore(open_store(t.url))
    target = {k: torch.zeros_like(v) for k, v in _states(1)[0].items()}
    with Subscriber(t.url, store=store, threads=1) as sub:
        for old in ("interval", "jitter", "max_interval", "cache_dir", "cache_every_s", "worker_id"):
            with pytest.raises(TypeError, match=old):
                sub.follow(target, **{old: 1.0})
        for kw, name in ((dict(poll=2.0), "PollPolicy"), (dict(poll=None), "PollPolicy"),
                         (dict(cache=str(tmp_path / "cache")), "CachePolicy"), (dict(heartbeat=True), "HeartbeatPolicy")):
            with pytest.raises(TypeError, match=name):
                next(sub.follow(target, **kw))
    assert store.calls == []


def test_follow_writes_heartbeats_at_the_policy_s_period(tmp_path: Path) -> None:
    t = StoreTarget("file", str(tmp_path / "store"))
    _publish_all(t, _states(1))
    target = {k: torch.zeros_like(v) for k, v in _states(1)[0].items()}
    with _subscriber(t) as sub:
        for _ in sub.follow(target, poll=PollPolicy(0.01), heartbeat=HeartbeatPolicy("w-7", interval_s=7.5)):
            running = sub.heartbeat()  # the loop's writer, as it is
            assert (running.worker_id, running.interval_s, running.closed) == ("w-7", 7.5, False)
            break
        assert running.closed  # the loop started it: it ends with the loop
