"""The fleet target (SPEC §1.2, docs/fleet.md): followers go to the version it names, back too,
bit-exactly; hold it while publishing goes on; follow HEAD again after ``--latest``; and
refuse what a target must not do (a collected version, an unsigned, forged or replayed target
on a signed store)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from deltastore import HeartbeatPolicy, PollPolicy, Publisher, Subscriber
from deltastore.cli import main
from deltastore.errors import (
    ConflictError,
    PreconditionFailedError,
    SigningRequiredError,
    VersionCollectedError,
    VersionNotFoundError,
)
from deltastore.fleet.ledger import STAGE_SWAPPED, read_ledger
from deltastore.fleet.target import TARGET_KEY, TargetDocument, read_target, sign_document, write_target
from deltastore.format.keys import digest_from_key
from deltastore.format.models import dump
from deltastore.layout.select import Selection
from deltastore.lifecycle.gc import collect
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.lifecycle import DAY, AgedStore
from testkit.partial import expected_rows
from testkit.stores import WrappedStore
from testkit.tensors import assert_bits_equal, small_state, snapshot, sparse_edit

#: Small chunks, so that an edit changes some chunks of a tensor and not others.
CHUNK_BYTES = 128
#: A poll as fast as the loop goes: the tests count polls, they never wait on a clock.
FAST = PollPolicy(0.001, jitter=0.0)


class Run:
    """One trainer publishing sparse edits of a small state; ``states`` by version."""

    def __init__(self, url: str, *, key: Ed25519PrivateKey | None = None, store: Any = None, anchor_every: int = 4):
        self.rng = np.random.default_rng(0)
        self.state = small_state(0, n=4, rows=32)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.pub = Publisher(url, store=store, signing_key=key, writer_policy=WriterPolicy(threads=2),
                             anchor_policy=AnchorPolicy(every=anchor_every), layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES))

    def publish(self, n: int) -> int:
        for _ in range(n):
            self.states[self.pub.publish(self.state).version] = snapshot(self.state)
            self.state = sparse_edit(self.state, self.rng, fraction=0.05)
        return max(self.states)

    def close(self) -> None:
        self.pub.close()


class Polls(WrappedStore):
    """Ends a follow loop after ``limit`` more polls of HEAD (no clock involved)."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        self.stop = threading.Event()
        self.left: int | None = None

    def stop_after(self, polls: int) -> threading.Event:
        self.stop.clear()
        self.left = polls
        return self.stop

    def get_if_changed(self, key: str, etag: str | None) -> Any:
        if key == "HEAD" and self.left is not None:
            self.left -= 1
            if self.left <= 0:
                self.stop.set()
        return super().get_if_changed(key, etag)


class Follower:
    """A subscriber following into its own tensors, driven a number of versions or polls at a time."""

    def __init__(self, url: str, *, keys: list[Any] | None = None, worker: str | None = None,
                 swap_mode: str = "inplace", select: Selection | None = None):
        self.swap_mode = swap_mode
        self.store = Polls(open_store(url))
        self.sub = Subscriber(url, store=self.store, threads=2, trusted_keys=keys, select=select)
        self.target: dict[str, torch.Tensor] | None = None
        self.heartbeat = None if worker is None else HeartbeatPolicy(worker)

    def records(self, stop: threading.Event | None = None, n: int | None = None) -> Iterator[Any]:
        if self.target is None:
            self.target = self.sub.allocate()
        return self.sub.follow(self.target, poll=FAST, stop=stop, heartbeat=self.heartbeat, max_versions=n,
                               swap_mode=self.swap_mode)

    def moves(self, n: int = 1) -> list[int]:
        """Follow until ``n`` versions were applied: their versions."""
        return [r.info.version for r in self.records(n=n)]

    def idle(self, polls: int = 6) -> list[int]:
        """Follow for ``polls`` polls: the versions applied meanwhile."""
        return [r.info.version for r in self.records(stop=self.store.stop_after(polls))]

    def close(self) -> None:
        self.sub.close()
        self.store.close()


@pytest.fixture
def url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


def _holds(f: Follower, state: dict[str, torch.Tensor], what: str) -> None:
    assert f.target is not None
    assert_bits_equal(f.target, state, what)


def test_followers_go_back_to_the_target_bit_exactly_and_return_to_head_with_latest(url: str) -> None:
    run = Run(url)
    head = run.publish(8)  # anchors 1 and 5: the way back to 3 crosses an anchor
    followers = [Follower(url), Follower(url, swap_mode="rebind")]
    try:
        for f in followers:
            assert f.moves() == [head]
        with open_store(url) as store:
            t = write_target(store, head - 5, note="8 regressed")
        assert (t.version, t.hold, t.head_version) == (head - 5, False, head)
        for f in followers:
            assert f.moves() == [head - 5]
            _holds(f, run.states[head - 5], "after the target moved the fleet back")
            assert f.sub.version == head - 5
            assert f.idle() == []  # it stays there
        assert main(["target", url, "--latest"]) == 0
        for f in followers:
            assert f.moves() == [head]
            _holds(f, run.states[head], "after --latest")
        with open_store(url) as store:
            latest = read_target(store)
            assert latest.version is None and latest.generation > t.generation
    finally:
        for f in followers:
            f.close()
        run.close()


def test_partial_followers_go_back_and_return_bit_exactly(url: str) -> None:
    """A partial subscriber's moves back are its selection's chunks, the spare bits of edge
    chunks swapped with them: rows (chunks straddle the slice's edges) and names."""
    run = Run(url)
    head = run.publish(8)  # anchors 1 and 5: the way back to 3 crosses an anchor
    selections = [Selection(shard=(0, 1, 3)), Selection(names=("t1", "t3"))]
    followers = [Follower(url, select=sel) for sel in selections]
    try:
        for f in followers:
            assert f.moves() == [head]
        with open_store(url) as store:
            write_target(store, head - 5)
        for f, sel in zip(followers, selections):
            assert f.moves() == [head - 5]
            assert_bits_equal(f.target, expected_rows(run.states[head - 5], sel), "after the move back")
        assert main(["target", url, "--latest"]) == 0
        run.publish(1)
        for f, sel in zip(followers, selections):
            assert f.moves() == [head + 1]
            assert_bits_equal(f.target, expected_rows(run.states[head + 1], sel), "back at HEAD")
    finally:
        for f in followers:
            f.close()
        run.close()


def test_a_target_lasts_until_a_newer_version_and_a_hold_lasts_while_publishing_goes_on(url: str) -> None:
    run = Run(url)
    run.publish(4)
    f = Follower(url)
    try:
        assert f.moves() == [4]
        assert main(["target", url, "3"]) == 0
        assert f.moves() == [3]
        run.publish(1)  # the trainer commits 5: the newest version wins again
        assert f.moves() == [5]
        _holds(f, run.states[5], "after a newer version superseded the target")

        assert main(["target", url, "4", "--hold"]) == 0
        assert f.moves() == [4]
        run.publish(3)  # 6, 7, 8: held at 4 all along
        assert f.idle() == []
        _holds(f, run.states[4], "held while publishing continued")

        assert main(["target", url, "--hold"]) == 0  # hold where HEAD is now
        assert f.moves() == [8]
        run.publish(1)
        assert f.idle() == [] and f.sub.version == 8
        assert main(["target", url, "--latest"]) == 0
        assert f.moves() == [9]
        _holds(f, run.states[9], "after --latest")
    finally:
        f.close()
        run.close()


def test_a_collected_or_missing_version_is_refused_and_followers_keep_theirs(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    aged = AgedStore(open_store(str(tmp_path / "store"), create=True))
    run = Run(aged.url, store=aged, anchor_every=3)
    run.publish(10)  # anchors 1, 4, 7, 10
    with Subscriber(aged.url, store=aged) as sub:
        old_key = sub.info(2).manifest
    aged.age_everything(2 * DAY)
    assert collect(aged, keep_last=3, grace_s=DAY).floor_after == 7
    with pytest.raises(VersionCollectedError, match="collected"):
        write_target(aged, 2)
    with pytest.raises(VersionNotFoundError):
        write_target(aged, 11)
    assert read_target(aged) is None  # nothing written
    assert main(["target", aged.url, "2"]) == 1
    assert "collected" in capsys.readouterr().err
    assert not aged.exists(TARGET_KEY)

    f = Follower(aged.url, worker="w1")
    try:
        assert f.moves() == [10]
        # A target naming 2, written after GC collected it (racing it), by hand: write_target refuses.
        lineage = read_target_lineage(aged)
        doc = TargetDocument(generation=1, version=2, manifest=old_key, manifest_sha256=digest_from_key(old_key),
                             lineage=lineage, hold=True, head_version=10, target_id="a" * 32, writer="t", created="")
        aged.put(TARGET_KEY, dump(doc), mode="create")
        assert f.idle() == []
        _holds(f, run.states[10], "after a target of a collected version")
    finally:
        f.close()
        run.close()
    (beat,) = read_ledger(aged)
    assert beat.version == 10 and "VersionCollectedError" in (beat.progress.error or ""), beat
    aged.close()


def read_target_lineage(store: Any) -> str:
    from deltastore.format.history import History

    got = History(store).read_head()
    assert got is not None
    return got[0].lineage


def test_on_a_signed_store_only_a_signed_newer_target_moves_followers(url: str) -> None:
    key, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    run = Run(url, key=key)
    run.publish(5)
    f = Follower(url, keys=[key.public_key()], worker="w1")
    store = open_store(url)
    try:
        assert f.moves() == [5]
        with pytest.raises(SigningRequiredError):
            write_target(store, 2)
        assert read_target(store) is None
        # Unsigned (a party with bucket access and no key), signed by an untrusted key, altered
        # after signing: each is ignored, the version kept, the reason in the heartbeat.
        v2 = _manifest(url, 2)
        write_target(store, 2, allow_unsigned=True)
        assert f.idle() == [] and f.sub.version == 5
        assert "is not signed" in _last_error(store)
        write_target(store, 2, signing_key=stranger)
        assert f.idle() == [] and f.sub.version == 5
        assert "not trusted" in _last_error(store)
        signed = write_target(store, 3, signing_key=key)
        altered = signed.document.model_copy(update={"version": 2, "manifest": v2, "manifest_sha256": digest_from_key(v2)})
        store.put(TARGET_KEY, dump(altered), mode="overwrite")
        assert f.idle() == [] and f.sub.version == 5
        assert "invalid signature" in _last_error(store)
        _holds(f, run.states[5], "after unsigned and forged targets")

        good = write_target(store, 3, signing_key=key)
        assert f.moves() == [3]
        _holds(f, run.states[3], "after a signed target")
        write_target(store, None, signing_key=key)  # --latest, signed
        assert f.moves() == [5]
        # The older signed target written back (a replay): ignored, as is deleting the target.
        store.put(TARGET_KEY, dump(good.document), mode="overwrite")
        assert f.idle() == [] and f.sub.version == 5
        store.delete(TARGET_KEY)
        write_target(store, 4, signing_key=key)
        assert f.moves() == [4]
        store.delete(TARGET_KEY)
        assert f.idle() == [] and f.sub.version == 4
    finally:
        f.close()
        store.close()
        run.close()
    with open_store(url) as s:
        (beat,) = read_ledger(s)
    assert beat.version == 4 and beat.progress.stage == STAGE_SWAPPED and "gone" in (beat.progress.error or "")


def _manifest(url: str, version: int) -> str:
    with Subscriber(url) as sub:
        return sub.info(version).manifest


def _last_error(store: Any) -> str:
    """The last error the (only) worker's heartbeat reports."""
    (beat,) = read_ledger(store)
    return beat.progress.error or ""


def test_target_writes_are_compare_and_swap_and_settle_a_lost_response(url: str) -> None:
    run = Run(url)
    run.publish(3)
    run.close()

    class Racing(WrappedStore):
        """Another operator writes the target between our read and our write."""

        def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> Any:
            if key == TARGET_KEY:
                write_target(self.inner, 1, note="the other operator")
            return super().put(key, data, mode=mode)

    class LostResponse(WrappedStore):
        """The write lands but its response is lost: the client's retry gets a 412."""

        def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> Any:
            super().put(key, data, mode=mode)
            raise PreconditionFailedError("412 on the retry of a write that landed")

    with open_store(url) as store:
        with pytest.raises(ConflictError, match="changed by someone else"):
            write_target(Racing(store), 2)
        assert read_target(store).note == "the other operator"
        t = write_target(LostResponse(store), 2, hold=True)
        assert (t.version, t.hold) == (2, True)
        assert read_target(store).target_id == t.target_id
        signed = sign_document(t.document, Ed25519PrivateKey.generate())
        assert signed.signature is not None and signed.model_copy(update={"signature": None}) == t.document


def test_gc_keeps_the_version_of_a_target_in_force(tmp_path: Path) -> None:
    aged = AgedStore(open_store(str(tmp_path / "store"), create=True))
    run = Run(aged.url, store=aged, anchor_every=3)
    try:
        run.publish(10)  # anchors 1, 4, 7, 10
        write_target(aged, 5, hold=True)
        aged.age_everything(2 * DAY)
        assert collect(aged, keep_last=3, grace_s=DAY).floor_after == 4  # 5's anchor
        with Subscriber(aged.url, store=aged) as sub:
            assert_bits_equal(sub.pull(5), run.states[5])
        write_target(aged, None)  # --latest: nothing is held any more
        assert collect(aged, keep_last=3, grace_s=DAY).floor_after == 7
    finally:
        run.close()
        aged.close()


def test_a_format_follower_goes_back_to_a_target_from_before_a_pause_in_its_format(url: str) -> None:
    """A fleet target names a version of the store; a follower of a serving format serves that
    version in its format, one from before a pause in the format too (its stream's earlier
    chain), and keeps its own where the target's version has no stream of its format."""
    from deltastore.serving.formats import derive, serving_format

    fmt = serving_format("fp8-block128")
    formats = ["bf16", "fp8-block128"]
    rng = np.random.default_rng(1)
    state = {n: t.bfloat16() for n, t in small_state(0, n=2, rows=256).items()}
    states = {}
    layout = LayoutPolicy(chunk_bytes=16 * 1024)
    for v, declared in enumerate((formats, formats, ["bf16"], formats, formats), 1):
        with Publisher(url, formats=declared, layout_policy=layout) as pub:
            assert pub.publish(state).version == v
        states[v] = snapshot(state)
        state = sparse_edit(state, rng, fraction=0.05)
    polls = Polls(open_store(url))
    with Subscriber(url, store=polls, format="fp8-block128", threads=2) as sub:
        target = sub.allocate()

        def moves(polls_at_most: int = 50) -> list[int]:
            return [r.info.version for r in sub.follow(target, poll=FAST, stop=polls.stop_after(polls_at_most),
                                                         max_versions=1)]

        assert moves() == [5]
        with open_store(url) as store:
            write_target(store, 2, note="back before the pause")
        assert moves() == [2]
        assert_bits_equal(target, derive(states[2], fmt), "the target's version, in FP8")
        with open_store(url) as store:
            write_target(store, 3, note="a version without FP8")
        assert moves(6) == [] and sub.version == 2
        assert_bits_equal(target, derive(states[2], fmt), "kept while the target has no FP8")
    polls.close()
