"""Where a test's store lives: a URL with a fresh prefix, its storage options, and how to open it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StoreTarget", "unique_prefix"]


@dataclass(frozen=True)
class StoreTarget:
    """Where a test's store lives: ``open_store(url, storage_options=...)`` opens it."""

    kind: str
    url: str
    storage_options: dict[str, Any] | None = field(default=None)

    def open(self):  # -> deltastore.storage.Store
        from deltastore.storage import open_store

        return open_store(self.url, storage_options=self.storage_options)


def unique_prefix() -> str:
    """A fresh prefix, so that tests sharing one server never see each other's objects."""
    return f"t-{uuid.uuid4().hex[:12]}"
