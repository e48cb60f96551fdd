"""What the native ``gs://`` and ``az://`` backends promise alike, on fake-gcs-server and
Azurite over HTTP: a missing bucket is one typed line, a precondition failure is never
retried, lost responses are settled by reading, idle polls move no body, bytes altered in
transit never stay stored nor get read, racing publishers commit once, and the bounded
campaigns find nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from deltastore.errors import BucketNotFoundError, PreconditionFailedError, UploadCorruptedError
from deltastore.storage import IfMatch, open_store
from deltastore.storage._cloud import CORRUPT_UPLOAD_MAX_ATTEMPTS
from deltastore.storage.probe import require_atomic_writes
from testkit.cloud_checks import lose_first_response, native_calls
from testkit.commit_race import race_publishers
from testkit.proxy import Fault, FaultPlan, FaultProxy, ScriptedProxy
from testkit.targets import StoreTarget

pytestmark = pytest.mark.integration

#: Trials of the bounded campaigns in CI (full sizes: benchmarks.cloud_campaigns' defaults).
CAMPAIGN_TRIALS = {"faults": 8, "crash": 2}
#: A higher fault rate than the full run's, so that a few publishes meet faults.
CAMPAIGN_EXTRA = {"faults": ["--rate", "0.2", "--slow", "0.05"]}


@dataclass(frozen=True)
class Cloud:
    """One backend's server and target, and how its requests look at a proxy."""

    target: StoreTarget
    server: Any
    #: the HTTP method of an upload
    upload: str
    #: a substring of the path of a download of a body ("" for every GET)
    media: str
    #: requests about the object (not the bucket's own metadata), as (method, path)
    about_object: Callable[[str, str], bool]

    def body_read(self, method: str, path: str) -> bool:
        return method == "GET" and self.media in path


@pytest.fixture(params=["gcs", "azure"])
def cloud(request: pytest.FixtureRequest) -> Cloud:
    if request.param == "gcs":
        # the Google client may GET the bucket's metadata once, in the background, for its traces
        return Cloud(request.getfixturevalue("gcs_url"), request.getfixturevalue("fake_gcs_server"), "POST",
                     "alt=media", lambda m, p: "/o/" in p)
    return Cloud(request.getfixturevalue("azure_url"), request.getfixturevalue("azurite_server"), "PUT", "",
                 lambda m, p: True)


def test_missing_bucket_is_one_typed_line(cloud: Cloud) -> None:
    """A bucket (GCS) or container (Azure) that does not exist: every call is one typed line
    naming it."""
    scheme = cloud.target.url.split("://", 1)[0]
    store = open_store(f"{scheme}://no-such-bucket-here/run1", storage_options=cloud.server.storage_options())
    for op in (
        lambda: store.get("HEAD"),
        lambda: store.head("HEAD"),
        lambda: store.put("HEAD", b"x", mode="create"),
        lambda: store.check_endpoint(),
    ):
        with pytest.raises(BucketNotFoundError) as info:
            op()
        message = str(info.value)
        assert "no-such-bucket-here" in message and "\n" not in message


def test_probe_passes_and_binds_the_endpoint(cloud: Cloud) -> None:
    with cloud.target.open() as store:
        result = require_atomic_writes(store)
        assert result is not None and result.ok, result.detail
        assert result.binding.endpoint == cloud.target.storage_options["endpoint_url"]
        assert result.binding.store == cloud.target.url


def test_a_precondition_failure_is_never_retried(cloud: Cloud) -> None:
    with cloud.target.open() as a, cloud.target.open() as b:
        first = a.put("HEAD", b"v1", mode="create")  # a knows v1's native version
        b.put("HEAD", b"v2", mode=IfMatch(b.head("HEAD").etag))
        with native_calls(a) as seen:
            with pytest.raises(PreconditionFailedError) as info:
                a.put("HEAD", b"v3", mode=IfMatch(first.etag))
        assert seen.writes == 1  # the server's 412, once, not retried as if transient
        assert "HEAD" in str(info.value) and "\n" not in str(info.value)
        assert a.get("HEAD") == b"v2"


def test_lost_create_and_cas_responses_are_settled_by_reading(cloud: Cloud) -> None:
    with cloud.target.open() as store:
        with lose_first_response(store) as lost:
            meta = store.put("HEAD", b"v1", mode="create")
            meta2 = store.put("HEAD", b"v2", mode=IfMatch(meta.etag))
            store.put("objects/blob", b"packed", mode="create")
        assert len(lost) == 3
        assert store.get_with_meta("HEAD").meta.etag == meta2.etag
        assert store.get("objects/blob") == b"packed"
        with lose_first_response(store), pytest.raises(PreconditionFailedError):
            store.put("HEAD", b"v3", mode=IfMatch(meta.etag))  # stale: a real refusal, retried or not


def test_idle_polls_move_no_body(cloud: Cloud) -> None:
    with ScriptedProxy(cloud.server.endpoint_url) as proxy:
        options = cloud.server.with_endpoint(proxy.endpoint_url).storage_options()
        with open_store(cloud.target.url, storage_options=options) as store:
            etag = store.put("HEAD", b"v1" * 100, mode="create").etag
            before = len(proxy.requests)
            for _ in range(5):
                assert store.get_if_changed("HEAD", etag) is None
            polls = [(m, p) for m, p in proxy.requests[before:] if cloud.about_object(m, p)]
            assert len(polls) == 5 and not [r for r in polls if cloud.body_read(*r)], polls
            changed = store.put("HEAD", b"v2" * 100, mode=IfMatch(etag))
            got = store.get_if_changed("HEAD", etag)
            assert got is not None and got.data == b"v2" * 100 and got.meta.etag == changed.etag
            assert [r for r in proxy.requests[before:] if cloud.body_read(*r)]  # the change moved a body


def test_racing_publishers_commit_once_and_a_worker_is_bit_exact(cloud: Cloud) -> None:
    outcome = race_publishers(cloud.target, rounds=3, publishers=3)
    assert outcome.clean, outcome
    assert outcome.versions == 3 and outcome.no_wins == 0


def test_bytes_altered_in_transit_never_stay_stored_nor_read(cloud: Cloud) -> None:
    """Every upload's body flipped on the way: refused or caught by its MD5, retried, then a
    typed error and nothing left under the key. A body flipped on the way back is read again."""
    data = bytes(range(256)) * 40
    plan = FaultPlan(rate=1.0, mix={"flip": 1.0}, methods=frozenset({cloud.upload}))
    with FaultProxy(cloud.server.endpoint_url, plan) as proxy:
        options = cloud.server.with_endpoint(proxy.endpoint_url).storage_options()
        with open_store(cloud.target.url, storage_options=options) as store:
            with pytest.raises(UploadCorruptedError) as info:
                store.put("objects/blob", data, mode="create")
            assert "objects/blob" in str(info.value) and "\n" not in str(info.value)
            assert not store.exists("objects/blob")
        assert proxy.counts["flip"] == CORRUPT_UPLOAD_MAX_ATTEMPTS
    with ScriptedProxy(cloud.server.endpoint_url) as proxy:
        options = cloud.server.with_endpoint(proxy.endpoint_url).storage_options()
        with open_store(cloud.target.url, storage_options=options) as store:
            store.put("objects/blob", data, mode="create")
            proxy.add(Fault("GET", path_part=cloud.media, flip_body_byte=100) if cloud.media
                      else Fault("GET", flip_body_byte=100))
            assert store.get("objects/blob") == data and len(proxy.applied) == 1


@pytest.mark.parametrize("name", list(CAMPAIGN_TRIALS))
def test_campaign_finds_nothing(name: str, cloud: Cloud) -> None:
    from benchmarks.cloud_campaigns import run_campaign

    t = run_campaign(name, cloud.server, CAMPAIGN_TRIALS[name], seed=1, extra=CAMPAIGN_EXTRA.get(name))
    assert t.trials >= CAMPAIGN_TRIALS[name] and sum(t.faults.values()) > 0, t.summary()
    assert t.extra.get("versions_committed", 0) > 0, t.summary()
    assert t.clean, t.summary()
