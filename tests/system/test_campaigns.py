"""The adversarial campaigns (campaigns/), bounded for CI, on moto and on SeaweedFS.

Two kinds of test:

- the fault-injecting proxy (testkit.proxy) does what its settings say (fault counts, a
  truncated body is really truncated, a dropped response really landed, filters hold);
- each campaign runs (trials ran, faults were injected) and finds nothing: 0 lost versions,
  0 corrupt applies, 0 wrong errors, 0 invariant violations (see docs/reliability.md).

Full-size runs: ``python -m campaigns all --backend seaweedfs`` (docs/reliability.md).
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
from typing import Any

import pytest

from campaigns.common import Tally, campaign_options
from campaigns.report import markdown, run_one
from testkit.proxy import FaultPlan, FaultProxy

pytestmark = pytest.mark.integration

# --- the proxy ------------------------------------------------------------------------------


def _raw(proxy: FaultProxy, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """An unsigned request through the proxy (its status does not matter to these tests)."""
    u = urllib.parse.urlsplit(proxy.endpoint_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request(method, path, body=body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _client(endpoint: str, server: Any):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        region_name=server.region, config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1, "mode": "standard"}),
    )  # fmt: skip


@pytest.fixture(params=["moto", "seaweedfs"])
def server(request: pytest.FixtureRequest):
    return request.getfixturevalue(f"{request.param}_server")


def test_proxy_passes_signed_requests_unchanged(server):
    """With no faults, SigV4-signed puts and gets (SeaweedFS checks them) work through the proxy."""
    from deltastore.storage import open_store

    with FaultProxy(server.endpoint_url) as proxy:
        opts = campaign_options(server, proxy.endpoint_url)
        with open_store(f"s3://{server.bucket}/proxy-{time.monotonic_ns()}", storage_options=opts) as store:
            store.put("a", b"x" * 3000, mode="create")
            assert store.get("a") == b"x" * 3000
            assert store.get("a", byte_range=(10, 20)) == b"x" * 10
        assert proxy.requests >= 3 and not proxy.counts


@pytest.mark.parametrize("kind,status,code", [("500", 500, "InternalError"), ("503", 503, "ServiceUnavailable"),
                                              ("409", 409, "ConditionalRequestConflict")])  # fmt: skip
def test_proxy_injects_error_responses_without_forwarding(server, kind, status, code):
    import botocore.exceptions

    key = f"err-{kind}-{time.monotonic_ns()}"
    with FaultProxy(server.endpoint_url, FaultPlan(rate=1.0, mix={kind: 1.0}, methods=frozenset({"PUT"}))) as proxy:
        client = _client(proxy.endpoint_url, server)
        with pytest.raises(botocore.exceptions.ClientError) as e:
            client.put_object(Bucket=server.bucket, Key=key, Body=b"data")
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
        assert e.value.response["Error"]["Code"] == code
        assert proxy.counts == {kind: 1}
        client.list_objects_v2(Bucket=server.bucket, Prefix=key)  # a GET: not faulted
        assert proxy.counts == {kind: 1}
    with pytest.raises(botocore.exceptions.ClientError):  # not forwarded: nothing landed
        server.boto3_client().head_object(Bucket=server.bucket, Key=key)


def test_proxy_truncate_really_truncates(server):
    import botocore.exceptions

    server.boto3_client().put_object(Bucket=server.bucket, Key="trunc", Body=b"z" * 10_000)
    with FaultProxy(server.endpoint_url, FaultPlan(rate=1.0, mix={"truncate": 1.0})) as proxy:
        response = _client(proxy.endpoint_url, server).get_object(Bucket=server.bucket, Key="trunc")
        assert response["ContentLength"] == 10_000
        with pytest.raises(botocore.exceptions.BotoCoreError, match="5000"):
            response["Body"].read()
        assert proxy.counts == {"truncate": 1}


def test_proxy_drop_lands_the_request_and_reset_does_not(server):
    import botocore.exceptions

    direct = server.boto3_client()
    for kind, lands in (("drop", True), ("reset", False)):
        key = f"{kind}-{time.monotonic_ns()}"
        with FaultProxy(server.endpoint_url, FaultPlan(rate=1.0, mix={kind: 1.0})) as proxy:
            with pytest.raises(botocore.exceptions.BotoCoreError):
                _client(proxy.endpoint_url, server).put_object(Bucket=server.bucket, Key=key, Body=b"landed")
            assert proxy.counts == {kind: 1}
        listed = direct.list_objects_v2(Bucket=server.bucket, Prefix=key).get("Contents", [])
        assert len(listed) == (1 if lands else 0), kind


def test_proxy_flip_damages_one_byte_of_the_body(server):
    import boto3
    from botocore.config import Config

    key = f"flip-{time.monotonic_ns()}"
    body = bytes(range(256)) * 8
    with FaultProxy(server.endpoint_url, FaultPlan(rate=1.0, mix={"flip": 1.0}, methods=frozenset({"PUT"}))) as proxy:
        client = boto3.client(
            "s3", endpoint_url=proxy.endpoint_url, aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key, region_name=server.region,
            config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                          retries={"total_max_attempts": 1, "mode": "standard"}),
        )  # fmt: skip
        client.put_object(Bucket=server.bucket, Key=key, Body=body)  # nothing checks end to end
        assert proxy.counts == {"flip": 1}
    stored = server.boto3_client().get_object(Bucket=server.bucket, Key=key)["Body"].read()
    assert len(stored) == len(body) and sum(a != b for a, b in zip(stored, body)) == 1


def test_proxy_slow_delays(moto_server):
    with FaultProxy(moto_server.endpoint_url, FaultPlan(rate=1.0, mix={"slow": 1.0}, slow_s=0.4)) as proxy:
        t = time.monotonic()
        _raw(proxy, "GET", f"/{moto_server.bucket}?list-type=2")
        assert time.monotonic() - t >= 0.4
        assert proxy.counts == {"slow": 1}


def test_proxy_rate_and_key_filter(moto_server):
    plan = FaultPlan(rate=0.5, mix={"500": 1.0, "503": 1.0}, key_pattern=r"/HEAD$", seed=3)
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        statuses = [_raw(proxy, "GET", f"/{moto_server.bucket}/other")[0] for _ in range(30)]  # 403: unsigned
        assert 500 not in statuses and 503 not in statuses and not proxy.counts
        statuses = [_raw(proxy, "GET", f"/{moto_server.bucket}/run/HEAD")[0] for _ in range(100)]
        faulted = sum(s in (500, 503) for s in statuses)
        assert 30 <= faulted <= 70
        assert sum(proxy.counts.values()) == faulted == len(proxy.events)
        assert set(proxy.counts) == {"500", "503"}


def test_report_table():
    t = Tally("faults", "moto", trials=3, seconds=1.5, command="python -m campaigns.faults --trials 3")
    t.faults["500"] += 2
    t.wrong("committed but raised StorageError", "step 2 is version 3")
    md = markdown([t])
    assert "| faults | moto | 3 | 500 2 | 0 | 0 | 0 | committed but raised StorageError 1 | 0 | 2 |" in md
    assert "python -m campaigns.faults --trials 3" in md and "step 2 is version 3" in md


# --- the campaigns, bounded ------------------------------------------------------------------

#: Trials per campaign in CI. The full sizes are in docs/reliability.md.
BOUNDED = {"crash": 5, "faults": 12, "races": 12, "corruption": 5, "hostile": 8}
#: The server each campaign runs on in CI: a campaign's machinery does not depend on the server,
#: so each runs once, and both servers are used. Those that race conditional writes or meet
#: injected faults on every request run on SeaweedFS, the server that checks them as S3 does.
BACKEND = {"crash": "seaweedfs", "faults": "seaweedfs", "races": "seaweedfs", "corruption": "moto", "hostile": "moto"}
#: A higher fault rate than the full run's 10%, so that a few publishes meet every kind of fault.
_EXTRA = {"hostile": ["--fuzz", "3"], "races": ["--publishers", "3"], "faults": ["--rate", "0.2", "--slow", "0.1"]}


def _clean(t: Tally) -> None:
    found = {"lost": t.versions_lost, "corrupt": t.corrupt_applies, "wrong": dict(t.wrong_errors),
             "violations": dict(t.invariant_violations)}  # fmt: skip
    assert t.clean, f"{found}\n{t.summary()}"


@pytest.mark.slow
@pytest.mark.parametrize("name,backend", list(BACKEND.items()))
def test_campaign_runs_and_finds_nothing(name: str, backend: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(f"{backend}_server")
    t = run_one(name, server, BOUNDED[name], seed=1, extra=_EXTRA.get(name))
    assert t.trials >= BOUNDED[name] - (1 if name == "races" else 0), t.summary()
    if name != "races":  # races needs no injected faults: the publishers are the adversary
        assert sum(t.faults.values()) > 0, t.summary()
    if name in ("crash", "faults", "races"):
        assert t.extra.get("versions_committed", 0) > 0, t.summary()
    if name == "hostile":
        assert t.errors, t.summary()  # the readers did refuse the hostile objects
    _clean(t)


# --- over column-grid stores (design 011) ---------------------------------------------------

#: ``--grid``: every publisher writes campaigns.model.GRID_SPECS (grids ragged both ways), the
#: workers read through GridTarget. Faults only, in CI: its publishes meet lost responses and
#: reopen (resume) after failures while a worker follows with pull_into; the full grid runs of
#: every campaign are in docs/reliability.md.
GRID_BOUNDED = {"faults": 12}


@pytest.mark.parametrize("name", list(GRID_BOUNDED))
def test_grid_campaign_finds_nothing(name: str, seaweedfs_server: Any) -> None:
    from campaigns.model import GRID_SPECS

    server = seaweedfs_server
    t = run_one(name, server, GRID_BOUNDED[name], seed=1, extra=_EXTRA.get(name), grid=True)
    assert t.trials >= GRID_BOUNDED[name] and sum(t.faults.values()) > 0, t.summary()
    assert t.extra["grid_tensors"] == {n: sp.chunk_cols for n, sp in GRID_SPECS.items()}, t.summary()
    _clean(t)


# --- over serving streams (design 012) ------------------------------------------------------

#: ``--formats``: every publish also writes an FP8 and an MXFP8 stream (campaigns.model.FORMAT_INCLUDE
#: quantized), committed by the version's one HEAD write. faults: faults hit the streams' writes
#: too, and every committed version is read back in each format against the reference derivation
#: of its step while a worker follows the FP8 stream. corruption: the FP8 stream's manifest, then
#: a pack of it, damaged, read by FP8 workers and `deltastore verify`. The full runs of every
#: campaign are in docs/reliability.md.
FORMATS = "fp8-block128,mxfp8"
STREAM_BOUNDED = {"faults": 8, "corruption": 2}
_STREAM_EXTRA = {"faults": _EXTRA["faults"], "corruption": ["--targets", "stream manifest,stream pack"]}


@pytest.mark.parametrize("name", list(STREAM_BOUNDED))
def test_serving_stream_campaign_finds_nothing(name: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(f"{BACKEND[name]}_server")
    t = run_one(name, server, STREAM_BOUNDED[name], seed=1, extra=_STREAM_EXTRA[name], formats=FORMATS)
    assert t.trials >= STREAM_BOUNDED[name] and sum(t.faults.values()) > 0, t.summary()
    if name == "faults":
        committed = t.extra["versions_committed"]
        assert committed > 0 and t.extra["worker_updates"] > 0, t.summary()
        assert t.extra["versions_checked"] == {"own": committed, "fp8-block128": committed, "mxfp8": committed}, t.summary()
    else:
        assert {k.split(" ", 1)[1] for k in t.faults} == {"stream manifest", "stream pack"}, t.summary()
        assert t.errors, t.summary()  # the damage was refused
    _clean(t)



def test_format_churn_campaign_finds_nothing(moto_server: Any) -> None:
    """faults with ``--format-churn``: the trainer stops publishing the workers' format and
    publishes it again, under faults; the worker keeps its last version through each pause and
    moves on after it, and every committed version reads back in each format it was published
    in, those from before a pause too, while the others are refused in it."""
    t = run_one("faults", moto_server, 9, seed=2, extra=[*_EXTRA["faults"], "--format-churn", "3"], formats=FORMATS)
    committed = t.extra["versions_committed"]
    assert t.extra["format_churns"] == 2 and committed > 6 and t.extra["worker_updates"] > 0, t.summary()
    checked = t.extra["versions_checked"]
    assert 0 < checked["fp8-block128"] < committed and checked["mxfp8"] == checked["own"] == committed, t.summary()
    _clean(t)
