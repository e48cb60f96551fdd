"""Every command that opens an ``s3://`` store, pointed at an endpoint that is down: one error
line naming the endpoint, exit 1, no traceback, and no wait through botocore's retries (the
endpoint check makes one attempt to connect)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import urllib3.util.connection
from safetensors.torch import save_file

from deltastore.cli import EXIT_FAILED, build_parser, main

#: Nothing listens on port 1 of the loopback address: every connection is refused at once.
DOWN = "http://127.0.0.1:1"
STORE = "s3://bucket/run"

#: The arguments after the store URL of every command that opens a store ({tmp}: a directory).
COMMANDS = {
    "publish": ["{tmp}/model.safetensors"],
    "pull": ["{tmp}/out.safetensors"],
    "log": [],
    "verify": [],
    "status": [],
    "inspect": [],
    "compact": [],
    "gc": [],
    "pin": ["1"],
    "unpin": ["1"],
    "aggregate": ["--site", "a=s3://bucket/site"],
    "target": ["1"],
    "mirror": ["{tmp}/mirror"],
    "site join": ["s3://bucket/site", "--name", "a", "--out", "{tmp}/out.safetensors"],
}
#: Commands that open no store.
STORELESS = {"keygen", "docs"}


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials to sign with, and nothing else from the environment that picks an endpoint."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY", "HTTPS_PROXY",
                 "http_proxy", "https_proxy", "DELTASTORE_DEBUG"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every TCP connection botocore opens from now on (host, port)."""
    seen: list[tuple[str, int]] = []
    real = urllib3.util.connection.create_connection

    def create_connection(address, *args, **kwargs):
        seen.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", create_connection)
    return seen


def _argv(command: str, tmp_path: Path, endpoint: str) -> list[str]:
    save_file({"w": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    rest = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]]
    return [*command.split(), STORE, *rest, "--endpoint-url", endpoint]  # "site join": a command's subcommand


def _one_error_line(err: str, endpoint: str) -> str:
    lines = err.splitlines()
    assert "Traceback" not in err, err
    assert lines and lines[0].startswith("deltastore: error: StorageError: "), err
    assert len(lines) <= 2 and all(line.startswith("hint: ") for line in lines[1:]), err
    assert [line for line in lines if endpoint in line] == [lines[0]], err  # named once, in the error
    return lines[0]


def test_every_command_that_takes_a_store_is_covered() -> None:
    parser = build_parser()
    commands = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices
    assert set(commands) == {c.split()[0] for c in COMMANDS} | STORELESS


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unreachable_endpoint_is_one_line(command: str, tmp_path: Path, connects: list[tuple[str, int]],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(command, tmp_path, DOWN)) == EXIT_FAILED
    line = _one_error_line(capsys.readouterr().err, DOWN)
    assert f"cannot reach the S3 endpoint {DOWN} for {STORE} (Connection refused)" in line
    assert "--endpoint-url" in line and "endpoint_url" not in line.replace("--endpoint-url", "")
    assert connects == [("127.0.0.1", 1)]  # one attempt: no backoff through botocore's retries
    assert not (tmp_path / "out.safetensors").exists()


def test_retries_given_apply_to_the_endpoint_check(tmp_path: Path, connects: list[tuple[str, int]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_argv("log", tmp_path, DOWN), "--storage-option", 'retries={"mode": "standard", "total_max_attempts": 2}']
    assert main(argv) == EXIT_FAILED
    _one_error_line(capsys.readouterr().err, DOWN)
    assert connects == [("127.0.0.1", 1)] * 2
