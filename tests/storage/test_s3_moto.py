"""S3Store against a moto server over real HTTP."""

from __future__ import annotations

import pytest

from deltastore.errors import BucketNotFoundError, NotFoundError
from deltastore.storage import S3Store, open_store
from tests.storage.contract import StoreContract

pytestmark = pytest.mark.integration


class TestS3Moto(StoreContract):
    @pytest.fixture
    def store(self, moto_s3_url):
        with moto_s3_url.open() as store:
            assert isinstance(store, S3Store)
            yield store


def test_missing_bucket(moto_server) -> None:
    store = open_store("s3://no-such-bucket-here/run1", storage_options=moto_server.storage_options())
    for op in (
        lambda: store.get("HEAD"),
        lambda: store.head("HEAD"),
        lambda: store.put("HEAD", b"x", mode="create"),
        lambda: list(store.list()),
    ):
        with pytest.raises(BucketNotFoundError) as info:
            op()
        message = str(info.value)
        assert "no-such-bucket-here" in message and "\n" not in message


def test_head_missing_key_in_existing_bucket_is_not_found(moto_s3_url) -> None:
    store = moto_s3_url.open()
    with pytest.raises(NotFoundError):
        store.head("missing")
    with pytest.raises(NotFoundError):  # the bucket check is cached; still NotFound
        store.head("missing")


def test_prefix_isolates_stores(moto_server) -> None:
    options = moto_server.storage_options()
    a = open_store(f"s3://{moto_server.bucket}/iso/a", storage_options=options)
    b = open_store(f"s3://{moto_server.bucket}/iso/ab", storage_options=options)
    a.put("k", b"1")
    b.put("k", b"2")
    assert [m.key for m in a.list()] == ["k"]
    assert a.get("k") == b"1" and b.get("k") == b"2"
    client = moto_server.boto3_client()
    assert client.get_object(Bucket=moto_server.bucket, Key="iso/a/k")["Body"].read() == b"1"


def test_repr_hides_credentials(moto_server) -> None:
    options = moto_server.storage_options(aws_secret_access_key="s3cr3t-value", aws_access_key_id="AKIDVALUE")
    store = open_store(f"s3://{moto_server.bucket}/x", storage_options=options)
    assert "s3cr3t-value" not in repr(store) and "AKIDVALUE" not in repr(store)
    assert "s3://deltastore-test/x" in repr(store)
