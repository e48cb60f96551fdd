"""The any_store_target fixture that end-to-end tests use: one fresh, empty store per backend."""

from __future__ import annotations

from deltastore.storage import IfMatch


def test_any_store_target_is_fresh_and_works(any_store_target) -> None:
    with any_store_target.open() as store:
        assert list(store.list()) == []
        meta = store.put("HEAD", b"v1", mode="create")
        store.put("HEAD", b"v2", mode=IfMatch(meta.etag))
        assert store.get("HEAD") == b"v2"
    # A second open of the same target sees the same objects.
    with any_store_target.open() as again:
        assert again.get("HEAD") == b"v2"
        assert again.atomic_conditional_writes
