"""The history index (SPEC §11) and its index-only HEAD writes (SPEC §4, design 005 D4)."""

from __future__ import annotations

import json

import pytest

import deltastore.write.commit as commit_mod
from deltastore import Publisher
from deltastore.errors import (
    ConflictError,
    HistoryReplacedError,
    StorageError,
    UnsupportedSchemaError,
    VersionCollectedError,
    VersionNotFoundError,
)
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY, new_lineage
from deltastore.format.models import Index, SquashRef
from deltastore.format.parse import parse_head
from deltastore.lifecycle.index import (
    INDEX_SUFFIX,
    add_pins,
    add_squashes,
    effective_floor,
    pin,
    pinned,
    read_index,
    unpin,
    update_index,
)
from deltastore.storage import open_store
from deltastore.storage.base import IfMatch
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from testkit.stores import HeadPutHook, read_head
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer

#: Fields an index-only HEAD write must copy unchanged (SPEC §4).
COPIED = ("version", "manifest", "manifest_sha256", "commit_id", "writer", "epoch", "lineage")


def _store_with_versions(tmp_path, n=5, anchor_every=3):
    url = str(tmp_path / "store")
    trainer = TinyTrainer()
    with Publisher(url, anchor_policy=AnchorPolicy(every=anchor_every),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for _ in range(n):
            pub.publish(trainer.step())
    return open_store(url)


def _set(floor=None, squashes=None):
    """A mutate setting the floor and/or squashes, keeping everything else."""

    def mutate(head, index):
        base = index or Index(lineage=head.lineage, generation=1, floor=1, writer="", created="")
        update = {}
        if floor is not None:
            update["floor"] = floor
        if squashes is not None:
            update["squashes"] = tuple(squashes)
        return base.model_copy(update=update)

    return mutate


def _squash(frm, to):
    return SquashRef(**{"from": frm, "to": to, "key": f"objects/{'a' * 32}/{frm:064x}.squash.json.zst",
                        "sha256": f"{frm:064x}", "bytes": 1})


def test_no_index_means_floor_one_and_no_pins(tmp_path):
    store = _store_with_versions(tmp_path, n=2)
    head = History(store).read_head()[0]
    assert head.schema_ == 3 and head.index is None
    assert read_index(History(store), head) is None
    assert effective_floor(None) == 1 and pinned(None) == set()


def test_index_only_write_copies_head_and_chains_generations(tmp_path):
    store = _store_with_versions(tmp_path)
    history = History(store)
    before = read_head(store)
    head1, idx1 = update_index(store, history, _set(floor=4), writer="gc-1")
    after = read_head(store)
    for f in COPIED:
        assert after[f] == before[f], f
    assert after["updated"] != before["updated"] or True  # new timestamp (may coincide to the ms)
    assert after["index"]["key"].startswith("objects/") and after["index"]["key"].endswith(INDEX_SUFFIX)
    assert idx1.generation == 1 and idx1.floor == 4 and idx1.previous is None and idx1.writer == "gc-1"
    assert idx1.lineage == before["lineage"]
    # The index object is what HEAD says, and reads back equal.
    assert read_index(History(store), parse_head(store.get(HEAD_KEY))) == idx1
    head2, idx2 = update_index(store, history, _set(floor=4, squashes=[_squash(4, 5)]), writer="gc-2")
    assert idx2.generation == 2 and idx2.previous == head1.index
    # Every index write is under its own attempt (design 005 D1).
    assert head1.index.key.split("/")[1] != head2.index.key.split("/")[1]


def test_floor_never_goes_down_and_squashes_below_it_are_dropped(tmp_path):
    store = _store_with_versions(tmp_path)
    history = History(store)
    update_index(store, history, _set(squashes=[_squash(1, 5), _squash(4, 5)]), writer="c")
    _, idx = update_index(store, history, _set(floor=4), writer="g")
    assert idx.floor == 4 and [s.from_ for s in idx.squashes] == [4]
    _, idx = update_index(store, history, _set(floor=1), writer="g")
    assert idx.floor == 4  # a lower floor is not written


def test_unchanged_index_is_not_rewritten(tmp_path):
    store = _store_with_versions(tmp_path)
    history = History(store)
    update_index(store, history, _set(floor=4), writer="g")
    etag = store.head(HEAD_KEY).etag
    update_index(store, history, _set(floor=4), writer="g")
    assert store.head(HEAD_KEY).etag == etag


def test_lost_cas_reruns_mutate_on_the_new_index(tmp_path):
    """Race: someone pins version 2 between our read of HEAD and our CAS; our floor raise must
    merge with that pin instead of overwriting it."""
    inner = _store_with_versions(tmp_path)
    fired = []

    def hook(key, data, mode, real_put):
        if not fired:
            fired.append(1)
            pin(inner, 2, note="other")  # lands first: our CAS now fails its If-Match
        return real_put()

    store = HeadPutHook(inner, hook)
    calls = []

    def mutate(head, index):
        calls.append(index)
        return _set(floor=4)(head, index)

    _, idx = update_index(store, History(store), mutate, writer="g")
    assert len(calls) == 2 and calls[0] is None and pinned(calls[1]) == {2}
    assert idx.floor == 4 and pinned(idx) == {2}
    assert read_index(History(inner), History(inner).read_head()[0]) == idx


def test_lost_response_is_settled_by_reading_head(tmp_path):
    """The CAS lands but its response is lost: success iff HEAD names our index, and no second
    index is written."""
    inner = _store_with_versions(tmp_path)

    def hook(key, data, mode, real_put):
        real_put()
        raise StorageError("connection reset after the body was sent")

    store = HeadPutHook(inner, hook)
    _head, idx = update_index(store, History(store), _set(floor=4), writer="g")
    assert read_index(History(inner), History(inner).read_head()[0]) == idx
    assert [c for c in store.calls if c == ("put", HEAD_KEY)] == [("put", HEAD_KEY)]
    assert len([m for m in inner.list("objects/") if m.key.endswith(INDEX_SUFFIX)]) == 1


class _UnreadableHeadAfterPut(HeadPutHook):
    """The HEAD write lands but its response is lost; then the next ``unreadable`` reads of HEAD
    fail (an outage while the writer reads HEAD back)."""

    def __init__(self, inner, unreadable: int):
        def lost(key, data, mode, real_put):
            real_put()
            self.failing = unreadable
            raise StorageError("connection reset after the body was sent")

        super().__init__(inner, lost)
        self.failing = 0

    def get_with_meta(self, key):
        if key == HEAD_KEY and self.failing:
            self.failing -= 1
            raise StorageError("503 Slow Down (injected)")
        return super().get_with_meta(key)


def test_index_writes_settle_with_the_commit_protocols_read_back(tmp_path, monkeypatch):
    """Every HEAD writer reads HEAD back alike (write/commit.py): an index write whose response
    was lost rides out as many unreadable HEAD reads as a publisher's commit does, and only
    beyond that reports HEAD unreadable (nothing it wrote is lost: HEAD names its index)."""
    monkeypatch.setattr(commit_mod, "READBACK_BACKOFF_S", 0.0)
    tries = commit_mod.READBACK_ATTEMPTS
    inner = _store_with_versions(tmp_path)
    store = _UnreadableHeadAfterPut(inner, unreadable=tries - 1)
    head, idx = update_index(store, History(store), _set(floor=4), writer="g")
    assert idx.floor == 4 and read_head(inner)["index"] == head.index.model_dump()
    store = _UnreadableHeadAfterPut(inner, unreadable=tries)
    with pytest.raises(StorageError, match="could not be read back"):
        update_index(store, History(store), _set(floor=5), writer="g")
    assert read_index(History(inner), History(inner).read_head()[0]).floor == 5  # it had landed


def test_a_cas_that_keeps_losing_gives_up(tmp_path):
    inner = _store_with_versions(tmp_path)
    n = []

    def hook(key, data, mode, real_put):
        n.append(1)
        doc = json.loads(inner.get(HEAD_KEY))
        doc["updated"] = f"2026-01-01T00:00:{len(n) % 60:02d}.000Z"  # someone else keeps writing
        inner.put(HEAD_KEY, json.dumps(doc).encode(), mode="overwrite")
        return real_put()

    with pytest.raises(ConflictError):
        update_index(HeadPutHook(inner, hook), History(inner), _set(floor=4), writer="g")


def test_lineage_change_between_tries_aborts(tmp_path):
    inner = _store_with_versions(tmp_path)

    def hook(key, data, mode, real_put):
        doc = json.loads(inner.get(HEAD_KEY))
        doc["lineage"] = new_lineage()  # the store was replaced by another history
        inner.put(HEAD_KEY, json.dumps(doc).encode(), mode="overwrite")
        return real_put()

    with pytest.raises(HistoryReplacedError):
        update_index(HeadPutHook(inner, hook), History(inner), _set(floor=4), writer="g")


def _downgrade_head(store):
    doc = json.loads(store.get(HEAD_KEY))
    doc["schema"] = 2
    doc.pop("index", None)
    store.put(HEAD_KEY, json.dumps(doc).encode(), mode="overwrite")


def test_a_head_of_an_earlier_format_is_refused(tmp_path):
    store = _store_with_versions(tmp_path)
    _downgrade_head(store)
    before = store.get(HEAD_KEY)
    with pytest.raises(UnsupportedSchemaError, match="earlier format"):
        update_index(store, History(store), _set(floor=4), writer="g")
    with pytest.raises(UnsupportedSchemaError, match="earlier format"):
        pin(store, 3)
    assert store.get(HEAD_KEY) == before


def test_pin_and_unpin(tmp_path):
    store = _store_with_versions(tmp_path)
    idx = pin(store, 2, note="eval run 7", writer="alice")
    p = idx.pins[0]
    assert (p.version, p.note, p.by) == (2, "eval run 7", "alice")
    assert p.manifest == History(store).find(2, History(store).read_head()[0])[0]
    etag = store.head(HEAD_KEY).etag
    assert pin(store, 2).pins == idx.pins  # idempotent: nothing written
    assert store.head(HEAD_KEY).etag == etag
    with pytest.raises(VersionNotFoundError):
        pin(store, 99)
    assert pinned(unpin(store, 2)) == set()
    assert pinned(unpin(store, 2)) == set()


def test_pin_below_floor_is_refused_with_the_floor_and_pins(tmp_path):
    store = _store_with_versions(tmp_path)
    pin(store, 2)
    update_index(store, History(store), _set(floor=4), writer="g")
    with pytest.raises(VersionCollectedError) as e:
        pin(store, 3)
    assert (e.value.version, e.value.floor, e.value.pins) == (3, 4, (2,))
    assert isinstance(e.value, VersionNotFoundError)
    pin(store, 2)  # already pinned below the floor: fine


def test_pin_racing_a_floor_raise(tmp_path):
    """Design 005 D3 #9, the order where the floor wins: the pin re-reads the index after its
    lost CAS and refuses (its version is now below the floor)."""
    inner = _store_with_versions(tmp_path)
    fired = []

    def hook(key, data, mode, real_put):
        if not fired:
            fired.append(1)
            update_index(inner, History(inner), _set(floor=4), writer="gc")
        return real_put()

    store = HeadPutHook(inner, hook)
    with pytest.raises(VersionCollectedError):
        update_index(store, History(store), add_pins([3], history=History(store)), writer="pinner")
    assert pinned(read_index(History(inner), History(inner).read_head()[0])) == set()


def test_publisher_keeps_the_index_across_commits(tmp_path):
    """HEAD writes by the publisher carry the index along (a commit must not drop the floor)."""
    url = str(tmp_path / "store")
    trainer = TinyTrainer()
    with Publisher(url, anchor_policy=AnchorPolicy(every=3), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for _ in range(3):
            pub.publish(trainer.step())
        idx = pin(url, 2)
        state = trainer.step()
        try:
            pub.publish(state)
        except ConflictError:  # a publisher without the D4 rebase loses one CAS to the index write
            pub.publish(state)
    head = read_head(open_store(url))
    assert head["version"] == 4 and head["index"] is not None
    store = open_store(url)
    assert read_index(History(store), History(store).read_head()[0]) == idx


def test_if_match_is_used_for_every_index_write(tmp_path):
    inner = _store_with_versions(tmp_path)
    modes = []

    def hook(key, data, mode, real_put):
        modes.append(mode)
        return real_put()

    update_index(HeadPutHook(inner, hook), History(inner), _set(floor=4), writer="g")
    assert modes and all(isinstance(m, IfMatch) for m in modes)


def test_an_attempt_past_its_deadline_is_abandoned_before_its_cas(tmp_path):
    """SPEC §5 step 3a for index writers: no HEAD write once the attempt is older than
    max_attempt_s (its index object may already be collectible)."""
    store = _store_with_versions(tmp_path)
    before = store.get(HEAD_KEY)
    with pytest.raises(ConflictError, match="max_attempt_s"):
        update_index(store, History(store), _set(floor=4), writer="g", max_attempt_s=-1)
    assert store.get(HEAD_KEY) == before


def test_add_squashes_merges_and_drops_those_below_the_floor(tmp_path):
    store = _store_with_versions(tmp_path)
    history = History(store)
    update_index(store, history, add_squashes([_squash(2, 5)]), writer="compactor")
    _, idx = update_index(store, history, add_squashes([_squash(2, 5), _squash(4, 5)]), writer="compactor")
    assert [s.from_ for s in idx.squashes] == [2, 4]
    _, idx = update_index(store, history, _set(floor=4), writer="gc")
    assert [s.from_ for s in idx.squashes] == [4]
    _, idx = update_index(store, history, add_squashes([_squash(1, 5)]), writer="compactor")
    assert [s.from_ for s in idx.squashes] == [4]  # from below the floor: never registered
