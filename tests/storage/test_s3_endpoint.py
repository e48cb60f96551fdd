"""S3Store's view of its endpoint, without an S3 server: the names it catches exist, the endpoint
check's answers, and the identity the conditional-write probe binds its verdict to."""

from __future__ import annotations

import ast
import http.server
import importlib
from collections.abc import Iterator
from pathlib import Path

import botocore.parsers
import pytest

from deltastore.errors import StorageError
from deltastore.storage import S3Store
from deltastore.storage.base import EndpointIdentity
from testkit.servers import http_server

S3_MODULE = Path(__file__).resolve().parents[2] / "deltastore" / "storage" / "_s3.py"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def test_every_sdk_name_the_backend_uses_exists() -> None:
    """A misspelt exception in an ``except`` clause is only evaluated when something is raised,
    and then it raises AttributeError instead of the error being translated."""
    names = set()
    for node in ast.walk(ast.parse(S3_MODULE.read_text())):
        name = _dotted(node) if isinstance(node, ast.Attribute) else None
        if name and name.split(".")[0] in ("botocore", "urllib3", "boto3") and name.count(".") >= 2:
            names.add(name)
    assert "botocore.exceptions.ClientError" in names  # the walk finds them
    missing = []
    for name in sorted(names):
        module, _, attr = name.rpartition(".")
        if not hasattr(importlib.import_module(module), attr):
            missing.append(name)
    assert missing == []


def test_unparseable_listing_is_not_an_s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    store = S3Store("s3://bucket/run", storage_options={**CREDENTIALS, "endpoint_url": "http://127.0.0.1:1", "retries": 0})

    def unparseable(**kwargs: object) -> None:
        raise botocore.parsers.ResponseParserError("Unable to parse response, invalid XML received")

    monkeypatch.setattr(store._client, "list_objects_v2", unparseable)
    with pytest.raises(StorageError, match="is not an S3 endpoint") as info:
        store.check_endpoint()
    assert "http://127.0.0.1:1" in str(info.value) and "not S3 XML" in str(info.value)


_LISTING = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bucket</Name><Prefix>run/</Prefix>'
            b"<KeyCount>0</KeyCount><MaxKeys>1</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>")
_NO_SUCH_KEY = b'<?xml version="1.0"?><Error><Code>NoSuchKey</Code><Message>no</Message></Error>'


class _TinyS3(http.server.BaseHTTPRequestHandler):
    """An empty bucket: listings answer 200, object reads 404, and errors name the server differently."""

    def do_GET(self) -> None:
        listing = "list-type=2" in self.path
        body = _LISTING if listing else _NO_SUCH_KEY
        self.send_response(200 if listing else 404)  # with "Server: TinyS3/1.0" (version_string)
        if not listing:
            self.send_header("Server", "errors")  # a second one: "TinyS3/1.0, errors", as moto does
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Server", "errors")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def version_string(self) -> str:
        return "TinyS3/1.0"

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def tiny_s3() -> Iterator[str]:
    with http_server(_TinyS3) as url:
        yield url


def test_endpoint_identity_is_what_the_client_observed(tiny_s3: str) -> None:
    port = tiny_s3.rsplit(":", 1)[1]
    with S3Store("s3://bucket/run", storage_options={**CREDENTIALS, "endpoint_url": f"HTTP://LocalHost:{port}/"}) as store:
        assert store.endpoint_identity() == EndpointIdentity(endpoint=f"http://localhost:{port}", server="")
        store.check_endpoint()  # a 200 listing
        assert store.endpoint_identity().server == "TinyS3/1.0"
        assert not store.exists("HEAD")  # a 404: its Server header is not the one kept
        assert store.endpoint_identity().server == "TinyS3/1.0"
