"""The contract every :class:`~deltastore.storage.Store` backend must meet.

Subclass :class:`StoreContract` in a backend's test module and override the ``store`` fixture
to return a fresh, empty store. Tests that need atomic conditional writes skip themselves on a
store whose ``atomic_conditional_writes`` is False.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from deltastore.errors import (
    AlreadyExistsError,
    InvalidKeyError,
    NotFoundError,
    PreconditionFailedError,
)
from deltastore.storage import IfMatch, ObjectMeta, Store

#: Racers in the concurrency tests: enough to make collisions likely, few enough to stay fast.
RACERS = 8
#: Compare-and-swap rounds in the CAS race test.
CAS_ROUNDS = 3
#: Large enough to cross multipart/chunking thresholds of clients and servers (SeaweedFS
#: chunks at 4 MiB, botocore streams in 8 MiB pieces).
LARGE_SIZE = 20 * 1024 * 1024


def _race(n: int, fn: Callable[[int], object]) -> list[object]:
    """Run fn(i) for i in range(n) on n threads released together; return results or errors."""
    barrier = threading.Barrier(n)

    def run(i: int) -> object:
        barrier.wait()
        try:
            return fn(i)
        except Exception as e:  # collected and asserted on by the caller
            return e

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))


class StoreContract:
    """Behaviour shared by all backends."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("override the store fixture")

    @staticmethod
    def require_atomic(store: Store) -> None:
        if not store.atomic_conditional_writes:
            pytest.skip(f"{type(store).__name__} does not promise atomic conditional writes")

    # --- reads and writes ----------------------------------------------------------------

    def test_put_get_roundtrip(self, store: Store) -> None:
        meta = store.put("obj", b"hello world")
        assert isinstance(meta, ObjectMeta)
        assert (meta.key, meta.size) == ("obj", 11)
        assert meta.etag
        assert store.get("obj") == b"hello world"
        head = store.head("obj")
        assert (head.key, head.size, head.etag) == ("obj", 11, meta.etag)
        result = store.get_with_meta("obj")
        assert result.data == b"hello world"
        assert result.meta.etag == meta.etag
        assert store.exists("obj")

    def test_empty_object(self, store: Store) -> None:
        meta = store.put("empty", b"")
        assert meta.size == 0
        assert store.get("empty") == b""
        assert store.head("empty").size == 0

    def test_overwrite_replaces_and_changes_etag(self, store: Store) -> None:
        first = store.put("obj", b"one")
        second = store.put("obj", b"two", mode="overwrite")
        assert first.etag != second.etag
        assert store.get("obj") == b"two"
        assert store.head("obj").etag == second.etag

    def test_same_content_same_etag_across_keys(self, store: Store) -> None:
        # ETags identify content versions; equal bytes written in one piece share one.
        assert store.put("a", b"same").etag == store.put("b", b"same").etag

    def test_byte_ranges(self, store: Store) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get("r", byte_range=(0, 10)) == data[0:10]
        assert store.get("r", byte_range=(100, 356)) == data[100:356]
        assert store.get("r", byte_range=(1000, 1024)) == data[1000:]
        assert store.get("r", byte_range=(1020, 5000)) == data[1020:]  # clipped at the end
        assert store.get("r", byte_range=(7, 7)) == b""
        assert store.get("r", byte_range=(2000, 3000)) == b""

    def test_invalid_byte_range(self, store: Store) -> None:
        store.put("r", b"abc")
        with pytest.raises(ValueError):
            store.get("r", byte_range=(2, 1))
        with pytest.raises(ValueError):
            store.get("r", byte_range=(-1, 2))

    def test_missing_key(self, store: Store) -> None:
        for read in (
            lambda: store.get("nope/missing"),
            lambda: store.get("nope/missing", byte_range=(0, 4)),
            lambda: store.get_with_meta("nope/missing"),
            lambda: store.get_if_changed("nope/missing", None),
            lambda: store.get_if_changed("nope/missing", "0" * 32),
            lambda: store.head("nope/missing"),
        ):
            with pytest.raises(NotFoundError) as info:
                read()
            assert isinstance(info.value, KeyError)
            message = str(info.value)
            assert "nope/missing" in message and "\n" not in message
        assert not store.exists("nope/missing")

    @pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "./a", "a/", "a\\b"])
    def test_invalid_keys_rejected(self, store: Store, key: str) -> None:
        with pytest.raises(InvalidKeyError) as info:
            store.put(key, b"x")
        assert isinstance(info.value, ValueError)
        with pytest.raises(InvalidKeyError):
            store.get(key)

    def test_nested_keys(self, store: Store) -> None:
        keys = ["x/y/z/w/file.bin", "x/y/other", "x/top", "blobs/ab/cd/abcdef0123"]
        for key in keys:
            store.put(key, key.encode())
        for key in keys:
            assert store.get(key) == key.encode()
        assert [m.key for m in store.list("x/y/")] == ["x/y/other", "x/y/z/w/file.bin"]

    def test_large_object(self, store: Store) -> None:
        data = os.urandom(LARGE_SIZE)
        meta = store.put("big/blob", data, mode="create")
        assert meta.size == LARGE_SIZE
        got = store.get_with_meta("big/blob")
        assert got.data == data
        assert got.meta.etag == meta.etag
        mid = LARGE_SIZE // 2
        assert store.get("big/blob", byte_range=(mid, mid + 5_000_000)) == data[mid : mid + 5_000_000]

    # --- conditional writes --------------------------------------------------------------

    def test_create_only_once(self, store: Store) -> None:
        first = store.put("HEAD", b"first", mode="create")
        with pytest.raises(AlreadyExistsError) as info:
            store.put("HEAD", b"second", mode="create")
        assert isinstance(info.value, PreconditionFailedError)
        assert isinstance(info.value, FileExistsError)
        assert "HEAD" in str(info.value) and "\n" not in str(info.value)
        assert store.get("HEAD") == b"first"
        assert store.head("HEAD").etag == first.etag

    def test_if_match_with_current_etag(self, store: Store) -> None:
        first = store.put("HEAD", b"v1", mode="create")
        second = store.put("HEAD", b"v2", mode=IfMatch(first.etag))
        assert second.etag != first.etag
        assert store.get("HEAD") == b"v2"
        assert store.head("HEAD").etag == second.etag
        third = store.put("HEAD", b"v3", mode=IfMatch(second.etag))
        assert store.get_with_meta("HEAD").meta.etag == third.etag

    def test_if_match_with_stale_etag(self, store: Store) -> None:
        first = store.put("HEAD", b"v1", mode="create")
        store.put("HEAD", b"v2", mode=IfMatch(first.etag))
        with pytest.raises(PreconditionFailedError) as info:
            store.put("HEAD", b"v3", mode=IfMatch(first.etag))
        assert not isinstance(info.value, AlreadyExistsError)
        assert store.get("HEAD") == b"v2"

    def test_if_match_on_missing_key(self, store: Store) -> None:
        etag = store.put("other", b"v1").etag
        with pytest.raises(PreconditionFailedError):
            store.put("HEAD", b"v1", mode=IfMatch(etag))
        assert not store.exists("HEAD")

    def test_get_if_changed(self, store: Store) -> None:
        first = store.put("HEAD", b"v1")
        assert store.get_if_changed("HEAD", first.etag) is None
        unconditional = store.get_if_changed("HEAD", None)
        assert unconditional is not None and unconditional.data == b"v1"
        second = store.put("HEAD", b"v2", mode=IfMatch(first.etag))
        changed = store.get_if_changed("HEAD", first.etag)
        assert changed is not None
        assert changed.data == b"v2"
        assert changed.meta.etag == second.etag
        assert store.get_if_changed("HEAD", second.etag) is None

    # --- listing and deleting ------------------------------------------------------------

    def test_list_prefix_sorted_and_scoped(self, store: Store) -> None:
        keys = ["a/b/c", "a/b-x", "a/b/a", "ab", "b/z", "a/c", "a0"]
        for key in reversed(keys):
            store.put(key, key.encode())
        assert [m.key for m in store.list()] == sorted(keys)
        assert [m.key for m in store.list("a/")] == ["a/b-x", "a/b/a", "a/b/c", "a/c"]
        assert [m.key for m in store.list("a/b")] == ["a/b-x", "a/b/a", "a/b/c"]
        assert [m.key for m in store.list("a")] == ["a/b-x", "a/b/a", "a/b/c", "a/c", "a0", "ab"]
        assert list(store.list("zz/")) == []
        for meta in store.list("b/"):
            assert (meta.size, meta.etag) == (3, store.head(meta.key).etag)

    def test_list_empty_store(self, store: Store) -> None:
        assert list(store.list()) == []

    def test_delete_is_idempotent(self, store: Store) -> None:
        store.put("d/x", b"1")
        store.put("d/y", b"2")
        store.delete("d/x")
        store.delete("d/x")
        store.delete("never/existed")
        assert not store.exists("d/x")
        with pytest.raises(NotFoundError):
            store.get("d/x")
        assert [m.key for m in store.list("d/")] == ["d/y"]
        store.put("d/x", b"again", mode="create")  # a deleted key can be created again
        assert store.get("d/x") == b"again"

    def test_repr_names_url(self, store: Store) -> None:
        assert store.url in repr(store)

    # --- concurrency ---------------------------------------------------------------------

    def test_concurrent_create_race(self, store: Store) -> None:
        self.require_atomic(store)
        payloads = [f"writer-{i}-".encode() * 1000 for i in range(RACERS)]
        results = _race(RACERS, lambda i: store.put("race/HEAD", payloads[i], mode="create"))
        winners = [i for i, r in enumerate(results) if isinstance(r, ObjectMeta)]
        assert len(winners) == 1, results
        for i, r in enumerate(results):
            if i not in winners:
                assert isinstance(r, PreconditionFailedError), r
        assert store.get("race/HEAD") == payloads[winners[0]]

    def test_concurrent_cas_race(self, store: Store) -> None:
        self.require_atomic(store)
        store.put("cas/HEAD", b"round-0", mode="create")
        read_barrier = threading.Barrier(RACERS)

        for round_ in range(1, CAS_ROUNDS + 1):
            payloads = [f"round-{round_}-writer-{i}".encode() for i in range(RACERS)]

            def attempt(i: int, payloads: list[bytes] = payloads) -> ObjectMeta:
                etag = store.head("cas/HEAD").etag
                read_barrier.wait()  # everyone has read the same version before anyone writes
                return store.put("cas/HEAD", payloads[i], mode=IfMatch(etag))

            results = _race(RACERS, attempt)
            winners = [i for i, r in enumerate(results) if isinstance(r, ObjectMeta)]
            assert len(winners) == 1, (round_, results)
            for i, r in enumerate(results):
                if i not in winners:
                    assert isinstance(r, PreconditionFailedError), r
                    assert not isinstance(r, AlreadyExistsError), r
            got = store.get_with_meta("cas/HEAD")
            assert got.data == payloads[winners[0]]
            assert got.meta.etag == results[winners[0]].etag

    def test_conditional_write_probe_passes(self, store: Store) -> None:
        """Every backend that promises atomic conditional writes passes the endpoint probe
        (docs/SPEC.md §1.1), and the probe leaves nothing behind."""
        from deltastore.storage.probe import META_PREFIX, probe_conditional_writes

        self.require_atomic(store)
        result = probe_conditional_writes(store)
        assert result.ok, result.detail
        assert list(store.list(META_PREFIX)) == []
