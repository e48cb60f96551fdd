"""GCSStore against fake-gcs-server over HTTP (it honours ifGenerationMatch): the contract, GCS's
own errors and routing, and the probe's refusal of gcp-storage-emulator (which ignores it). What
GCS and Azure promise alike is tested in test_cloud.py."""

from __future__ import annotations

import pytest

from deltastore.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    StorageError,
    UnsafeStoreError,
    UnsupportedURLError,
)
from deltastore.storage import GCSStore, open_store
from deltastore.storage.probe import require_atomic_writes
from testkit.contract import StoreContract
from testkit.targets import unique_prefix

pytestmark = pytest.mark.integration


class TestGCSFakeServer(StoreContract):
    @pytest.fixture
    def store(self, gcs_url):
        with gcs_url.open() as store:
            assert isinstance(store, GCSStore)
            yield store


def test_unreadable_credentials_are_one_typed_line(fake_gcs_server, tmp_path) -> None:
    missing = tmp_path / "no-such-key.json"
    with pytest.raises(AccessDeniedError) as info:
        open_store("gs://bucket/run1", storage_options=fake_gcs_server.storage_options(token=str(missing)))
    message = str(info.value)
    assert "gs://bucket/run1" in message and str(missing) in message and "\n" not in message
    with pytest.raises(UnsupportedURLError, match="aws_access_key_id"):
        open_store("gs://bucket/run1", storage_options={"aws_access_key_id": "x"})


def test_probe_refuses_a_server_that_ignores_generation_preconditions(gcp_storage_emulator_server) -> None:
    """gcp-storage-emulator accepts ifGenerationMatch and ignores it: two creates both win."""
    server = gcp_storage_emulator_server
    with open_store(server.url(unique_prefix()), storage_options=server.storage_options()) as store:
        with pytest.raises(UnsafeStoreError) as info:
            require_atomic_writes(store)
        message = str(info.value)
        assert store.url in message and "create-only" in message and "\n" not in message
        assert require_atomic_writes(store, allow_unsafe_store=True) is None


def test_open_store_routes_gs_and_gcs(fake_gcs_server) -> None:
    for scheme in ("gs", "gcs"):
        with open_store(f"{scheme}://b/run", storage_options=fake_gcs_server.storage_options()) as store:
            assert isinstance(store, GCSStore) and store.atomic_conditional_writes
            assert store.url == "gs://b/run"
    with pytest.raises(StorageError):  # nothing listens there: a typed error, after few attempts
        open_store("gs://b/run", storage_options={"endpoint_url": "http://127.0.0.1:9", "retries": 1}).head("k")





def test_without_the_sdk_gs_names_the_extra_or_falls_back_to_fsspec(monkeypatch) -> None:
    """Without google-cloud-storage: gcsfs if installed (checks then writes, so refused for
    concurrent publishers), else an error naming the extra."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "google.cloud.storage" else real(name, *a))
    if real("gcsfs") is None:
        with pytest.raises(UnsupportedURLError) as info:
            open_store("gs://bucket/run")
        assert "deltastore-weights[gcs]" in str(info.value) and "gcsfs" in str(info.value)
    else:
        store = open_store("gs://bucket/run", storage_options={"token": "anon"})
        assert not isinstance(store, GCSStore) and not store.atomic_conditional_writes
        with pytest.raises(UnsafeStoreError):
            require_atomic_writes(store)


def _scripted_gcs(answers: list[tuple[int, dict]]):
    """An HTTP handler answering GCS JSON API requests from ``answers`` in order (the last one
    repeats), and the list of paths it was asked for."""
    import http.server
    import json as json_module

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            if "/o" not in self.path.split("?")[0]:  # the SDK's own bucket-metadata GET (trace attributes)
                status, body = _error(403, "no storage.buckets.get")
            else:
                seen.append(f"{self.command} {self.path}")
                status, body = answers[min(len(seen), len(answers)) - 1]
            data = json_module.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    return Handler, seen


def _error(code: int, message: str) -> tuple[int, dict]:
    return code, {"error": {"code": code, "message": message, "errors": [{"message": message}]}}


def test_throttling_is_retried_and_a_refusal_is_not(monkeypatch) -> None:
    """429 (GCS's answer above about one write per second to an object) is retried with backoff;
    403 is one typed line naming the URL; 412 is answered once, as a refusal."""
    import deltastore.storage._cloud as cloud
    from testkit.servers import http_server

    monkeypatch.setattr(cloud, "THROTTLE_BACKOFF_BASE_S", 0.001)
    meta = {"name": "run/HEAD", "bucket": "b", "generation": "7", "size": "2", "md5Hash": "1B2M2Y8AsgTpgAmY7PhCfg=="}
    handler, seen = _scripted_gcs([_error(429, "rate limit"), _error(429, "rate limit"), (200, meta)])
    with http_server(handler) as endpoint:
        store = open_store("gs://b/run", storage_options={"endpoint_url": endpoint, "retries": 3})
        assert store.head("HEAD").etag == "d41d8cd98f00b204e9800998ecf8427e"
    assert len(seen) == 3
    handler, seen = _scripted_gcs([_error(403, "caller does not have storage.objects.get access")])
    with http_server(handler) as endpoint:
        store = open_store("gs://b/run", storage_options={"endpoint_url": endpoint, "retries": 3})
        with pytest.raises(AccessDeniedError) as info:
            store.head("HEAD")
        assert "gs://b/run/HEAD" in str(info.value) and "\n" not in str(info.value)
    assert len(seen) == 1
    handler, seen = _scripted_gcs([_error(412, "conditionNotMet")])
    with http_server(handler) as endpoint:
        store = open_store("gs://b/run", storage_options={"endpoint_url": endpoint, "retries": 3})
        with pytest.raises(AlreadyExistsError):
            store.put("HEAD", b"x", mode="create")
    assert len(seen) == 1
