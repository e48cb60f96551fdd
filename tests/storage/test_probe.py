"""The conditional-write probe: passes on real servers, refuses endpoints that fake it."""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from deltastore.errors import AlreadyExistsError, PreconditionFailedError, StorageError, UnsafeStoreError
from deltastore.storage import FsspecStore, IfMatch, MemoryStore, ObjectMeta, open_store
from deltastore.storage import probe as probe_module
from deltastore.storage.base import EndpointIdentity, PutMode, Store
from deltastore.storage.probe import (
    PROBE_MAX_AGE_S,
    PROBE_PREFIX,
    PROBE_RESULT_KEY,
    ProbeBinding,
    ProbeResult,
    cached_probe,
    observe_binding,
    probe_conditional_writes,
    require_atomic_writes,
)
from deltastore.write.policy import WriterPolicy
from testkit.proxy import ScriptedProxy


def _count_puts(monkeypatch: pytest.MonkeyPatch, store: Store) -> list[str]:
    keys: list[str] = []
    real = store.put

    def put(key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        keys.append(key)
        return real(key, data, mode=mode)

    monkeypatch.setattr(store, "put", put)
    return keys


def _count_probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs of every full probe run from now on."""
    urls: list[str] = []
    real = probe_module.probe_conditional_writes

    def probe(store: Store) -> ProbeResult:
        urls.append(store.url)
        return real(store)

    monkeypatch.setattr(probe_module, "probe_conditional_writes", probe)
    return urls


# --- real servers ---------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "server"), [("moto_s3_url", "Werkzeug/"), ("seaweedfs_s3_url", "SeaweedFS")])
def test_probe_passes_on_real_servers_and_is_cached(kind: str, server: str, request, monkeypatch) -> None:
    target = request.getfixturevalue(kind)
    with target.open() as store:
        result = require_atomic_writes(store)
        assert result is not None and result.ok, result
        assert "refused" in result.detail
        assert result.binding.endpoint == target.storage_options["endpoint_url"]
        assert result.binding.store == target.url
        assert result.binding.server.startswith(server) and "amazon.com" not in result.binding.server
        assert [m.key for m in store.list(PROBE_PREFIX)] == []  # probe keys cleaned up
        assert [m.key for m in store.list()] == [PROBE_RESULT_KEY]
        assert cached_probe(store) == result
    with target.open() as store:  # the next publisher, its own client
        puts = _count_puts(monkeypatch, store)
        probes = _count_probes(monkeypatch)
        assert require_atomic_writes(store) == result
        assert probes == []  # trusted the cached verdict,
        assert puts == [PROBE_RESULT_KEY]  # after one create-only PUT of it was refused
        assert cached_probe(store) == result


@pytest.mark.integration
def test_probe_refuses_endpoint_that_ignores_conditional_headers(moto_server) -> None:
    """rclone's serve s3 emulated: a proxy strips If-None-Match/If-Match (moto checks no signatures)."""
    url = f"s3://{moto_server.bucket}/probe-{uuid.uuid4().hex[:8]}"
    with ScriptedProxy(moto_server.endpoint_url, strip_request_headers=("If-None-Match", "If-Match")) as proxy:
        with open_store(url, storage_options=moto_server.storage_options(endpoint_url=proxy.endpoint_url)) as store:
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


class LosesResponses(MemoryStore):
    """A conforming endpoint whose answer to a winning conditional PUT of a key matching
    ``lost`` is lost after the write landed: the SDK's retry of it is then refused, as a retry
    on a real server is (the write stands, the caller sees AlreadyExistsError or
    PreconditionFailedError)."""

    conditional_writes_need_probe = True
    lost: tuple[str, ...] = ()

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        meta = super().put(key, data, mode=mode)
        if mode != "overwrite" and key.endswith(self.lost):
            self.lost = tuple(s for s in self.lost if not key.endswith(s))  # once per key
            raise AlreadyExistsError(f"{key} exists") if mode == "create" else PreconditionFailedError(f"{key} changed")
        return meta


@pytest.mark.parametrize("lost", [("/create",), ("/create-race-0", "/cas-race-0"), ("/create-race-0", "/create-race-1")])
def test_a_lost_response_during_the_probe_is_resolved_by_reading_the_store(lost) -> None:
    """A lost answer to the first create-only PUT (the key holds our bytes), or a race whose
    winner's answer was lost (no winner seen: run again on a fresh key), is no verdict on the
    endpoint: the probe passes."""
    store = LosesResponses(f"memory://{uuid.uuid4().hex}")
    store.lost = lost
    result = require_atomic_writes(store)
    assert result is not None and result.ok, result
    assert store.lost == ()  # each lost response did happen
    assert [m.key for m in store.list(PROBE_PREFIX)] == []


def test_a_race_never_answered_is_a_storage_error_not_an_unsafe_endpoint() -> None:
    """Every run of the create-only race loses its winner's answer: nothing is concluded about
    the endpoint, so the error is a StorageError to retry, not UnsafeStoreError (whose advice,
    allow_unsafe_store=True, would drop the protection on an endpoint that has it)."""
    store = LosesResponses(f"memory://{uuid.uuid4().hex}")
    store.lost = tuple(f"/create-race-{i}" for i in range(probe_module.PROBE_RACE_ATTEMPTS))
    with pytest.raises(StorageError, match="could not tell") as info:
        require_atomic_writes(store)
    assert not isinstance(info.value, UnsafeStoreError)
    assert "0 won, 4 refused" in str(info.value)
    assert not store.exists(PROBE_RESULT_KEY)  # no verdict cached


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
    binding = ProbeBinding("http://127.0.0.1:8333", "s3://b/run", "SeaweedFS 8000GB 4.48")
    result = ProbeResult(True, True, False, True, True, "x", "0.1.0", "2026-01-01T00:00:00+00:00", binding)
    assert ProbeResult.from_json(result.to_json()) == result
    assert json.loads(result.to_json())["binding"] == {"endpoint": "http://127.0.0.1:8333", "store": "s3://b/run",
                                                      "server": "SeaweedFS 8000GB 4.48"}
    assert not result.ok
    assert ProbeResult.from_json(b'{"format": "deltastore.probe", "schema": 99}') is None
    assert ProbeResult.from_json(result.to_json().replace(b"false", b'"no"')) is None
    unbound = json.loads(result.to_json())
    del unbound["binding"]
    assert ProbeResult.from_json(json.dumps(unbound).encode()) is None
    unbound["binding"] = {"endpoint": "http://127.0.0.1:8333", "store": "s3://b/run", "server": None}
    assert ProbeResult.from_json(json.dumps(unbound).encode()) is None


# --- the verdict's binding: earned where it is used ------------------------------------------


class RemoteMemory(MemoryStore):
    """An in-process store that reports an endpoint identity, as S3Store does; the test sets it."""

    conditional_writes_need_probe = True

    def __init__(self, url: str, endpoint: str = "http://10.0.0.7:8333", server: str = "SeaweedFS 4.48"):
        super().__init__(url)
        self.identity = EndpointIdentity(endpoint=endpoint, server=server)

    def endpoint_identity(self) -> EndpointIdentity:
        return self.identity


class RemoteIgnoresModes(RemoteMemory):
    """Reports an identity and ignores every put's condition (s3rver, rclone serve s3)."""

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        return super().put(key, data, mode="overwrite")


def _rewrite_verdict(store: Store, **changes: object) -> None:
    body = json.loads(store.get(PROBE_RESULT_KEY))
    binding = changes.pop("binding", None)
    if binding is not None:
        body["binding"].update(binding)
    body.update(changes)
    store.put(PROBE_RESULT_KEY, json.dumps(body).encode())


def test_matching_fresh_verdict_is_reused_without_probing(monkeypatch) -> None:
    store = RemoteMemory(f"memory://{uuid.uuid4().hex}")
    first = require_atomic_writes(store)
    assert first is not None and first.ok
    assert first.binding == ProbeBinding("http://10.0.0.7:8333", store.url, "SeaweedFS 4.48")
    probes = _count_probes(monkeypatch)
    puts = _count_puts(monkeypatch, store)
    assert require_atomic_writes(store) == first
    assert probes == [] and puts == [PROBE_RESULT_KEY]  # only the refused create-only check
    assert cached_probe(store) == first


def _older(seconds: float) -> str:
    return (datetime.now(timezone.utc) - timedelta(seconds=seconds)).isoformat(timespec="seconds")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"binding": {"endpoint": "http://10.0.0.8:8333"}}, "endpoint"),
        ({"binding": {"server": "MinIO"}}, "server"),
        ({"binding": {"server": ""}}, "server"),
        ({"binding": {"store": "s3://other-bucket/run"}}, "store"),
        ({"probed_at": _older(PROBE_MAX_AGE_S + 60)}, "old"),
        ({"probed_at": _older(-86400)}, "in the future"),
        ({"probed_at": "2026-01-01T00:00:00"}, "not a UTC timestamp"),
        ({"probed_at": "yesterday"}, "not a UTC timestamp"),
    ],
)  # fmt: skip
def test_verdict_for_another_binding_or_too_old_is_probed_again(change, why, monkeypatch, caplog) -> None:
    store = RemoteMemory(f"memory://{uuid.uuid4().hex}")
    require_atomic_writes(store)
    _rewrite_verdict(store, **change)
    probes = _count_probes(monkeypatch)
    with caplog.at_level(logging.INFO, logger="deltastore.storage.probe"):
        result = require_atomic_writes(store)
    assert probes == [store.url]
    assert result is not None and result.ok
    assert result.binding == ProbeBinding("http://10.0.0.7:8333", store.url, "SeaweedFS 4.48")
    assert cached_probe(store) == result  # the new verdict replaced the foreign one
    assert why in caplog.text


def test_a_verdict_just_within_its_age_is_reused(monkeypatch) -> None:
    store = RemoteMemory(f"memory://{uuid.uuid4().hex}")
    require_atomic_writes(store)
    _rewrite_verdict(store, probed_at=_older(PROBE_MAX_AGE_S - 60))
    probes = _count_probes(monkeypatch)
    require_atomic_writes(store)
    assert probes == []


def test_same_objects_through_another_endpoint_are_probed_again(monkeypatch) -> None:
    """One bucket, reached through a gateway: the verdict earned directly is not the gateway's."""
    url = f"memory://{uuid.uuid4().hex}"
    require_atomic_writes(RemoteMemory(url))
    gateway = RemoteMemory(url, endpoint="https://gateway.example:443", server="nginx")
    probes = _count_probes(monkeypatch)
    result = require_atomic_writes(gateway)
    assert probes == [url]
    assert result is not None and result.binding.endpoint == "https://gateway.example:443"


def test_copied_or_forged_verdict_never_makes_an_unsafe_endpoint_safe(monkeypatch) -> None:
    """A verdict that passed, names exactly this endpoint and is fresh (a copy made with the
    binding rewritten, or written by whoever can write the store) still does not pass an
    endpoint that ignores If-None-Match: the create-only PUT of probe.json is not refused."""
    safe = RemoteMemory(f"memory://{uuid.uuid4().hex}")
    require_atomic_writes(safe)
    unsafe = RemoteIgnoresModes(f"memory://{uuid.uuid4().hex}", endpoint="http://10.0.0.9:4568", server="")
    unsafe.put(PROBE_RESULT_KEY, safe.get(PROBE_RESULT_KEY))
    _rewrite_verdict(unsafe, binding=dict(endpoint="http://10.0.0.9:4568", store=unsafe.url, server=""))
    forged = cached_probe(unsafe)
    assert forged is not None and forged.ok and forged.binding == observe_binding(unsafe)
    probes = _count_probes(monkeypatch)
    with pytest.raises(UnsafeStoreError, match="a second create-only PUT"):
        require_atomic_writes(unsafe)
    assert probes == [unsafe.url]
    cached = cached_probe(unsafe)
    assert cached is not None and not cached.ok  # the forged verdict is replaced by the truth


def test_older_schema_is_probed_again_quietly(monkeypatch, caplog) -> None:
    store = RemoteMemory(f"memory://{uuid.uuid4().hex}")
    old = {"format": "deltastore.probe", "schema": 1, "create_only_ok": True, "if_match_ok": True,
           "if_match_missing_ok": True, "create_race_ok": True, "if_match_race_ok": True, "detail": "ok",
           "deltastore_version": "0.1.0", "probed_at": _older(60)}
    store.put(PROBE_RESULT_KEY, json.dumps(old).encode())
    probes = _count_probes(monkeypatch)
    with caplog.at_level(logging.INFO, logger="deltastore.storage.probe"):
        result = require_atomic_writes(store)
    assert probes == [store.url] and result is not None and result.ok
    assert "probe schema 1" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_store_without_an_endpoint_binds_to_its_url() -> None:
    store = MemoryStore(f"memory://{uuid.uuid4().hex}")
    store.conditional_writes_need_probe = True
    assert observe_binding(store) == ProbeBinding(endpoint="", store=store.url, server="")


# --- a store copied from a safe server to one that ignores conditional writes -----------------


@pytest.mark.integration
def test_s3rver_ignores_conditional_writes(s3rver_server) -> None:
    """The fixture's premise: on a fresh prefix of s3rver the probe refuses."""
    url = s3rver_server.url(f"fresh-{uuid.uuid4().hex[:8]}")
    with open_store(url, storage_options=s3rver_server.storage_options()) as store:
        with pytest.raises(UnsafeStoreError, match="a second create-only PUT") as info:
            require_atomic_writes(store)
        assert "an If-Match PUT with a wrong ETag succeeded" in str(info.value)
        cached = cached_probe(store)
        assert cached is not None and cached.binding.endpoint == s3rver_server.endpoint_url


def _copy_objects(source, target, prefix: str) -> list[str]:
    """Every object under ``prefix`` from one server to the other, as ``aws s3 sync`` copies."""
    src, dst = source.boto3_client(), target.boto3_client()
    keys = []
    for page in src.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            body = src.get_object(Bucket=source.bucket, Key=obj["Key"])["Body"].read()
            dst.put_object(Bucket=target.bucket, Key=obj["Key"], Body=body)
            keys.append(obj["Key"][len(prefix):])
    return keys


@pytest.mark.integration
def test_store_copied_to_a_server_without_conditional_writes_is_refused(seaweedfs_server, s3rver_server) -> None:
    """Three versions published to SeaweedFS, every object copied to s3rver (probe.json too):
    two publishers there must be refused, not both commit version 4 and lose one of them."""
    import torch

    from deltastore import Publisher

    prefix = f"copied-{uuid.uuid4().hex[:8]}"
    with Publisher(seaweedfs_server.url(prefix), storage_options=seaweedfs_server.storage_options()) as pub:
        for step in range(3):
            pub.publish({"w": torch.full((64,), float(step))})
    keys = _copy_objects(seaweedfs_server, s3rver_server, prefix + "/")
    assert PROBE_RESULT_KEY in keys and "HEAD" in keys

    url, opts = s3rver_server.url(prefix), s3rver_server.storage_options()
    opened, refused = [], []
    for _ in range(2):
        try:
            opened.append(Publisher(url, storage_options=opts, writer_policy=WriterPolicy(takeover=False)))
        except UnsafeStoreError as e:
            refused.append(str(e))
    published = []
    for i, pub in enumerate(opened):
        with pub:
            published.append(pub.publish({"w": torch.full((64,), 10.0 + i)}).version)
    assert published == [], f"both publishers committed on s3rver: versions {published}"
    assert len(refused) == 2 and all(url in message for message in refused)


def test_publisher_refuses_an_endpoint_that_ignores_conditional_writes(moto_server):
    """Publisher runs the probe: behind a header-stripping proxy (rclone-like) it refuses to
    start, and with allow_unsafe_store=True (a single writer) it publishes."""
    import torch

    from deltastore import Publisher, UnsafeStoreError

    with ScriptedProxy(moto_server.endpoint_url, strip_request_headers=("If-None-Match", "If-Match")) as proxy:
        url = f"s3://{moto_server.bucket}/{uuid.uuid4().hex}"
        opts = moto_server.storage_options(endpoint_url=proxy.endpoint_url)
        with pytest.raises(UnsafeStoreError, match="allow_unsafe_store"):
            Publisher(url, storage_options=opts)
        with Publisher(url, storage_options=opts, writer_policy=WriterPolicy(allow_unsafe_store=True)) as pub:
            assert pub.publish({"w": torch.ones(4)}).version == 1
