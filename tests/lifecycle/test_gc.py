"""Garbage collection (SPEC §11, design 005 D2/D3): what is kept, what goes, and when GC aborts.

Ages are controlled with :class:`AgedStore`, which reports chosen objects as older than they
are (GC reads every age from the store's metadata, never from its own clock).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deltastore import Publisher
from deltastore.errors import (
    GCAbortedError,
    GCRefusedError,
    NotFoundError,
    StorageError,
    UnsupportedSchemaError,
    VersionCollectedError,
)
from deltastore.fleet.ledger import encode_heartbeat
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY
from deltastore.format.models import DEFAULT_MAX_ATTEMPT_S
from deltastore.lifecycle.gc import CLOCK_MARGIN_S, collect
from deltastore.lifecycle.index import pin, pinned, read_index
from deltastore.storage import open_store
from deltastore.storage.base import ObjectMeta, Store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from testkit.lifecycle import (
    DAY,
    AgedStore,
    assert_versions_intact,
    needs_of,
    pin_needs_of,
    publish,
    pull_from_manifest,
)
from testkit.stores import WrappedStore, keys
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer, assert_bits_equal

#: A grace the deadline check accepts for manifests of the default attempt deadline (6 h + 10 min).
SAFE_GRACE = DEFAULT_MAX_ATTEMPT_S + CLOCK_MARGIN_S


def all_deleted(report) -> list[str]:
    return [k for ks in report.deleted.values() for k in ks]


def _index(store: Store):
    h = History(store)
    return read_head_and_index(h)


def read_head_and_index(h: History):
    head = h.read_head()[0]
    return head, read_index(h, head)


@pytest.fixture
def aged(tmp_path) -> AgedStore:
    return AgedStore(open_store(str(tmp_path / "store")))


def test_keeps_what_kept_versions_need_and_deletes_old_unreachable(aged):
    states = publish(aged, 10)  # anchors 1, 4, 7, 10
    orphan = f"objects/{'ef' * 16}/{'ab' * 32}.pack"
    aged.inner.put(orphan, b"left by a crashed publish", mode="create")
    aged.inner.put("manifests/000000000011-" + "cd" * 32 + ".json", b"{}", mode="create")
    stray = "blobs/ab/" + "ab" * 32  # the pack prefix of an earlier format: not GC's to delete
    aged.inner.put(stray, b"not ours", mode="create")
    aged.inner.put("workers/w1.json", b"not even a heartbeat", mode="overwrite")
    aged.inner.put("elsewhere/file", b"not ours", mode="create")
    aged.age_everything(2 * DAY)
    needed = set().union(*(needs_of(aged, v) for v in (7, 8, 9, 10)))
    before = keys(aged)

    report = collect(aged, keep_last=3, grace_s=DAY)

    after = keys(aged)
    assert report.floor_before == 1 and report.floor_after == 7  # anchor(10 - 3 + 1 = 8) = 7
    assert report.kept_versions == [7, 8, 9, 10]
    assert needed <= after, sorted(needed - after)
    assert orphan not in after and "manifests/000000000011-" + "cd" * 32 + ".json" not in after
    for v in range(1, 7):
        assert not any(k.startswith(f"manifests/{v:012d}-") for k in after)
    assert {"HEAD", "workers/w1.json", "elsewhere/file", stray} <= after
    gone = before - after
    assert gone == set(all_deleted(report))
    assert report.deleted_objects == len(gone) and report.deleted_bytes > 0
    assert all(k.startswith(("manifests/", "objects/", "gc/")) for k in gone)
    # The floor is committed in the index HEAD names; the run's records are in gc/.
    _head, idx = _index(aged)
    assert idx.floor == 7
    assert f"gc/{report.run_id}.json" in after and f"gc/{report.run_id}-report.json" in after
    assert json.loads(aged.get(f"gc/{report.run_id}-report.json"))["deleted_objects"] == report.deleted_objects
    assert_versions_intact(aged, states, [7, 8, 9, 10])


def test_nothing_younger_than_grace_is_deleted(aged):
    publish(aged, 10)
    young = {k for k in keys(aged) if not k.startswith("manifests/")}
    for k in keys(aged) - young:  # only the manifests are old: nothing was head recently
        aged.offsets[k] = 2 * DAY
    report = collect(aged, keep_last=1, grace_s=DAY)
    assert report.floor_after == 10 and _index(aged)[1].floor == 10
    after = keys(aged)
    assert young <= after  # unreferenced now, but younger than the grace period
    assert report.deleted["manifests"] and not report.deleted["packs"]
    assert not any(k.startswith("manifests/000000000009-") for k in after)


def test_versions_head_within_grace_are_all_kept(aged):
    publish(aged, 10)
    before = keys(aged)
    report = collect(aged, keep_last=1, grace_s=DAY)  # every version was head less than a day ago
    assert report.floor_after == 1 and report.deleted_objects == 0 and before <= keys(aged)


def test_recent_heads_hold_the_floor(aged):
    """A version that was head within the grace period keeps its chain (a new worker may be
    pulling it): here 9 and 8 were head less than a day ago."""
    states = publish(aged, 8)
    aged.age_everything(2 * DAY)
    publish(aged, 2, trainer=None, states=states)  # versions 9 and 10, young
    # (a fresh trainer: only the versions matter here)
    report = collect(aged, keep_last=1, grace_s=DAY)
    assert report.floor_after == 7  # recent = {8, 9, 10} (manifest(9) is young) → anchor(8) = 7
    assert needs_of(aged, 8) <= keys(aged)


def test_live_workers_hold_the_floor(aged):
    publish(aged, 10)
    head = History(aged).read_head()[0]
    aged.inner.put("workers/live.json", encode_heartbeat("live", 5, lineage=head.lineage), mode="overwrite")
    aged.inner.put("workers/other.json", encode_heartbeat("other", 2, lineage="f" * 32), mode="overwrite")
    aged.inner.put("workers/stale.json", encode_heartbeat("stale", 1, lineage=head.lineage), mode="overwrite")
    aged.age_everything(2 * DAY)  # every heartbeat is old now: no worker is live
    report = collect(aged, keep_last=1, grace_s=DAY, dry_run=True)
    assert report.floor_after == 10
    aged.offsets.pop("workers/live.json")  # this one beat just now
    aged.inner.put("workers/done.json", encode_heartbeat("done", 2, lineage=head.lineage, state="stopped"),
                   mode="overwrite")  # exited cleanly just now: its cache is checked against the store on restart
    report = collect(aged, keep_last=1, grace_s=DAY)
    assert report.floor_after == 4  # anchor(5); the other lineage's, the stale and the stopped worker do not count
    assert needs_of(aged, 5) <= keys(aged)


def test_keep_versions_are_pinned_then_kept_with_their_chain(aged):
    states = publish(aged, 10)
    pin_needs, unneeded = pin_needs_of(aged, 5)  # anchor 4 (its full packs), delta 5
    assert unneeded  # the schema-3 writer gives anchor 4 a delta pack too (from 3)
    aged.age_everything(2 * DAY)
    report = collect(aged, keep_last=1, keep_versions=[5], grace_s=DAY)
    assert report.floor_after == 10 and report.pins == [5]
    _head, idx = _index(aged)
    assert pinned(idx) == {5}
    after = keys(aged)
    assert pin_needs <= after
    assert not unneeded & after  # a pin keeps what materializing it needs, not anchor 4's delta packs
    assert not any(k.startswith("manifests/000000000006-") for k in after)  # not needed by the pin
    assert_bits_equal(pull_from_manifest(aged, idx.pins[0].manifest), states[5])
    # The pin persists: the next run keeps it too.
    collect(aged, keep_last=1, grace_s=DAY)
    assert pin_needs <= keys(aged)
    assert_versions_intact(aged, states, [10])


def test_keep_version_below_floor_is_refused_and_nothing_deleted(aged):
    publish(aged, 10)
    aged.age_everything(2 * DAY)
    collect(aged, keep_last=1, grace_s=DAY)
    publish(aged, 1)
    aged.age_everything(2 * DAY)
    before = keys(aged)
    with pytest.raises(VersionCollectedError) as e:
        collect(aged, keep_last=1, keep_versions=[3], grace_s=DAY)
    assert e.value.floor == 10
    assert before <= keys(aged)


def test_grace_shorter_than_attempt_deadline_is_refused(aged):
    publish(aged, 4)
    aged.age_everything(2 * DAY)
    before, head = keys(aged), aged.get(HEAD_KEY)
    with pytest.raises(GCRefusedError, match="attempt deadline"):
        collect(aged, keep_last=1, grace_s=SAFE_GRACE - 1)
    assert before <= keys(aged) and aged.get(HEAD_KEY) == head
    collect(aged, keep_last=1, grace_s=SAFE_GRACE)  # exactly the minimum is accepted


def test_dry_run_deletes_and_commits_nothing(aged):
    publish(aged, 10)
    aged.age_everything(2 * DAY)
    before, head = keys(aged), aged.get(HEAD_KEY)
    report = collect(aged, keep_last=1, grace_s=DAY, dry_run=True)
    after = keys(aged)
    assert report.dry_run and report.deleted_objects > 0 and report.floor_after == 10
    assert after - before == {f"gc/{report.run_id}.json"} and before <= after  # only the probe
    assert aged.get(HEAD_KEY) == head
    real = collect(aged, keep_last=1, grace_s=DAY)
    assert sorted(all_deleted(real)) == sorted(all_deleted(report))


class FailingList(AgedStore):
    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        if prefix == "":
            def pages():
                yield from list(super(FailingList, self).list(prefix))[:3]
                raise StorageError("ListObjectsV2 page 2: 503 Slow Down")
            return pages()
        return super().list(prefix)


def test_list_failure_aborts_with_nothing_deleted(tmp_path):
    store = FailingList(open_store(str(tmp_path / "store")))
    publish(store, 10)
    store.age_everything(2 * DAY)
    before = keys(store.inner)
    with pytest.raises(GCAbortedError, match="listing"):
        collect(store, keep_last=1, grace_s=DAY)
    assert before <= keys(store.inner)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_unreadable_kept_manifest_aborts_with_nothing_deleted(aged, damage):
    publish(aged, 10)
    aged.age_everything(2 * DAY)
    h = History(aged)
    key9, _ = h.find(9, h.read_head()[0])
    if damage == "corrupt":
        data = bytearray(aged.get(key9))
        data[10] ^= 1
        aged.inner.put(key9, bytes(data), mode="overwrite")
    else:
        aged.inner.delete(key9)
    before = keys(aged)
    with pytest.raises(GCAbortedError):
        collect(aged, keep_last=3, grace_s=DAY)
    assert before <= keys(aged)


def test_unreadable_pinned_chain_aborts_with_nothing_deleted(aged):
    publish(aged, 10)
    pin(aged, 5)
    aged.age_everything(2 * DAY)
    h = History(aged)
    aged.inner.delete(h.find(4, h.read_head()[0])[0])  # the pin's anchor manifest
    before = keys(aged)
    with pytest.raises(GCAbortedError):
        collect(aged, keep_last=1, grace_s=DAY)
    assert before <= keys(aged)


class DieAfter(AgedStore):
    """Deletes ``n`` objects, then the process 'dies' (an exception out of delete)."""

    def __init__(self, inner: Store, n: int):
        super().__init__(inner)
        self.n = n

    def delete(self, key: str) -> None:
        with self._lock:  # deletes run on several threads
            if self.n == 0:
                raise KeyboardInterrupt("killed")
            self.n -= 1
        super().delete(key)


@pytest.mark.parametrize("n", [0, 3, 9])
def test_gc_killed_halfway_loses_nothing_kept_and_the_next_run_finishes(tmp_path, n):
    base = open_store(str(tmp_path / "store"))
    dying = DieAfter(base, n)
    states = publish(dying, 10)
    pin(dying, 2)
    dying.age_everything(2 * DAY)
    want = dying  # a reference run on a copy would be nicer; the dry run says what must go
    planned = collect(want, keep_last=2, grace_s=DAY, dry_run=True)
    with pytest.raises((KeyboardInterrupt, GCAbortedError)):
        collect(dying, keep_last=2, grace_s=DAY)
    # Whatever was deleted was a candidate; the floor was committed before the first delete.
    assert _index(base)[1].floor == 7
    for v in (7, 8, 9, 10):
        assert needs_of(base, v) <= keys(base)
    aged = AgedStore(base)
    aged.offsets = dying.offsets
    report = collect(aged, keep_last=2, grace_s=DAY)
    left = keys(base)
    assert not set(all_deleted(planned)) - {f"gc/{planned.run_id}.json"} & left
    assert report.floor_after == 7
    assert_versions_intact(base, states, [7, 8, 9, 10])
    assert_bits_equal(pull_from_manifest(base, _index(base)[1].pins[0].manifest), states[2])


def test_delete_failure_aborts_and_reports_progress(aged):
    publish(aged, 10)
    aged.age_everything(2 * DAY)

    class Boom(AgedStore):
        done = 0
        lock = threading.Lock()

        def delete(self, key):
            with self.lock:  # deletes run on several threads
                if self.done == 2:
                    raise StorageError("500 InternalError")
                self.done += 1
            super().delete(key)

    boom = Boom(aged.inner)
    boom.offsets = aged.offsets
    with pytest.raises(GCAbortedError) as e:
        collect(boom, keep_last=1, grace_s=DAY)
    assert e.value.deleted == 2


def test_packs_are_deleted_before_the_manifests_that_name_them(aged):
    publish(aged, 10)
    aged.age_everything(2 * DAY)
    collect(aged, keep_last=1, grace_s=DAY)
    deletes = [k for verb, k in aged.calls if verb == "delete"]
    first_manifest = next(i for i, k in enumerate(deletes) if k.startswith("manifests/"))
    assert all(not k.startswith(("blobs/", "objects/")) or k.endswith(".index.json.zst")
               for k in deletes[first_manifest:])


def test_old_indexes_and_run_records_are_collected(aged):
    publish(aged, 10)
    collect(aged, keep_last=5, grace_s=DAY)
    first_index = _index(aged)[0].index.key
    aged.age_everything(2 * DAY)
    report = collect(aged, keep_last=1, grace_s=DAY)
    assert first_index in report.deleted["indexes"]
    assert len(report.deleted["records"]) == 2  # the first run's probe and report
    assert _index(aged)[0].index.key in keys(aged)


def test_a_store_of_an_earlier_format_is_refused(aged):
    """A schema-2 HEAD is refused (UnsupportedSchemaError naming it); nothing is deleted."""
    publish(aged, 4)
    doc = json.loads(aged.get(HEAD_KEY))
    doc["schema"] = 2
    doc.pop("index")
    aged.inner.put(HEAD_KEY, json.dumps(doc).encode(), mode="overwrite")
    aged.age_everything(2 * DAY)
    before = keys(aged)
    with pytest.raises(UnsupportedSchemaError, match="HEAD.*earlier format"):
        collect(aged, keep_last=1, grace_s=DAY)
    assert before <= keys(aged)


class NoClock(WrappedStore):
    def head(self, key: str) -> ObjectMeta:
        return dataclasses.replace(super().head(key), last_modified=None)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return iter([dataclasses.replace(m, last_modified=None) for m in super().list(prefix)])


def test_a_store_without_last_modified_is_refused(tmp_path):
    store = NoClock(open_store(str(tmp_path / "store")))
    publish(store, 3)
    before = keys(store)
    with pytest.raises(GCRefusedError, match="last-modified"):
        collect(store, keep_last=1, grace_s=DAY)
    assert before <= keys(store)


def test_fsspec_store_gives_no_clock_and_is_refused(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    from deltastore.storage._fsspec import FsspecStore

    store = FsspecStore(fsspec.filesystem("memory"), f"/gc-{tmp_path.name}")
    store.put(f"objects/{'0' * 32}/{'0' * 64}.pack", b"x", mode="create")
    before = keys(store)
    with pytest.raises(GCRefusedError, match="last-modified"):
        collect(store, keep_last=1, grace_s=DAY)
    assert before <= keys(store)


def test_orphan_reuse_cannot_resurrect_a_collected_object(tmp_path):
    """Design 005 D3 #1: a publish crashes after uploading its packs; much later the retry
    produces identical bytes; GC runs between the retry's uploads and its HEAD write and
    deletes the crashed attempt's (old, unreferenced) packs. Were packs named by their content
    alone, the retry would meet the old orphan (AlreadyExists = success) and HEAD then name a
    deleted pack. With attempt-scoped keys (D1) the retry's packs are new, young objects under
    its own attempt, and every committed version is complete."""
    inner = open_store(str(tmp_path / "store"))
    store = AgedStore(inner)
    trainer = TinyTrainer()
    states = publish(store, 3, trainer=trainer)
    collect(store, keep_last=100, grace_s=DAY)  # an index exists: later runs change nothing in it
    nxt = trainer.step()
    reports = []

    class CrashOnManifest(AgedStore):
        crash = True
        gc_hook = None

        def put(self, key, data, *, mode="overwrite"):
            if key.startswith("manifests/"):
                if self.crash:
                    raise StorageError("the publisher's machine died")
                if self.gc_hook is not None:
                    self.gc_hook()
            return super().put(key, data, mode=mode)

    crashing = CrashOnManifest(inner)
    crashing.offsets = store.offsets
    with Publisher(inner.url, store=crashing, anchor_policy=AnchorPolicy(every=100),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        with pytest.raises(StorageError):
            pub.publish(nxt)
        orphans = keys(inner) - {k for v in states for k in needs_of(inner, v)} - {"HEAD"}
        orphans = {k for k in orphans if k.startswith("objects/") and not k.endswith(".index.json.zst")}
        assert orphans and all(k.endswith(".pack") for k in orphans)  # the crashed attempt's packs
        crashing.age_everything(2 * DAY)  # ... days pass
        crashing.crash = False
        crashing.gc_hook = lambda: reports.append(collect(crashing, keep_last=100, grace_s=DAY))
        info = pub.publish(nxt)  # the retry; GC runs just before its manifest is written
    # The hazard was exercised: GC ran between the retry's uploads and its commit, and deleted
    # the crashed attempt's packs (older than the grace, named by no manifest).
    assert len(reports) == 1 and orphans <= set(reports[0].deleted["packs"])
    assert not orphans & keys(inner)
    needed = needs_of(inner, info.version)
    packs = {k for k in needed if k.endswith(".pack")}
    assert packs and not packs & orphans  # the retry wrote its own packs (a new attempt)
    assert needed <= keys(inner), sorted(needed - keys(inner))
    states[info.version] = nxt
    assert_versions_intact(inner, states, sorted(states))


def test_empty_store_is_a_no_op(tmp_path):
    store = open_store(str(tmp_path / "store"))
    report = collect(store, keep_last=1, grace_s=DAY)
    assert report.aborted_reason and report.deleted_objects == 0


def test_cli_gc_pin_unpin(tmp_path, capsys):
    from deltastore.cli import main

    url = str(tmp_path / "store")
    publish(open_store(url), 6)
    assert main(["pin", url, "2", "--note", "eval"]) == 0
    assert "pinned version 2" in capsys.readouterr().out
    assert main(["gc", url, "--keep-last", "1", "--grace", "6h"]) == 1  # below the deadline
    assert "GCRefusedError" in capsys.readouterr().err
    assert main(["gc", url, "--keep-last", "1", "--grace", "7h", "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # every version was head within the grace period: the floor stays, nothing goes
    assert out["dry_run"] and out["floor_after"] == 1 and out["pins"] == [2] and out["deleted_objects"] == 0
    assert main(["gc", url, "--keep-last", "1", "--grace", "24h"]) == 0
    assert "floor 1 -> 1" in capsys.readouterr().out
    assert main(["unpin", url, "2"]) == 0
    assert "pins: none" in capsys.readouterr().out
    from deltastore.cli import _parse_duration

    assert [_parse_duration(x) for x in ("90s", "30m", "24h", "2d", "15")] == [90, 1800, 86400, 172800, 15]


def test_not_found_kept_pack_is_reported_by_pull_not_masked(aged):
    """Sanity of the checks above: deleting a kept pack makes the pull fail (so the
    assertions that kept versions pull bit-exact can fail)."""
    states = publish(aged, 4)
    for pack in needs_of(aged, 4):
        if not pack.startswith("manifests/"):
            aged.inner.delete(pack)
    with pytest.raises(NotFoundError):
        assert_versions_intact(aged, states, [4])


def test_collect_on_every_backend(any_store_target):
    """The probe's last-modified, listing ages and deletes on each backend (S3 included)."""
    with any_store_target.open() as inner:
        store = AgedStore(inner)
        states = publish(store, 7)  # anchors 1, 4, 7
        store.age_everything(2 * DAY)
        report = collect(store, keep_last=3, grace_s=DAY)  # low 5 → floor 4
        assert report.floor_after == 4 and report.deleted["manifests"] and report.deleted["packs"]
        left = keys(inner)
        assert not set(all_deleted(report)) & left
        assert_versions_intact(inner, states, [4, 5, 6, 7])
        assert f"gc/{report.run_id}-report.json" in left


def test_missing_needed_pack_is_reported(aged):
    publish(aged, 4)
    pack = min(k for k in needs_of(aged, 4) if k.endswith(".pack"))  # a pack, not the layout
    aged.inner.delete(pack)
    report = collect(aged, keep_last=1, grace_s=DAY, dry_run=True)
    assert report.missing == [pack]


def test_missing_layout_of_a_kept_version_aborts_with_nothing_deleted(aged):
    """A schema-3 manifest cannot be read without its layout (SPEC §11: GC aborts when it
    cannot read a needed layout). The layout here was written by version 1's attempt and is
    reused by every later version."""
    publish(aged, 10)
    h = History(aged)
    _, m = h.head_manifest(h.read_head()[0])
    assert m.layout is not None and m.commit_id not in m.layout.key
    aged.inner.delete(m.layout.key)
    aged.age_everything(2 * DAY)
    before = keys(aged)
    with pytest.raises(GCAbortedError, match="layout"):
        collect(aged, keep_last=1, grace_s=DAY)
    assert before <= keys(aged)


def test_a_layout_written_by_an_older_attempt_is_kept(aged):
    """Versions reuse their parent's layout object (design 005 D8): the layout the kept
    versions name was written by version 1's attempt, whose manifest and packs GC deletes."""
    states = publish(aged, 10)  # anchors 1, 4, 7, 10
    h = History(aged)
    _, m10 = h.head_manifest(h.read_head()[0])
    first, m1 = h.find(1, h.read_head()[0])
    assert m10.layout == m1.layout and m1.commit_id in m10.layout.key
    aged.age_everything(2 * DAY)
    report = collect(aged, keep_last=1, grace_s=DAY)
    after = keys(aged)
    assert first not in after and not any(b.key in after for b in m1.blobs)  # its attempt's other objects went
    assert m10.layout.key in after and m10.layout.key not in all_deleted(report)
    assert_versions_intact(aged, states, [10])


def test_grace_minimum_follows_the_deadline_the_kept_manifests_record(aged):
    """M is the largest max_attempt_s among manifests ≥ floor (none recorded: 6 h)."""
    from deltastore.format.keys import manifest_key, sha256_hex
    from deltastore.format.manifest import encode_manifest

    publish(aged, 10)  # anchors 1, 4, 7, 10
    head = json.loads(aged.get(HEAD_KEY))
    h = History(aged)
    m = h.manifest(head["manifest"])
    layout = h.layout(m.layout) if m.layout is not None else None
    data = encode_manifest(m.model_copy(update={"max_attempt_s": 100}), layout)  # as a schema-3 writer records it
    key = manifest_key(10, sha256_hex(data))
    aged.inner.put(key, data, mode="create")
    head.update(manifest=key, manifest_sha256=sha256_hex(data))
    aged.inner.put(HEAD_KEY, json.dumps(head).encode(), mode="overwrite")
    aged.age_everything(2 * DAY)
    with pytest.raises(GCRefusedError, match="100s"):
        collect(aged, keep_last=1, grace_s=100 + CLOCK_MARGIN_S - 1)
    with pytest.raises(GCRefusedError, match="21600s"):  # keep_last 2: version 9 (none recorded) is kept
        collect(aged, keep_last=2, grace_s=100 + CLOCK_MARGIN_S)
    report = collect(aged, keep_last=1, grace_s=100 + CLOCK_MARGIN_S)
    assert report.floor_after == 10


def test_registered_squashes_are_kept_with_their_packs_and_layout(aged):
    """SPEC §11: the squashes the index lists whose ``from`` is ≥ floor or a pin are kept with
    their packs and layout; one from below the floor (not pinned) is dropped from the index
    on the floor raise and collected with its packs."""
    from deltastore.lifecycle.compact import compact

    publish(aged, 14, anchor_every=5)  # anchors 1, 6, 11
    report = compact(aged, bases=[7, 8, 11], to=14)
    assert report.registered and sorted(s.from_ for s in report.squashes) == [7, 8, 11]
    h = History(aged)
    sq = {s.from_: h.squash(s) for s in h.index(h.read_head()[0]).squashes}
    needs = {f: {s.key for s in h.index(h.read_head()[0]).squashes if s.from_ == f} | set(q.references())
             | ({q.layout.key} if q.layout is not None else set()) for f, q in sq.items()}
    assert all(q.blobs for q in sq.values())
    aged.age_everything(2 * DAY)

    first = collect(aged, keep_last=6, grace_s=DAY)  # low 9 → floor 6: every squash stays
    assert first.floor_after == 6
    assert set().union(*needs.values()) <= keys(aged)
    assert sorted(s.from_ for s in read_head_and_index(History(aged))[1].squashes) == [7, 8, 11]

    second = collect(aged, keep_last=1, keep_versions=[7], grace_s=DAY)  # floor 11, pin 7
    assert second.floor_after == 11 and second.pins == [7]
    _head, idx = _index(aged)
    assert sorted(s.from_ for s in idx.squashes) == [7, 11]  # from 7 is pinned; from 8 is below the floor
    after = keys(aged)
    assert needs[7] | needs[11] <= after
    assert not needs[8] - (needs[7] | needs[11]) & after  # the dropped squash and its own packs went
    assert needs[8] - (needs[7] | needs[11]) <= set(all_deleted(second))
    for s in idx.squashes:
        History(aged).squash(s)  # still readable and verified


def test_a_pins_own_layout_is_kept_below_the_floor(aged):
    """A pin below the floor needs its chain's layout even when no kept version names it
    (SPEC §11 needs_materialize: the manifests with their layouts). Versions 6 on add a tensor,
    so their layout is a new object; version 5's layout is needed by the pin alone."""
    trainer = TinyTrainer()
    states = publish(aged, 5, trainer=trainer)  # anchors 1, 4
    with Publisher(aged.url, store=aged, anchor_policy=AnchorPolicy(every=3),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for i in range(4):  # versions 6–9: 6 an anchor (the layout changes), 9 an anchor
            s = dict(trainer.step())
            s["extra.added"] = torch.arange(12, dtype=torch.float32)
            states[pub.publish(s, anchor=i == 0).version] = s
    h = History(aged)
    _, m5 = h.find(5, h.read_head()[0])
    _, m9 = h.head_manifest(h.read_head()[0])
    assert m5.layout is not None and m9.layout is not None and m5.layout.key != m9.layout.key
    pin_needs, _ = pin_needs_of(aged, 5)
    assert m5.layout.key in pin_needs
    aged.age_everything(2 * DAY)
    report = collect(aged, keep_last=1, keep_versions=[5], grace_s=DAY)
    assert report.floor_after > 5 and report.pins == [5]
    after = keys(aged)
    assert pin_needs <= after and m9.layout.key in after
    assert_bits_equal(pull_from_manifest(aged, _index(aged)[1].pins[0].manifest), states[5])
    assert_versions_intact(aged, states, [9])


class _CollectedMidRun(AgedStore):
    """A store whose first full listing lets ``before_listing`` run first: another GC, racing
    the one that lists (two GCs serialize only their index writes)."""

    def __init__(self, inner: Store, before_listing: Any):
        super().__init__(inner)
        self.before_listing = before_listing

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        if prefix == "" and self.before_listing is not None:
            hook, self.before_listing = self.before_listing, None
            hook()
        return super().list(prefix)


def test_objects_another_gc_collected_meanwhile_are_not_reported_missing(aged):
    """GC A marks at floor 4 and commits it; before A lists, GC B raises the floor to 7 and
    collects versions 4-6. Their objects are then absent from A's listing: collected, not lost,
    so A reports none of them; an object a version above B's floor still needs and that is gone
    is still reported (a race once seen on SeaweedFS)."""
    states = publish(aged, 10)  # anchors 1, 4, 7, 10
    aged.age_everything(2 * DAY)
    old = set().union(*(needs_of(aged, v) for v in (4, 5, 6))) - needs_of(aged, 8)
    lost = min(k for k in needs_of(aged, 9) - needs_of(aged, 8) if k.endswith(".pack"))
    reports = []

    def other_gc() -> None:
        reports.append(collect(aged, keep_last=3, grace_s=DAY))  # floor 7
        aged.inner.delete(lost)  # real damage, after B: B's report cannot have seen it

    racing = _CollectedMidRun(aged.inner, other_gc)
    racing.offsets = aged.offsets
    report = collect(racing, keep_last=6, grace_s=DAY)  # marks at floor 4
    assert reports[0].floor_after == 7 and set(all_deleted(reports[0])) >= old
    assert report.floor_after == 4 and report.missing == [lost], report.missing
    assert_versions_intact(aged, states, [7, 8, 10])
