"""Freed heap memory returned after whole-model work (deltastore._util.heap)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import deltastore._util.heap as heap
import deltastore.read.reader as pull_mod
import deltastore.write.publisher as publish_mod
from deltastore import Publisher, Subscriber
from deltastore.write.policy import AnchorPolicy


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(256, 64, generator=g), "b": torch.randn(1000, generator=g)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_free_heap_trims_on_glibc() -> None:
    # the machines this runs on (CI, the dev box) use glibc; elsewhere it is a no-op by design
    assert heap._TRIM is not None
    assert heap.release_free_heap() is True


def test_release_free_heap_is_a_no_op_without_malloc_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_TRIM", None)
    assert heap.release_free_heap() is False


def test_release_free_heap_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_pad: int) -> int:
        raise OSError("no")

    monkeypatch.setattr(heap, "_TRIM", broken)
    assert heap.release_free_heap() is False


def test_trimmed_after_an_anchor_and_a_whole_pull_not_after_a_delta(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(publish_mod, "release_free_heap", lambda: calls.append("publish") or True)
    monkeypatch.setattr(pull_mod, "release_free_heap", lambda: calls.append("pull") or True)
    url = str(tmp_path / "store")
    with Publisher(url, anchor_policy=AnchorPolicy(every=1000)) as pub:
        pub.publish(_state(0), step=0)  # the first version: an anchor
        assert calls == ["publish"]
        s1 = _state(0)
        s1["a"][0, 0] += 1.0
        pub.publish(s1, step=1)  # a delta
        assert calls == ["publish"]
        pub.publish(s1, step=2, anchor=True)
        assert calls == ["publish", "publish"]
    with Subscriber(url) as sub:
        out = sub.pull(2)
        assert calls[-1] == "pull"
        n = len(calls)
        target = sub.pull(2)
        sub.pull_into(target, version=3)  # no whole read: nothing to give back
        assert len(calls) == n + 1
    assert torch.equal(out["a"], s1["a"])
