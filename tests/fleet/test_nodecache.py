"""One fetch per node (deltastore.fleet.nodecache): worker processes sharing a cache directory
fetch each immutable object once, survive a fetcher killed mid-fetch, replace a damaged file,
and keep the directory within its bound."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import signal
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from deltastore import Subscriber
from deltastore.cli import main
from deltastore.errors import IntegrityError, NodeCacheError
from deltastore.fleet import nodecache
from deltastore.fleet.nodecache import NODE_CACHE_ENV, NodeCache, NodeCacheStore, cache_name
from deltastore.format.keys import HEAD_KEY
from deltastore.storage import open_store
from deltastore.storage.base import Store
from testkit.stores import WrappedStore, publish_history
from testkit.tensors import assert_bits_equal, mp_context, raw

#: Worker processes that race for the same objects (ranks of one engine).
WORKERS = 3
#: Seconds a child may take before the test calls it hung.
CHILD_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, torch.Tensor]]]:
    url = str(tmp_path_factory.mktemp("nodecache") / "store")
    return url, publish_history(url, n=4)


def immutable_keys(url: str) -> dict[str, bytes]:
    with open_store(url) as store:
        return {m.key: store.get(m.key) for m in store.list() if cache_name(m.key) is not None}


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode() + raw(state[name]))
    return h.hexdigest()


def fetched_keys(store: WrappedStore) -> list[str]:
    """Immutable objects the counting store read (one entry per GET)."""
    return [key for key, _ in store.reads if cache_name(key) is not None]


# --- child processes ---------------------------------------------------------------------------


def _worker(url: str, cache_dir: str, barrier, out) -> None:
    counting = WrappedStore(open_store(url))
    with Subscriber(url, store=counting, node_cache=cache_dir, threads=2) as sub:
        barrier.wait(CHILD_TIMEOUT_S)  # all ranks miss together: the lock decides who fetches
        target = sub.pull(1)
        sub.pull_into(target)
        out.put((state_digest(target), fetched_keys(counting)))


class _StallOnSecondPiece(WrappedStore):
    """Returns the first piece of an object, then never answers (a fetch that stalls)."""

    def __init__(self, inner: Store, started):
        super().__init__(inner)
        self.started = started

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if byte_range is not None and byte_range[0] > 0:
            self.started.set()
            threading.Event().wait()  # nobody sets it: the fetch hangs until the process is killed
        return super().get(key, byte_range=byte_range)


def _stalled_fetcher(url: str, cache_dir: str, key: str, started) -> None:
    nodecache.FETCH_PIECE_BYTES = 16  # so the fetch writes a partial file before it stalls
    store = NodeCacheStore(_StallOnSecondPiece(open_store(url), started), cache_dir)
    store.get(key)


# --- tests -------------------------------------------------------------------------------------


def test_worker_processes_fetch_each_object_once(published, tmp_path: Path) -> None:
    url, states = published
    ctx = mp_context()
    barrier, out = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, str(tmp_path / "node"), barrier, out)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=CHILD_TIMEOUT_S) for _ in procs]
    for p in procs:
        p.join(CHILD_TIMEOUT_S)
        assert p.exitcode == 0
    want = state_digest(states[-1])
    assert [digest for digest, _ in results] == [want] * WORKERS
    per_key = Counter(key for _, keys in results for key in keys)
    assert per_key and max(per_key.values()) == 1, per_key.most_common(3)  # never twice per node
    # every object the workers read is in the cache, under its digest, and only those
    assert sorted(os.listdir(tmp_path / "node" / "objects")) == sorted(cache_name(k)[0] for k in per_key)


def test_a_fetcher_killed_midway_leaves_the_object_to_the_next_process(published, tmp_path: Path) -> None:
    url, _ = published
    objects = immutable_keys(url)
    key = max(objects, key=lambda k: len(objects[k]))  # a pack, longer than one 16-byte piece
    ctx = mp_context()
    started = ctx.Event()
    child = ctx.Process(target=_stalled_fetcher, args=(url, str(tmp_path), key, started))
    child.start()
    try:
        assert started.wait(CHILD_TIMEOUT_S), "the fetcher never started"
        assert list((tmp_path / "tmp").glob("*.partial")), "the stalled fetch wrote no partial file"
    finally:
        os.kill(child.pid, signal.SIGKILL)  # mid-fetch, holding the object's lock
        child.join(CHILD_TIMEOUT_S)
    counting = WrappedStore(open_store(url))
    store = NodeCacheStore(counting, tmp_path)
    assert store.get(key) == objects[key]
    assert fetched_keys(counting) == [key] and store.stats().fetched == 1
    assert not list((tmp_path / "tmp").glob("*.partial"))  # the dead fetch's leftovers are gone
    assert (tmp_path / "objects" / cache_name(key)[0]).read_bytes() == objects[key]


def _damage(cache_dir: Path, key: str, how: str) -> None:
    path = cache_dir / "objects" / cache_name(key)[0]
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("verify_reads", [True, False])
def test_a_damaged_cached_file_is_fetched_again(published, tmp_path: Path, how: str, verify_reads: bool) -> None:
    url, states = published
    objects = immutable_keys(url)
    with Subscriber(url, node_cache=tmp_path) as sub:
        assert_bits_equal(sub.pull(), states[-1])
    packs = [k for k in objects if k.endswith(".pack") and (tmp_path / "objects" / cache_name(k)[0]).exists()]
    assert packs
    for key in packs:  # every pack damaged: whatever path the pull takes meets one
        _damage(tmp_path, key, how)
    counting = WrappedStore(open_store(url))
    with Subscriber(url, store=counting, node_cache=NodeCache(tmp_path, verify_reads=verify_reads)) as sub:
        if verify_reads:  # each file is hashed before its first use: the damage is never read
            assert_bits_equal(sub.pull(), states[-1])
        else:  # the read path's checks find it; its next try hashes the file and replaces it
            named = []  # the pack each failed pull names: a damaged file fails one read, no more
            for _ in range(len(packs) + 1):
                try:
                    assert_bits_equal(sub.pull(), states[-1])
                    break
                except IntegrityError as e:
                    pack = re.search(r"pack '([^']+)'", str(e))
                    assert pack is not None, e
                    named.append(pack.group(1))
            else:
                pytest.fail(f"no pull succeeded: {named}")
            assert named and len(set(named)) == len(named) and set(named) <= set(packs)
    refetched = [k for k in fetched_keys(counting) if k.endswith(".pack")]
    assert sorted(refetched) == sorted(packs)  # each damaged file fetched again, once
    for key in packs:
        assert (tmp_path / "objects" / cache_name(key)[0]).read_bytes() == objects[key]


def test_a_write_into_a_verified_file_is_seen_by_a_long_lived_reader(published, tmp_path: Path) -> None:
    url, _ = published
    objects = immutable_keys(url)
    key = max(objects, key=lambda k: len(objects[k]))
    store = NodeCacheStore(open_store(url), tmp_path)
    assert store.get(key, byte_range=(0, 8)) == objects[key][:8]
    path = tmp_path / "objects" / cache_name(key)[0]
    _damage(tmp_path, key, "flip")
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 10**9))  # a write a second later
    assert store.get(key, byte_range=(8, 16)) == objects[key][8:16]
    assert store.stats().refetched == 1 and path.read_bytes() == objects[key]


def test_an_object_that_fails_its_digest_is_refused_and_not_cached(published, tmp_path: Path) -> None:
    url, _ = published
    objects = immutable_keys(url)
    key = max(objects, key=lambda k: len(objects[k]))

    class Flipping(WrappedStore):
        def get(self, k: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
            data = bytearray(super().get(k, byte_range=byte_range))
            data[0] ^= 1
            return bytes(data)

    with pytest.raises(IntegrityError, match="SHA-256"):
        NodeCacheStore(Flipping(open_store(url)), tmp_path).get(key)
    assert os.listdir(tmp_path / "objects") == [] and os.listdir(tmp_path / "tmp") == []


def test_the_cache_keeps_its_bound_and_spares_files_being_read(published, tmp_path: Path) -> None:
    url, _ = published
    objects = immutable_keys(url)
    order = sorted(objects, key=lambda k: len(objects[k]))
    bound = sum(len(objects[k]) for k in order[-3:])  # room for the three largest objects
    store = NodeCacheStore(open_store(url), NodeCache(tmp_path, max_bytes=bound))
    first = order[0]
    assert store.get(first) == objects[first]
    reader = os.open(tmp_path / "objects" / cache_name(first)[0], os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)  # another process reading the least recently used file
    try:
        for key in order[1:]:
            assert store.get(key, byte_range=(1, 9)) == objects[key][1:9]
            files = list((tmp_path / "objects").iterdir())
            pinned = len(objects[first])
            assert sum(f.stat().st_size for f in files) <= bound + pinned
        assert (tmp_path / "objects" / cache_name(first)[0]).exists()
    finally:
        os.close(reader)
    assert store.stats().evicted > 0
    store.get(order[-1])  # one more fetch trims again, the file no longer being read
    assert sum(f.stat().st_size for f in (tmp_path / "objects").iterdir()) <= bound

    tiny = NodeCacheStore(open_store(url), NodeCache(tmp_path / "tiny", max_bytes=1))
    assert tiny.get(order[-1]) == objects[order[-1]]  # larger than the bound: read, not cached
    assert os.listdir(tmp_path / "tiny" / "objects") == []


def test_a_busy_lock_past_its_wait_reads_the_store(published, tmp_path: Path) -> None:
    url, _ = published
    objects = immutable_keys(url)
    key = next(iter(objects))
    store = NodeCacheStore(open_store(url), NodeCache(tmp_path, lock_wait_s=0.05))
    held = os.open(tmp_path / "locks" / f"{cache_name(key)[0]}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # a fetcher that stalls
    try:
        assert store.get(key) == objects[key]
    finally:
        os.close(held)
    assert store.stats().bypassed == 1


def test_only_immutable_objects_are_cached(published, tmp_path: Path) -> None:
    url, _ = published
    assert cache_name(HEAD_KEY) is None and cache_name("workers/w1.json") is None
    assert cache_name("gc/run.json") is None and cache_name("objects/x/y.pack") is None
    counting = WrappedStore(open_store(url))
    store = NodeCacheStore(counting, tmp_path)
    for _ in range(2):
        store.get(HEAD_KEY)
    assert [k for k, _ in counting.reads].count(HEAD_KEY) == 2
    assert os.listdir(tmp_path / "objects") == []


def test_subscriber_cli_and_environment_take_a_node_cache(published, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    url, states = published
    (tmp_path / "file").write_text("")
    with pytest.raises(NodeCacheError, match="file"):
        Subscriber(url, node_cache=tmp_path / "file")
    monkeypatch.setenv(NODE_CACHE_ENV, str(tmp_path / "env"))
    with Subscriber(url) as sub:
        assert_bits_equal(sub.pull(), states[-1])
    assert os.listdir(tmp_path / "env" / "objects")
    monkeypatch.delenv(NODE_CACHE_ENV)
    out = tmp_path / "out.safetensors"
    assert main(["pull", url, str(out), "--node-cache", str(tmp_path / "cli"), "-q"]) == 0
    assert sorted(os.listdir(tmp_path / "cli" / "objects")) == sorted(os.listdir(tmp_path / "env" / "objects"))
