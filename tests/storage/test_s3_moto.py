"""S3Store against a moto server over real HTTP."""

from __future__ import annotations

import logging

import pytest

from deltastore.errors import BucketNotFoundError, NotFoundError, StorageError
from deltastore.storage import IfMatch, S3Store, open_store
from testkit.contract import StoreContract

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


def test_head_cut_short_is_a_typed_error(moto_s3_url) -> None:
    """A HEAD answer whose headers were truncated in transit (the fault campaign's "truncate")
    carries an ETag but no Content-Length: a StorageError naming the object, not a KeyError."""
    from botocore.stub import ANY, Stubber

    store = moto_s3_url.open()
    with Stubber(store._client) as stub:
        stub.add_response("head_object", {"ETag": '"d41d8cd98f00b204e9800998ecf8427e"'}, {"Bucket": ANY, "Key": ANY})
        with pytest.raises(StorageError, match="without its size") as info:
            store.head("HEAD")
    assert "HEAD" in str(info.value) and not isinstance(info.value, KeyError)


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


SECRET = "SECRETdeltastore-test-6b1f0c9e2a7d4f31"
TOKEN = "TOKENdeltastore-session-3c8a9e1f5b2d4c60"


@pytest.mark.parametrize("kind", ["moto_server", "seaweedfs_server"])
def test_credentials_never_logged_nor_in_errors(kind, request, caplog) -> None:
    """Distinctive secret key and session token: through put/get/list and failures (moto accepts
    any credentials; SeaweedFS rejects them, so every call fails there), with DEBUG logging of
    deltastore and botocore captured, neither appears in a log record, repr, str or error."""
    from deltastore.errors import DeltastoreError

    server = request.getfixturevalue(kind)
    options = server.storage_options(
        aws_access_key_id="AKIDDELTASTORETEST", aws_secret_access_key=SECRET, aws_session_token=TOKEN
    )
    texts: list[str] = []
    caplog.set_level(logging.DEBUG)  # root: botocore, urllib3, s3transfer, deltastore all propagate
    for name in ("botocore", "boto3", "urllib3", "deltastore"):
        caplog.set_level(logging.DEBUG, logger=name)
    store = open_store(f"s3://{server.bucket}/creds-{kind}", storage_options=options)
    texts += [repr(store), str(store)]
    ops = [
        lambda: store.put("k", b"v", mode="create"),
        lambda: store.put("k", b"v", mode="create"),  # AlreadyExists on moto
        lambda: store.put("k", b"w", mode=IfMatch("0" * 32)),
        lambda: store.get("k"),
        lambda: store.get("missing"),
        lambda: store.get_if_changed("k", "0" * 32),
        lambda: store.head("missing"),
        lambda: list(store.list()),
        lambda: store.delete("k"),
        lambda: open_store("s3://no-such-bucket-x/y", storage_options=options).get("k"),
    ]
    errors = 0
    for op in ops:
        try:
            op()
        except DeltastoreError as e:
            errors += 1
            texts += [str(e), repr(e), repr(e.__cause__), str(e.__cause__)]
    assert errors >= 3
    texts += [r.getMessage() for r in caplog.records]
    texts += [str(r.args) for r in caplog.records]
    assert any("PutObject" in t or "put_object" in t.lower() for t in texts)  # botocore did log
    leaked = [t[:200] for t in texts if SECRET in t or TOKEN in t]
    assert leaked == []
    # botocore does log the token header at DEBUG; it reaches handlers redacted, not dropped
    assert any("X-Amz-Security-Token': b'<redacted>'" in r.getMessage() for r in caplog.records)
