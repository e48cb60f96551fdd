"""Every writer on a store keeps the publisher's attempt deadline (SPEC §5 step 3a, §11).

GC's grace is checked against the ``max_attempt_s`` the manifests record; a compactor or an
index writer that kept a longer deadline could register objects GC had already judged
abandoned and deleted. Both adopt the head manifest's deadline (``History.attempt_deadline``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from deltastore import Publisher
from deltastore.errors import CommitAbandonedError, ConflictError
from deltastore.format.history import History
from deltastore.format.models import DEFAULT_MAX_ATTEMPT_S
from deltastore.lifecycle.compact import compact
from deltastore.lifecycle.index import pin
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.stores import WrappedStore
from testkit.tensors import SMALL_CHUNK_BYTES, TinyTrainer

DEADLINE_S = 1.0


class SlowSquashes(WrappedStore):
    """Squash packs and index objects take longer to write than the publisher's deadline."""

    def put(self, key, data, *, mode="overwrite"):
        if key.endswith((".squash.json.zst", ".index.json.zst")):
            time.sleep(DEADLINE_S + 0.2)
        return super().put(key, data, mode=mode)


def _run(url: str, versions: int, **writer: Any) -> None:
    trainer = TinyTrainer(0)
    with Publisher(url, writer_policy=WriterPolicy(threads=1, **writer),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
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
    with caplog.at_level(logging.WARNING, logger="deltastore.lifecycle.compact"):
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


class _Suspended:
    """A machine suspended for ``seconds`` in the middle of a commit attempt: the clock that
    counts suspended time jumps, ``time.monotonic`` (which stops during a suspend) does not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = 0.0
        real = time.clock_gettime

        def clock_gettime(clock: int) -> float:
            return real(clock) + (self.offset if clock == time.CLOCK_BOOTTIME else 0.0)

        monkeypatch.setattr(time, "clock_gettime", clock_gettime)


class SuspendBeforeManifest(WrappedStore):
    """Suspends the machine just before the attempt's manifest upload (its packs are written)."""

    def __init__(self, inner, suspended: _Suspended, seconds: float) -> None:
        super().__init__(inner)
        self.suspended, self.seconds = suspended, seconds

    def put(self, key, data, *, mode="overwrite"):
        if key.startswith("manifests/"):
            self.suspended.offset += self.seconds
        return super().put(key, data, mode=mode)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="needs Linux's CLOCK_BOOTTIME")
def test_an_attempt_suspended_past_its_deadline_is_abandoned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher suspended mid-attempt for longer than max_attempt_s must not commit on
    resume: GC, running on the store's clock meanwhile, may have collected its packs."""
    url = str(tmp_path / "store")
    _run(url, 1, max_attempt_s=60)
    store = SuspendBeforeManifest(open_store(url), _Suspended(monkeypatch), seconds=120)
    before = History(open_store(url)).read_head()[0]
    with Publisher(url, store=store, writer_policy=WriterPolicy(threads=1, max_attempt_s=60),
                   layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        with pytest.raises(CommitAbandonedError, match="past its deadline"):
            pub.publish(TinyTrainer(0).step(), anchor=True)
    after = History(open_store(url)).read_head()[0]
    assert (after.version, after.manifest) == (before.version, before.manifest)  # nothing committed
