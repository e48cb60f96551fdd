"""Stateful property test: random operation sequences against a dict model of a store.

Run on the fast backends (memory, local, fsspec); the HTTP backends are covered by the contract
suite. ETags are the content MD5 on all three, so the model can predict every IfMatch outcome.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid

import fsspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from deltastore.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError
from deltastore.storage import FsspecStore, IfMatch, LocalStore, MemoryStore, Store
from deltastore.storage._keys import content_etag
from deltastore.storage._local import local_etag
from testkit.hypo import examples

KEYS = st.sampled_from(["HEAD", "a/b", "a/c", "a/b-x", "blobs/ab/cd"])
VALUES = st.binary(max_size=16)


def _make(kind: str) -> Store:
    if kind == "memory":
        return MemoryStore(f"memory://{uuid.uuid4().hex}")
    if kind == "local":
        return LocalStore(tempfile.mkdtemp(prefix="deltastore-model-"))
    return FsspecStore(fsspec.filesystem("memory"), f"/deltastore-model/{uuid.uuid4().hex}")


class StoreModel(RuleBasedStateMachine):
    kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.store = _make(self.kind)
        self.model: dict[str, bytes] = {}
        # the ETag each backend computes: S3's MD5, or a local store's XXH3-128
        self.etag = local_etag if self.kind == "local" else content_etag

    def teardown(self) -> None:
        if isinstance(self.store, LocalStore):
            shutil.rmtree(self.store.root, ignore_errors=True)

    @rule(key=KEYS, value=VALUES)
    def overwrite(self, key: str, value: bytes) -> None:
        meta = self.store.put(key, value)
        assert meta.etag == self.etag(value)
        self.model[key] = value

    @rule(key=KEYS, value=VALUES)
    def create(self, key: str, value: bytes) -> None:
        if key in self.model:
            with pytest.raises(AlreadyExistsError):
                self.store.put(key, value, mode="create")
        else:
            self.store.put(key, value, mode="create")
            self.model[key] = value

    @rule(key=KEYS, value=VALUES, guess=st.one_of(st.none(), VALUES))
    def compare_and_swap(self, key: str, value: bytes, guess: bytes | None) -> None:
        # guess=None: use the current ETag; else the ETag of some other content (maybe equal).
        current = self.model.get(key)
        expected_etag = self.etag(guess if guess is not None else (current or b"\0missing"))
        if current is not None and expected_etag == self.etag(current):
            self.store.put(key, value, mode=IfMatch(expected_etag))
            self.model[key] = value
        else:
            with pytest.raises(PreconditionFailedError):
                self.store.put(key, value, mode=IfMatch(expected_etag))

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        self.store.delete(key)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def get_if_changed(self, key: str) -> None:
        if key not in self.model:
            with pytest.raises(NotFoundError):
                self.store.get_if_changed(key, None)
            return
        assert self.store.get_if_changed(key, self.etag(self.model[key])) is None
        changed = self.store.get_if_changed(key, "0" * 32)
        assert changed is not None and changed.data == self.model[key]

    @invariant()
    def contents_match(self) -> None:
        listed = list(self.store.list())
        assert [m.key for m in listed] == sorted(self.model)
        for meta in listed:
            assert meta.size == len(self.model[meta.key])
            assert meta.etag == self.etag(self.model[meta.key])
            assert self.store.get(meta.key) == self.model[meta.key]


_SETTINGS = settings(
    # A fraction of the profile's budget: each example is a whole sequence of store calls.
    max_examples=examples(0.4), stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("kind", ["memory", "local", "fsspec"])
def test_store_matches_model(kind: str) -> None:
    machine = type(f"StoreModel_{kind}", (StoreModel,), {"kind": kind})
    machine.TestCase.settings = _SETTINGS
    machine.TestCase().runTest()
