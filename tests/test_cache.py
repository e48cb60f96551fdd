"""WorkerCache: atomic save/load; damaged or foreign caches are ignored, never trusted."""

from __future__ import annotations

import json

import torch

from deltastore.cache import HELD_FILE, WorkerCache
from tests._helpers import raw, small_state


def test_round_trip_and_only_the_newest_state_file_stays(tmp_path):
    cache = WorkerCache(tmp_path / "c")
    s1, s2 = small_state(1), small_state(2)
    cache.save(s1, url="file:///x", version=3, manifest="manifests/3", lineage="L")
    cache.save(s2, url="file:///x", version=4, manifest="manifests/4", lineage="L")
    got = cache.load()
    assert got is not None and (got.version, got.manifest, got.lineage, got.url) == (4, "manifests/4", "L", "file:///x")
    assert {k: raw(v) for k, v in got.tensors.items()} == {k: raw(v) for k, v in s2.items()}
    assert len(list((tmp_path / "c").glob("state-*"))) == 1


def test_a_kill_before_the_index_is_replaced_leaves_the_previous_pair(tmp_path, monkeypatch):
    import os

    cache = WorkerCache(tmp_path / "c")
    s1 = small_state(1)
    cache.save(s1, url="u", version=1, manifest="m1", lineage=None)
    real_replace = os.replace

    def die_on_index(src, dst):
        if str(dst).endswith(HELD_FILE):
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", die_on_index)
    try:
        cache.save(small_state(2), url="u", version=2, manifest="m2", lineage=None)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    got = WorkerCache(tmp_path / "c").load()
    assert got is not None and got.version == 1
    assert {k: raw(v) for k, v in got.tensors.items()} == {k: raw(v) for k, v in s1.items()}


def test_damaged_caches_load_as_none(tmp_path, caplog):
    cache = WorkerCache(tmp_path / "c")
    assert cache.load() is None
    path = cache.save(small_state(), url="u", version=1, manifest="m", lineage=None)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated tensors
    with caplog.at_level("WARNING"):
        assert cache.load() is None
    (tmp_path / "c" / HELD_FILE).write_text("{not json")
    assert cache.load() is None
    (tmp_path / "c" / HELD_FILE).write_text(json.dumps({"format": "deltastore.worker-cache", "schema": 1,
                                                         "file": "../../etc/passwd", "version": 1}))
    assert cache.load() is None
    assert sum("ignoring the worker cache" in r.message for r in caplog.records) == 3
    cache.clear()
    assert cache.load() is None and not list((tmp_path / "c").glob("state-*"))


def test_device_and_non_contiguous_sources_are_saved_as_cpu(tmp_path):
    cache = WorkerCache(tmp_path / "c")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cache.save({"t": t}, url="u", version=1, manifest="m", lineage=None)
    assert torch.equal(cache.load().tensors["t"], t)
