"""S3Store's view of its endpoint, without an S3 server: the names it catches exist, and the
endpoint check's answers."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import botocore.parsers
import pytest

from deltastore.errors import StorageError
from deltastore.storage import S3Store

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
