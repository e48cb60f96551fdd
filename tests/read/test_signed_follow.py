"""A follower with trusted keys never goes backwards and never changes history unasked
(SPEC §3.1 "Threat model", design 004): a party who can write the bucket but holds no
signing key copies another run's validly signed objects into the store and points HEAD at
them, or points HEAD at an older signed version of the same run."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from deltastore import (
    CachePolicy,
    HeadRolledBackError,
    HistoryReplacedError,
    PollPolicy,
    Publisher,
    Subscriber,
    VersionNotFoundError,
)
from deltastore.format.keys import HEAD_KEY
from deltastore.read.cache import WorkerCache
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.stores import WrappedStore, read_head
from testkit.targets import StoreTarget
from testkit.tensors import assert_bits_equal, small_state, snapshot, sparse_edit

#: Small chunks, so that a sparse edit changes some chunks of a tensor and not others.
CHUNK_BYTES = 128
#: A follow loop in a test never waits longer than this for what it expects.
DEADLINE_S = 60.0


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def _file(tmp_path: Path, name: str) -> StoreTarget:
    return StoreTarget("file", str(tmp_path / name))


def _run(t: StoreTarget, n: int, seed: int, key: Ed25519PrivateKey | None) -> dict[int, dict[str, torch.Tensor]]:
    """Publish ``n`` versions of one run (one lineage), signed by ``key``; version → its bits."""
    rng = np.random.default_rng(seed)
    state = small_state(seed, n=4, rows=32)
    out = {}
    with Publisher(t.url, storage_options=t.storage_options, signing_key=key, writer_policy=WriterPolicy(threads=2),
                   layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES)) as pub:
        for _ in range(n):
            out[pub.publish(state).version] = snapshot(state)
            state = sparse_edit(state, rng, fraction=0.05)
    return out


def _subscriber(t: StoreTarget, key: Ed25519PrivateKey | None, store: Any = None) -> Subscriber:
    keys = None if key is None else [key.public_key()]
    return Subscriber(t.url, storage_options=t.storage_options, threads=2, trusted_keys=keys, store=store)


def _copy_objects(src: StoreTarget, dst: StoreTarget) -> None:
    """Copy every manifest, layout and pack of ``src`` into ``dst`` (all but HEAD and the ledger)."""
    with open_store(src.url, storage_options=src.storage_options) as s, open_store(dst.url, storage_options=dst.storage_options) as d:
        for meta in list(s.list("")):
            if meta.key != HEAD_KEY and not meta.key.startswith(("workers/", "_deltastore/")):
                d.put(meta.key, s.get(meta.key), mode="overwrite")


def _point_head(t: StoreTarget, at: StoreTarget, version: int, *, lineage: str | None = None) -> None:
    """Write ``t``'s HEAD to name ``version`` of ``at``'s history (its objects copied into ``t``):
    what anyone with write access can do without a key. ``lineage``: HEAD's field (default the
    lineage of ``at``'s HEAD: a copy of its HEAD)."""
    with _subscriber(at, None) as sub:
        mkey = sub.info(version).manifest
    with open_store(at.url, storage_options=at.storage_options) as s:
        head = read_head(s)
        digest = hashlib.sha256(s.get(mkey)).hexdigest()
    head.update(version=version, manifest=mkey, manifest_sha256=digest, index=None)
    if lineage is not None:
        head["lineage"] = lineage
    with open_store(t.url, storage_options=t.storage_options) as d:
        d.put(HEAD_KEY, json.dumps(head).encode(), mode="overwrite")


def _lineage(t: StoreTarget) -> str:
    with open_store(t.url, storage_options=t.storage_options) as s:
        return read_head(s)["lineage"]


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _first(sub: Subscriber, target: dict[str, torch.Tensor], **kw: Any) -> Any:
    """The first record of a follow (the caller expects one, or an error)."""
    return next(sub.follow(target, poll=PollPolicy(0.01), heartbeat=None, max_versions=1, **kw))


# --- another run's signed objects under HEAD ---------------------------------------------------


def _refuses_another_run(a: StoreTarget, b: StoreTarget, key: Ed25519PrivateKey, held: int, ahead: int) -> None:
    """A follower at version ``held`` of run A; HEAD then names run B's version 2 and ``ahead``."""
    run_a = _run(a, held, seed=1, key=key)
    _run(b, ahead, seed=2, key=key)
    _copy_objects(b, a)
    with _subscriber(a, key) as sub:
        target = sub.allocate()
        assert _first(sub, target).info.version == held
        # B's version 2 (a rollback by number) and a later one (ahead: a mix of runs by
        # number), HEAD's own lineage field copied from B or left as A's: the signed manifest decides.
        for version, lineage in ((2, None), (ahead, None), (ahead, _lineage(a))):
            _point_head(a, b, version, lineage=lineage)
            with pytest.raises(HistoryReplacedError, match="lineage") as exc:
                _first(sub, target)
            assert "on_history_replaced" in str(exc.value)
            assert sub.version == held
            assert_bits_equal(target, run_a[held], f"after HEAD named version {version} of another run")


def test_a_signed_follower_refuses_another_runs_history_signed_by_the_same_key(tmp_path: Path, key) -> None:
    _refuses_another_run(_file(tmp_path, "a"), _file(tmp_path, "b"), key, held=6, ahead=8)


@pytest.mark.integration
def test_a_signed_follower_refuses_another_runs_history_on_seaweedfs(seaweedfs_s3_url: StoreTarget, key) -> None:
    t = seaweedfs_s3_url
    _refuses_another_run(t, StoreTarget(t.kind, f"{t.url}-other", t.storage_options), key, held=3, ahead=4)


def test_a_signed_follower_loads_another_history_only_when_told(tmp_path: Path, key) -> None:
    a, b = _file(tmp_path, "a"), _file(tmp_path, "b")
    _run(a, 3, seed=1, key=key)
    run_b = _run(b, 4, seed=2, key=key)
    _copy_objects(b, a)
    with _subscriber(a, key) as sub:
        target = sub.allocate()
        assert _first(sub, target).info.version == 3
        _point_head(a, b, 4)
        rec = _first(sub, target, on_history_replaced="reload")
    assert rec.full_load and rec.info.version == 4
    assert_bits_equal(target, run_b[4])


def test_follow_without_keys_reloads_a_replaced_history_unless_told_to_raise(tmp_path: Path) -> None:
    """Without trusted keys anyone who can write HEAD is trusted: a new run under the URL is
    loaded whole (the default), or raised when asked."""
    a, b = _file(tmp_path, "a"), _file(tmp_path, "b")
    run_a = _run(a, 3, seed=1, key=None)
    run_b = _run(b, 4, seed=2, key=None)
    _copy_objects(b, a)
    with _subscriber(a, None) as sub:
        target = sub.allocate()
        assert _first(sub, target).info.version == 3
        _point_head(a, b, 4)
        with pytest.raises(HistoryReplacedError):
            _first(sub, target, on_history_replaced="raise")
        assert_bits_equal(target, run_a[3])
        assert _first(sub, target).full_load
    assert_bits_equal(target, run_b[4])


def test_a_restarted_signed_follower_refuses_another_history_over_its_cache(tmp_path: Path, key) -> None:
    a, b = _file(tmp_path, "a"), _file(tmp_path, "b")
    cache = tmp_path / "cache"
    _run(a, 3, seed=1, key=key)
    _run(b, 4, seed=2, key=key)
    with _subscriber(a, key) as sub:
        target = sub.allocate()
        assert _first(sub, target, cache=CachePolicy(cache)).info.version == 3
    assert WorkerCache(cache).load().version == 3
    _copy_objects(b, a)
    _point_head(a, b, 4)
    fresh = {n: torch.zeros_like(t) for n, t in target.items()}
    with _subscriber(a, key) as sub:
        with pytest.raises(HistoryReplacedError, match="lineage"):
            _first(sub, fresh, cache=CachePolicy(cache))
        assert sub.version is None
    assert all(not t.any() for t in fresh.values()), "nothing was loaded"
    assert WorkerCache(cache).load().version == 3, "the cache of the held history is kept"


# --- an older signed version of the same run under HEAD --------------------------------------------


class CountingPolls(WrappedStore):
    def polls(self) -> int:
        return sum(1 for verb, k in list(self.calls) if verb == "get_if_changed" and k == HEAD_KEY)


def test_a_signed_follower_keeps_its_version_when_head_is_rolled_back(tmp_path: Path, key, caplog) -> None:
    a = _file(tmp_path, "a")
    run_a = _run(a, 6, seed=1, key=key)
    with open_store(a.url) as s:
        real_head = s.get(HEAD_KEY)
    store = CountingPolls(open_store(a.url))
    with _subscriber(a, key, store=store) as sub:
        target = sub.allocate()
        assert _first(sub, target).info.version == 6
        _point_head(a, a, 4)
        with pytest.raises(HeadRolledBackError, match="older") as exc:
            sub.pull_into(target)
        assert isinstance(exc.value, VersionNotFoundError)
        got: list[int] = []
        stop = threading.Event()

        def run() -> None:
            for rec in sub.follow(target, poll=PollPolicy(0.01, max_interval=0.02), stop=stop, heartbeat=None):
                got.append(rec.info.version)

        with caplog.at_level(logging.INFO, logger="deltastore.read"):
            th = threading.Thread(target=run)
            th.start()
            try:
                polls = store.polls()
                _wait(lambda: store.polls() >= polls + 20, "20 polls of the rolled-back HEAD")
                assert not got and sub.version == 6
                assert_bits_equal(target, run_a[6], "while HEAD names version 4")
                warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "older" in r.getMessage()]
                assert len(warned) == 1, [r.getMessage() for r in caplog.records]  # once per HEAD, not per poll
                assert "version 4" in warned[0].getMessage() and "version 6" in warned[0].getMessage()
                # HEAD put back and the run goes on: the follower takes the next version.
                with open_store(a.url) as s:
                    s.put(HEAD_KEY, real_head, mode="overwrite")
                state = sparse_edit(run_a[6], np.random.default_rng(9), fraction=0.05)
                with Publisher(a.url, signing_key=key, writer_policy=WriterPolicy(threads=2),
                               layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES)) as pub:
                    assert pub.publish(state).version == 7
                _wait(lambda: got == [7], "version 7")
            finally:
                stop.set()
                th.join()
    assert_bits_equal(target, state)


def test_a_restarted_signed_follower_keeps_its_cached_version_when_head_is_rolled_back(tmp_path: Path, key) -> None:
    a = _file(tmp_path, "a")
    cache = tmp_path / "cache"
    run_a = _run(a, 4, seed=1, key=key)
    with _subscriber(a, key) as sub:
        target = sub.allocate()
        assert _first(sub, target, cache=CachePolicy(cache)).info.version == 4
    _point_head(a, a, 2)
    fresh = {n: torch.zeros_like(t) for n, t in target.items()}
    with _subscriber(a, key) as sub:
        rec = _first(sub, fresh, cache=CachePolicy(cache))
        assert rec.info.version == 4 and rec.bytes_fetched == 0
        assert_bits_equal(fresh, run_a[4])
        with pytest.raises(HeadRolledBackError):
            sub.pull_into(fresh)
    assert_bits_equal(fresh, run_a[4])


def test_follow_options_are_checked_before_anything_is_read() -> None:
    with Subscriber(f"memory://{uuid.uuid4().hex}") as sub, pytest.raises(ValueError, match="'raise' or 'reload'"):
        next(sub.follow({}, on_history_replaced="ignore"))


def test_cli_pull_follow_with_a_trusted_key_stops_on_another_history_unless_told(tmp_path: Path, key, capsys) -> None:
    from cryptography.hazmat.primitives import serialization
    from safetensors.torch import load_file

    from deltastore.cli import main

    a, b = _file(tmp_path, "a"), _file(tmp_path, "b")
    _run(a, 3, seed=1, key=key)
    run_b = _run(b, 4, seed=2, key=key)
    pub = tmp_path / "k.pub"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    out, cache = str(tmp_path / "out.safetensors"), str(tmp_path / "cache")
    follow = ["pull", a.url, out, "--follow", "--max-versions", "1", "--interval", "0.01", "--cache", cache,
              "--trusted-key", str(pub)]
    assert main(follow) == 0
    _copy_objects(b, a)
    _point_head(a, b, 4)
    capsys.readouterr()
    assert main(follow) == 1  # restarted over its cache of run A
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HistoryReplacedError" in err[0] and "--on-history-replaced reload" in err[0], err
    assert main([*follow, "--on-history-replaced", "reload"]) == 0
    assert_bits_equal(load_file(out), run_b[4])
