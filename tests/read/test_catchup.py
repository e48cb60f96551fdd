"""Catch-up planning (design 005 D6) and collected versions on the read side (D2): squashes
chosen by bytes, squashes that turn out missing or bad, workers holding a collected version,
and pull() of a version below the floor."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore import CachePolicy, PollPolicy, Subscriber
from deltastore.errors import CorruptObjectError, NotFoundError, VersionCollectedError, VersionNotFoundError
from deltastore.format.history import History
from deltastore.format.keys import HEAD_KEY
from deltastore.format.models import SquashRef
from deltastore.format.parse import parse_head
from deltastore.lifecycle.compact import compact
from deltastore.lifecycle.gc import collect as gc_collect
from deltastore.read import catchup
from deltastore.storage import open_store
from deltastore.storage.base import Store
from testkit.lifecycle import publish_run, set_index
from testkit.stores import WrappedStore
from testkit.tensors import assert_bits_equal

# --- the index writer and GC, driven the way these tests need them ------------------------------


def chain_keys(store: Store) -> dict[int, str]:
    """Manifest key of each version on HEAD's chain (down to the first collected one)."""
    head = parse_head(store.get(HEAD_KEY))
    history = History(store)
    out, key = {}, head.manifest
    while key is not None:
        try:
            m = history.manifest(key)
        except NotFoundError:  # collected below here
            break
        out[m.version] = key
        key = m.parent_manifest
    return out


def collect(store: Store, floor: int, *, pins: Iterable[int] = ()) -> None:
    """Run GC (deltastore.lifecycle.gc.collect, no grace) so that the floor becomes ``floor``: it raises the
    floor in the index, then deletes every manifest and pack that versions ≥ floor and the pins'
    anchor chains do not need."""
    head = parse_head(store.get(HEAD_KEY))
    report = gc_collect(store, keep_last=head.version - floor + 1, keep_versions=pins, grace_s=0.0,
                        unsafe_grace_ok=True)
    assert report.floor_after == floor and report.pins == sorted(pins), report
    assert report.deleted["packs"] and report.deleted["manifests"], report


def squash_pack(store: Store, sq: SquashRef) -> str:
    """The key of the (first) pack a squash's deltas are in."""
    packs = History(store).squash(sq).references()
    assert packs and all(k.endswith(".pack") for k in packs), packs
    return packs[0]


# --- a small fine-tune ------------------------------------------------------------------------------


def held_at(url: str, version: int, store: Store | None = None) -> tuple[Subscriber, dict[str, torch.Tensor]]:
    sub = Subscriber(url, threads=2, store=store)
    return sub, sub.pull(version)


def catch_up(sub: Subscriber, target: dict[str, torch.Tensor]) -> int:
    """pull_into the latest version; the pack bytes it fetched."""
    before = sub.bytes_fetched
    assert sub.pull_into(target) is not None
    return sub.bytes_fetched - before


@pytest.fixture
def run10(tmp_path: Path) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    url = str(tmp_path / "store")
    return url, publish_run(url, 10)


def test_planner_picks_the_squash_when_it_is_cheaper(run10: Any) -> None:
    url, states = run10
    sub, target = held_at(url, 2)
    with sub:
        chain_bytes = catch_up(sub, target)  # no index yet: the chain 2→10
        assert_bits_equal(target, states[10])
    report = compact(url, bases=[2], register=False)
    (sq,) = report.squashes
    set_index(open_store(url), squashes=[sq.ref()])
    sub, target = held_at(url, 2)
    with sub:
        squash_bytes = catch_up(sub, target)
        assert_bits_equal(target, states[10], "through the squash")
    assert squash_bytes == sq.bytes < chain_bytes, (squash_bytes, sq.bytes, chain_bytes)


def test_planner_picks_the_chain_when_it_is_cheaper(run10: Any) -> None:
    url, states = run10
    sub, target = held_at(url, 2)
    with sub:
        chain_bytes = catch_up(sub, target)
    (sq,) = compact(url, bases=[2], register=False).squashes
    # The same squash, registered as if it were larger than the chain: priced, not used.
    big = sq.ref().model_copy(update={"bytes": chain_bytes * 10})
    set_index(open_store(url), squashes=[big])
    sub, target = held_at(url, 2)
    with sub:
        assert catch_up(sub, target) == chain_bytes
        assert_bits_equal(target, states[10])


def test_a_squash_and_the_chain_after_it(run10: Any) -> None:
    """S(2, 6) then the deltas 7..10: the squash's digests carry the running digests on."""
    url, states = run10
    (sq,) = compact(url, bases=[2], to=6, register=False).squashes
    set_index(open_store(url), squashes=[sq.ref()])
    sub, target = held_at(url, 2)
    with sub:
        catch_up(sub, target)
        assert_bits_equal(target, states[10])


@pytest.mark.parametrize("damage", ["manifest deleted", "pack deleted", "pack corrupted"])
def test_a_squash_that_is_missing_or_bad_is_planned_around(run10: Any, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    url, states = run10
    sub, target = held_at(url, 2)
    with sub:
        chain_bytes = catch_up(sub, target)
    (sq,) = compact(url, bases=[2], register=False).squashes
    store = open_store(url)
    set_index(store, squashes=[sq.ref()])
    pack = squash_pack(store, sq.ref())
    if damage == "manifest deleted":
        store.delete(sq.key)
    elif damage == "pack deleted":
        store.delete(pack)
    else:
        data = bytearray(store.get(pack))
        data[len(data) // 2] ^= 0xFF
        store.put(pack, bytes(data), mode="overwrite")
    sub, target = held_at(url, 2)
    with sub, caplog.at_level(logging.WARNING, logger="deltastore.read"):
        fetched = catch_up(sub, target)
        assert_bits_equal(target, states[10], damage)
    assert any(sq.key in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    if damage == "manifest deleted":
        assert fetched == chain_bytes


def test_a_squash_whose_tables_do_not_plan_is_planned_around(run10: Any, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A squash that reads and checks fine but whose tables the planner refuses (as a squash
    of grid deltas planned without the held grid was) is skipped like an unreadable one: the
    pull goes through the chain, bit-exact, and the squash is named in a warning."""
    url, states = run10
    (sq,) = compact(url, bases=[2], register=False).squashes
    set_index(open_store(url), squashes=[sq.ref()])
    real = catchup.plan_forward
    refused: list[str] = []

    def plan(ms, specs, base):
        if ms and ms[0][0] == sq.key:
            refused.append(ms[0][0])
            raise CorruptObjectError(f"manifest {sq.key!r}: tensor 'x' does not match the layout")
        return real(ms, specs, base)

    monkeypatch.setattr(catchup, "plan_forward", plan)
    sub, target = held_at(url, 2)
    with sub, caplog.at_level(logging.WARNING, logger="deltastore.read"):
        catch_up(sub, target)
        assert_bits_equal(target, states[10])
    assert refused == [sq.key]
    assert any(sq.key in r.getMessage() and "planning without it" in r.getMessage() for r in caplog.records)


def test_follow_uses_the_squash_and_holds_digests_not_manifests(run10: Any) -> None:
    url, states = run10
    (sq,) = compact(url, bases=[2], register=False).squashes
    set_index(open_store(url), squashes=[sq.ref()])
    sub, target = held_at(url, 2)
    with sub:
        (rec,) = list(sub.follow(target, poll=PollPolicy(0.01), max_versions=1, heartbeat=None))
        assert rec.info.version == 10 and rec.bytes_fetched == sq.bytes
        assert_bits_equal(target, states[10])
        held = sub._reader.held
        assert held is not None and held.manifest.version == 10
        # one digest per chunk of the layout, whatever the versions followed
        assert len(held.digests) == sum(s.n_chunks for s in held.specs.values())


@pytest.fixture
def spans(tmp_path: Path) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    """Versions 1..12 with anchors at 1, 5, 9."""
    url = str(tmp_path / "store")
    return url, publish_run(url, 12, anchor_every=4)


def test_a_worker_holding_a_collected_version_catches_up_from_the_anchor(spans: Any, caplog: pytest.LogCaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    url, states = spans
    monkeypatch.setattr("deltastore.read.fetch.COALESCE_GAP_BYTES", 0)  # bytes fetched = segments read
    sub, target = held_at(url, 2)
    store = open_store(url)
    anchor = History(store).manifest(chain_keys(store)[9])
    assert anchor.kind == "anchor"
    collect(store, floor=9)
    with sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        fetched = catch_up(sub, target)
        assert_bits_equal(target, states[12])
    lines = [r.getMessage() for r in caplog.records if "was collected" in r.getMessage()]
    assert lines == ["version 2 was collected (floor 9); catching up from anchor 9"]
    # chunks whose held digest already equals their digest at 12 are not fetched: less than
    # materializing 12 from its anchor
    with Subscriber(url, threads=2) as fresh:
        fresh.pull()
        assert 0 < fetched < fresh.bytes_fetched


def test_pull_of_a_collected_version_raises_and_pins_stay_readable(spans: Any) -> None:
    url, states = spans
    collect(open_store(url), floor=9, pins=[3])
    with Subscriber(url, threads=2) as sub:
        with pytest.raises(VersionCollectedError) as e:
            sub.pull(6)
        assert (e.value.version, e.value.floor, e.value.pins) == (6, 9, (3,))
        assert isinstance(e.value, VersionNotFoundError)
        assert_bits_equal(sub.pull(3), states[3], "pinned")
        assert_bits_equal(sub.pull(9), states[9], "the floor")
        assert_bits_equal(sub.pull(), states[12], "head")
        assert [i.version for i in sub.log()] == [9, 10, 11, 12]
        report = sub.verify(all_versions=True)
        assert report.ok and report.versions == [9, 10, 11, 12]


class CollectOnFirstPackRead(WrappedStore):
    """GC runs (floor 9) just as the worker starts reading packs."""

    def __init__(self, inner: Store):
        super().__init__(inner)
        self.done = True  # armed by the test

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        if key.endswith(".pack") and not self.done:
            with self._lock:
                if not self.done:
                    self.done = True
                    collect(self.inner, floor=9)
        return super().get(key, byte_range=byte_range)


def test_a_pack_collected_while_catching_up_makes_the_worker_replan(spans: Any, caplog: pytest.LogCaptureFixture) -> None:
    url, states = spans
    store = CollectOnFirstPackRead(open_store(url))
    with Subscriber(url, threads=2, store=store) as sub:
        target = sub.pull(2)
        store.done = False  # the next pack read (the catch-up's) triggers the collection
        with caplog.at_level(logging.INFO, logger="deltastore.read"):
            sub.pull_into(target)
        assert_bits_equal(target, states[12])
        assert 3 not in chain_keys(store.inner)  # the collection did happen
        assert any("version 2 was collected (floor 9)" in r.getMessage() for r in caplog.records)


def test_a_worker_cache_holding_a_collected_version_fetches_only_the_chunks_that_differ(
        spans: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Design 005 D2: the cached chunks are hashed against head's digests; only those that
    differ are fetched, from head's anchor."""
    from deltastore.read.cache import WorkerCache

    url, states = spans
    monkeypatch.setattr("deltastore.read.fetch.COALESCE_GAP_BYTES", 0)  # bytes fetched = segments read
    cache = tmp_path / "cache"
    with Subscriber(url, threads=2) as sub:
        target = sub.pull(2)
        WorkerCache(cache).save(target, url=sub.url, version=2, manifest=sub._reader.held.key, lineage=sub._reader.held.manifest.lineage)
    collect(open_store(url), floor=9)
    with Subscriber(url, threads=2) as fresh:
        fresh.pull()
        full = fresh.bytes_fetched
    with Subscriber(url, threads=2) as sub, caplog.at_level(logging.INFO, logger="deltastore.read"):
        target = sub.allocate()
        (rec,) = list(sub.follow(target, poll=PollPolicy(0.01), max_versions=1, cache=CachePolicy(cache), heartbeat=None))
        assert rec.full_load and rec.info.version == 12 and sub.version == 12
        assert_bits_equal(target, states[12])
        assert 0 < rec.bytes_fetched < full
    messages = [r.getMessage() for r in caplog.records]
    assert "version 2 was collected (floor 9); catching up from anchor 9" in messages
    assert not any("not usable" in msg for msg in messages)


def test_a_missing_pack_of_a_kept_version_is_damage_not_collection(spans: Any) -> None:
    """Below the floor already, a 404 on the anchor's pack is not explained by a new floor: the
    reader raises NotFoundError (SPEC §7.7) instead of planning again and again."""
    url, states = spans
    sub, target = held_at(url, 2)
    store = open_store(url)
    collect(store, floor=9)
    anchor_key = chain_keys(store)[9]
    for b in History(store).manifest(anchor_key).blobs:  # its packs (not the layout 10..12 share)
        store.delete(b.key)
    with sub, pytest.raises(NotFoundError, match="missing"):
        sub.pull_into(target)
    assert_bits_equal(target, states[2], "rolled back")


def test_a_staged_update_through_a_corrupt_squash_falls_back_to_the_chain(run10: Any) -> None:
    """follow stages (no write before the pause): a squash whose pack fails its SHA-256 is
    dropped and the update staged again from the chain."""
    url, states = run10
    (sq,) = compact(url, bases=[2], register=False).squashes
    store = open_store(url)
    set_index(store, squashes=[sq.ref()])
    pack = squash_pack(store, sq.ref())
    data = bytearray(store.get(pack))
    data[0] ^= 0xFF
    store.put(pack, bytes(data), mode="overwrite")
    sub, target = held_at(url, 2)
    with sub:
        (rec,) = list(sub.follow(target, poll=PollPolicy(0.01), max_versions=1, heartbeat=None))
        assert rec.info.version == 10 and rec.bytes_fetched > sq.bytes  # the squash's pack, then the chain
        assert_bits_equal(target, states[10])
