"""What the rank processes of :func:`testkit.ranks.run_ranks` share with their scenarios: the
store's storage options (an S3 endpoint and its keys, set as a rank starts) and reads of the
store that the scenarios check."""

from __future__ import annotations

import json
from typing import Any

from deltastore.format.keys import HEAD_KEY
from deltastore.storage import open_store

#: The store's storage options in this rank process (None: a local store).
_OPTIONS: dict[str, Any] | None = None


def set_storage_options(options: dict[str, Any] | None) -> None:
    """This rank's storage options (:func:`testkit.ranks.run_ranks`'s ``options``)."""
    global _OPTIONS
    _OPTIONS = options


def storage_options() -> dict[str, Any] | None:
    """This rank's storage options."""
    return _OPTIONS


def head_version(url: str) -> int:
    """The version HEAD of ``url`` names now."""
    store = open_store(url, storage_options=dict(_OPTIONS or {}))  # in a rank: the server's keys
    try:
        return json.loads(store.get(HEAD_KEY))["version"]
    finally:
        store.close()


def record_pack_reads(pub: Any) -> list[tuple[str, int]]:
    """Every pack read through this rank's store from now on: (key, bytes)."""
    reads: list[tuple[str, int]] = []
    real = pub.store.get

    def get(key: str, **kw: Any) -> bytes:
        data = real(key, **kw)
        if key.endswith(".pack"):
            reads.append((key, len(data)))
        return data

    pub.store.get = get
    return reads
