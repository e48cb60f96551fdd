"""encode._PackWriter: the pack digest taken incrementally per segment (never by re-reading the
pack) and the segment digests the encode threads take must name the bytes actually stored; a
manifest is written only after every pack it names is stored."""

from __future__ import annotations

import hashlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import Publisher, StorageError, Subscriber
from deltastore.codec.container import Segment
from deltastore.storage import open_store
from deltastore.write import encode
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.manifest_docs import read_manifest_doc
from testkit.stores import WrappedStore
from testkit.tensors import assert_bits_equal, small_state, sparse_edit


@pytest.mark.parametrize("stream_bytes", [1, 250, 1 << 40], ids=["streamed-per-segment", "streamed-in-pieces", "whole"])
@pytest.mark.parametrize("given_digest", [True, False])
def test_pack_and_segment_digests_name_the_stored_bytes(tmp_path, monkeypatch, given_digest, stream_bytes):
    monkeypatch.setattr(encode, "PACK_TARGET_BYTES", 1000)  # several packs, flushed mid-stream
    # a local store takes packs streamed as they fill: per segment, in pieces, or whole
    monkeypatch.setattr(encode, "STREAM_WRITE_BYTES", stream_bytes)
    store = open_store(str(tmp_path / "store"))
    segs = [Segment("add-sparse/1", bytes([i % 251]) * (100 + 37 * i), i) for i in range(40)]
    with ThreadPoolExecutor(4) as up:
        w = encode._PackWriter(store, up, attempt="a" * 32, role="d")
        refs = [w.add(s, hashlib.sha256(s.data).hexdigest() if given_digest else None) for s in segs]
        w.finish()
    assert len(w.blobs) > 3
    packs = [store.get(b.key) for b in w.blobs]
    for b, data in zip(w.blobs, packs):
        assert b.sha256 == hashlib.sha256(data).hexdigest() and b.size == len(data)
        assert b.key == f"objects/{'a' * 32}/{b.sha256}.pack"
    assert w.bytes_written == sum(len(s.data) for s in segs)
    for s, r in zip(segs, refs):
        stored = packs[r.blob][r.offset : r.offset + r.length]
        assert stored == s.data and r.sha256 == hashlib.sha256(stored).hexdigest()
    assert not [p for p in (tmp_path / "store").rglob(".deltastore-tmp-*")]


class _SlowPacks(WrappedStore):
    """Pack uploads take ``delay`` seconds (and fail when ``fail``); records when each pack put
    ended and when each manifest put began."""

    def __init__(self, inner, delay: float):
        super().__init__(inner)
        self.delay = delay
        self.fail = False
        self.events: list[tuple[str, str, float]] = []

    def put(self, key, data, *, mode="overwrite"):
        if key.endswith(".pack"):
            time.sleep(self.delay)
            try:
                if self.fail:
                    raise StorageError(f"{key}: 503 (injected)")
                return super().put(key, data, mode=mode)
            finally:
                with self._lock:
                    self.events.append(("pack done", key, time.monotonic()))
        if key.startswith("manifests/"):
            with self._lock:
                self.events.append(("manifest start", key, time.monotonic()))
        return super().put(key, data, mode=mode)


def test_manifest_is_written_only_after_every_pack_it_names_is_stored():
    # A reader that finds a manifest must find its packs (SPEC §5), however slow their uploads.
    store = _SlowPacks(open_store(f"memory://packs-{uuid.uuid4().hex}"), delay=0.2)
    states = [small_state(0, rows=64)]
    states += [sparse_edit(states[-1], np.random.default_rng(i)) for i in range(1, 3)]
    with Publisher("unused", store=store, writer_policy=WriterPolicy(threads=2)) as pub:
        for s in states:
            pub.publish(s)
    manifests = [(k, t) for what, k, t in store.events if what == "manifest start"]
    packs = [t for what, _, t in store.events if what == "pack done"]
    assert len(manifests) == len(states) and len(packs) >= len(states)
    for key, started in manifests:
        m = read_manifest_doc(store.inner, key)
        done = [t for what, k, t in store.events if what == "pack done" and k in {b["key"] for b in m["blobs"]}]
        assert len(done) == len(m["blobs"]) and max(done) <= started, key


def test_a_pack_upload_that_fails_after_the_scan_commits_nothing():
    store = _SlowPacks(open_store(f"memory://packs-{uuid.uuid4().hex}"), delay=0.05)
    s0 = small_state(0, rows=64)
    s1 = sparse_edit(s0, np.random.default_rng(1))
    with Publisher("unused", store=store, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(s0)
        store.fail = True
        with pytest.raises(StorageError, match="injected"):
            pub.publish(s1)
        # nothing was left uploading, no manifest names the failed pack, HEAD did not move
        assert [e for e in store.events if e[0] == "manifest start"][1:] == []
        assert pub.version == 1
        store.fail = False
        assert pub.publish(s1).version == 2
    with Subscriber("unused", store=store.inner) as sub:
        assert_bits_equal(sub.pull(), s1)



# --- a streamed pack's last piece, written by the upload job --------------------


def _streamed_states():
    states = [small_state(0, n=8, rows=4096)]  # deltas of 50-100 KB: streamed in 40 KB pieces
    return states + [sparse_edit(states[-1], np.random.default_rng(i), 0.05) for i in range(1, 4)]


def test_a_streamed_pack_is_committed_before_the_manifest_that_names_it(tmp_path, monkeypatch):
    """The publisher builds its manifest while the upload job writes the last piece of each
    streamed pack and commits it; the manifest is still written only after every commit."""
    import threading

    from deltastore.storage._local import LocalStore, _LocalStreamedPut

    monkeypatch.setattr(encode, "STREAM_WRITE_BYTES", 40_000)  # a pack: pieces, then a last one
    monkeypatch.setattr(encode, "PACK_TARGET_BYTES", 200_000)
    events: list[tuple[str, str, float]] = []
    lock = threading.Lock()
    tails: list[tuple[str, int]] = []
    real_commit, real_put, real_end = _LocalStreamedPut.commit, LocalStore.put, encode._end_stream

    def slow_commit(self, name):
        time.sleep(0.15)
        meta = real_commit(self, name)
        with lock:
            events.append(("pack done", meta.key, time.monotonic()))
        return meta

    def noted_put(self, key, data, *, mode="overwrite"):
        if key.startswith("manifests/"):
            with lock:
                events.append(("manifest start", key, time.monotonic()))
        return real_put(self, key, data, mode=mode)

    def end_stream(store, stream, tail, *args):
        tails.append((threading.current_thread().name, len(tail)))
        return real_end(store, stream, tail, *args)

    monkeypatch.setattr(_LocalStreamedPut, "commit", slow_commit)
    monkeypatch.setattr(LocalStore, "put", noted_put)
    monkeypatch.setattr(encode, "_end_stream", end_stream)
    states = _streamed_states()
    url = str(tmp_path / "store")
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        for s in states:
            pub.publish(s)
    # the upload jobs wrote the packs' last pieces (empty where a piece ended with the pack)
    assert tails and all(n.startswith("deltastore-upload") for n, _ in tails)
    assert any(size for _, size in tails)
    manifests = [(k, t) for what, k, t in events if what == "manifest start"]
    assert len(manifests) == len(states)
    store = open_store(url)
    for key, started in manifests:
        m = read_manifest_doc(store, key)
        done = [t for what, k, t in events if what == "pack done" and k in {b["key"] for b in m["blobs"]}]
        assert len(done) == len(m["blobs"]) and max(done) <= started, key
    with Subscriber(url) as sub:
        assert_bits_equal(sub.pull(), states[-1])


def test_a_last_piece_that_fails_to_write_is_raised_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """_PackWriter: a pack's last piece is written by the upload job; when that write fails
    (a full disk) the pack is not committed, its temp file is gone, and finish raises."""
    import errno
    import threading

    from deltastore.storage._local import _LocalStreamedPut

    monkeypatch.setattr(encode, "STREAM_WRITE_BYTES", 250)
    real_write = _LocalStreamedPut.write
    writers: list[str] = []

    def write(self, data):
        writers.append(threading.current_thread().name)
        if threading.current_thread().name.startswith("upload"):
            real_write(self, data[:1])  # part of the piece is in the temp file
            raise self._fail(OSError(errno.ENOSPC, "No space left on device (injected)"))
        return real_write(self, data)

    monkeypatch.setattr(_LocalStreamedPut, "write", write)
    store = open_store(str(tmp_path / "store"))
    with ThreadPoolExecutor(2, thread_name_prefix="upload") as up:
        w = encode._PackWriter(store, up, attempt="b" * 32, role="d")
        for i in range(4):  # 300 bytes streamed by this thread, then 100 left for the upload job
            w.add(Segment("add-sparse/1", bytes([i]) * 100, 1))
        with pytest.raises(StorageError, match="injected"):
            w.finish()
    assert writers == ["MainThread", "upload_0"]
    assert not list((tmp_path / "store").rglob(".deltastore-tmp-*")) and not list((tmp_path / "store").rglob("*.pack"))


def test_a_deferred_pack_upload_that_fails_commits_nothing(tmp_path, monkeypatch):
    """The publisher builds its manifest while the last packs are stored; when such an upload
    fails, the publish raises it, no manifest or HEAD names the version, no temp file is left,
    and the next publish writes the version."""
    import threading

    monkeypatch.setattr(encode, "STREAM_WRITE_BYTES", 40_000)
    fail = threading.Event()
    real_end = encode._end_stream

    def end_stream(store, stream, tail, *args):
        if fail.is_set():
            stream.abort()
            raise StorageError("pack upload: 503 (injected)")
        return real_end(store, stream, tail, *args)

    monkeypatch.setattr(encode, "_end_stream", end_stream)
    states = _streamed_states()
    url = str(tmp_path / "store")
    root = tmp_path / "store"
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(states[0])
        pub.publish(states[1])
        manifests = {p.name for p in root.rglob("manifests/*")}
        fail.set()
        with pytest.raises(StorageError, match="injected"):
            pub.publish(states[2])
        assert pub.version == 2
        assert {p.name for p in root.rglob("manifests/*")} == manifests
        assert not list(root.rglob(".deltastore-tmp-*"))
        fail.clear()
        assert pub.publish(states[2]).version == 3
    with Subscriber(url) as sub:
        assert sub.latest().version == 3
        assert_bits_equal(sub.pull(), states[2])


# --- jobs and the in-flight window -------------------------------------


def _encode_steady(tmp_path, name: str, threads: int):
    """A delta of a 40-tensor state in 4 KiB chunks (many per job), encoded on ``threads``
    threads; returns what encode_version returned and every pack's bytes."""
    import torch

    from deltastore.format.keys import new_attempt_id
    from deltastore.layout.tensors import spec_for

    g = torch.Generator().manual_seed(7)
    old = {f"t{i}": torch.randint(-2000, 2000, (9 + i, 512), generator=g, dtype=torch.int16) for i in range(40)}
    new = {n: t.clone() for n, t in old.items()}
    for i, t in enumerate(new.values()):
        if i % 3:  # some tensors unchanged: their chunks are not listed
            flat = t.view(-1)
            flat[torch.randint(0, flat.numel(), (50,), generator=g)] += 1
    specs = {n: spec_for(n, t, 4096) for n, t in old.items()}
    reference = {n: t.clone() for n, t in old.items()}
    store = open_store(str(tmp_path / name))
    with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(4) as up:
        enc = encode.encode_version(new, specs, kind="delta", reference=reference, pool=pool, uploader=up,
                                    store=store, threads=threads, attempt=new_attempt_id())
    for n in new:  # the reference was advanced to the new state
        assert torch.equal(reference[n], new[n])
    return enc, [store.get(b.key) for b in enc.blobs]


def _comparable(enc):
    return [e.model_dump() for e in enc.entries], enc.stats, [(b.sha256, b.size) for b in enc.blobs]


def test_grouped_jobs_and_a_window_waited_by_halves_write_what_one_job_per_chunk_writes(tmp_path, monkeypatch):
    # One job per chunk and a window waited on job by job (an earlier encoder)...
    monkeypatch.setattr(encode, "ENCODE_JOB_BYTES", 1)
    monkeypatch.setattr(encode, "WAIT_DIVISOR", 1)
    monkeypatch.setattr(encode, "IN_FLIGHT_PER_THREAD", 1)
    want, want_packs = _encode_steady(tmp_path, "one-by-one", threads=1)
    assert len(want.entries) == 26 and want.stats.elements_changed > 0
    # ...against grouped jobs of several chunks, windows of several sizes, waited on by halves
    # (or to empty: a window of one job per thread), on 1-3 threads: same entries, same packs.
    monkeypatch.setattr(encode, "WAIT_DIVISOR", 2)
    for job_bytes, per_thread, threads in [(16 * 1024, 8, 2), (16 * 1024, 1, 3), (1 << 20, 8, 1), (4096, 3, 2)]:
        monkeypatch.setattr(encode, "ENCODE_JOB_BYTES", job_bytes)
        monkeypatch.setattr(encode, "IN_FLIGHT_PER_THREAD", per_thread)
        got, packs = _encode_steady(tmp_path, f"g{job_bytes}-{per_thread}-{threads}", threads)
        assert _comparable(got) == _comparable(want)
        assert packs == want_packs


def test_chunk_jobs_group_consecutive_chunks_up_to_the_job_size(monkeypatch):
    from deltastore.layout.tensors import TensorSpec

    specs = {"a": TensorSpec("a", "int16", (10, 512), 1), "b": TensorSpec("b", "int16", (3, 2048), 1)}
    monkeypatch.setattr(encode, "ENCODE_JOB_BYTES", 3 * 1024)  # a's chunks are 1 KiB, b's 4 KiB
    jobs = encode.chunk_jobs(specs)
    assert [[(ti, ci) for ti, ci, _ in j] for j in jobs] == [
        [(0, 0), (0, 1), (0, 2)], [(0, 3), (0, 4), (0, 5)], [(0, 6), (0, 7), (0, 8)], [(0, 9), (1, 0)], [(1, 1)], [(1, 2)],
    ]


def test_layout_work_is_made_once_per_layout_and_anew_for_another(monkeypatch):
    """encode_version's per-layout work (jobs with their spans, dtype kinds, totals) is kept by
    the encoder's LayoutWorks across versions of one layout (found by equal specs) and made anew
    for any other layout or job size."""
    from deltastore.layout.tensors import TensorSpec

    works = encode.LayoutWorks()
    a = {"a": TensorSpec("a", "bfloat16", (10, 512), 2), "b": TensorSpec("b", "int32", (3, 7), 1)}
    work = works(a)
    assert works(dict(a)) is work  # same specs: the same work
    assert works({n: TensorSpec(s.name, s.dtype, s.shape, s.chunk_rows) for n, s in a.items()}) is work
    assert encode.LayoutWorks()(a) is not work  # another encoder's: its own
    assert [c for job in work.jobs for c in job] == [
        (0, ci, "a", ci * 1024, ci * 1024 + 1024) for ci in range(5)] + [(1, ci, "b", ci * 7, ci * 7 + 7) for ci in range(3)]
    assert work.floating == {"a": True, "b": False} and work.elements_total == 5141
    # another chunking of one tensor, or another job size: new jobs, as chunk_jobs cuts them
    b = {**a, "a": TensorSpec("a", "bfloat16", (10, 512), 5)}
    assert [[c[:3] for c in job] for job in works(b).jobs] == encode.chunk_jobs(b)
    assert [c[3:] for job in works(b).jobs for c in job][:2] == [(0, 2560), (2560, 5120)]
    monkeypatch.setattr(encode, "ENCODE_JOB_BYTES", 1)
    assert len(works(a).jobs) == 8 and len(work.jobs) == 1


def test_a_publisher_makes_its_layout_work_once(tmp_path, monkeypatch):
    """A publisher's versions of one layout reuse the jobs of the first (its LayoutWorks)."""
    made = []
    real = encode.chunk_jobs
    monkeypatch.setattr(encode, "chunk_jobs", lambda specs: made.append(1) or real(specs))
    state = small_state()
    with Publisher(str(tmp_path / "store"), writer_policy=WriterPolicy(threads=2)) as pub:
        for step in range(4):
            pub.publish(state, step=step)
            state = sparse_edit(state, np.random.default_rng(step))
    assert len(made) == 1


def test_a_failed_chunk_job_raises_its_own_error(tmp_path, monkeypatch):
    real = encode.encode_chunk
    seen: list[tuple[int, int]] = []

    def failing(ti, ci, *args):
        seen.append((ti, ci))
        if (ti, ci) == (5, 1):
            raise RuntimeError("chunk 1 of tensor 5 (injected)")
        return real(ti, ci, *args)

    monkeypatch.setattr(encode, "encode_chunk", failing)
    monkeypatch.setattr(encode, "ENCODE_JOB_BYTES", 8192)
    with pytest.raises(RuntimeError, match="tensor 5"):
        _encode_steady(tmp_path, "fails", threads=2)
    assert (5, 1) in seen


# --- results packed in job order by the encode threads (encode._InOrder) ----------


@settings(deadline=None)
@given(st.permutations(list(range(12))))
def test_in_order_consumes_every_result_in_job_order_whatever_order_jobs_end(order):
    got: list[int] = []
    seq = encode._InOrder(lambda res: got.extend(res))
    for i in order:
        seq.done(i, [i])
        assert got == list(range(len(got)))  # never ahead of a job that has not ended
    seq.wait(12)
    assert got == list(range(12)) and seq.consumed == 12


def test_in_order_one_consumer_at_a_time_across_threads():
    import random
    import threading

    n, inside, overlaps, got = 400, [0], [0], []
    lock = threading.Lock()

    def consume(res):
        with lock:
            inside[0] += 1
            overlaps[0] += inside[0] > 1
        time.sleep(random.random() * 1e-4)
        got.extend(res)
        with lock:
            inside[0] -= 1

    seq = encode._InOrder(consume)

    def job(i):
        time.sleep(random.random() * 2e-4)
        seq.done(i, [i])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(job, range(n)))
    seq.wait(n)
    assert got == list(range(n)) and overlaps[0] == 0


def test_in_order_a_failed_job_stops_packing_at_it_and_the_lowest_failure_is_raised():
    got: list[int] = []
    seq = encode._InOrder(lambda res: got.extend(res))
    for i in (0, 1, 3, 4):
        seq.done(i, [i])
    seq.fail(5, RuntimeError("job 5"))
    seq.fail(2, ValueError("job 2"))  # a lower job's failure wins, whichever is seen first
    seq.done(6, [6])
    with pytest.raises(ValueError, match="job 2"):
        seq.wait(7)
    assert got == [0, 1]  # nothing at or after the failed job was packed


def test_in_order_a_failing_consume_is_raised_and_nothing_after_it_is_packed():
    got: list[int] = []

    def consume(res):
        if res == [3]:
            raise OSError("pack write failed (injected)")
        got.extend(res)

    seq = encode._InOrder(consume)
    for i in range(6):
        seq.done(i, [i])
    with pytest.raises(OSError, match="injected"):
        seq.wait(6)
    assert got == [0, 1, 2]


def test_a_failed_version_leaves_no_half_streamed_pack(tmp_path, monkeypatch):
    """A local store takes packs as they fill (begin_put): a chunk that fails after part of a
    pack was streamed drops that write; no temp file and no pack of it is left."""
    real = encode.encode_chunk

    def failing(ti, ci, *args):
        if (ti, ci) == (30, 0):
            raise RuntimeError("chunk 0 of tensor 30 (injected)")
        return real(ti, ci, *args)

    monkeypatch.setattr(encode, "STREAM_WRITE_BYTES", 1)  # every segment streamed at once
    monkeypatch.setattr(encode, "encode_chunk", failing)
    monkeypatch.setattr(encode, "ENCODE_JOB_BYTES", 8192)
    streamed: list[int] = []
    from deltastore.storage._local import _LocalStreamedPut

    real_write = _LocalStreamedPut.write

    def counted(self, data):
        streamed.append(len(data))
        return real_write(self, data)

    monkeypatch.setattr(_LocalStreamedPut, "write", counted)
    with pytest.raises(RuntimeError, match="tensor 30"):
        _encode_steady(tmp_path, "fails", threads=2)
    assert streamed and sum(streamed) > 0  # part of the pack was written before the failure
    root = tmp_path / "fails"
    assert not list(root.rglob(".deltastore-tmp-*")) and not list(root.rglob("*.pack"))


# --- the reference's bit views, kept with it ---------------------------


def _counting_bits(monkeypatch):
    """Count encode.bits calls by the id of the tensor viewed."""
    from collections import Counter

    calls: Counter[int] = Counter()
    real = encode.bits

    def counted(t):
        calls[id(t)] += 1
        return real(t)

    monkeypatch.setattr(encode, "bits", counted)
    return calls


def test_reference_views_are_made_once_per_reference_and_write_the_same_packs(monkeypatch):
    """The publisher keeps encode_version's views of its reference between publishes: each
    reference tensor is viewed once while that reference lives (the state's tensors every
    publish), a new reference (an anchor without a base, a failed publish) gets new views,
    and the packs are those a publisher that views per publish writes."""
    from deltastore.write import publisher as publish_mod

    rng = np.random.default_rng(3)
    states = [small_state(0, n=6, rows=64)]
    for _ in range(4):
        states.append(sparse_edit(states[-1], rng))

    def run(name: str, cache: bool):
        store = _SlowPacks(open_store(f"memory://refviews-{name}-{uuid.uuid4().hex}"), delay=0)
        shas = []
        with Publisher("unused", store=store, writer_policy=WriterPolicy(threads=2),
                       anchor_policy=AnchorPolicy("every", every=1000)) as pub:
            if not cache:
                real = publish_mod.encode_version
                monkeypatch.setattr(publish_mod, "encode_version", lambda *a, **k: real(*a, **{**k, "reference_bits": None}))
            calls = _counting_bits(monkeypatch)
            for i, s in enumerate(states[:3]):
                pub.publish(s)
                if i == 0:
                    first_ref = pub._reference
                    assert pub._reference_bits == {}  # an anchor without a base views no reference
            if cache:  # two deltas on one reference: each of its tensors viewed once
                assert pub._reference is first_ref
                assert set(pub._reference_bits) == set(first_ref)
                assert all(calls[id(t)] == 1 for t in first_ref.values())
            else:
                assert all(calls[id(t)] == 2 for t in first_ref.values())
            # a failed publish drops the reference and its views with it
            store.fail = True
            with pytest.raises(StorageError, match="injected"):
                pub.publish(states[3])
            assert pub._reference is None and pub._reference_bits == {}
            store.fail = False
            pub.publish(states[3])  # resumes from the head: a new reference, new views
            assert pub._reference is not first_ref
            pub.publish(states[4])
            assert not cache or set(pub._reference_bits) == set(pub._reference)
            monkeypatch.undo()
            head = pub._head
        for v in range(1, head.version + 1):
            from deltastore.format.history import History

            _, m = History(store.inner).resolve(v, head)
            shas.append([(b.sha256, b.size) for b in m.blobs])
        with Subscriber("unused", store=store.inner) as sub:
            assert_bits_equal(sub.pull(), states[4])
        return shas

    assert run("cached", cache=True) == run("per-call", cache=False)


def test_the_chunk_table_a_writer_builds_is_out_of_the_collectors_sets(tmp_path) -> None:
    """encode_version untracks the entries it returns (they live as long as the writer's last
    version; design 006, the cyclic collector), and they are freed by reference counting."""
    import gc
    import weakref

    from deltastore._util import kernels

    state = small_state(0, n=3, rows=16)
    store = open_store(str(tmp_path / "s"))
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(2) as uploader:
        encoded = encode.encode_version(state, LayoutPolicy().units(state), kind="anchor", reference=None, pool=pool,
                                        uploader=uploader, store=store, threads=2, attempt=uuid.uuid4().hex[:16])
    entries = [*encoded.entries, *(c for t in encoded.entries for c in t.chunks)]
    refs = [s for t in encoded.entries for c in t.chunks for s in (c.full, c.delta) if s is not None]
    assert entries and refs
    tracked = [gc.is_tracked(o) for o in [*entries, *refs, *(t.__dict__ for t in encoded.entries)]]
    assert not any(tracked) if kernels.untrack is not None else all(tracked[:len(entries) + len(refs)])
    gone = weakref.ref(encoded.entries[0].chunks[0])
    del encoded, entries, refs
    assert gone() is None  # no collection needed

