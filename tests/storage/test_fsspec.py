"""FsspecStore over fsspec's in-memory and local filesystems.

The atomicity-dependent contract tests skip themselves: FsspecStore says it is not atomic.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest

from deltastore.storage import FsspecStore
from testkit.contract import StoreContract


class TestFsspecMemory(StoreContract):
    @pytest.fixture
    def store(self):
        fs = fsspec.filesystem("memory")
        root = f"/deltastore-test/{uuid.uuid4().hex}"
        yield FsspecStore(fs, root)
        if fs.exists(root):
            fs.rm(root, recursive=True)


class TestFsspecLocal(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> FsspecStore:
        return FsspecStore(fsspec.filesystem("file"), str(tmp_path))


def test_declares_non_atomic_writes() -> None:
    assert FsspecStore.atomic_conditional_writes is False
    assert "NOT safe for concurrent writers" in (FsspecStore.__doc__ or "")


def test_from_url(tmp_path: Path) -> None:
    store = FsspecStore.from_url(f"memory://deltastore-test/{uuid.uuid4().hex}")
    store.put("a/b", b"1", mode="create")
    assert [m.key for m in store.list()] == ["a/b"]
