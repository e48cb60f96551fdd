"""Every bad input to the CLI ends in one error line naming the object, a hint in CLI terms, and
a documented exit code; nothing is created or written on the way."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deltastore.cli import EXIT_FAILED, EXIT_NOTHING_TO_DO, EXIT_OK, EXIT_USAGE, main
from deltastore.cli.common import storage_option
from testkit import servers

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g).bfloat16(), "b": torch.randn(16, generator=g)}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file(_state(), str(p))
    return p


def _error(capsys: pytest.CaptureFixture[str]) -> tuple[str, str | None]:
    """The error line and the hint (or None); asserts the shape: one error line, at most one hint."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines and lines[0].startswith("deltastore: error: "), err
    assert len(lines) <= 2, err
    hint = None
    if len(lines) == 2:
        assert lines[1].startswith("hint: "), err
        hint = lines[1]
    assert "Traceback" not in err
    return lines[0], hint


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- URLs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("url, meant", [
    ("s3:/weights/typo", "s3://weights/typo"),
    ("S3://weights/typo", "s3://weights/typo"),
    ("s3//weights/typo", "s3://weights/typo"),
    ("gs:bucket/x", "gs://bucket/x"),
])
def test_mistyped_url_is_refused_and_creates_nothing(url: str, meant: str, tmp_path: Path, ckpt: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path)
    assert main(["publish", url, str(ckpt)]) == EXIT_USAGE
    line, hint = _error(capsys)
    assert "UnsupportedURLError" in line and meant in line and url in line
    assert hint is not None and "s3://BUCKET/PREFIX" in hint
    assert _listing(tmp_path) == before  # no ./s3:/weights/typo directory


def test_http_url_is_an_endpoint_not_a_store(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["publish", "http://127.0.0.1:9/bucket", str(ckpt)]) == EXIT_USAGE
    line, _ = _error(capsys)
    assert "--endpoint-url http://127.0.0.1:9" in line  # the Python spelling translated to the flag
    assert "endpoint_url" not in line


def test_unknown_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "nosuchscheme://x/y"]) == EXIT_USAGE
    line, _ = _error(capsys)
    assert "nosuchscheme://x/y" in line


@pytest.mark.parametrize("argv", [["log"], ["status"], ["inspect"], ["verify"], ["gc", "--dry-run"], ["pin", "1"]])
def test_commands_other_than_publish_create_no_local_store(argv: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "store"
    assert main([argv[0], str(missing), *argv[1:]]) == EXIT_FAILED
    line, hint = _error(capsys)
    assert "BucketNotFoundError" in line and str(missing) in line
    assert hint is not None and "publish creates" in hint
    assert not (tmp_path / "no").exists()


def test_pull_source_missing_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "store"
    assert main(["pull", str(missing), str(tmp_path / "o.safetensors")]) == EXIT_FAILED
    _error(capsys)
    assert _listing(tmp_path) == []


# --- endpoints that are not S3 --------------------------------------------------------------------


class _Html(http.server.BaseHTTPRequestHandler):
    status = 404

    def _answer(self) -> None:
        body = b"<html><body><h1>Not Found</h1></body></html>"
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(params=[404, 200], ids=["html-404", "html-200"])
def html_endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    with servers.http_server(type("Handler", (_Html,), {"status": request.param})) as url:
        yield url


@pytest.fixture
def fake_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.mark.parametrize("argv", [["log"], ["status"], ["verify"], ["inspect"]])
def test_non_s3_endpoint_is_reported_not_empty(argv: list[str], html_endpoint: str, fake_credentials: None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([argv[0], "s3://bucket/run", "--endpoint-url", html_endpoint, "--storage-option", "retries=1"]) == EXIT_FAILED
    line, hint = _error(capsys)
    assert "not an S3 endpoint" in line and html_endpoint in line
    assert hint is not None and "--endpoint-url" in hint
    assert "no versions" not in capsys.readouterr().out


def test_follower_on_non_s3_endpoint_fails_fast(html_endpoint: str, fake_credentials: None, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "no versions yet" forever. A 10 s pytest timeout would catch a wait.
    assert main(["pull", "s3://bucket/run", str(tmp_path / "o.safetensors"), "--follow", "--interval", "0.1",
                 "--endpoint-url", html_endpoint, "--storage-option", "retries=1"]) == EXIT_FAILED
    line, _ = _error(capsys)
    assert "not an S3 endpoint" in line


@pytest.mark.integration
def test_real_s3_endpoint_passes_the_check(moto_s3_url, ckpt: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    opts = moto_s3_url.storage_options
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["aws_secret_access_key"])
    flags = ["--endpoint-url", opts["endpoint_url"]]
    assert main(["log", moto_s3_url.url, *flags]) == EXIT_OK  # an empty prefix of a real bucket: empty, fine
    assert "no versions" in capsys.readouterr().out
    assert main(["publish", moto_s3_url.url, str(ckpt), *flags, "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["version"] == 1
    assert main(["log", moto_s3_url.url, *flags, "-v"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "deltastore." in err and "botocore" not in err  # -v: our lines, not botocore's flood
    assert main(["log", moto_s3_url.url, *flags, "-vv"]) == EXIT_OK
    assert "botocore" in capsys.readouterr().err
    assert main(["log", "s3://no-such-bucket-e1/x", *flags]) == EXIT_FAILED
    line, hint = _error(capsys)
    assert "BucketNotFoundError" in line and hint is not None and "create the bucket" in hint


# --- bad files and flags --------------------------------------------------------------------------


def test_bad_input_files(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(ckpt.read_bytes()[:-100])
    text = tmp_path / "notes.safetensors"
    text.write_text("hello, these are not weights\n")
    pickle = tmp_path / "model.pt"
    torch.save(_state(), str(pickle))
    for path, words in ((truncated, "truncated"), (text, "not a .safetensors file"), (pickle, "PyTorch pickle"),
                        (tmp_path / "missing.safetensors", "no such file"), (tmp_path, "is a directory")):
        assert main(["publish", str(store), str(path)]) == EXIT_FAILED, path
        line, _ = _error(capsys)
        assert str(path) in line and words in line, line
    assert not store.exists()  # a bad file is refused before the store is touched


def _replace_on_data_read(monkeypatch: pytest.MonkeyPatch, path: Path, make_next) -> list[int]:
    """Make ``path`` be atomically replaced by ``make_next(i)`` when safetensors maps its data by
    name (between reading the header and the data): a trainer saving its next checkpoint then."""
    from_file = torch.UntypedStorage.from_file
    calls: list[int] = []

    def replaced(filename, *args, **kwargs):
        if str(filename) == str(path):
            nxt = make_next(len(calls))
            if nxt is not None:
                calls.append(1)
                os.replace(nxt, path)
        return from_file(filename, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "from_file", replaced)
    return calls


def test_publish_of_a_checkpoint_replaced_while_read_publishes_one_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the check, the old file's header cut the new file's bytes: header bytes were
    published as weights."""
    from safetensors.torch import load_file

    store, path, out = str(tmp_path / "store"), tmp_path / "latest.safetensors", tmp_path / "out.safetensors"
    old = {"w": torch.arange(64, dtype=torch.int32)}
    new = {"w": torch.arange(64, dtype=torch.int32) + 1000}
    save_file(old, str(path), metadata={"step": "9"})
    save_file(new, str(tmp_path / "next"), metadata={"step": "10", "note": "a longer header " * 4})
    calls = _replace_on_data_read(monkeypatch, path, lambda i: tmp_path / "next" if i == 0 else None)
    assert main(["publish", store, str(path)]) == EXIT_OK
    assert calls == [1]
    monkeypatch.undo()
    assert main(["pull", store, str(out)]) == EXIT_OK
    assert torch.equal(load_file(str(out))["w"], new["w"])


def test_a_checkpoint_replaced_at_every_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store, path = tmp_path / "store", tmp_path / "latest.safetensors"
    save_file({"w": torch.zeros(8)}, str(path), metadata={"step": "0"})

    def next_save(i: int) -> Path:
        nxt = tmp_path / f"next{i}"
        save_file({"w": torch.full((8,), float(i + 1))}, str(nxt), metadata={"step": str(i + 1) * (i + 1)})
        return nxt

    _replace_on_data_read(monkeypatch, path, next_save)
    assert main(["publish", str(store), str(path)]) == EXIT_FAILED
    *retries, line = capsys.readouterr().err.splitlines()
    assert len(retries) == 3 and all("reading it again" in r for r in retries), retries
    assert line.startswith("deltastore: error: ") and str(path) in line and "replaced while it was read" in line, line
    assert not store.exists()


def test_pull_output_directory_missing(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    assert main(["publish", store, str(ckpt)]) == EXIT_OK
    capsys.readouterr()
    out = tmp_path / "nodir" / "o.safetensors"
    assert main(["pull", store, str(out)]) == EXIT_FAILED
    line, _ = _error(capsys)
    assert str(tmp_path / "nodir") in line and "mkdir -p" in line
    assert main(["pull", store, str(tmp_path)]) == EXIT_FAILED
    line, _ = _error(capsys)
    assert "is a directory" in line
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("flags, words", [
    (["--metadata", "{not json"], "--metadata"),
    (["--metadata", "[1, 2]"], "JSON object"),
    (["--endpoint-url", "127.0.0.1:9000"], "http://127.0.0.1:9000"),
    (["--storage-option", "retries"], "KEY=VALUE"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_flags_are_usage_errors(flags: list[str], words: str, tmp_path: Path, ckpt: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["publish", str(tmp_path / "store"), str(ckpt), *flags]) == EXIT_USAGE
    line, hint = _error(capsys)
    assert words in line
    assert hint is not None and "--help" in hint
    assert not (tmp_path / "store").exists()


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and mtime: what a command that writes nothing leaves as it was."""
    return {str(f.relative_to(root)): (f.stat().st_size, f.stat().st_mtime_ns) for f in root.rglob("*") if f.is_file()}


#: Out-of-range values of every numeric argument, and the flag each error names.
OUT_OF_RANGE = [
    (["compact", "{store}", "--base", "-5"], "--base"),
    (["compact", "{store}", "--base", "0"], "--base"),
    (["compact", "{store}", "--follow", "--interval", "0"], "--interval"),
    (["gc", "{store}", "--keep-last", "0"], "--keep-last"),
    (["gc", "{store}", "--keep-version", "-3", "--dry-run"], "--keep-version"),
    (["gc", "{store}", "--grace=-1h"], "--grace"),
    (["pin", "{store}", "0"], "version"),
    (["unpin", "{store}", "-2"], "version"),
    (["inspect", "{store}", "--version", "-1"], "--version"),
    (["verify", "{store}", "--version", "0"], "--version"),
    (["pull", "{store}", "{out}", "--version", "-1"], "--version"),
    (["pull", "{store}", "{out}", "--follow", "--interval", "-1"], "--interval"),
    (["pull", "{store}", "{out}", "--follow", "--interval", "nan"], "--interval"),
    (["pull", "{store}", "{out}", "--follow", "--max-versions", "0"], "--max-versions"),
    (["publish", "{store}", "{ckpt}", "--anchor-every", "0"], "--anchor-every"),
    (["publish", "{store}", "{ckpt}", "--step", str(2**63)], "--step"),
]


@pytest.mark.parametrize("argv, flag", OUT_OF_RANGE,
                         ids=[" ".join(a for a in argv if not a.startswith("{")) for argv, _ in OUT_OF_RANGE])
def test_out_of_range_numbers_are_usage_errors_and_write_nothing(argv: list[str], flag: str, tmp_path: Path,
                                                                 ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert main(["publish", str(store), str(ckpt)]) == EXIT_OK
    save_file(_state(1), str(ckpt))
    assert main(["publish", str(store), str(ckpt)]) == EXIT_OK
    capsys.readouterr()
    before = _tree(tmp_path)
    args = [a.format(store=store, ckpt=ckpt, out=tmp_path / "out.safetensors") for a in argv]
    assert main(args) == EXIT_USAGE
    line, hint = _error(capsys)
    assert f"argument {flag}:" in line and ("out of range" in line or "negative" in line), line
    assert hint is not None and f"deltastore {argv[0]} --help" in hint
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("command", ["log", "status", "inspect"])
def test_commands_that_read_versions_name_an_unsigned_version_above_a_signed_one(
        command: str, tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """They read through a History, not a Subscriber (no torch), and name the cause as it does."""
    key = tmp_path / "k.pem"
    assert main(["keygen", str(key)]) == EXIT_OK
    store = str(tmp_path / "store")
    assert main(["publish", store, str(ckpt), "--signing-key", str(key)]) == EXIT_OK
    save_file(_state(1), str(ckpt))
    assert main(["publish", store, str(ckpt), "--allow-unsigned"]) == EXIT_OK
    capsys.readouterr()
    assert main([command, store, "--trusted-key", str(tmp_path / "k.pub")]) == EXIT_FAILED
    line, hint = _error(capsys)
    assert "UnsignedVersionError" in line and "publisher without the signing key" in line, line
    assert hint is not None and "--signing-key" in hint and "--trusted-key" not in hint, hint


def test_storage_option_values_are_typed() -> None:
    assert storage_option("retries=2") == ("retries", 2)
    assert storage_option("read_timeout=2.5") == ("read_timeout", 2.5)
    assert storage_option("anon=true") == ("anon", True) and storage_option("anon=False") == ("anon", False)
    assert storage_option('retries={"mode": "adaptive", "max_attempts": 3}') == ("retries", {"mode": "adaptive", "max_attempts": 3})
    assert storage_option("addressing_style=path") == ("addressing_style", "path")
    assert storage_option("profile=123") == ("profile", "123")  # string options stay strings
    assert storage_option("aws_secret_access_key=a=b") == ("aws_secret_access_key", "a=b")


def test_typed_retries_reach_the_s3_client(html_endpoint: str, fake_credentials: None,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # retries=2 used to stay the string "2" and crash botocore's config; now it is an int.
    assert main(["log", "s3://bucket/run", "--endpoint-url", html_endpoint, "--storage-option", "retries=2"]) == EXIT_FAILED
    line, _ = _error(capsys)
    assert "not an S3 endpoint" in line  # got as far as the endpoint: the option was accepted


def test_unknown_aws_profile(fake_credentials: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["log", "s3://bucket/run", "--endpoint-url", "http://127.0.0.1:9",
                 "--storage-option", "profile=no-such-profile-e1"]) == EXIT_FAILED
    line, hint = _error(capsys)
    assert "no-such-profile-e1" in line
    assert hint is not None and "--storage-option profile=NAME" in hint


def test_unknown_profile_from_the_environment(fake_credentials: None, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile-e1")
    assert main(["log", "s3://bucket/run", "--endpoint-url", "http://127.0.0.1:9"]) == EXIT_FAILED
    line, hint = _error(capsys)
    assert "'no-such-profile-e1'" in line and "None" not in line
    assert hint is not None and "profile=NAME" in hint


def test_endpoint_from_the_environment_without_scheme(fake_credentials: None, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    assert main(["status", "s3://bucket/run"]) == EXIT_USAGE
    line, hint = _error(capsys)
    assert "AWS_ENDPOINT_URL='127.0.0.1:9000'" in line and "http://127.0.0.1:9000" in line and hint is None


def test_library_messages_are_put_in_cli_terms() -> None:
    from deltastore.cli.common import cli_terms

    text = cli_terms("pass allow_unsafe_store=True if only one publisher; or storage_options and endpoint_url=http://h")
    assert text == "pass --allow-unsafe-store if only one publisher; or --storage-option KEY=VALUE and --endpoint-url http://h"


# --- exit codes, versions, verbosity, JSON ----------------------------------------------------------


def test_version_and_verbosity_anywhere(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import deltastore

    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"deltastore {deltastore.__version__}"
    store = str(tmp_path / "store")
    assert main(["publish", store, str(ckpt), "-v"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "deltastore.write.publisher" in err and "published version 1" in err  # deltastore's own lines
    assert main(["-v", "log", store]) == EXIT_OK
    assert main(["log", store, "-q"]) == EXIT_OK and main(["-q", "log", store]) == EXIT_OK
    assert capsys.readouterr().err == ""


def test_identical_state_is_not_republished(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    assert main(["publish", store, str(ckpt)]) == EXIT_OK
    capsys.readouterr()
    assert main(["publish", store, str(ckpt), "--step", "5"]) == EXIT_NOTHING_TO_DO
    out = capsys.readouterr().out
    assert "identical to version 1" in out and "--allow-empty" in out
    assert main(["publish", store, str(ckpt), "--json"]) == EXIT_NOTHING_TO_DO
    got = json.loads(capsys.readouterr().out)
    assert got["skipped"] is True and got["version"] == 1
    assert main(["publish", store, str(ckpt), "--allow-empty", "--json"]) == EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert got["skipped"] is False and got["version"] == 2 and got["elements_changed"] == 0
    changed = tmp_path / "changed.safetensors"
    sd = _state()
    sd["w"][0, 0] += 1
    save_file(sd, str(changed))
    assert main(["publish", store, str(changed), "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["version"] == 3
    assert main(["log", store, "--json"]) == EXIT_OK
    assert [json.loads(x)["version"] for x in capsys.readouterr().out.splitlines()] == [1, 2, 3]


def test_json_on_every_informational_command(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    assert main(["publish", store, str(ckpt), "--json", "--step", "1", "--metadata", '{"run": "a"}']) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["metadata"] == {"run": "a"}
    out = str(tmp_path / "o.safetensors")
    for argv in (["pull", store, out], ["verify", store], ["status", store], ["inspect", store], ["pin", store, "1"],
                 ["unpin", store, "1"], ["compact", store], ["gc", store, "--dry-run", "--grace", "7h"]):
        assert main([*argv, "--json"]) == EXIT_OK, argv
        doc = json.loads(capsys.readouterr().out)
        assert isinstance(doc, dict) and doc, argv
    assert main(["verify", store, "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_progress_bar_on_request_and_off_with_q(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = str(tmp_path / "store")
    monkeypatch.setenv("DELTASTORE_PROGRESS", "1")  # stderr is not a TTY under pytest
    assert main(["publish", store, str(ckpt)]) == EXIT_OK
    err = capsys.readouterr().err
    assert "publish" in err and "B/s" in err
    assert main(["pull", store, str(tmp_path / "o.safetensors"), "-q"]) == EXIT_OK
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("DELTASTORE_PROGRESS")
    assert main(["pull", store, str(tmp_path / "o.safetensors")]) == EXIT_OK
    assert capsys.readouterr().err == ""  # not a terminal: no bar


# --- takeover ---------------------------------------------------------------------------------------


def test_no_takeover_refuses_a_live_publisher(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltastore.errors import FencedError
    from deltastore.write.publisher import Publisher

    store = str(tmp_path / "store")
    changed = tmp_path / "changed.safetensors"
    sd = _state()
    sd["w"][0, 0] += 1
    save_file(sd, str(changed))
    with Publisher(store) as trainer:  # a live trainer: just wrote HEAD
        trainer.publish(_state(), step=0)
        assert main(["publish", store, str(changed), "--no-takeover"]) == EXIT_FAILED
        line, hint = _error(capsys)
        assert "ConflictError" in line and trainer.writer_id in line and "--no-takeover" in line
        assert hint is not None
        trainer.publish(_state(1), step=1)  # not fenced: the CLI wrote nothing
        assert main(["publish", store, str(changed)]) == EXIT_OK  # the default takes over, with a warning
        err = capsys.readouterr().err
        assert "warning" in err.lower() and trainer.writer_id in err and "fences" in err
        with pytest.raises(FencedError):
            trainer.publish(_state(2), step=2)


def test_no_takeover_publishes_when_nobody_is_live(tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    assert main(["publish", store, str(ckpt), "--no-takeover"]) == EXIT_OK
    changed = tmp_path / "changed.safetensors"
    sd = _state()
    sd["w"][0, 0] += 1
    save_file(sd, str(changed))
    # the last writer was a CLI call (it has exited): not a live publisher
    assert main(["publish", store, str(changed), "--no-takeover"]) == EXIT_OK
    assert "warning" not in capsys.readouterr().err.lower()


# --- through a real process ------------------------------------------------------------------------


def test_errors_through_a_subprocess(tmp_path: Path, ckpt: Path) -> None:
    env = {**os.environ, "DELTASTORE_DEBUG": "", "PYTHONPATH": str(REPO)}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltastore", *argv], capture_output=True, text=True, check=False,
                              env=env, cwd=tmp_path, timeout=120)

    r = run("publish", "s3:/weights/typo", str(ckpt))
    assert r.returncode == EXIT_USAGE and r.stderr.startswith("deltastore: error: UnsupportedURLError")
    assert "s3://weights/typo" in r.stderr and "\nhint: " in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s3:").exists()
    r = run("log", str(tmp_path / "nothing"))
    assert r.returncode == EXIT_FAILED and "BucketNotFoundError" in r.stderr and not (tmp_path / "nothing").exists()
    r = run("publish", str(tmp_path / "store"), str(ckpt), "--metadata", "{")
    assert r.returncode == EXIT_USAGE and r.stderr.startswith("deltastore: error: argument --metadata")
    r = run("publish", str(tmp_path / "store"), str(ckpt), "-q")
    assert r.returncode == EXIT_OK and r.stderr == ""
    r = run("publish", str(tmp_path / "store"), str(ckpt))
    assert r.returncode == EXIT_NOTHING_TO_DO and "identical" in r.stdout
    r = run("--version")
    assert r.returncode == EXIT_OK and r.stdout.startswith("deltastore ")


@pytest.mark.integration
@pytest.mark.slow
def test_seaweedfs_filer_and_master_ports_are_not_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A worker pointed at SeaweedFS's filer port once saw an empty store forever."""
    if os.environ.get("DELTASTORE_SKIP_SEAWEEDFS") == "1":
        pytest.skip("DELTASTORE_SKIP_SEAWEEDFS=1")
    from deltastore import devserver  # where the server is started (testkit.servers wraps it)

    picked: list[list[int]] = []
    real_free_ports = devserver.free_ports

    def recording(n: int) -> list[int]:  # the fixture does not expose its filer and master ports
        picked.append(real_free_ports(n))
        return picked[-1]

    monkeypatch.setattr(devserver, "free_ports", recording)
    cm = servers.seaweedfs(tmp_path)
    try:
        server = cm.__enter__()
    except servers.ServerStartError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        master, _, _, _, filer, _, s3, _ = picked[-1]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        monkeypatch.setenv("AWS_DEFAULT_REGION", server.region)
        url = f"s3://{server.bucket}/run"
        for port in (filer, master):
            argv = ["log", url, "--endpoint-url", f"http://127.0.0.1:{port}", "--storage-option", "retries=1"]
            assert main(argv) == EXIT_FAILED, port
            line, _ = _error(capsys)
            assert "not an S3 endpoint" in line, line
        assert main(["log", url, "--endpoint-url", f"http://127.0.0.1:{s3}"]) == EXIT_OK
        assert "no versions" in capsys.readouterr().out
    finally:
        cm.__exit__(None, None, None)


def test_progress_bar_on_a_terminal_only(tmp_path: Path, ckpt: Path) -> None:
    """A real pseudo-terminal gets a bar on stderr; the same command piped gets none."""
    import fcntl
    import pty
    import struct
    import termios

    argv = [sys.executable, "-m", "deltastore", "publish", str(tmp_path / "store"), str(ckpt)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DELTASTORE_PROGRESS", None)
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execve(argv[0], argv, env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # tqdm draws nothing at width 0
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == EXIT_OK
    assert b"publish: " in out and b"B/s" in out and b"published version 1" in out
    piped = subprocess.run([*argv[:-2], str(tmp_path / "store2"), str(ckpt)], capture_output=True, text=True, check=False,
                           env=env, timeout=120)
    assert piped.returncode == EXIT_OK and piped.stderr == ""


def test_library_subscriber_on_non_s3_endpoint_fails_fast(html_endpoint: str, fake_credentials: None) -> None:
    """Not only the CLI: a Subscriber reading HEAD from an HTML server raises at once (an HTML 404
    cannot be told from a missing bucket by a HEAD request: BucketNotFoundError; an HTML 200:
    not an S3 endpoint), instead of reading as an empty store."""
    from deltastore.errors import BucketNotFoundError, StorageError
    from deltastore.read.subscriber import Subscriber

    opts = {"endpoint_url": html_endpoint, "retries": 1}
    with Subscriber("s3://bucket/run", storage_options=opts) as sub:
        with pytest.raises(StorageError) as got:
            sub.latest()
    assert isinstance(got.value, BucketNotFoundError) or "not an S3 endpoint" in str(got.value), got.value
