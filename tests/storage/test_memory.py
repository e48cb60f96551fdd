from __future__ import annotations

import uuid

import pytest

from deltastore.storage import MemoryStore, open_store
from testkit.contract import StoreContract


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> MemoryStore:
        return MemoryStore(f"memory://{uuid.uuid4().hex}")


def test_same_name_shares_objects() -> None:
    name = f"memory://{uuid.uuid4().hex}"
    open_store(name).put("k", b"v")
    assert open_store(name).get("k") == b"v"
    assert not open_store(f"memory://{uuid.uuid4().hex}").exists("k")
