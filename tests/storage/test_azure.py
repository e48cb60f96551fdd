"""AzureBlobStore against Azurite over HTTP, and the probe's refusal of an endpoint that drops
``If-None-Match`` / ``If-Match`` on the way."""

from __future__ import annotations

import pytest

from deltastore.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    PreconditionFailedError,
    UnsafeStoreError,
    UploadCorruptedError,
    UnsupportedURLError,
)
from deltastore.storage import AzureBlobStore, IfMatch, open_store
from deltastore.storage._cloud import CORRUPT_UPLOAD_MAX_ATTEMPTS
from deltastore.storage.probe import require_atomic_writes
from testkit.cloud_checks import lose_first_response, native_calls
from testkit.commit_race import race_publishers
from testkit.contract import StoreContract
from testkit.proxy import Fault, FaultPlan, FaultProxy, ScriptedProxy
from testkit.targets import StoreTarget, unique_prefix

pytestmark = pytest.mark.integration

WRONG_KEY = "d3Jvbmcta2V5LWRlbHRhc3RvcmUtdGVzdA=="


class TestAzurite(StoreContract):
    @pytest.fixture
    def store(self, azure_url):
        with azure_url.open() as store:
            assert isinstance(store, AzureBlobStore)
            yield store


def test_wrong_key_is_one_typed_line_without_the_key(azurite_server) -> None:
    url = azurite_server.url("creds")
    store = open_store(url, storage_options=azurite_server.storage_options(account_key=WRONG_KEY))
    for op in (
        lambda: store.get("HEAD"),
        lambda: store.head("HEAD"),
        lambda: store.put("HEAD", b"x", mode="create"),
        lambda: list(store.list()),
    ):
        with pytest.raises(AccessDeniedError) as info:
            op()
        message = str(info.value)
        assert url in message and "\n" not in message and WRONG_KEY not in message
    assert WRONG_KEY not in repr(store)
    with pytest.raises(AccessDeniedError, match="az://c/run"):
        open_store("az://c/run", storage_options={"endpoint_url": azurite_server.endpoint_url})
    with pytest.raises(UnsupportedURLError, match="aws_access_key_id"):
        open_store("az://c/run", storage_options={"aws_access_key_id": "x"})


def test_missing_container_is_one_typed_line(azurite_server) -> None:
    store = open_store("az://no-such-container/run1", storage_options=azurite_server.storage_options())
    for op in (
        lambda: store.get("HEAD"),
        lambda: store.head("HEAD"),
        lambda: store.put("HEAD", b"x", mode="create"),
        lambda: store.check_endpoint(),
    ):
        with pytest.raises(BucketNotFoundError) as info:
            op()
        message = str(info.value)
        assert "no-such-container" in message and "\n" not in message


def test_probe_passes_and_binds_the_endpoint(azure_url: StoreTarget) -> None:
    with azure_url.open() as store:
        result = require_atomic_writes(store)
        assert result is not None and result.ok, result.detail
        assert result.binding.endpoint == azure_url.storage_options["endpoint_url"]
        assert result.binding.server.startswith("Azurite")


def test_probe_refuses_an_endpoint_that_drops_the_conditions(azurite_server) -> None:
    """A proxy that strips If-None-Match and If-Match: every conditional write "succeeds". (With
    a SAS token, which signs no request headers; a shared-key signature covers them.)"""
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    options = azurite_server.storage_options()
    sas = generate_account_sas(
        options.pop("account_name"), options.pop("account_key"), ResourceTypes(container=True, object=True),
        AccountSasPermissions(read=True, write=True, delete=True, list=True, create=True),
        datetime.now(timezone.utc) + timedelta(hours=1),
    )
    with ScriptedProxy(azurite_server.endpoint_url, strip_request_headers=("If-None-Match", "If-Match")) as proxy:
        endpoint = azurite_server.with_endpoint(proxy.endpoint_url).endpoint_url
        options.update(endpoint_url=endpoint, sas_token=sas)
        with open_store(azurite_server.url(unique_prefix()), storage_options=options) as store:
            with pytest.raises(UnsafeStoreError) as info:
                require_atomic_writes(store)
            assert store.url in str(info.value) and "\n" not in str(info.value)


def test_a_precondition_failure_is_never_retried(azure_url: StoreTarget) -> None:
    with azure_url.open() as a, azure_url.open() as b:
        first = a.put("HEAD", b"v1", mode="create")
        b.put("HEAD", b"v2", mode=IfMatch(b.head("HEAD").etag))
        with native_calls(a) as seen:
            with pytest.raises(PreconditionFailedError) as info:
                a.put("HEAD", b"v3", mode=IfMatch(first.etag))
        assert seen.writes == 1
        assert "HEAD" in str(info.value) and "\n" not in str(info.value)
        assert a.get("HEAD") == b"v2"


def test_lost_create_and_cas_responses_are_settled_by_reading(azure_url: StoreTarget) -> None:
    with azure_url.open() as store:
        with lose_first_response(store) as lost:
            meta = store.put("HEAD", b"v1", mode="create")
            meta2 = store.put("HEAD", b"v2", mode=IfMatch(meta.etag))
            store.put("objects/blob", b"packed", mode="create")
        assert lost == ["HEAD", "HEAD", "blob"]
        assert store.get_with_meta("HEAD").meta.etag == meta2.etag
        assert store.get("objects/blob") == b"packed"


def test_idle_polls_move_no_body(azure_url: StoreTarget, azurite_server) -> None:
    with ScriptedProxy(azurite_server.endpoint_url) as proxy:
        endpoint = azurite_server.with_endpoint(proxy.endpoint_url).endpoint_url
        with open_store(azure_url.url, storage_options=azurite_server.storage_options(endpoint_url=endpoint)) as store:
            etag = store.put("HEAD", b"v1" * 100, mode="create").etag
            before = len(proxy.requests)
            for _ in range(5):
                assert store.get_if_changed("HEAD", etag) is None
            polls = proxy.requests[before:]
            assert len(polls) == 5 and {m for m, _ in polls} == {"HEAD"}, polls  # metadata only
            changed = store.put("HEAD", b"v2" * 100, mode=IfMatch(etag))
            got = store.get_if_changed("HEAD", etag)
            assert got is not None and got.data == b"v2" * 100 and got.meta.etag == changed.etag
            assert "GET" in {m for m, _ in proxy.requests[before:]}  # the change moved a body


def test_racing_publishers_commit_once_and_a_worker_is_bit_exact(azure_url: StoreTarget) -> None:
    outcome = race_publishers(azure_url, rounds=3, publishers=3)
    assert outcome.clean, outcome
    assert outcome.versions == 3 and outcome.no_wins == 0


def test_bytes_altered_in_transit_never_stay_stored_nor_read(azure_url, azurite_server) -> None:
    """Every upload's body flipped on the way: refused by its Content-MD5, retried, then a
    typed error and nothing left under the key. A body flipped on the way back is read again."""
    data = bytes(range(256)) * 40
    plan = FaultPlan(rate=1.0, mix={"flip": 1.0}, methods=frozenset({"PUT"}))
    with FaultProxy(azurite_server.endpoint_url, plan) as proxy:
        options = azurite_server.with_endpoint(proxy.endpoint_url).storage_options()
        with open_store(azure_url.url, storage_options=options) as store:
            with pytest.raises(UploadCorruptedError) as info:
                store.put("objects/blob", data, mode="create")
            assert "objects/blob" in str(info.value) and "\n" not in str(info.value)
            assert not store.exists("objects/blob")
        assert proxy.counts["flip"] == CORRUPT_UPLOAD_MAX_ATTEMPTS
    with ScriptedProxy(azurite_server.endpoint_url) as proxy:
        options = azurite_server.with_endpoint(proxy.endpoint_url).storage_options()
        with open_store(azure_url.url, storage_options=options) as store:
            store.put("objects/blob", data, mode="create")
            proxy.add(Fault("GET", flip_body_byte=100))
            assert store.get("objects/blob") == data and len(proxy.applied) == 1


#: Trials of the bounded campaigns in CI (full sizes: benchmarks.cloud_campaigns' defaults).
CAMPAIGN_TRIALS = {"faults": 8, "crash": 2}
#: A higher fault rate than the full run's, so that a few publishes meet faults.
CAMPAIGN_EXTRA = {"faults": ["--rate", "0.2", "--slow", "0.05"]}


@pytest.mark.parametrize("name", list(CAMPAIGN_TRIALS))
def test_campaign_finds_nothing(name: str, azurite_server) -> None:
    from benchmarks.cloud_campaigns import run_campaign

    t = run_campaign(name, azurite_server, CAMPAIGN_TRIALS[name], seed=1, extra=CAMPAIGN_EXTRA.get(name))
    assert t.trials >= CAMPAIGN_TRIALS[name] and sum(t.faults.values()) > 0, t.summary()
    assert t.extra.get("versions_committed", 0) > 0, t.summary()
    assert t.clean, t.summary()
