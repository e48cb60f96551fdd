"""URL routing and bad input for open_store."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from deltastore.errors import UnsupportedURLError
from deltastore.storage import FsspecStore, LocalStore, MemoryStore, S3Store, open_store


def test_routes_by_scheme(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(tmp_path.as_uri()), LocalStore)
    assert isinstance(open_store("memory://routing"), MemoryStore)
    s3 = open_store("s3://bucket/prefix", storage_options={"endpoint_url": "http://127.0.0.1:9"})
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.url) == ("bucket", "prefix/", "s3://bucket/prefix")
    assert s3._client.meta.config.s3["addressing_style"] == "path"  # custom endpoint → path-style


def test_s3_addressing_defaults_to_auto_on_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    store = S3Store("s3://bucket", storage_options={"region_name": "us-east-1"})
    assert store._client.meta.config.s3["addressing_style"] == "auto"
    assert store.prefix == ""


def test_s3_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store = S3Store("s3://bucket/p", storage_options={"region_name": "us-east-1"})
    assert store.endpoint_url == "http://127.0.0.1:9"
    assert store._client.meta.endpoint_url == "http://127.0.0.1:9"
    assert store._client.meta.config.s3["addressing_style"] == "path"


def test_unknown_scheme() -> None:
    with pytest.raises(UnsupportedURLError, match="nosuchscheme://x/y") as info:
        open_store("nosuchscheme://x/y")
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_other_fsspec_scheme_goes_to_fsspec(tmp_path) -> None:
    """A scheme deltastore has no backend of its own for goes to fsspec (fsspec's own
    protocols here, so the test needs no optional package)."""
    store = open_store(f"simplecache::file://{tmp_path}/run")
    assert isinstance(store, FsspecStore)
    assert store.atomic_conditional_writes is False


def test_s3a_goes_to_fsspec_when_s3fs_is_installed() -> None:
    pytest.importorskip("s3fs", reason="s3fs is not a dependency: fsspec's s3a:// needs it installed")
    store = open_store("s3a://bucket/run", storage_options={"anon": True})
    assert isinstance(store, FsspecStore)
    assert store.atomic_conditional_writes is False


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("s3://", None),
        ("s3:///prefix", None),
        ("memory://", None),
        ("memory://x", {"anon": True}),
        ("s3://bucket/p", {"not_an_option": 1}),
        ("", None),
    ],
)
def test_malformed(url: str, options: dict | None) -> None:
    with pytest.raises(UnsupportedURLError):
        open_store(url, storage_options=options)


def test_no_credentials_is_access_denied(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deltastore.errors import AccessDeniedError

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = S3Store("s3://bucket/p", storage_options={"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"})
    with pytest.raises(AccessDeniedError, match="no AWS credentials for s3://bucket/p/HEAD"):
        store.get("HEAD")
