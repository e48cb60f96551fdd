"""How the read engine (deltastore.read.engine) orders a pull_into's reads (design 006, pull_into): the pack is read while the kept chunks are hashed, each segment's
SHA-256 is checked by the thread that decodes it, and neither change lets a bad segment or a
modified target through."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from deltastore import Subscriber
from deltastore.errors import IntegrityError, TargetModifiedError
from deltastore.format.keys import sha256_hex
from deltastore.read.engine import ReadEngine, _Target, _views_while_reading
from deltastore.read.fetch import CheckedOnRead
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy
from testkit.stores import WrappedStore, head_manifest, publisher
from testkit.tensors import TinyTrainer, assert_bits_equal, snapshot


def test_checked_on_read_hashes_each_segment_before_handing_it_out() -> None:
    good, bad = b"segment one", b"segment two"
    segs = CheckedOnRead("memory://run")
    segs.defer(("objects/p.pack", 0), memoryview(good), sha256_hex(good))
    segs.defer(("objects/p.pack", 11), memoryview(bad), sha256_hex(b"something else"))
    assert ("objects/p.pack", 11) in segs  # present, but not handed out unchecked
    assert bytes(segs[("objects/p.pack", 0)]) == good
    assert bytes(segs.get(("objects/p.pack", 0))) == good
    assert segs.get(("objects/p.pack", 99)) is None
    for _ in range(2):  # a failed check is not remembered as passed
        with pytest.raises(IntegrityError, match=r"segment at 11 of pack 'objects/p.pack' of memory://run does not "
                                                 r"match its SHA-256"):
            segs[("objects/p.pack", 11)]
    with pytest.raises(TypeError):
        segs.values()  # only keyed (checked) reads


def _history(url: str, n: int = 3) -> list[dict[str, torch.Tensor]]:
    trainer = TinyTrainer(seed=3)
    states = []
    with publisher(url, anchor_policy=AnchorPolicy(every=100)) as pub:
        for step in range(n):
            state = trainer.export() if step == 0 else trainer.step()
            pub.publish(state, step=step)
            states.append(snapshot(state))
    return states


def test_the_pack_is_read_while_the_kept_chunks_are_hashed(tmp_path: Path, monkeypatch) -> None:
    """The pack GET starts before the check of the kept chunks returns (it waits for it here;
    when the fetch only started after that check, the wait timed out), and the result is exact."""
    url = str(tmp_path / "store")
    states = _history(url)
    started = threading.Event()

    class Packs(WrappedStore):
        def get(self, key: str, *, byte_range=None) -> bytes:
            if key.endswith(".pack"):
                started.set()
            return super().get(key, byte_range=byte_range)

    seen: list[bool] = []
    check_kept = ReadEngine.check_kept

    def waiting(self, *args, **kwargs):
        seen.append(started.wait(timeout=10))
        return check_kept(self, *args, **kwargs)

    monkeypatch.setattr(ReadEngine, "check_kept", waiting)
    with open_store(url) as inner, Subscriber(url, store=Packs(inner), threads=2) as sub:
        target = sub.pull(1)
        started.clear()
        assert sub.pull_into(target, version=3).version == 3
    assert seen == [True]
    assert_bits_equal(target, states[2])


def test_target_views_are_made_while_the_first_batch_is_read() -> None:
    """apply_in_place's own thread makes the CPU targets' views while the first batch of
    segments is being read, and stops as soon as the read has ended (an apply thread makes the
    rest at each tensor's first chunk); a batch iterator that does not prefetch gets none."""

    class Batches:
        def __init__(self, reads: int):
            self.polls = 0
            self.reads = reads

        def ready(self) -> bool:
            self.polls += 1
            return self.polls > self.reads

    targets = {f"t{i}": _Target(torch.zeros(4)) for i in range(5)}
    targets["group"] = object()  # a group row's target: not a tensor's, left alone
    _views_while_reading(targets, Batches(reads=3))
    assert [t._raw is not None for k, t in targets.items() if k != "group"] == [True, True, True, False, False]
    _views_while_reading(targets, Batches(reads=100))
    assert all(t._raw is not None for k, t in targets.items() if k != "group")
    fresh = {"t": _Target(torch.zeros(4))}
    _views_while_reading(fresh, iter(()))
    assert fresh["t"]._raw is None


def test_a_modified_kept_chunk_stops_the_read_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept chunk modified since the pull: TargetModifiedError while the pack is in flight,
    nothing applied, and no fetch left running behind the error (the prefetch thread, one per
    subscriber, ends with it)."""
    url = str(tmp_path / "store")
    states = _history(url)
    lock = threading.Lock()
    running = [0, 0]  # pack reads in flight, pack reads started
    started = threading.Event()

    class Packs(WrappedStore):
        def get(self, key: str, *, byte_range=None) -> bytes:
            if not key.endswith(".pack"):
                return super().get(key, byte_range=byte_range)
            with lock:
                running[0] += 1
                running[1] += 1
            started.set()
            try:
                time.sleep(0.05)  # still in flight when the kept chunk's check fails
                return super().get(key, byte_range=byte_range)
            finally:
                with lock:
                    running[0] -= 1

    check_kept = ReadEngine.check_kept

    def once_reading(self, *args, **kwargs):  # the check fails while the pack read runs
        assert started.wait(timeout=10)
        return check_kept(self, *args, **kwargs)

    with open_store(url) as inner, Subscriber(url, store=Packs(inner), threads=2) as sub:
        target = sub.pull(1)
        kept = "extra.scale"  # 0-d and constant: kept by every delta of this history
        target[kept].add_(1.0)
        before = snapshot(target)
        reads = running[1]
        started.clear()
        monkeypatch.setattr(ReadEngine, "check_kept", once_reading)
        with pytest.raises(TargetModifiedError, match=kept):
            sub.pull_into(target, version=3)
        assert running[1] > reads and running[0] == 0  # the pack read began, and ended before the raise
        assert_bits_equal(target, before)
        assert sub.version == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("deltastore-prefetch") and t.is_alive()]
    assert states


def test_a_damaged_segment_in_a_whole_pack_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    """The pack's bytes of one delta segment are damaged (its SHA-256 in the manifest is the
    intact one): the decode thread's check refuses it, and with no full segment to fall back
    to, nothing is applied."""
    url = str(tmp_path / "store")
    states = _history(url, n=2)
    with open_store(url) as store:
        _, doc = head_manifest(store)
        c = next(c for t in doc["tensors"] for c in t["chunks"] if c.get("delta") and t["name"].endswith("weight"))
        blob = doc["blobs"][c["delta"]["blob"]]
        data = bytearray(store.get(blob["key"]))
        data[c["delta"]["offset"] + c["delta"]["length"] - 1] ^= 0x40
        store.put(blob["key"], bytes(data), mode="overwrite")
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        with pytest.raises(IntegrityError, match="does not match its SHA-256"):
            sub.pull_into(target, version=2)
        assert_bits_equal(target, states[0])
        assert sub.version == 1


def test_one_run_is_read_on_the_calling_thread(tmp_path: Path) -> None:
    """A fetch that needs one GET does not hand it to an IO thread (two wake-ups). Without
    deadlines: they hand every request to a thread that can be abandoned at its deadline."""
    url = str(tmp_path / "store")
    _history(url, n=2)
    threads: list[str] = []

    class Where(WrappedStore):
        def get(self, key: str, *, byte_range=None) -> bytes:
            if key.endswith(".pack"):
                threads.append(threading.current_thread().name)
            return super().get(key, byte_range=byte_range)

    with open_store(url) as inner, Subscriber(url, store=Where(inner), threads=2, deadlines=None) as sub:
        target = sub.pull(1)
        threads.clear()
        sub.pull_into(target, version=2)
    assert threads and all(n.startswith("deltastore-prefetch") for n in threads), threads


def test_groups_are_applied_largest_first() -> None:
    """The decode threads share one queue: the biggest groups go first, so the last group
    taken is a small one (and the order within a group is kept)."""
    from deltastore.layout.tensors import TensorSpec
    from deltastore.read.engine import _largest_first
    from deltastore.read.plan import ChunkPlan

    specs = {n: TensorSpec(n, "bfloat16", (rows, 64), 1 << 20) for n, rows in (("a", 4), ("b", 4096), ("c", 64))}
    plan = {n: ChunkPlan(n, 0, specs[n].chunk_span(0), "0" * 32) for n in specs}
    groups = [[plan["a"]], [plan["b"]], [plan["a"], plan["c"]]]
    assert [[p.name for p in g] for g in _largest_first(groups, specs)] == [["b"], ["a", "c"], ["a"]]


@pytest.mark.parametrize("deltas", [1, 2])
def test_a_modified_patched_chunk_is_found_through_its_result(tmp_path: Path, monkeypatch, deltas: int) -> None:
    """SPEC §7.5 (iv): a chunk the update patches is hashed once, after its last delta (no
    hash of its bits before); a local edit there still raises TargetModifiedError (not a
    corrupt-segment error), and every chunk written before is restored bit for bit."""
    import deltastore.codec as codec_mod

    url = str(tmp_path / "store")
    states = _history(url, n=1 + deltas)
    asked: list[tuple[bool, bool]] = []
    real = codec_mod.apply_delta_digests

    def spy(*args, **kw):
        asked.append((kw.get("before", False), kw.get("after", False)))
        return real(*args, **kw)

    monkeypatch.setattr(codec_mod, "apply_delta_digests", spy)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        patched = "extra.step"  # 0-d, changed by every step: patched by every delta
        target[patched].add_(100)
        edited = snapshot(target)
        asked.clear()
        with pytest.raises(TargetModifiedError, match=patched):
            sub.pull_into(target, version=1 + deltas)
        assert_bits_equal(target, edited)
        assert sub.version == 1
        assert asked and not any(before for before, _ in asked)
        # per chunk, only its last delta hashes (its result)
        assert sum(after for _, after in asked) * deltas == len(asked)
        target[patched].sub_(100)  # the edit undone: the same call goes through
        assert sub.pull_into(target, version=1 + deltas).version == 1 + deltas
    assert_bits_equal(target, states[deltas])


def test_stage_finds_a_modified_patched_chunk_through_its_result(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    states = _history(url, n=2)
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(1)
        target["extra.step"].add_(100)
        edited = snapshot(target)
        with pytest.raises(TargetModifiedError, match="extra.step"):
            sub.stage(target, version=2)
        assert_bits_equal(target, edited)
        target["extra.step"].sub_(100)
        sub.swap(sub.stage(target, version=2), target)
    assert_bits_equal(target, states[1])
