"""Every writer on a store keeps the publisher's attempt deadline (SPEC §5 step 3a, §11).

GC's grace is checked against the ``max_attempt_s`` the manifests record; a compactor or an
index writer that kept a longer deadline could register objects GC had already judged
abandoned and deleted. Both adopt the head manifest's deadline (``History.attempt_deadline``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from deltastore import Publisher
from deltastore.compact import compact
from deltastore.errors import ConflictError
from deltastore.history import History
from deltastore.index import pin
from deltastore.manifest import DEFAULT_MAX_ATTEMPT_S
from deltastore.storage import open_store
from tests._helpers import SMALL_CHUNK_BYTES, TinyTrainer, WrappedStore

DEADLINE_S = 1.0


class SlowSquashes(WrappedStore):
    """Squash packs and index objects take longer to write than the publisher's deadline."""

    def put(self, key, data, *, mode="overwrite"):
        if key.endswith((".squash.json.zst", ".index.json.zst")):
            time.sleep(DEADLINE_S + 0.2)
        return super().put(key, data, mode=mode)


def _run(url: str, versions: int, **kw) -> None:
    trainer = TinyTrainer(0)
    with Publisher(url, threads=1, chunk_bytes=SMALL_CHUNK_BYTES, **kw) as pub:
        state = trainer.export()
        for _ in range(versions):
            pub.publish(state)
            state = trainer.step()


def test_the_store_deadline_is_the_head_manifests(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    _run(url, 2, max_attempt_s=DEADLINE_S)
    h = History(open_store(url))
    assert h.attempt_deadline(h.read_head()[0]) == DEADLINE_S
    url2 = str(tmp_path / "store2")
    _run(url2, 2)
    h2 = History(open_store(url2))
    assert h2.attempt_deadline(h2.read_head()[0]) == DEFAULT_MAX_ATTEMPT_S


def test_a_compactor_slower_than_the_publishers_deadline_registers_nothing(tmp_path: Path, caplog) -> None:
    url = str(tmp_path / "store")
    _run(url, 6, max_attempt_s=DEADLINE_S)
    store = SlowSquashes(open_store(url))
    with caplog.at_level(logging.WARNING, logger="deltastore.compact"):
        rep = compact(store, bases=[2])
    assert rep.squashes and not rep.registered
    assert "deadline passed" in caplog.text
    assert History(open_store(url)).read_head()[0].index is None  # HEAD untouched


def test_an_index_write_slower_than_the_publishers_deadline_is_abandoned(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    _run(url, 3, max_attempt_s=DEADLINE_S)
    store = SlowSquashes(open_store(url))
    with pytest.raises(ConflictError):
        pin(store, 2)
    assert History(open_store(url)).read_head()[0].index is None
