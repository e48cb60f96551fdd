"""Mirrors (SPEC §16): a copy that is a valid store of the same lineage at every moment, and
workers that read through it while the origin vouches for what they apply."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from deltastore import Subscriber
from deltastore.cli import main
from deltastore.errors import IntegrityError, MirrorLineageError, SignatureError, StorageError
from deltastore.fleet.deadlines import Deadlines
from deltastore.fleet.mirror import Mirror, mirror
from deltastore.fleet.sources import Sources
from deltastore.format.keys import HEAD_KEY, stream_prefix
from deltastore.lifecycle.gc import collect
from deltastore.serving.formats import derive
from deltastore.storage import open_store
from deltastore.storage.base import GetResult, PutMode
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from testkit.stores import HeadPutHook, WrappedStore, check_invariants, publish_history, publisher
from testkit.tensors import SMALL_CHUNK_BYTES, assert_bits_equal, snapshot, sparse_edit


def _head(url: str) -> bytes:
    return (Path(url) / HEAD_KEY).read_bytes()


def _publish_more(url: str, states: list, n: int, **kw) -> list:
    """``n`` more versions on top of ``states[-1]`` (the store's head)."""
    rng = np.random.default_rng(len(states))
    with publisher(url, layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES), **kw) as pub:
        for _ in range(n):
            states.append(snapshot(sparse_edit(states[-1], rng, 0.02)))
            pub.publish(states[-1])
    return states


def _pull(url: str, **kw) -> tuple[int, dict]:
    with Subscriber(url, threads=2, **kw) as sub:
        state = sub.pull()
        return sub.version, state


def _snapshot_files(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


@pytest.fixture
def stores(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "origin"), str(tmp_path / "mirror")


def test_a_mirror_holds_every_version_and_pulls_bit_exact(stores: tuple[str, str]) -> None:
    src, dst = stores
    states = publish_history(src, n=3)
    report = mirror(src, dst)
    assert (report.from_version, report.to_version, report.versions, report.head_written) == (0, 3, (1, 2, 3), True)
    assert _head(dst) == _head(src)  # same lineage, epoch, commit id: the same bytes
    with open_store(dst) as s:
        assert check_invariants(s) == [1, 2, 3]
    version, got = _pull(dst)
    assert version == 3
    assert_bits_equal(got, states[-1])

    states = _publish_more(src, states, 2)
    again = mirror(src, dst)
    assert (again.from_version, again.to_version, again.versions) == (3, 5, (4, 5))
    assert mirror(src, dst).head_written is False  # nothing left to do
    origin = WrappedStore(open_store(src))
    with Subscriber(src, threads=2, store=origin, mirrors=[dst]) as sub:
        assert_bits_equal(sub.pull(), states[-1])
        origin_reads = {k for verb, k in origin.calls if verb.startswith("get")}
    assert origin_reads == {HEAD_KEY}  # everything but HEAD came from the mirror


@pytest.mark.parametrize("fail_at", [1, 3, 5])
def test_a_mirror_killed_mid_copy_leaves_the_previous_head_and_resumes(stores: tuple[str, str], fail_at: int) -> None:
    src, dst = stores
    states = publish_history(src, n=2)
    mirror(src, dst)
    states = _publish_more(src, states, 2)
    before = _head(dst)

    class Killed(WrappedStore):
        puts = 0

        def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite"):
            Killed.puts += 1
            if Killed.puts >= fail_at:
                raise StorageError(f"connection reset writing {key!r}")
            return super().put(key, data, mode=mode)

    with pytest.raises(StorageError):
        Mirror(open_store(src), Killed(open_store(dst))).sync()
    assert Killed.puts >= fail_at and _head(dst) == before
    with open_store(dst) as s:
        assert check_invariants(s) == [1, 2]
    version, got = _pull(dst)
    assert version == 2
    assert_bits_equal(got, states[1])

    resumed = mirror(src, dst)
    # present: the layout versions 3 and 4 share with version 1, and what was copied before the kill
    assert resumed.to_version == 4 and resumed.objects_present == fail_at
    assert _head(dst) == _head(src)
    assert_bits_equal(_pull(dst)[1], states[-1])


def test_a_destination_of_another_history_is_refused_and_left_untouched(stores: tuple[str, str]) -> None:
    src, dst = stores
    publish_history(src, n=2)
    publish_history(dst, n=2)  # another run: another lineage
    files = _snapshot_files(dst)
    with pytest.raises(MirrorLineageError, match="lineage"):
        mirror(src, dst)
    assert _snapshot_files(dst) == files


def test_a_mirror_that_forked_is_refused(stores: tuple[str, str]) -> None:
    """Same lineage, but someone published to the mirror: its version 3 is not the origin's."""
    src, dst = stores
    states = publish_history(src, n=2)
    mirror(src, dst)
    _publish_more(src, list(states), 1)
    _publish_more(dst, list(states), 1)
    files = _snapshot_files(dst)
    with pytest.raises(MirrorLineageError, match="forked"):
        mirror(src, dst)
    assert _snapshot_files(dst) == files


@pytest.mark.parametrize("first", ["new", "old"])
def test_two_mirrors_racing_on_one_destination_never_fork_it(stores: tuple[str, str], first: str) -> None:
    """Both plan against the same DST HEAD; one of them saw SRC before its last publish. Either
    order of their HEAD writes leaves DST at SRC's head, never moved back."""
    src, dst = stores
    states = publish_history(src, n=2)
    mirror(src, dst)
    states = _publish_more(src, states, 1)
    old_head = open_store(src).get_with_meta(HEAD_KEY)
    states = _publish_more(src, states, 1)

    class SawOldHead(WrappedStore):
        def get_with_meta(self, key: str) -> GetResult:
            return old_head if key == HEAD_KEY else super().get_with_meta(key)

    ready = {n: threading.Event() for n in ("new", "old")}
    go = {n: threading.Event() for n in ("new", "old")}

    def hook(name: str):
        def held(key, data, mode, real_put):
            if not ready[name].is_set():
                ready[name].set()
                assert go[name].wait(10)
            return real_put()
        return held

    reports: dict[str, object] = {}
    mirrors = {"new": Mirror(open_store(src), HeadPutHook(open_store(dst), hook("new"))),
               "old": Mirror(SawOldHead(open_store(src)), HeadPutHook(open_store(dst), hook("old")))}
    threads = {n: threading.Thread(target=lambda n=n: reports.__setitem__(n, mirrors[n].sync())) for n in mirrors}
    for t in threads.values():
        t.start()
    assert ready["new"].wait(10) and ready["old"].wait(10)  # both planned on DST at version 2
    second = "old" if first == "new" else "new"
    go[first].set()
    threads[first].join(10)
    go[second].set()
    threads[second].join(10)
    assert set(reports) == {"new", "old"}
    assert reports[first].head_written and reports["new"].to_version == 4  # type: ignore[attr-defined]
    assert reports["old"].source_version == 3  # type: ignore[attr-defined]
    assert _head(dst) == _head(src)
    with open_store(dst) as s:
        assert check_invariants(s) == [1, 2, 3, 4]
    assert_bits_equal(_pull(dst)[1], states[-1])


def test_a_worker_skips_a_mirror_serving_a_corrupt_object(stores: tuple[str, str], caplog) -> None:
    src, dst = stores
    states = publish_history(src, n=3)
    mirror(src, dst)
    pack = sorted(Path(dst).glob("objects/*/*.pack"))[-1]
    pack.chmod(0o644)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x01
    pack.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="deltastore.fleet.sources"):
        version, got = _pull(src, mirrors=[dst])
    assert version == 3
    assert_bits_equal(got, states[-1])
    named = [r.getMessage() for r in caplog.records if str(pack.relative_to(dst)) in r.getMessage()]
    assert named and Path(dst).as_uri() in named[0]


@pytest.mark.parametrize("fmt", [None, "fp8-block128"])
def test_a_stalled_mirror_is_passed_over_within_its_deadline(stores: tuple[str, str], fmt: str | None, caplog) -> None:
    """A mirror that never answers a pack GET is a failed source once the fetch deadline
    passes (a serving stream's packs too, read under ``streams/<format>/``, not given the far
    longer deadline of a poll): the origin serves, the pull is bit-exact."""
    src, dst = stores
    states = publish_history(src, n=2, **({} if fmt is None else {"formats": ["bf16", fmt]}))
    want = states[-1] if fmt is None else derive(states[-1], fmt)
    mirror(src, dst)
    release = threading.Event()
    stalled_packs: list[str] = []

    class Stalled(WrappedStore):
        def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
            if key.endswith(".pack"):
                stalled_packs.append(key)
                release.wait(30)
            return super().get(key, byte_range=byte_range)

    stalled = Stalled(open_store(dst))
    try:
        with caplog.at_level(logging.WARNING, logger="deltastore.fleet.sources"):
            with Subscriber(src, threads=2, mirrors=[stalled], format=fmt,
                            deadlines=Deadlines(fetch=0.3, min_bytes_per_s=1e12)) as sub:
                t0 = time.monotonic()
                got = sub.pull()
                took = time.monotonic() - t0
        assert_bits_equal(got, want)
        assert stalled_packs and all(k.startswith(stream_prefix(fmt) if fmt else "objects/") for k in stalled_packs)
        assert took < 5, took  # one deadline per stalled pack, not the stall
        assert any("DeadlineExceededError" in r.getMessage() or "deadline" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        stalled.close()


def test_a_worker_does_not_follow_a_mirror_of_another_history(stores: tuple[str, str], caplog) -> None:
    src, dst = stores
    states = publish_history(src, n=2)
    publish_history(dst, n=3)  # a "mirror" that is another run: its HEAD is ignored, its objects never match
    with caplog.at_level(logging.WARNING, logger="deltastore.fleet.sources"):
        version, got = _pull(src, mirrors=[dst])
    assert version == 2
    assert_bits_equal(got, states[-1])
    assert any("lineage" in r.getMessage() and Path(dst).as_uri() in r.getMessage() for r in caplog.records)


def test_a_worker_does_not_follow_a_forked_mirror_head(stores: tuple[str, str]) -> None:
    """The mirror's HEAD names a version 3 of the origin's lineage that the origin never had
    (a self-consistent manifest, digests and all): HEAD is not signed, so only the origin's
    chain can vouch for it, and it does not."""
    src, dst = stores
    states = publish_history(src, n=2)
    mirror(src, dst)
    origin_states = _publish_more(src, list(states), 2)
    _publish_more(dst, list(states), 1)
    version, got = _pull(src, mirrors=[dst])
    assert version == 4
    assert_bits_equal(got, origin_states[-1])


def test_a_mirror_behind_the_origin_serves_its_older_head(stores: tuple[str, str]) -> None:
    src, dst = stores
    states = publish_history(src, n=2)
    mirror(src, dst)
    states = _publish_more(src, states, 2)
    origin = WrappedStore(open_store(src))
    with Subscriber(src, threads=2, store=origin, mirrors=[dst]) as sub:
        assert_bits_equal(sub.pull(), states[1])  # the mirror's head, vouched by the origin's chain
        assert sub.version == 2
        target = sub.pull()
        mirror(src, dst)
        assert sub.pull_into(target).version == 4
        assert_bits_equal(target, states[-1])
        assert not any(k.endswith(".pack") for k, _ in origin.reads)  # the bulk came from the mirror


def test_a_signed_store_stays_signed_on_its_mirror(stores: tuple[str, str], tmp_path: Path) -> None:
    from deltastore.format.signing import generate_key_files

    src, dst = stores
    priv, pub = generate_key_files(tmp_path / "k.pem")
    states = publish_history(src, n=3, signing_key=priv)
    report = mirror(src, dst, trusted_keys=[pub])
    assert report.to_version == 3 and _head(dst) == _head(src)
    version, got = _pull(dst, trusted_keys=[pub])
    assert version == 3
    assert_bits_equal(got, states[-1])
    assert_bits_equal(_pull(src, trusted_keys=[pub], mirrors=[dst])[1], states[-1])

    unsigned = str(tmp_path / "unsigned")
    publish_history(unsigned, n=1)
    with pytest.raises(SignatureError):
        mirror(unsigned, str(tmp_path / "refused"), trusted_keys=[pub])
    assert not (tmp_path / "refused" / HEAD_KEY).exists()


def test_a_damaged_source_object_is_not_copied(stores: tuple[str, str]) -> None:
    src, dst = stores
    publish_history(src, n=2)
    pack = sorted(Path(src).glob("objects/*/*.pack"))[0]
    pack.chmod(0o644)
    pack.write_bytes(pack.read_bytes()[:-1] + b"\x00")
    with pytest.raises(IntegrityError, match="does not match"):
        mirror(src, dst)
    assert not (Path(dst) / HEAD_KEY).exists()
    assert not (Path(dst) / pack.relative_to(src)).exists()


def test_gc_on_a_mirror_keeps_its_own_retention(stores: tuple[str, str]) -> None:
    src, dst = stores
    states = publish_history(src, n=4, anchor_policy=AnchorPolicy(every=2))
    mirror(src, dst)
    report = collect(dst, keep_last=1, grace_s=0, unsafe_grace_ok=True)
    assert report.floor_after > 1 and report.deleted_objects > 0
    own_floor = report.floor_after
    states = _publish_more(src, states, 1, anchor_policy=AnchorPolicy(every=2))
    again = mirror(src, dst)
    assert again.own_index and again.to_version == 5
    mirrored, origin = json.loads(_head(dst)), json.loads(_head(src))
    assert mirrored.pop("index") != origin.pop("index") and mirrored == origin  # only the index differs
    with open_store(dst) as s:
        from deltastore.format.history import History

        h = History(s)
        assert h.index(h.read_head()[0]).floor == own_floor
    assert_bits_equal(_pull(dst)[1], states[-1])


def test_follow_keeps_the_mirror_current(stores: tuple[str, str]) -> None:
    src, dst = stores
    states = publish_history(src, n=1)
    stop, synced = threading.Event(), threading.Event()

    def on_sync(report) -> None:
        if report.to_version == 3:
            synced.set()

    t = threading.Thread(target=mirror, args=(src, dst), kwargs=dict(follow=True, interval=0.02, stop=stop, on_sync=on_sync))
    t.start()
    try:
        states = _publish_more(src, states, 2)
        assert synced.wait(20)
    finally:
        stop.set()
        t.join(10)
    assert _head(dst) == _head(src)
    assert_bits_equal(_pull(dst)[1], states[-1])


def test_cli_mirror(stores: tuple[str, str], capsys) -> None:
    src, dst = stores
    states = publish_history(src, n=2)
    assert main(["mirror", src, dst, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["to_version"] == 2
    out = Path(dst).parent / "pulled.safetensors"
    assert main(["pull", src, str(out), "--mirror", dst, "-q"]) == 0  # through the mirror
    from safetensors.torch import load_file

    assert_bits_equal(load_file(str(out)), states[-1])
    publish_history(str(Path(dst).parent / "other"), n=1)
    assert main(["mirror", str(Path(dst).parent / "other"), dst]) == 1
    assert "lineage" in capsys.readouterr().err


@pytest.mark.integration
def test_mirror_into_s3_and_read_through_it(stores: tuple[str, str], moto_s3_url) -> None:
    src, _ = stores
    states = publish_history(src, n=2)
    with moto_s3_url.open() as s3:
        assert mirror(src, s3).to_version == 2
        with Sources.open(open_store(src), [s3], owns_origin=True) as sources:
            with Subscriber(src, threads=2, store=sources) as sub:
                assert_bits_equal(sub.pull(), states[-1])
            assert sources.stats()[0].bytes > 0 and sources.stats()[-1].objects == 0


def test_a_slow_mirror_never_lowers_the_floor_another_mirror_wrote(stores: tuple[str, str]) -> None:
    """A sync that read SRC's HEAD before SRC's GC raised the floor (same version, older index)
    finds DST already holding the later HEAD and writes nothing."""
    src, dst = stores
    publish_history(src, n=4, anchor_policy=AnchorPolicy(every=2))
    old_head = open_store(src).get_with_meta(HEAD_KEY)
    collect(src, keep_last=1, grace_s=0, unsafe_grace_ok=True)
    assert mirror(src, dst).to_version == 4

    class SawOldHead(WrappedStore):
        def get_with_meta(self, key: str) -> GetResult:
            return old_head if key == HEAD_KEY else super().get_with_meta(key)

    assert Mirror(SawOldHead(open_store(src)), open_store(dst)).sync().head_written is False
    assert _head(dst) == _head(src)


def test_serving_streams_are_mirrored(stores: tuple[str, str]) -> None:
    import torch

    from deltastore import Publisher

    src, dst = stores
    g = torch.Generator().manual_seed(0)
    state = {"model.layers.0.mlp.down_proj.weight": (torch.randn(96, 256, generator=g) * 0.02).to(torch.bfloat16),
             "model.norm.weight": torch.ones(96, dtype=torch.bfloat16)}
    with Publisher(src, formats=["fp8-block128"], layout_policy=LayoutPolicy(chunk_bytes=16 * 1024)) as pub:
        for i in range(2):
            state = {n: (t.float() * (1 + 0.01 * (i + 1))).to(t.dtype) for n, t in state.items()}
            pub.publish(state)
    mirror(src, dst)
    assert any(Path(dst).glob("streams/fp8-block128/objects/*/*.pack"))
    expected = _pull(src, format="fp8-block128")[1]
    assert_bits_equal(_pull(dst, format="fp8-block128")[1], expected)
    origin = WrappedStore(open_store(src))
    with Subscriber(src, threads=2, store=origin, mirrors=[dst], format="fp8-block128") as sub:
        assert_bits_equal(sub.pull(), expected)
    assert {k for verb, k in origin.calls if verb.startswith("get")} == {HEAD_KEY}


def test_a_mirror_that_stopped_is_left_behind(stores: tuple[str, str], caplog, monkeypatch) -> None:
    from types import SimpleNamespace

    from deltastore.fleet import sources

    src, dst = stores
    states = publish_history(src, n=2)
    mirror(src, dst)
    states = _publish_more(src, states, 2)
    clock = [1000.0]
    monkeypatch.setattr(sources, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    with Subscriber(src, threads=2, mirrors=[dst]) as sub:
        target = sub.pull()
        assert sub.version == 2  # behind, but within its lag: its head
        clock[0] += sources.MAX_MIRROR_LAG_S + 1
        with caplog.at_level(logging.WARNING, logger="deltastore.fleet.sources"):
            assert sub.pull_into(target).version == 4  # the origin's head, read from the origin
    assert_bits_equal(target, states[-1])
    assert any("lacked" in r.getMessage() and Path(dst).as_uri() in r.getMessage() for r in caplog.records)
