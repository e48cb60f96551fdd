"""WorkerCache: atomic save/load; damaged or foreign caches are ignored, never trusted."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors import SafetensorError

from deltastore.errors import DeltastoreError, WorkerCacheError
from deltastore.read.cache import HELD_FILE, WorkerCache
from testkit.tensors import raw, small_state


def test_round_trip_and_only_the_newest_state_file_stays(tmp_path):
    cache = WorkerCache(tmp_path / "c")
    s1, s2 = small_state(1), small_state(2)
    cache.save(s1, url="file:///x", version=3, manifest="manifests/3", lineage="L")
    cache.save(s2, url="file:///x", version=4, manifest="manifests/4", lineage="L")
    got = cache.load()
    assert got is not None and (got.version, got.manifest, got.lineage, got.url) == (4, "manifests/4", "L", "file:///x")
    assert {k: raw(v) for k, v in got.tensors.items()} == {k: raw(v) for k, v in s2.items()}
    assert len(list((tmp_path / "c").glob("state-*"))) == 1


def test_a_partial_subscribers_state_round_trips_and_odd_spare_entries_load_as_none(tmp_path):
    import numpy as np

    cache = WorkerCache(tmp_path / "c")
    state = small_state(1)
    state["#spare/0"] = torch.arange(4, dtype=torch.int64)  # a user's tensor may take the spare bits' key
    spare = {("#group/0", 3): np.arange(10, dtype=np.uint16), ("w", 0): np.arange(6, dtype=np.uint32)}
    sel = {"names": ["a.*"], "shard": None, "shard_names": None, "shard_dims": None, "exclude": []}
    cache.save(state, url="u", version=2, manifest="m", lineage=None, selection=sel, spare=spare)
    got = cache.load()
    assert got is not None and got.selection == sel
    assert {k: raw(v) for k, v in got.tensors.items()} == {k: raw(v) for k, v in state.items()}
    assert set(got.spare) == set(spare)
    for k, v in spare.items():
        assert got.spare[k].dtype == np.uint8 and got.spare[k].tobytes() == v.tobytes()
    held = tmp_path / "c" / HELD_FILE
    doc = json.loads(held.read_text())
    for odd in ([["#group/0", "3", doc["spare"][0][2]]], [["u", 0, "no such key"]], [["u", 0]], "x"):
        held.write_text(json.dumps({**doc, "spare": odd}))
        assert cache.load() is None, odd
    held.write_text(json.dumps({**doc, "selection": ["a.*"]}))
    assert cache.load() is None


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


def _failing_writer(error: BaseException):
    """A safetensors writer that leaves half a file, then fails as a full disk does."""
    from safetensors.torch import save

    def save_file(tensors, filename, metadata=None):
        data = save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[: len(data) // 2])
        raise error

    return save_file


@pytest.mark.parametrize("error", [
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    OSError(errno.ENOSPC, "No space left on device"),
], ids=["SafetensorError", "OSError"])
def test_a_save_that_fails_midway_leaves_the_previous_state_and_no_partial_file(tmp_path, monkeypatch, error):
    import safetensors.torch

    cache = WorkerCache(tmp_path / "c")
    s1 = small_state(1)
    cache.save(s1, url="u", version=1, manifest="m1", lineage=None)
    monkeypatch.setattr(safetensors.torch, "save_file", _failing_writer(error))
    with pytest.raises(WorkerCacheError, match=f"version 2 of u in the worker cache {tmp_path / 'c'}") as got:
        cache.save(small_state(2), url="u", version=2, manifest="m2", lineage=None)
    assert isinstance(got.value, OSError) and got.value.__cause__ is error
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "c").iterdir() if "partial" in p.name or "-000000000002-" in p.name) == []
    held = WorkerCache(tmp_path / "c").load()
    assert held is not None and (held.version, held.manifest) == (1, "m1")  # what it holds, never more
    assert {k: raw(v) for k, v in held.tensors.items()} == {k: raw(v) for k, v in s1.items()}


def test_the_leftovers_of_a_killed_save_go_even_when_the_next_save_fails(tmp_path, monkeypatch):
    import safetensors.torch

    cache = WorkerCache(tmp_path / "c")
    (tmp_path / "c" / "state-000000000001-0badf00d.safetensors.partial").write_bytes(b"x" * 1000)
    (tmp_path / "c" / f"{HELD_FILE}.0badf00d.partial").write_text("{")
    monkeypatch.setattr(safetensors.torch, "save_file", _failing_writer(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(WorkerCacheError):
        cache.save(small_state(), url="u", version=2, manifest="m2", lineage=None)
    assert list((tmp_path / "c").iterdir()) == []  # they would keep a full disk full


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_cache_path_that_cannot_be_a_directory_is_a_typed_error(tmp_path, where):
    f = tmp_path / "f"
    f.write_text("not a directory")
    path = f if where == "a file" else f / "cache"
    with pytest.raises(WorkerCacheError, match=f"worker cache path {path} ") as got:
        WorkerCache(path)
    assert isinstance(got.value, DeltastoreError)
    assert f.read_text() == "not a directory"
