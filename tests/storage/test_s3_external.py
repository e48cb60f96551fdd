"""The contract suite against any S3-compatible server you point it at (MinIO, R2, AWS, ...).

Skipped unless ``DELTASTORE_TEST_S3_URL`` is set, e.g.::

    AWS_ENDPOINT_URL=http://127.0.0.1:9000 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    DELTASTORE_TEST_S3_URL=s3://deltastore/contract pytest tests/storage/test_s3_external.py

Each test writes under a fresh ``<url>/t-<random>/`` prefix and deletes what it wrote.
"""

from __future__ import annotations

import os
import uuid

import pytest

from deltastore.storage import open_store
from testkit.contract import StoreContract

EXTERNAL_URL = os.environ.get("DELTASTORE_TEST_S3_URL")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not EXTERNAL_URL, reason="set DELTASTORE_TEST_S3_URL=s3://bucket/prefix to run"),
]


class TestS3External(StoreContract):
    @pytest.fixture
    def store(self):
        store = open_store(f"{EXTERNAL_URL.rstrip('/')}/t-{uuid.uuid4().hex[:12]}")
        yield store
        for meta in store.list():
            store.delete(meta.key)
        store.close()
