"""GC racing a publisher, a compactor, another GC and pins (design 005 D3 interleavings #3, #9,
#10), with real processes on real S3 servers (moto, SeaweedFS), and deterministic pin-vs-GC
interleavings.

The race runs with a grace period of a few seconds (``unsafe_grace_ok``: below the 10-minute
clock margin) and a publisher whose attempt deadline (``max_attempt_s``) is shorter than the
grace, as SPEC §11 requires; the compactor and the index writers keep the deadline the head
manifest records, so none of them can commit an object GC already judged abandoned.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.errors import (
    CommitAbandonedError,
    ConflictError,
    DeltastoreError,
    GCAbortedError,
    VersionCollectedError,
)
from deltastore.format.history import History
from deltastore.lifecycle.compact import compact
from deltastore.lifecycle.gc import collect
from deltastore.lifecycle.index import pin, pinned, read_index
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.lifecycle import (
    DAY,
    AgedStore,
    needs_of,
    pin_needs_of,
    publish,
    pull_from_manifest,
)
from testkit.stores import HeadPutHook, keys
from testkit.tensors import SMALL_CHUNK_BYTES, assert_bits_equal, mp_context, small_state

#: Versions the racing publisher commits.
RACE_VERSIONS = 16
#: Seconds between its versions: versions must age past the grace while the race runs.
RACE_PAUSE_S = 0.25
#: The grace of the racing GC (see the module docstring).
RACE_GRACE_S = 3.0
#: The racing publisher's attempt deadline: shorter than the grace (SPEC §11).
RACE_ATTEMPT_S = 2.0


def state_for(i: int) -> dict[str, torch.Tensor]:
    """Version i's state, the same in every process: a few rows change per step."""
    s = small_state(seed=0, n=4, rows=32)
    for j in range(1, i + 1):
        g = torch.Generator().manual_seed(j)
        name = f"t{j % 4}"
        row = j % 32
        s[name][row] = torch.randn(8, generator=g).to(s[name].dtype)
    return s


def _publisher(url: str, options: dict, out: mp.Queue) -> None:
    conflicts = 0
    with Publisher(url, storage_options=options, writer_policy=WriterPolicy(max_attempt_s=RACE_ATTEMPT_S),
                   anchor_policy=AnchorPolicy(every=5), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for i in range(1, RACE_VERSIONS + 1):
            state = state_for(i)
            for _ in range(50):
                try:
                    pub.publish(state, step=i)
                    break
                except (ConflictError, CommitAbandonedError):  # 8 index writes in a row, or a slow attempt
                    conflicts += 1
            else:
                raise AssertionError(f"step {i} never committed")
            time.sleep(RACE_PAUSE_S)
    out.put(("publisher", conflicts))


def _gc(url: str, options: dict, stop: mp.Event, out: mp.Queue, keep_last: int, name: str) -> None:
    runs = deleted = aborted = damaged = 0
    while not stop.is_set():
        try:
            r = collect(url, storage_options=options, keep_last=keep_last, grace_s=RACE_GRACE_S, unsafe_grace_ok=True)
            runs += 1
            deleted += r.deleted_objects
            damaged += len(r.missing)
        except ConflictError:  # its index write lost 8 races in a row: try again
            aborted += 1
        except GCAbortedError as e:
            aborted += 1
            damaged += "missing" in str(e)  # a needed object gone: what GC must never cause
        time.sleep(0.1)
    out.put((name, (runs, deleted, aborted, damaged)))


def _compactor(url: str, options: dict, stop: mp.Event, out: mp.Queue) -> None:
    """Squashes from 2 and 5 versions behind head, registered in the index, while GC runs."""
    runs = written = failed = 0
    store = open_store(url, storage_options=options)
    h = History(store)
    while not stop.is_set():
        cur = h.read_head()
        if cur is not None and cur[0].version > 5:
            v = cur[0].version
            try:
                rep = compact(store, bases=[v - 2, v - 5], to=v)
                runs += 1
                written += len(rep.squashes) if rep.registered else 0
            except DeltastoreError:  # a base collected under it, a lost CAS race: next round
                failed += 1
        time.sleep(0.3)
    out.put(("compactor", (runs, written, failed)))


def _pinner(url: str, options: dict, stop: mp.Event, out: mp.Queue) -> None:
    pinned_ok, refused = [], 0
    store = open_store(url, storage_options=options)
    h = History(store)
    while not stop.is_set():
        cur = h.read_head()
        if cur is not None and cur[0].version > 3:
            idx = read_index(h, cur[0])
            floor = idx.floor if idx is not None else 1
            v = max(floor, cur[0].version - 3)  # near the floor: the interesting race
            try:
                pin(store, v, note="race")
                pinned_ok.append(v)
            except (VersionCollectedError, ConflictError):
                refused += 1
        time.sleep(0.6)
    out.put(("pinner", (pinned_ok, refused)))


@pytest.mark.integration
@pytest.mark.slow
def test_gc_racing_a_publisher_and_pins_on_s3(seaweedfs_s3_url):
    # SeaweedFS, not moto: the race is about conditional writes, which SeaweedFS checks as S3
    # does; moto's answers to the same calls are held to the store contract (tests/storage/).
    target = seaweedfs_s3_url
    url, options = target.url, target.storage_options
    ctx = mp_context()
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_publisher, args=(url, options, out)),
             ctx.Process(target=_gc, args=(url, options, stop, out, 2, "gc")),
             ctx.Process(target=_gc, args=(url, options, stop, out, 4, "gc2")),  # two GCs serialize by CAS
             ctx.Process(target=_pinner, args=(url, options, stop, out)),
             ctx.Process(target=_compactor, args=(url, options, stop, out))]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=240)
        assert procs[0].exitcode == 0, "the publisher failed"
        time.sleep(RACE_GRACE_S + 1)  # let the GC collect behind the last versions too
    finally:
        stop.set()
        for p in procs[1:]:
            p.join(timeout=60)
        for p in procs:
            if p.is_alive():
                p.kill()
    results = {}
    roles = {"publisher", "gc", "gc2", "pinner", "compactor"}
    while set(results) != roles:  # every role reports once; a missing one fails the assert below
        try:
            who, what = out.get(timeout=5)
        except queue.Empty:
            break
        results[who] = what
    print(f"race: {results}")
    assert set(results) == roles, results
    assert results["compactor"][1] > 0, results  # squashes were registered during the race
    runs, deleted, _aborted, damaged = (a + b for a, b in zip(results["gc"], results["gc2"]))
    assert runs >= 3 and deleted > 0, results  # GC really ran and collected during the race
    assert damaged == 0, results

    store = open_store(url, storage_options=options)
    h = History(store)
    head = h.read_head()[0]
    idx = read_index(h, head)
    assert head.version == RACE_VERSIONS
    assert idx is not None and idx.floor > 1, "the floor never rose: the race did not exercise GC"
    print(f"race: floor {idx.floor}, head {head.version}, pins {sorted(pinned(idx))}")
    present = keys(store)
    with Subscriber(url, store=store) as sub:
        for v in range(idx.floor, head.version + 1):
            assert needs_of(store, v) <= present, f"version {v} lost objects"
            info = sub.info(v)
            assert info.step == v  # one commit per step, in order
            assert_bits_equal(sub.pull(v), state_for(v), f"version {v}")
    for p in idx.pins:
        assert_bits_equal(pull_from_manifest(store, p.manifest), state_for(p.version), f"pinned version {p.version}")
    # Every pin that succeeded is still pinned (GC merged them, never dropped them).
    assert set(results["pinner"][0]) <= pinned(idx)
    # Every squash the index still names is whole and brings its base to its end bit-exactly.
    for ref in idx.squashes:
        assert ref.from_ >= idx.floor or ref.from_ in pinned(idx), f"index keeps a squash below the floor: {ref}"
        sq = h.squash(ref)
        assert set(sq.references()) <= present, f"squash {ref.from_}→{ref.to} lost objects"
        with Subscriber(url, store=store) as sub:
            target = sub.pull(ref.from_)
            assert sub.pull_into(target, version=ref.to).version == ref.to
            assert_bits_equal(target, state_for(ref.to), f"through squash {ref.from_}→{ref.to}")


def test_pin_landing_between_gc_read_and_cas_is_kept(tmp_path):
    """Design 005 D3 #9, the order where the pin wins: GC's CAS fails, GC re-reads the index,
    keeps the new pin, and deletes nothing the pinned version needs."""
    inner = open_store(str(tmp_path / "store"))
    aged = AgedStore(inner)
    states = publish(aged, 10)
    aged.age_everything(2 * DAY)
    pin_needs, _ = pin_needs_of(aged, 5)  # SPEC §11 needs_materialize(5)
    fired = []

    def hook(key, data, mode, real_put):
        if not fired:
            fired.append(1)
            pin(inner, 5, note="racer")  # lands between GC's read of HEAD and its CAS
        return real_put()

    racing = HeadPutHook(aged, hook)
    report = collect(racing, keep_last=1, grace_s=DAY)
    assert fired and report.pins == [5] and report.floor_after == 10
    assert pin_needs <= keys(inner)
    idx = read_index(History(inner), History(inner).read_head()[0])
    assert_bits_equal(pull_from_manifest(inner, idx.pins[0].manifest), states[5])


def test_floor_raised_by_another_gc_past_our_head_keeps_the_committed_heads_chain(tmp_path):
    """Two GCs and a publisher: ours read head 10; before our CAS, versions 11–13 were
    committed and another GC raised the floor to 13. We must keep what the committed HEAD
    needs, not what the head we read needed."""
    inner = open_store(str(tmp_path / "store"))
    aged = AgedStore(inner)
    states = publish(aged, 12, anchor_every=3)  # anchors 1, 4, 7, 10
    aged.age_everything(2 * DAY)
    fired = []

    def hook(key, data, mode, real_put):
        if not fired:
            fired.append(1)
            publish(aged, 1, states=states)  # version 13, a fresh anchor (new publisher)
            aged.age_everything(2 * DAY)
            collect(aged, keep_last=1, grace_s=DAY)  # the other GC: floor 13
        return real_put()

    collect(HeadPutHook(aged, hook), keep_last=3, grace_s=DAY)
    assert fired
    head = History(inner).read_head()[0]
    assert head.version == 13
    assert needs_of(inner, 13) <= keys(inner)
    with Subscriber(inner.url, store=inner) as sub:
        assert_bits_equal(sub.pull(13), states[13])
