"""Unclear outcomes of the commit path (docs/reliability.md D2-D6): a publish that committed never reports
failure; one that did not never leaves HEAD moved.

Faults are injected in-process by wrapping the store (backend-neutral protocol logic); the key
cases also run against moto server and SeaweedFS through ``cas_store_target``.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from deltastore import (
    AlreadyExistsError,
    ConflictError,
    FencedError,
    PreconditionFailedError,
    Publisher,
    StorageError,
    Subscriber,
)
from deltastore.errors import CommitUnknownError
from deltastore.format.keys import HEAD_KEY
from deltastore.format.parse import parse_head
from deltastore.storage import open_store
from deltastore.storage.base import GetResult, IfMatch
from deltastore.write import commit as commit_mod
from deltastore.write.policy import WriterPolicy
from testkit.manifest_docs import read_manifest_doc
from testkit.stores import HeadPutHook, check_invariants, keys
from testkit.tensors import assert_bits_equal, small_state, sparse_edit


class _Boom(StorageError):
    """A 5xx / reset / timeout after the SDK's own retries gave up (injected)."""


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_mod, "READBACK_BACKOFF_S", 0.001, raising=False)


@pytest.fixture(params=["memory", "file"])
def local_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return str(tmp_path / "store")
    return f"memory://faults-{uuid.uuid4().hex}"


def _states(n: int, rows: int = 32) -> list[dict]:
    out = [small_state(0, rows=rows)]
    for i in range(1, n):
        out.append(sparse_edit(out[-1], np.random.default_rng(i)))
    return out


class FaultyStore(HeadPutHook):
    """HEAD writes go through ``hook``; ``fail_reads`` HEAD reads raise; manifest puts through ``manifest_hook``."""

    def __init__(self, inner, hook=None, manifest_hook=None):
        super().__init__(inner, hook or (lambda key, data, mode, real_put: real_put()))
        self.manifest_hook = manifest_hook
        self.fail_reads = 0
        self.truncate_reads = False  # failing HEAD reads return a cut body instead of raising
        self.head_modes: list[object] = []

    def put(self, key, data, *, mode="overwrite"):
        if key == HEAD_KEY:
            self.head_modes.append(mode)
        if key.startswith("manifests/") and self.manifest_hook is not None:
            self._note("put", key)
            return self.manifest_hook(key, data, mode, lambda: self.inner.put(key, data, mode=mode))
        return super().put(key, data, mode=mode)

    def _read_fault(self, key):
        if key == HEAD_KEY and self.fail_reads > 0:
            self.fail_reads -= 1
            raise _Boom(f"{key}: 503 Slow Down (injected on read-back)")

    def get_with_meta(self, key):
        if self.truncate_reads and key == HEAD_KEY and self.fail_reads > 0:
            self.fail_reads -= 1
            res = super().get_with_meta(key)
            return GetResult(res.data[: len(res.data) // 2], res.meta)  # a truncated response body
        self._read_fault(key)
        return super().get_with_meta(key)

    def get_if_changed(self, key, etag):
        self._read_fault(key)
        return super().get_if_changed(key, etag)

    def get(self, key, *, byte_range=None):
        self._read_fault(key)
        return super().get(key, byte_range=byte_range)


def _land_then(error: Exception, times: list[int]):
    """A HEAD hook: the write lands, then the client reports ``error`` (``times[0]`` times)."""

    def hook(key, data, mode, real_put):
        meta = real_put()
        if times[0] > 0:
            times[0] -= 1
            raise error
        return meta

    return hook


def _manifest_epochs(store) -> list[tuple[int, int, str]]:
    """(version, epoch, writer) along HEAD's chain, oldest first."""
    h = parse_head(store.get(HEAD_KEY))
    out = []
    key = h.manifest
    while key is not None:
        doc = read_manifest_doc(store, key)
        out.append((doc["version"], doc["epoch"], doc["writer"]))
        key = doc["parent_manifest"]
    return out[::-1]


# --- D2: lost response on the manifest upload -------------------------------------------------


@pytest.mark.parametrize("error", [AlreadyExistsError, PreconditionFailedError])
def test_manifest_upload_whose_retry_sees_itself_is_success(local_url: str, error) -> None:
    states = _states(3)
    inner = open_store(local_url)
    lost = [0]

    def manifest_hook(key, data, mode, real_put):
        meta = real_put()
        if lost[0]:
            lost[0] -= 1
            raise error(f"{key} already exists (injected: the SDK retry saw our own upload)")
        return meta

    pub = Publisher(local_url, store=FaultyStore(inner, manifest_hook=manifest_hook),
                    writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    lost[0] = 1
    info = pub.publish(states[1])
    assert (info.version, info.kind) == (2, "delta")
    assert pub.publish(states[2]).version == 3
    assert check_invariants(inner) == [1, 2, 3]
    with Subscriber(local_url, threads=2) as sub:
        assert_bits_equal(sub.pull(2), states[1])
    pub.close()


def test_manifest_upload_whose_first_attempt_landed_altered_is_replaced(local_url: str) -> None:
    """The first attempt lands altered and its answer is lost; the retry is refused as "already
    exists". Read back, the object is not the manifest its key names: it is replaced under its
    ETag, and the version reads back bit-exact."""
    states = _states(2)
    inner = open_store(local_url)
    armed = [0]
    puts: list[object] = []

    def manifest_hook(key, data, mode, real_put):
        puts.append(mode)
        if armed[0]:
            armed[0] -= 1
            altered = bytearray(data)
            altered[len(altered) // 2] ^= 0x01
            inner.put(key, bytes(altered), mode=mode)
            raise AlreadyExistsError(f"{key} already exists (injected: the retry of an attempt that landed altered)")
        return real_put()

    pub = Publisher(local_url, store=FaultyStore(inner, manifest_hook=manifest_hook),
                    writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    armed[0], puts[:] = 1, []
    assert pub.publish(states[1]).version == 2
    assert puts[0] == "create" and isinstance(puts[1], IfMatch)  # replaced under the altered object's ETag
    assert check_invariants(inner) == [1, 2]
    with Subscriber(local_url, threads=2) as sub:
        assert_bits_equal(sub.pull(2), states[1])
    pub.close()


def test_manifest_conflict_without_the_object_fails_cleanly(local_url: str) -> None:
    """A precondition failure on a manifest key that is not there (a 409): not committed, no
    bare PreconditionFailedError, HEAD untouched."""
    states = _states(2)
    inner = open_store(local_url)
    fail = [0]

    def manifest_hook(key, data, mode, real_put):
        if fail[0]:
            fail[0] -= 1
            raise PreconditionFailedError(f"{key}: 409 ConditionalRequestConflict (injected)")
        return real_put()

    pub = Publisher(local_url, store=FaultyStore(inner, manifest_hook=manifest_hook),
                    writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    head = inner.get(HEAD_KEY)
    fail[0] = 1
    with pytest.raises(StorageError) as exc:
        pub.publish(states[1])
    assert not isinstance(exc.value, (PreconditionFailedError, ConflictError))
    assert inner.get(HEAD_KEY) == head
    assert pub.publish(states[1]).version == 2
    assert check_invariants(inner) == [1, 2]
    pub.close()


# --- D3: the HEAD write landed, every retry failed ----------------------------------------------


@pytest.mark.parametrize("fail_reads, truncated", [(0, False), (3, False), (3, True)])
def test_head_write_landed_then_5xx_is_success(local_url: str, fail_reads: int, truncated: bool) -> None:
    states = _states(4)
    inner = open_store(local_url)
    times = [0]
    store = FaultyStore(inner, _land_then(_Boom("HEAD: 500 InternalError after the write (injected)"), times))
    pub = Publisher(local_url, store=store, writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    times[0] = 1
    store.fail_reads = fail_reads  # the read-back itself fails a few times before it succeeds
    store.truncate_reads = truncated
    info = pub.publish(states[1])  # committed: must not raise
    assert info.version == 2
    assert pub.version == 2
    for v, s in enumerate(states[2:], start=3):
        assert pub.publish(s).version == v  # no ConflictError naming ourselves
    assert check_invariants(inner) == [1, 2, 3, 4]
    with Subscriber(local_url, threads=2) as sub:
        for v, s in enumerate(states, start=1):
            assert_bits_equal(sub.pull(v), s, f"version {v}")
    pub.close()


def test_head_write_outcome_unknown_is_typed_and_resolved_by_the_next_publish(local_url: str) -> None:
    states = _states(4)
    inner = open_store(local_url)
    times = [0]
    store = FaultyStore(inner, _land_then(_Boom("HEAD: connection reset (injected)"), times))
    pub = Publisher(local_url, store=store, writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    times[0] = 1
    store.fail_reads = 10**6  # HEAD cannot be read back at all
    with pytest.raises(CommitUnknownError) as exc:
        pub.publish(states[1])
    assert isinstance(exc.value, StorageError)
    assert "unknown" in str(exc.value)
    # While HEAD stays unreadable, the next publish refuses (it could lose or double a step).
    with pytest.raises(CommitUnknownError):
        pub.publish(states[2])
    store.fail_reads = 0
    # It landed: the next publish resolves that first and commits on top of it.
    info = pub.publish(states[2])
    assert (info.version, info.parent) == (3, 2)
    assert pub.publish(states[3]).version == 4
    assert check_invariants(inner) == [1, 2, 3, 4]
    with Subscriber(local_url, threads=2) as sub:
        for v, s in enumerate(states, start=1):
            assert_bits_equal(sub.pull(v), s, f"version {v}")
    pub.close()


def test_unknown_outcome_that_did_not_land_is_not_counted(local_url: str) -> None:
    states = _states(3)
    inner = open_store(local_url)
    fail = [0]

    def hook(key, data, mode, real_put):
        if fail[0]:
            fail[0] -= 1
            raise _Boom("HEAD: timeout before the write (injected)")
        return real_put()

    store = FaultyStore(inner, hook)
    pub = Publisher(local_url, store=store, writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    head = inner.get(HEAD_KEY)
    fail[0] = 1
    store.fail_reads = 10**6
    with pytest.raises(CommitUnknownError):
        pub.publish(states[1])
    assert inner.get(HEAD_KEY) == head
    store.fail_reads = 0
    info = pub.publish(states[2])
    assert (info.version, info.parent) == (2, 1)
    assert check_invariants(inner) == [1, 2]
    assert_bits_equal(Subscriber(local_url, threads=2).pull(2), states[2])
    pub.close()


# --- D4: a 409 on HEAD ---------------------------------------------------------------------------


def test_spurious_precondition_failure_on_head_is_not_a_conflict_naming_ourselves(local_url: str) -> None:
    states = _states(3)
    inner = open_store(local_url)
    fail = [0]

    def hook(key, data, mode, real_put):
        if fail[0]:
            fail[0] -= 1
            raise PreconditionFailedError(f"{key}: 409 ConditionalRequestConflict (injected, did not land)")
        return real_put()

    pub = Publisher(local_url, store=FaultyStore(inner, hook), writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    head = inner.get(HEAD_KEY)
    fail[0] = 1
    with pytest.raises(StorageError) as exc:
        pub.publish(states[1])
    assert not isinstance(exc.value, (ConflictError, PreconditionFailedError)), repr(exc.value)
    assert inner.get(HEAD_KEY) == head
    assert pub.publish(states[1]).version == 2
    assert pub.publish(states[2]).version == 3
    assert check_invariants(inner) == [1, 2, 3]
    pub.close()


# --- D5: lost HEAD response while another publisher claims the store ------------------------------


def test_lost_head_response_during_a_takeover_is_success_then_fenced(cas_store_target) -> None:
    t = cas_store_target
    states = _states(3)
    inner = t.open()
    newcomers: list[Publisher] = []

    def land_then_takeover_then_lose(key, data, mode, real_put):
        real_put()
        newcomers.append(Publisher(t.url, storage_options=t.storage_options,
                                   writer_policy=WriterPolicy(takeover=True, threads=2)))  # claims on top
        raise PreconditionFailedError(f"{key}: precondition failed (injected lost response)")

    store = FaultyStore(inner)
    pub = Publisher(t.url, store=store, writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    store.hook = land_then_takeover_then_lose
    info = pub.publish(states[1])  # our version committed: not a FencedError
    assert info.version == 2
    store.hook = lambda key, data, mode, real_put: real_put()
    head = inner.get(HEAD_KEY)
    with pytest.raises(FencedError):
        pub.publish(states[2])
    assert inner.get(HEAD_KEY) == head
    assert newcomers[0].publish(states[2]).version == 3
    assert check_invariants(inner) == [1, 2, 3]
    with Subscriber(t.url, storage_options=t.storage_options, threads=2) as sub:
        assert_bits_equal(sub.pull(2), states[1])
    newcomers[0].close()
    pub.close()
    inner.close()


# --- D6: takeover claims an empty store ----------------------------------------------------------


def test_takeover_claims_an_empty_store(local_url: str) -> None:
    with Publisher(local_url, writer_policy=WriterPolicy(takeover=True, threads=2)) as pub:
        with open_store(local_url) as store:
            head = parse_head(store.get(HEAD_KEY))
        assert (head.version, head.manifest, head.epoch, head.writer) == (0, None, 1, pub.writer_id)
        with Subscriber(local_url, threads=2) as sub:
            assert sub.latest() is None and sub.log() == []
    # The first publish onto the claimed store is a CAS on the claim, not a create.
    inner = open_store(local_url)
    store = FaultyStore(inner)
    with Publisher(local_url, store=store, writer_policy=WriterPolicy(takeover=True, threads=2)) as pub:
        assert pub.publish(small_state(0)).version == 1
    assert [type(m).__name__ for m in store.head_modes] == ["IfMatch", "IfMatch"]
    assert isinstance(store.head_modes[-1], IfMatch)


def test_two_publishers_opened_on_an_empty_store_the_later_fences_the_earlier(local_url: str) -> None:
    a = Publisher(local_url, writer_policy=WriterPolicy(takeover=True, threads=2))
    b = Publisher(local_url, writer_policy=WriterPolicy(takeover=True, threads=2))
    assert b.epoch > a.epoch >= 1
    with pytest.raises(FencedError):
        a.publish(small_state(0))
    assert b.publish(small_state(1)).version == 1
    with pytest.raises(FencedError):
        a.publish(small_state(2))
    assert b.publish(small_state(3)).version == 2
    assert [w for _, _, w in _manifest_epochs(open_store(local_url))] == [b.writer_id] * 2
    a.close()
    b.close()


def test_racing_trainers_on_an_empty_store_never_interleave(cas_store_target) -> None:
    """Three trainers open an empty store at once and publish: versions never alternate
    between writers (epochs never go down along the chain), and the last writer is unfenced."""
    n, rounds = 3, 4
    barrier = threading.Barrier(n)
    results: dict[int, list[object]] = {i: [] for i in range(n)}

    def trainer(i: int) -> None:
        barrier.wait()
        try:
            pub = Publisher(cas_store_target.url, storage_options=cas_store_target.storage_options,
                            writer_policy=WriterPolicy(threads=1))
        except FencedError as e:
            results[i].append(e)
            return
        with pub:
            for r in range(rounds):
                try:
                    results[i].append(pub.publish(small_state(100 * i + r)))
                except (FencedError, ConflictError) as e:
                    results[i].append(e)
                    if isinstance(e, FencedError):
                        return

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = cas_store_target.open()
    chain = _manifest_epochs(store)
    assert chain, f"no trainer committed anything: {results}"
    assert [v for v, _, _ in chain] == list(range(1, len(chain) + 1))
    epochs = [e for _, e, _ in chain]
    assert epochs == sorted(epochs), f"epochs went down along the chain: {chain}"
    runs = [w for i, (_, _, w) in enumerate(chain) if i == 0 or chain[i - 1][2] != w]
    assert len(runs) == len(set(runs)), f"writers interleaved: {chain}"
    assert all(e >= 1 for e in epochs), "every version was written after a claim"
    last_writer_results = [r for rs in results.values() for r in rs if getattr(r, "writer", None) == chain[-1][2]]
    owner = next(i for i in range(n) if any(r in last_writer_results for r in results[i]))
    assert not any(isinstance(x, FencedError) for x in results[owner]), results
    store.close()


# --- on real servers -----------------------------------------------------------------------------


def test_lost_responses_on_manifest_and_head_on_a_real_server(cas_store_target) -> None:
    states = _states(4)
    inner = cas_store_target.open()
    times = [0]
    lost_manifest = [0]

    def manifest_hook(key, data, mode, real_put):
        meta = real_put()
        if lost_manifest[0]:
            lost_manifest[0] -= 1
            raise AlreadyExistsError(f"{key} already exists (injected lost response)")
        return meta

    store = FaultyStore(inner, _land_then(_Boom("HEAD: 503 after the write (injected)"), times), manifest_hook)
    # skip_unchanged=False: states[3] is published again after its unknown outcome, and must
    # make version 5 even though version 4 (the same state) turned out to have landed.
    pub = Publisher(cas_store_target.url, store=store,
                    writer_policy=WriterPolicy(takeover=True, threads=2, skip_unchanged=False))
    pub.publish(states[0])
    lost_manifest[0] = 1
    assert pub.publish(states[1]).version == 2  # D2
    times[0] = 1
    assert pub.publish(states[2]).version == 3  # D3
    times[0] = 1
    store.fail_reads = 10**6
    with pytest.raises(CommitUnknownError):
        pub.publish(states[3])
    store.fail_reads = 0
    assert pub.publish(states[3]).version == 5  # version 4 landed; resolved first
    assert check_invariants(inner) == [1, 2, 3, 4, 5]
    with Subscriber(cas_store_target.url, storage_options=cas_store_target.storage_options, threads=2) as sub:
        assert_bits_equal(sub.pull(4), states[3])
        assert_bits_equal(sub.pull(5), states[3])
    assert len(keys(inner, "manifests/")) == 5
    pub.close()
    inner.close()


@pytest.mark.parametrize("error", [PreconditionFailedError("HEAD: 412 (injected lost response)"), _Boom("HEAD: 503 after the write (injected)")])
@pytest.mark.parametrize("empty", [True, False])
def test_claim_whose_response_was_lost_is_a_claim_not_a_fence(local_url: str, error: Exception, empty: bool) -> None:
    if not empty:
        with Publisher(local_url, writer_policy=WriterPolicy(takeover=False, threads=2)) as seed:
            seed.publish(small_state(0))
    inner = open_store(local_url)
    times = [1]
    store = FaultyStore(inner, _land_then(error, times))
    with Publisher(local_url, store=store, writer_policy=WriterPolicy(takeover=True, threads=2)) as pub:
        assert pub.epoch == (1 if empty else 1)
        info = pub.publish(small_state(1))  # not FencedError: the claim that landed is ours
        assert info.version == (1 if empty else 2)
    assert check_invariants(inner)[-1] == info.version


@pytest.mark.parametrize("meanwhile", ["rival commits", "HEAD deleted"])
def test_unknown_outcome_settled_after_the_store_moved_on(local_url: str, meanwhile: str) -> None:
    """The unknown write did not land, and by the next publish HEAD has moved: the publisher
    builds on what is there now (or starts again on a deleted HEAD), never on its own guess."""
    states = _states(3)
    inner = open_store(local_url)
    fail = [0]

    def hook(key, data, mode, real_put):
        if fail[0]:
            fail[0] -= 1
            raise _Boom("HEAD: timeout before the write (injected)")
        return real_put()

    store = FaultyStore(inner, hook)
    pub = Publisher(local_url, store=store, writer_policy=WriterPolicy(takeover=False, threads=2))
    pub.publish(states[0])
    fail[0] = 1
    store.fail_reads = 10**6
    with pytest.raises(CommitUnknownError):
        pub.publish(states[1])
    store.fail_reads = 0
    if meanwhile == "rival commits":
        with Publisher(local_url, writer_policy=WriterPolicy(takeover=False, threads=2)) as rival:
            rival.publish(small_state(50, rows=32))
        info = pub.publish(states[2])
        assert (info.version, info.parent) == (3, 2)
        assert check_invariants(inner) == [1, 2, 3]
    else:
        inner.delete(HEAD_KEY)
        info = pub.publish(states[2])
        assert (info.version, info.parent, info.kind) == (1, None, "anchor")
        assert check_invariants(inner) == [1]
    with Subscriber(local_url, threads=2) as sub:
        assert_bits_equal(sub.pull(), states[2])
    pub.close()
