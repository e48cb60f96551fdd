"""The conditional-write probe: passes on real servers, refuses endpoints that fake it."""

from __future__ import annotations

import time
import uuid

import pytest

from deltastore.errors import AlreadyExistsError, PreconditionFailedError, UnsafeStoreError
from deltastore.storage import FsspecStore, IfMatch, MemoryStore, ObjectMeta, open_store
from deltastore.storage.base import PutMode, Store
from deltastore.storage.probe import (
    PROBE_PREFIX,
    PROBE_RESULT_KEY,
    ProbeResult,
    cached_probe,
    probe_conditional_writes,
    require_atomic_writes,
)
from tests.storage.faultproxy import FaultProxy


def _count_puts(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[str]:
    keys: list[str] = []
    real = store.put

    def put(key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        keys.append(key)
        return real(key, data, mode=mode)

    monkeypatch.setattr(store, "put", put)
    return keys


# --- real servers ---------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["moto_s3_url", "seaweedfs_s3_url"])
def test_probe_passes_on_real_servers_and_is_cached(kind: str, request, monkeypatch) -> None:
    with request.getfixturevalue(kind).open() as store:
        result = require_atomic_writes(store)
        assert result is not None and result.ok, result
        assert "refused" in result.detail
        assert [m.key for m in store.list(PROBE_PREFIX)] == []  # probe keys cleaned up
        assert [m.key for m in store.list()] == [PROBE_RESULT_KEY]
        assert cached_probe(store) == result
        puts = _count_puts(monkeypatch, store)
        assert require_atomic_writes(store) == result
        assert puts == []  # the second publisher trusts the cached verdict


@pytest.mark.integration
def test_probe_refuses_endpoint_that_ignores_conditional_headers(moto_server) -> None:
    """rclone's serve s3 emulated: a proxy strips If-None-Match/If-Match (moto checks no signatures)."""
    url = f"s3://{moto_server.bucket}/probe-{uuid.uuid4().hex[:8]}"
    with FaultProxy(moto_server.endpoint_url, strip_request_headers=("If-None-Match", "If-Match")) as proxy:
        with open_store(url, storage_options=moto_server.storage_options(endpoint_url=proxy.url)) as store:
            with pytest.raises(UnsafeStoreError) as info:
                require_atomic_writes(store)
            message = str(info.value)
            assert url in message
            assert "a second create-only PUT (If-None-Match: *) of an existing key succeeded" in message
            assert "allow_unsafe_store=True" in message and "\n" not in message
            cached = cached_probe(store)
            assert cached is not None and not cached.ok
            assert not (cached.create_only_ok or cached.if_match_ok or cached.if_match_missing_ok)
            assert not (cached.create_race_ok or cached.if_match_race_ok)
            assert require_atomic_writes(store, allow_unsafe_store=True) is None
    with open_store(url, storage_options=moto_server.storage_options()) as direct:
        # the same bucket straight to moto: the cached failure is probed again, and passes
        result = require_atomic_writes(direct)
        assert result is not None and result.ok


# --- in-process endpoints that fake conditional writes ---------------------------------------


class IgnoresModes(MemoryStore):
    """Every put is an overwrite, like rclone serve s3."""

    conditional_writes_need_probe = True

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        return super().put(key, data, mode="overwrite")


class IfMatchCreatesMissing(MemoryStore):
    """If-Match on a missing key writes it (MinIO before the fix of issue #21526)."""

    conditional_writes_need_probe = True

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        if isinstance(mode, IfMatch) and not self.exists(key):
            mode = "overwrite"
        return super().put(key, data, mode=mode)


class CheckThenWrite(MemoryStore):
    """Right answers one at a time, but the check and the write are not atomic."""

    conditional_writes_need_probe = True

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        current = self.head(key) if self.exists(key) else None
        if mode == "create" and current is not None:
            raise AlreadyExistsError(f"{key} exists")
        if isinstance(mode, IfMatch) and (current is None or current.etag != mode.etag):
            raise PreconditionFailedError(f"{key} changed")
        time.sleep(0.05)  # the window in which every racer has checked
        return super().put(key, data, mode="overwrite")


@pytest.mark.parametrize(
    ("store_cls", "failed", "said"),
    [
        (IgnoresModes, {"create_only_ok", "if_match_ok", "if_match_missing_ok", "create_race_ok", "if_match_race_ok"},
         "a second create-only PUT"),
        (IfMatchCreatesMissing, {"if_match_missing_ok"}, "an If-Match PUT on a missing key succeeded"),
        (CheckThenWrite, {"create_race_ok", "if_match_race_ok"}, "4 concurrent create-only PUTs of one key: 4 won"),
    ],
)  # fmt: skip
def test_probe_names_what_the_endpoint_did(store_cls, failed, said) -> None:
    store = store_cls(f"memory://{uuid.uuid4().hex}")
    result = probe_conditional_writes(store)
    flags = {"create_only_ok", "if_match_ok", "if_match_missing_ok", "create_race_ok", "if_match_race_ok"}
    assert {f for f in flags if not getattr(result, f)} == failed
    assert said in result.detail
    with pytest.raises(UnsafeStoreError, match="allow_unsafe_store=True") as info:
        require_atomic_writes(store)
    assert said in str(info.value)
    assert [m.key for m in store.list(PROBE_PREFIX)] == []


def test_local_and_memory_are_not_probed(tmp_path, monkeypatch) -> None:
    for store in (open_store(str(tmp_path / "s")), open_store(f"memory://{uuid.uuid4().hex}")):
        puts = _count_puts(monkeypatch, store)
        assert require_atomic_writes(store) is None
        assert puts == [] and list(store.list()) == []


def test_fsspec_store_is_refused_without_probing(monkeypatch) -> None:
    fs_store = FsspecStore.from_url(f"memory://probe-{uuid.uuid4().hex}")  # fsspec's memory fs
    puts = _count_puts(monkeypatch, fs_store)
    with pytest.raises(UnsafeStoreError, match="allow_unsafe_store=True"):
        require_atomic_writes(fs_store)
    assert puts == []
    assert require_atomic_writes(fs_store, allow_unsafe_store=True) is None


def test_unreadable_cache_is_ignored_and_rewritten() -> None:
    store = MemoryStore(f"memory://{uuid.uuid4().hex}")
    store.conditional_writes_need_probe = True
    store.put(PROBE_RESULT_KEY, b"{not json")
    assert cached_probe(store) is None
    result = require_atomic_writes(store)
    assert result is not None and result.ok and cached_probe(store) == result


def test_probe_result_json_roundtrip() -> None:
    result = ProbeResult(True, True, False, True, True, "x", "0.1.0", "2026-01-01T00:00:00+00:00")
    assert ProbeResult.from_json(result.to_json()) == result
    assert not result.ok
    assert ProbeResult.from_json(b'{"format": "deltastore.probe", "schema": 99}') is None
    assert ProbeResult.from_json(result.to_json().replace(b"false", b'"no"')) is None


def test_publisher_refuses_an_endpoint_that_ignores_conditional_writes(moto_server):
    """Publisher runs the probe: behind a header-stripping proxy (rclone-like) it refuses to
    start, and with allow_unsafe_store=True (a single writer) it publishes."""
    import torch

    from deltastore import Publisher, UnsafeStoreError

    with FaultProxy(moto_server.endpoint_url, strip_request_headers=("If-None-Match", "If-Match")) as proxy:
        url = f"s3://{moto_server.bucket}/{uuid.uuid4().hex}"
        opts = moto_server.storage_options(endpoint_url=proxy.url)
        with pytest.raises(UnsafeStoreError, match="allow_unsafe_store"):
            Publisher(url, storage_options=opts)
        with Publisher(url, storage_options=opts, allow_unsafe_store=True) as pub:
            assert pub.publish({"w": torch.ones(4)}).version == 1
