"""The commit protocol (SPEC §5): racing publishers, fencing, lost responses, crashes."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from deltastore import (
    AlreadyExistsError,
    ConflictError,
    FencedError,
    HistoryReplacedError,
    PreconditionFailedError,
    Publisher,
    StorageError,
    Subscriber,
    UnsupportedSchemaError,
)
from deltastore.format.keys import HEAD_KEY
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, WriterPolicy
from testkit.stores import HeadPutHook, WrappedStore, check_invariants, keys, pull_fresh
from testkit.tensors import assert_bits_equal, small_state, snapshot, sparse_edit

#: Racing rounds: enough that both publishers win some, few enough for S3 servers in tests.
ROUNDS = {"memory": 16, "file": 12, "moto": 6, "seaweedfs": 6, "gcs": 6, "azure": 6}


@pytest.fixture(params=["memory", "file"])
def local_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh store on the in-process backends (for fault injection that is backend-neutral)."""
    if request.param == "file":
        return str(tmp_path / "store")
    return f"memory://protocol-{uuid.uuid4().hex}"


def _pub(target, **kw) -> Publisher:
    return Publisher(target.url, storage_options=target.storage_options, writer_policy=WriterPolicy(threads=2), **kw)


def _sub(target) -> Subscriber:
    return Subscriber(target.url, storage_options=target.storage_options, threads=2)


# --- racing publishers ----------------------------------------------------------------------


def test_racing_publishers_never_fork_history(cas_store_target) -> None:
    rounds = ROUNDS[cas_store_target.kind]
    # Both publishers are held at the HEAD write until both are there, so every round is a
    # real race of two conditional writes on the same base (the loser of a round has more to do
    # in the next one, reading the winner's version back, and would otherwise always lose).
    at_head = threading.Barrier(2)
    racing = [True]

    def meet_at_head(key, data, mode, real_put):
        if racing[0]:
            at_head.wait(timeout=60)
        return real_put()

    stores = [HeadPutHook(cas_store_target.open(), meet_at_head) for _ in range(2)]
    # skip_unchanged=False: every round must race to HEAD, even when an edit happens to change nothing
    pubs = [Publisher(cas_store_target.url, store=st,
                      writer_policy=WriterPolicy(takeover=False, threads=2, skip_unchanged=False),
                      anchor_policy=AnchorPolicy(every=1000))
            for st in stores]
    rng = np.random.default_rng(0)
    base = small_state(0, n=3, rows=16)
    barrier = threading.Barrier(2)
    winners: list[tuple[int, dict]] = []  # per round: (winner index, state it published)
    lost_last = [False, False]
    wins = [0, 0]

    def attempt(i: int, state: dict):
        barrier.wait(timeout=60)
        try:
            return pubs[i].publish(state, step=i)
        except ConflictError as e:
            return e

    with ThreadPoolExecutor(2) as pool:
        for r in range(rounds):
            states = [sparse_edit(base, rng, 0.05) for _ in range(2)]
            results = list(pool.map(attempt, [0, 1], states))
            ok = [i for i in (0, 1) if not isinstance(results[i], Exception)]
            assert len(ok) == 1, f"round {r}: {results}"
            w, loser = ok[0], 1 - ok[0]
            info, err = results[w], results[loser]
            assert info.version == r + 1
            # The loser learns who won and at which version; it is not fenced.
            assert type(err) is ConflictError
            assert err.head_version == r + 1 and err.head_writer == pubs[w].writer_id
            assert str(r + 1) in str(err)
            # A publisher whose last attempt lost reads the winner's version back (SPEC §5,
            # resume) and publishes a delta against it; only the very first version is an anchor.
            assert info.kind == ("anchor" if r == 0 else "delta"), (r, lost_last)
            assert info.parent == (r or None)
            lost_last[w], lost_last[loser] = False, True
            wins[w] += 1
            winners.append((w, states[w]))
            base = states[w]
    assert min(wins) > 0 or rounds < 8, f"no real race: wins {wins}"
    racing[0] = False
    # The loser's next publish, unraced, succeeds on top of the winner's version.
    last_loser = lost_last.index(True)
    state = sparse_edit(base, rng)
    info = pubs[last_loser].publish(state)
    assert (info.version, info.kind, info.parent) == (rounds + 1, "delta", rounds)
    assert 0 < info.elements_changed < sum(t.numel() for t in state.values()) / 2
    winners.append((last_loser, state))
    for p in pubs:
        p.close()
    for st in stores:
        st.close()

    with _sub(cas_store_target) as sub:
        log = sub.log()
        assert [i.version for i in log] == list(range(1, rounds + 2))
        assert [i.parent for i in log] == [None] + list(range(1, rounds + 1))
        assert [i.writer for i in log] == [pubs[w].writer_id for w, _ in winners]
        # The content of each version is what its winner published.
        target = sub.pull(1)
        assert_bits_equal(target, winners[0][1], "version 1")
        for v in range(2, rounds + 2):
            sub.pull_into(target, version=v)
            assert_bits_equal(target, winners[v - 1][1], f"version {v}")
    with cas_store_target.open() as store:
        check_invariants(store)


def test_takeover_fences_the_older_publisher(cas_store_target) -> None:
    a = _pub(cas_store_target)
    s1, s2, s3 = small_state(1), small_state(2), small_state(3)
    a.publish(s1)
    b = _pub(cas_store_target)  # takeover=True by default
    assert b.epoch > a.epoch
    with cas_store_target.open() as store:
        head_after_claim = store.get(HEAD_KEY)
    with pytest.raises(FencedError) as exc:
        a.publish(s2)
    assert isinstance(exc.value, ConflictError)
    assert exc.value.head_version == 1 and exc.value.head_writer == b.writer_id
    with cas_store_target.open() as store:
        assert store.get(HEAD_KEY) == head_after_claim, "a fenced publish must not touch HEAD"
    # Fenced for good, even if it would now be based on the right HEAD; and it stops writing
    # (a zombie trainer must not keep uploading packs nobody will read).
    with cas_store_target.open() as store:
        before = keys(store)
    with pytest.raises(FencedError):
        a.publish(s2, anchor=True)
    with cas_store_target.open() as store:
        assert keys(store) == before
    assert b.publish(s3).version == 2
    assert b.publish(small_state(4)).kind == "delta"
    with pytest.raises(FencedError):
        a.publish(s3)
    assert_bits_equal(pull_fresh(cas_store_target.url, storage_options=cas_store_target.storage_options), small_state(4))
    a.close()
    b.close()


def test_takeover_fences_a_publisher_that_never_published(local_url: str) -> None:
    with Publisher(local_url) as a:
        a.publish(small_state(0))
    old = Publisher(local_url)  # claims epoch 1
    with Publisher(local_url) as new:  # claims epoch 2
        with pytest.raises(FencedError):
            old.publish(small_state(1))
        assert new.publish(small_state(2)).version == 2
    old.close()


def test_takeover_claims_even_while_the_old_publisher_commits(local_url: str) -> None:
    """A new publisher must be able to take over from a live one that just committed."""
    old = Publisher(local_url, writer_policy=WriterPolicy(threads=2))
    old.publish(small_state(0))
    fired = []

    def old_commits_first(key, data, mode, real_put):
        if not fired:
            fired.append(old.publish(small_state(1)))  # lands between our read and our CAS
        return real_put()

    store = HeadPutHook(open_store(local_url), old_commits_first)
    new = Publisher(local_url, store=store, writer_policy=WriterPolicy(threads=2))
    assert fired and fired[0].version == 2
    with pytest.raises(FencedError):
        old.publish(small_state(2))
    assert new.publish(small_state(3)).version == 3
    assert_bits_equal(pull_fresh(local_url), small_state(3))
    old.close()
    new.close()


def test_racing_takeovers_leave_exactly_one_unfenced_publisher(local_url: str) -> None:
    with Publisher(local_url) as first:
        first.publish(small_state(0))
    barrier = threading.Barrier(4)

    def open_pub(_):
        barrier.wait()
        try:
            return Publisher(local_url, writer_policy=WriterPolicy(threads=1))
        except FencedError as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        opened = list(pool.map(open_pub, range(4)))
    pubs = [p for p in opened if isinstance(p, Publisher)]
    results = []
    for i, p in enumerate(pubs):
        try:
            results.append(p.publish(small_state(10 + i)))
        except FencedError:
            results.append(None)
    assert sum(r is not None for r in results) == 1, results
    for p in pubs:
        p.close()
    with Subscriber(local_url) as sub:
        assert [i.version for i in sub.log()] == [1, 2]


# --- lost responses --------------------------------------------------------------------------


def _lost_response_hook(error: type[PreconditionFailedError], hits: list[str]):
    """The HEAD write lands, then the client reports a precondition failure (its retry saw it)."""

    def hook(key, data, mode, real_put):
        real_put()
        hits.append(repr(mode))
        raise error(f"{key}: precondition failed (injected: the retry saw our own write)")

    return hook


@pytest.mark.parametrize("error", [PreconditionFailedError, AlreadyExistsError])
def test_lost_response_is_success_committed_once(local_url: str, error) -> None:
    hits: list[str] = []
    inner = open_store(local_url)
    pub = Publisher(local_url, store=HeadPutHook(inner, _lost_response_hook(error, hits)),
                    writer_policy=WriterPolicy(takeover=False, threads=2))
    states = [small_state(0)]
    for i in range(1, 4):
        states.append(sparse_edit(states[-1], np.random.default_rng(i)))
    infos = [pub.publish(s, step=i) for i, s in enumerate(states)]
    assert len(hits) == 4, "every HEAD write went through the lossy path"
    assert [i.version for i in infos] == [1, 2, 3, 4]
    assert [i.kind for i in infos] == ["anchor", "delta", "delta", "delta"]
    with Subscriber(local_url) as sub:
        log = sub.log()
        assert [i.version for i in log] == [1, 2, 3, 4]
        assert [i.manifest for i in log] == [i.manifest for i in infos]
        target = sub.pull(1)
        for v in range(2, 5):
            sub.pull_into(target, version=v)
            assert_bits_equal(target, states[v - 1], f"version {v}")
    with inner as store:
        assert len(keys(store, "manifests/")) == 4, "each version committed exactly once"
    pub.close()


def test_genuine_conflict_during_head_write_is_a_conflict(local_url: str) -> None:
    with Publisher(local_url, writer_policy=WriterPolicy(takeover=False)) as seed:
        seed.publish(small_state(0))
    rival = Publisher(local_url, writer_policy=WriterPolicy(takeover=False, threads=2))
    rival_states = []

    def rival_commits_first(key, data, mode, real_put):
        rival_states.append(small_state(len(rival_states) + 10))
        rival.publish(rival_states[-1])
        return real_put()  # now fails its If-Match for real

    inner = open_store(local_url)
    pub = Publisher(local_url, store=HeadPutHook(inner, rival_commits_first),
                    writer_policy=WriterPolicy(takeover=False, threads=2))
    with pytest.raises(ConflictError) as exc:
        pub.publish(small_state(1))
    assert type(exc.value) is ConflictError
    assert exc.value.head_version == 2 and exc.value.head_writer == rival.writer_id
    with Subscriber(local_url) as sub:
        assert [i.writer for i in sub.log()][1:] == [rival.writer_id]
        assert_bits_equal(sub.pull(), rival_states[0])
    # Its next attempt builds on the rival's version: a delta (SPEC §5, resume) whose content
    # is exactly what it was given.
    pub.store.hook = lambda key, data, mode, real_put: real_put()
    info = pub.publish(small_state(1))
    assert (info.version, info.kind, info.parent) == (3, "delta", 2)
    assert_bits_equal(pull_fresh(local_url), small_state(1))
    rival.close()
    pub.close()


@pytest.mark.parametrize("resume", [True, False])
def test_after_a_conflict_the_next_publish_builds_on_the_winner(local_url: str, resume: bool) -> None:
    a = Publisher(local_url, writer_policy=WriterPolicy(takeover=False, resume=resume, threads=2))
    base = small_state(0, rows=64)
    a.publish(base)
    b = Publisher(local_url, writer_policy=WriterPolicy(takeover=False, resume=resume, threads=2))
    mine = sparse_edit(base, np.random.default_rng(1))
    theirs = sparse_edit(base, np.random.default_rng(2))
    assert b.publish(theirs).kind == ("delta" if resume else "anchor")
    with pytest.raises(ConflictError) as exc:
        a.publish(mine)
    assert exc.value.head_version == 2
    info = a.publish(mine)
    assert (info.version, info.parent) == (3, 2)
    assert info.kind == ("delta" if resume else "anchor")
    with Subscriber(local_url) as sub:
        assert_bits_equal(sub.pull(2), theirs)
        target = sub.pull(2)
        sub.pull_into(target)
        assert_bits_equal(target, mine)
    a.close()
    b.close()


# --- crashes ---------------------------------------------------------------------------------


class _Boom(StorageError):
    pass


@pytest.mark.parametrize("fail_on", ["HEAD", "manifests/", "objects/"])
def test_failed_commit_leaves_head_and_readers_untouched(local_url: str, fail_on: str) -> None:
    states = [small_state(0, n=4, rows=64)]
    states.append(sparse_edit(states[0], np.random.default_rng(1)))
    states.append(sparse_edit(states[1], np.random.default_rng(2)))
    inner = open_store(local_url)
    failing = [True]

    class Crashy(WrappedStore):
        def put(self, key, data, *, mode="overwrite"):
            if failing[0] and key.startswith(fail_on):
                raise _Boom(f"injected failure writing {key}")
            return self.inner.put(key, data, mode=mode)

    pub = Publisher(local_url, store=Crashy(inner), writer_policy=WriterPolicy(takeover=False, threads=2))
    failing[0] = False
    pub.publish(states[0])
    sub = Subscriber(local_url, threads=2)
    target = sub.pull()
    head_before = inner.get(HEAD_KEY)
    failing[0] = True
    for _ in range(2):  # failing twice leaves two sets of orphans
        with pytest.raises(_Boom):
            pub.publish(states[1], step=1)
    assert inner.get(HEAD_KEY) == head_before
    assert pub.version == 1
    assert sub.latest().version == 1 and sub.pull_into(target) is None
    assert_bits_equal(pull_fresh(local_url), states[0])
    # A later publish commits normally, as a delta against the last committed version.
    failing[0] = False
    info = pub.publish(states[1], step=1)
    assert (info.version, info.kind, info.parent) == (2, "delta", 1)
    assert pub.publish(states[2]).version == 3
    assert sub.pull_into(target).version == 3
    assert_bits_equal(target, states[2])
    assert_bits_equal(pull_fresh(local_url, 2), states[1])
    assert check_invariants(inner) == [1, 2, 3]
    if fail_on == "HEAD":
        assert len(keys(inner, "manifests/")) == 5, "two orphan manifests beside three committed ones"
    sub.close()
    pub.close()


def test_head_write_that_landed_but_raised_keeps_history_linear(local_url: str) -> None:
    """A network error after the HEAD write landed: read back, it is a success (docs/reliability.md D3);
    nothing forks and no later publish conflicts with itself."""
    states = [small_state(0)]
    for i in range(1, 5):
        states.append(sparse_edit(states[-1], np.random.default_rng(i)))
    inner = open_store(local_url)
    mode = {"raise_after": False}

    def hook(key, data, m, real_put):
        meta = real_put()
        if mode["raise_after"]:
            mode["raise_after"] = False
            raise _Boom("connection reset after the request was sent (injected)")
        return meta

    pub = Publisher(local_url, store=HeadPutHook(inner, hook), writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    mode["raise_after"] = True
    assert pub.publish(states[1]).version == 2  # it did land
    for v, s in enumerate(states[2:], start=3):
        assert pub.publish(s).version == v
    assert check_invariants(inner) == list(range(1, len(states) + 1))
    with Subscriber(local_url) as sub:
        for v, s in enumerate(states, start=1):
            assert_bits_equal(sub.pull(v), s, f"version {v}")
    pub.close()


def test_orphans_from_a_crashed_writer_do_not_confuse_readers(local_url: str) -> None:
    with Publisher(local_url, writer_policy=WriterPolicy(takeover=False)) as pub:
        s0 = small_state(0)
        pub.publish(s0)
    # A writer that uploaded packs and manifests for versions 2 and 3, then died before HEAD.
    with Publisher("memory://orphan-source") as other:
        other.publish(small_state(5))
        other.publish(small_state(6))
        other.publish(small_state(7))
        src = other.store
        with open_store(local_url) as dst:
            for k in keys(src, "manifests/") | keys(src, "blobs/"):
                if not k.startswith("manifests/000000000001-"):
                    dst.put(k, src.get(k), mode="create")
    with Subscriber(local_url) as sub:
        assert [i.version for i in sub.log()] == [1]
        assert sub.latest().version == 1
        assert_bits_equal(sub.pull(), s0)
    with Publisher(local_url, writer_policy=WriterPolicy(takeover=False)) as pub:
        s1 = snapshot(small_state(1))
        assert pub.publish(s1).version == 2
    assert_bits_equal(pull_fresh(local_url), s1)
    assert_bits_equal(pull_fresh(local_url, 1), s0)


def test_lost_response_then_a_rival_commit_on_top_is_still_our_success(local_url: str) -> None:
    """Our HEAD write lands, its response is lost, and a rival commits on top before we look."""
    with Publisher(local_url, writer_policy=WriterPolicy(takeover=False)) as seed:
        seed.publish(small_state(0))
    rivals: list[Publisher] = []

    def land_then_rival_then_lose(key, data, mode, real_put):
        real_put()
        rivals.append(Publisher(local_url, writer_policy=WriterPolicy(takeover=False, threads=2)))
        rivals[0].publish(small_state(20))  # resumes from our version 2, commits 3
        raise PreconditionFailedError(f"{key}: precondition failed (injected lost response)")

    inner = open_store(local_url)
    pub = Publisher(local_url, store=HeadPutHook(inner, land_then_rival_then_lose),
                    writer_policy=WriterPolicy(takeover=False, threads=2))
    mine = small_state(1)
    info = pub.publish(mine)  # a success, not a ConflictError
    assert info.version == 2
    rival = rivals[0]
    with Subscriber(local_url) as sub:
        assert [(i.version, i.writer) for i in sub.log()] == [
            (1, sub.log()[0].writer), (2, pub.writer_id), (3, rival.writer_id)
        ]
        assert_bits_equal(sub.pull(2), mine)
    # The next publish builds on the rival's version 3, not on ours.
    pub.store.hook = lambda key, data, mode, real_put: real_put()
    nxt = sparse_edit(small_state(20), np.random.default_rng(5))
    info = pub.publish(nxt)
    assert info.version == 4 and info.parent == 3
    assert_bits_equal(pull_fresh(local_url, 4), nxt)
    rival.close()
    pub.close()


# --- lineage: a replaced history (docs/reliability.md D7) -----------------------------------------------


def _run(target, seed: int, n: int, states: list[dict] | None = None) -> list[dict]:
    """A publisher (a new run) committing ``n`` versions (or ``states``); returns the states."""
    if states is None:
        states = [small_state(seed, rows=64)]
        for i in range(1, n):
            states.append(sparse_edit(states[-1], np.random.default_rng(seed * 100 + i)))
    with _pub(target) as pub:
        for s in states:
            pub.publish(s)
    return states


@pytest.mark.parametrize("new_run", ["7 versions", "5 versions", "silent mix"])
def test_pull_into_refuses_a_replaced_history(cas_store_target, new_run: str) -> None:
    """HEAD deleted and a new run published under the same URL: a worker holding version 5 of
    the old run must not fast-forward onto the new run (nor call its version 5 current).

    "silent mix": the new run differs from the old one only in a tensor its later versions do
    not touch, so every digest the fast-forward checks would pass and the worker would hold a
    mix of both runs."""
    old = _run(cas_store_target, 1, 6)
    sub = _sub(cas_store_target)
    target = sub.pull(5)
    with cas_store_target.open() as store:
        store.delete(HEAD_KEY)
    if new_run == "silent mix":
        other = small_state(9, rows=64)["t3"]
        states = [dict(s, t3=other) for s in old[:5]]
        for i in range(2):
            nxt = dict(states[-1], t0=states[-1]["t0"].clone())
            nxt["t0"][i, 0] += 1
            states.append(nxt)
        new = _run(cas_store_target, 0, 0, states)
    else:
        new = _run(cas_store_target, 2, 7 if new_run == "7 versions" else 5)
    with pytest.raises(HistoryReplacedError) as exc:
        sub.pull_into(target)
    assert "replaced" in str(exc.value) and "Subscriber" in str(exc.value)
    assert isinstance(exc.value, ConflictError)
    assert_bits_equal(target, old[4], "nothing applied")
    assert sub.version == 5
    # A new subscriber, or pull() on this one, reads the new run; then pull_into follows it.
    with _sub(cas_store_target) as fresh:
        assert_bits_equal(fresh.pull(), new[-1])
    target = sub.pull()
    assert_bits_equal(target, new[-1])
    with _pub(cas_store_target) as pub:
        pub.publish(sparse_edit(new[-1], np.random.default_rng(7)))
    assert sub.pull_into(target).version == len(new) + 1
    sub.close()


def test_a_store_of_an_earlier_format_is_refused_by_readers_and_writers(local_url: str) -> None:
    """A HEAD of schema 1 (no lineage, plain-JSON manifests): a Subscriber and a Publisher
    refuse it with UnsupportedSchemaError naming HEAD, and nothing is written."""
    import json

    with Publisher(local_url, writer_policy=WriterPolicy(takeover=False, threads=2)) as pub:
        pub.publish(small_state(0, rows=64))
    with open_store(local_url) as store:
        head = json.loads(store.get(HEAD_KEY))
        head["schema"] = 1
        del head["lineage"], head["index"]
        store.put(HEAD_KEY, json.dumps(head).encode(), mode="overwrite")
        before = {m.key for m in store.list("")}
    with pytest.raises(UnsupportedSchemaError, match="HEAD.*earlier format"):
        with Subscriber(local_url, threads=2) as sub:
            sub.pull()
    with pytest.raises(UnsupportedSchemaError, match="HEAD.*earlier format"):
        with Publisher(local_url, writer_policy=WriterPolicy(threads=2)) as pub:
            pub.publish(small_state(1, rows=64))
    with open_store(local_url) as store:
        assert {m.key for m in store.list("")} == before


@pytest.mark.parametrize("schema", [None, "3", 3.0])
def test_a_head_without_a_schema_number_is_named_corrupt_not_newer(local_url: str, schema) -> None:
    """A HEAD whose schema is not an integer is not from a newer release: the refusal says the
    object is corrupt instead of asking for an upgrade."""
    import json

    with Publisher(local_url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(small_state(0, rows=64))
    with open_store(local_url) as store:
        head = json.loads(store.get(HEAD_KEY))
        head["schema"] = schema
        store.put(HEAD_KEY, json.dumps(head).encode(), mode="overwrite")
    with pytest.raises(UnsupportedSchemaError, match="not a schema number") as err:
        with Subscriber(local_url, threads=2) as sub:
            sub.pull()
    assert "upgrade" not in str(err.value)
