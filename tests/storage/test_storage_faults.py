"""S3Store under faults, over real HTTP to moto and SeaweedFS (docs/reliability.md: D1, D4, D9, reads).

Faults come from two places: a botocore ``before-send`` hook on the store's client (a 409 answer
without touching the server, or a byte flipped in the request body after its checksum was
computed), and :class:`~testkit.proxy.ScriptedProxy` in front of the server (a response
body cut short, shortened, or altered on the way back).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable, Iterator

import pytest
from botocore.awsrequest import AWSResponse

from deltastore.errors import (
    AlreadyExistsError,
    ConcurrentWriteError,
    IntegrityError,
    PreconditionFailedError,
    StorageError,
    UploadCorruptedError,
)
from deltastore.storage import IfMatch, S3Store, _s3, open_store
from testkit.proxy import Fault, ScriptedProxy
from testkit.servers import S3Server

pytestmark = pytest.mark.integration

DATA = os.urandom(64 * 1024)


@pytest.fixture(params=["moto", "seaweedfs"])
def server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_s3, "CONFLICT_BACKOFF_BASE_S", 0.001)
    monkeypatch.setattr(_s3, "READ_BACKOFF_BASE_S", 0.001)


@pytest.fixture
def store(server: S3Server, request: pytest.FixtureRequest) -> Iterator[S3Store]:
    url = f"s3://{server.bucket}/faults-{request.node.name[:40]}-{os.urandom(4).hex()}"
    with open_store(url, storage_options=server.storage_options()) as s:
        assert isinstance(s, S3Store)
        yield s


class _Raw:
    def __init__(self, body: bytes):
        self._body = body

    def stream(self, **_: object) -> Iterator[bytes]:
        yield self._body


def _error_response(request, status: int, code: str) -> AWSResponse:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>injected by the test</Message></Error>"
    ).encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))


def _hook_puts(store: S3Store, handler: Callable) -> list:
    """Call handler(request, attempt) before every PutObject is sent; return the request log."""
    seen: list = []

    def before_send(request, **_: object):
        seen.append(request)
        return handler(request, len(seen))

    store._client.meta.events.register("before-send.s3.PutObject", before_send)
    return seen


# --- D1 / D4: 409 is a concurrent write, never "already exists" -------------------------------


@pytest.mark.parametrize("mode_name", ["create", "overwrite", "if-match"])
def test_409_is_retried_in_every_mode(store: S3Store, mode_name: str) -> None:
    mode = "overwrite" if mode_name == "overwrite" else "create"
    if mode_name == "if-match":
        mode = IfMatch(store.put("k", b"old").etag)
    seen = _hook_puts(
        store, lambda req, n: _error_response(req, 409, "ConditionalRequestConflict") if n <= 2 else None
    )
    meta = store.put("k", DATA, mode=mode)
    assert len(seen) == 3
    assert store.get("k") == DATA
    assert meta.etag == store.head("k").etag


def test_409_that_persists_is_concurrent_write_error(store: S3Store) -> None:
    seen = _hook_puts(store, lambda req, n: _error_response(req, 409, "ConditionalRequestConflict"))
    with pytest.raises(ConcurrentWriteError) as info:
        store.put("blobs/ab/abcd", DATA, mode="create")
    assert not isinstance(info.value, PreconditionFailedError)  # never "already exists"
    assert "blobs/ab/abcd" in str(info.value)
    assert len(seen) == _s3.CONFLICT_MAX_ATTEMPTS
    assert not store.exists("blobs/ab/abcd")


def test_409_after_the_first_attempt_landed_is_already_exists(store: S3Store, server: S3Server) -> None:
    """An SDK retry overlapping its own slow first attempt: the object is there, with our bytes."""
    client = server.boto3_client()

    def first_lands_then_409(request, n: int):
        if n == 1:
            client.put_object(Bucket=server.bucket, Key=store.prefix + "k", Body=DATA)
            return _error_response(request, 409, "ConditionalRequestConflict")
        return None

    _hook_puts(store, first_lands_then_409)
    with pytest.raises(AlreadyExistsError):
        store.put("k", DATA, mode="create")
    assert store.get("k") == DATA


# --- D9: end-to-end checksums on uploads ----------------------------------------------------


@pytest.fixture
def no_sdk_checksums(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's own flexible checksums off: only ours protect the upload."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")


def _flip_body(request) -> None:
    body = request.body
    if hasattr(body, "seek"):
        body.seek(0)
    raw = bytearray(body if isinstance(body, (bytes, bytearray)) else body.read())
    raw[len(raw) // 2] ^= 0x01
    request.body = bytes(raw)


@pytest.mark.parametrize("mode", ["create", "overwrite"])
def test_checksums_sent_with_every_put(no_sdk_checksums, store: S3Store, mode: str) -> None:
    seen = _hook_puts(store, lambda req, n: None)
    store.put("k", DATA, mode=mode)
    headers = {k.lower(): v for k, v in seen[0].headers.items()}
    assert headers["x-amz-checksum-sha256"] == base64.b64encode(hashlib.sha256(DATA).digest())
    assert headers["content-md5"] == base64.b64encode(hashlib.md5(DATA).digest())


@pytest.mark.parametrize("mode", ["create", "overwrite", "if-match"])
def test_upload_flipped_in_transit_never_lands(no_sdk_checksums, store: S3Store, mode: str) -> None:
    """SeaweedFS refuses the body (BadDigest); moto stores it, the ETag gives it away, and the
    damaged object is replaced. Either way the store ends up holding exactly DATA."""
    put_mode = IfMatch(store.put("k", b"old").etag) if mode == "if-match" else mode
    seen = _hook_puts(store, lambda req, n: _flip_body(req) if n == 1 else None)
    meta = store.put("k", DATA, mode=put_mode)
    assert len(seen) >= 2
    assert store.get("k") == DATA
    assert store.head("k").etag == meta.etag == hashlib.md5(DATA).hexdigest()


@pytest.mark.parametrize("mode", ["create", "overwrite", "if-match"])
def test_a_replacement_that_landed_without_its_response_is_success(no_sdk_checksums, store: S3Store,
                                                                   server: S3Server, mode: str) -> None:
    """The damaged upload is replaced, the replacement lands but its answer is lost, and the
    SDK's retry of it is refused (412: the ETag it names is gone). The outcome is read from the
    store: it holds exactly DATA, so the put succeeds."""
    if server.kind != "moto":
        pytest.skip("SeaweedFS refuses a flipped body (BadDigest): nothing damaged is stored to replace")
    put_mode = IfMatch(store.put("k", b"old").etag) if mode == "if-match" else mode
    client = server.boto3_client()

    def flip_then_lost_replacement(request, n: int):
        if n == 1:
            _flip_body(request)
        elif n == 2:  # the replacement lands, and the client sees the retry's 412
            client.put_object(Bucket=server.bucket, Key=store.prefix + "k", Body=DATA)
            return _error_response(request, 412, "PreconditionFailed")
        return None

    seen = _hook_puts(store, flip_then_lost_replacement)
    meta = store.put("k", DATA, mode=put_mode)
    assert len(seen) == 2
    assert store.get("k") == DATA
    assert meta.etag == store.head("k").etag == hashlib.md5(DATA).hexdigest()


def test_a_replacement_stored_altered_without_its_response_is_replaced_in_turn(store: S3Store,
                                                                                server: S3Server) -> None:
    """The replacement lands altered too (it fails the checksum stored with it: botocore's
    response checksums on) and its answer is lost: the damaged object is replaced again, and the
    store ends up holding exactly DATA."""
    if server.kind != "moto":
        pytest.skip("SeaweedFS refuses a flipped body (BadDigest): nothing damaged is stored to replace")
    client = server.boto3_client()
    altered = bytearray(DATA)
    altered[7] ^= 0x01

    def flip_then_altered_replacement(request, n: int):
        if n == 1:
            _flip_body(request)
        elif n == 2:  # lands altered, under DATA's checksum, and the client sees the retry's 412
            client.put_object(Bucket=server.bucket, Key=store.prefix + "k", Body=bytes(altered),
                              ChecksumAlgorithm="SHA256",
                              ChecksumSHA256=base64.b64encode(hashlib.sha256(DATA).digest()).decode("ascii"))
            return _error_response(request, 412, "PreconditionFailed")
        return None

    seen = _hook_puts(store, flip_then_altered_replacement)
    meta = store.put("k", DATA, mode="overwrite")
    assert len(seen) == 3
    assert store.get("k") == DATA and meta.etag == hashlib.md5(DATA).hexdigest()


def test_a_replacement_refused_because_another_writer_replaced_it_is_unreplaceable(
        no_sdk_checksums, store: S3Store, server: S3Server) -> None:
    if server.kind != "moto":
        pytest.skip("SeaweedFS refuses a flipped body (BadDigest): nothing damaged is stored to replace")
    client = server.boto3_client()

    def flip_then_other_writer(request, n: int):
        if n == 1:
            _flip_body(request)
        elif n == 2:
            client.put_object(Bucket=server.bucket, Key=store.prefix + "k", Body=b"someone else's bytes")
            return _error_response(request, 412, "PreconditionFailed")
        return None

    _hook_puts(store, flip_then_other_writer)
    with pytest.raises(UploadCorruptedError, match="could not be replaced"):
        store.put("k", DATA, mode="overwrite")
    assert store.get("k") == b"someone else's bytes"  # not ours to overwrite


def test_md5_only_mode_still_keeps_flipped_uploads_out(no_sdk_checksums, server: S3Server) -> None:
    """upload_checksum="md5" (servers that reject flexible-checksum headers): Content-MD5 plus
    the ETag check still catch a flipped body."""
    url = f"s3://{server.bucket}/md5-{os.urandom(4).hex()}"
    with open_store(url, storage_options=server.storage_options(upload_checksum="md5")) as store:
        seen = _hook_puts(store, lambda req, n: _flip_body(req) if n == 1 else None)
        store.put("k", DATA, mode="create")
        headers = {k.lower() for k in seen[0].headers}
        assert "content-md5" in headers and "x-amz-checksum-sha256" not in headers
        assert len(seen) >= 2 and store.get("k") == DATA
    with pytest.raises(ValueError, match="upload_checksum"):
        open_store(url, storage_options=server.storage_options(upload_checksum="crc32"))


def test_upload_flipped_on_every_attempt_is_upload_corrupted(no_sdk_checksums, store: S3Store) -> None:
    _hook_puts(store, lambda req, n: _flip_body(req))
    with pytest.raises(UploadCorruptedError) as info:
        store.put("manifests/x.json", DATA, mode="create")
    assert "manifests/x.json" in str(info.value)
    assert isinstance(info.value, StorageError) and not isinstance(info.value, PreconditionFailedError)
    # nothing damaged is left to read as "already exists" to the next writer of this key
    assert not store.exists("manifests/x.json")


# --- reads: truncated bodies, short ranges, checksum mismatches -------------------------------


@pytest.fixture
def proxied(server: S3Server, request: pytest.FixtureRequest) -> Iterator[tuple[ScriptedProxy, S3Store]]:
    url = f"s3://{server.bucket}/proxied-{os.urandom(4).hex()}"
    with ScriptedProxy(server.endpoint_url) as proxy:
        with open_store(url, storage_options=server.storage_options(endpoint_url=proxy.endpoint_url)) as s:
            s.put("k", DATA, mode="create")
            yield proxy, s


READS: dict[str, Callable[[S3Store], bytes]] = {
    "get": lambda s: s.get("k"),
    "get_with_meta": lambda s: s.get_with_meta("k").data,
    "get_if_changed": lambda s: s.get_if_changed("k", "0" * 32).data,
    "range": lambda s: s.get("k", byte_range=(100, 40_100)),
}
EXPECTED = {"get": DATA, "get_with_meta": DATA, "get_if_changed": DATA, "range": DATA[100:40_100]}


@pytest.mark.parametrize("op", list(READS))
def test_truncated_body_is_retried(proxied, op: str) -> None:
    proxy, store = proxied
    proxy.add(Fault("GET", "/k", cut_body_after=1000), Fault("GET", "/k", cut_body_after=10))
    assert READS[op](store) == EXPECTED[op]
    assert len(proxy.applied) == 2


def test_truncated_body_every_time_is_storage_error(proxied) -> None:
    proxy, store = proxied
    proxy.add(*[Fault("GET", "/k", cut_body_after=1000)] * _s3.READ_MAX_ATTEMPTS)
    with pytest.raises(StorageError, match="/k") as info:
        store.get("k")
    assert not isinstance(info.value, IntegrityError)


def test_short_range_is_retried_then_raises(proxied) -> None:
    proxy, store = proxied
    proxy.add(Fault("GET", "/k", shorten_body_to=7))
    assert store.get("k", byte_range=(0, 100)) == DATA[:100]
    proxy.add(*[Fault("GET", "/k", shorten_body_to=7)] * _s3.READ_MAX_ATTEMPTS)
    with pytest.raises(StorageError, match="/k"):
        store.get("k", byte_range=(0, 100))
    # a range past the end is a legitimately shorter slice, as bytes[start:stop]
    assert store.get("k", byte_range=(len(DATA) - 5, len(DATA) + 100)) == DATA[-5:]


def test_read_checksum_mismatch_is_retried_then_integrity_error(proxied) -> None:
    """botocore validates the SHA-256 the server stored with the object (sent by our put)."""
    proxy, store = proxied
    proxy.add(Fault("GET", "/k", flip_body_byte=123))
    assert store.get("k") == DATA
    proxy.add(*[Fault("GET", "/k", flip_body_byte=123)] * _s3.READ_MAX_ATTEMPTS)
    with pytest.raises(IntegrityError, match="/k"):
        store.get_with_meta("k")
