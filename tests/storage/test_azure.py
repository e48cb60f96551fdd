"""AzureBlobStore against Azurite over HTTP: the contract, Azure's own errors, and the probe's
refusal of an endpoint that drops ``If-None-Match`` / ``If-Match`` on the way. What GCS and
Azure promise alike is tested in test_cloud.py."""

from __future__ import annotations

import pytest

from deltastore.errors import (
    AccessDeniedError,
    UnsafeStoreError,
    UnsupportedURLError,
)
from deltastore.storage import AzureBlobStore, open_store
from deltastore.storage.probe import require_atomic_writes
from testkit.contract import StoreContract
from testkit.proxy import ScriptedProxy
from testkit.targets import unique_prefix

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
