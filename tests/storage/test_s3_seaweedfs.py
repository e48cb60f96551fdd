"""S3Store against a real SeaweedFS S3 gateway (signature checking on) over HTTP."""

from __future__ import annotations

import pytest

from deltastore.errors import AccessDeniedError, BucketNotFoundError
from deltastore.storage import S3Store, open_store
from testkit.contract import StoreContract

pytestmark = pytest.mark.integration


class TestS3SeaweedFS(StoreContract):
    @pytest.fixture
    def store(self, seaweedfs_s3_url):
        with seaweedfs_s3_url.open() as store:
            assert isinstance(store, S3Store)
            yield store


@pytest.mark.parametrize(
    "override",
    [{"aws_secret_access_key": "wrong-secret"}, {"aws_access_key_id": "unknown-key"}],
    ids=["bad-secret", "unknown-key"],
)
def test_wrong_credentials(seaweedfs_server, override) -> None:
    url = f"s3://{seaweedfs_server.bucket}/creds"
    store = open_store(url, storage_options=seaweedfs_server.storage_options(**override))
    for op in (
        lambda: store.get("HEAD"),
        lambda: store.head("HEAD"),
        lambda: store.put("HEAD", b"x", mode="create"),
        lambda: list(store.list()),
    ):
        with pytest.raises(AccessDeniedError) as info:
            op()
        message = str(info.value)
        assert url in message and "\n" not in message
        assert "wrong-secret" not in message and seaweedfs_server.secret_key not in message
    assert isinstance(info.value, PermissionError)


def test_missing_bucket(seaweedfs_server) -> None:
    store = open_store("s3://no-such-bucket-here/run1", storage_options=seaweedfs_server.storage_options())
    for op in (
        lambda: store.get("HEAD"),
        lambda: store.head("HEAD"),
        lambda: store.put("HEAD", b"x", mode="create"),
    ):
        with pytest.raises(BucketNotFoundError, match="no-such-bucket-here"):
            op()
