"""Startup manners: ``import deltastore``, ``deltastore --help`` and usage errors import no heavy
library; the commands that move no tensors (log, status, inspect, gc, pin, keygen) import no
tensor library.

Each check runs in a fresh interpreter (this process has torch loaded already).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Libraries that cost 0.1-1.4 s to import and that no help text or error class needs.
HEAVY = ("torch", "boto3", "botocore", "fsspec", "s3fs", "pydantic", "numpy", "safetensors", "matplotlib", "tqdm")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_deltastore_loads_no_heavy_module() -> None:
    assert _loaded_after("import deltastore") == []


def test_error_classes_and_version_need_no_heavy_module() -> None:
    assert _loaded_after("import deltastore\ndeltastore.DeltastoreError, deltastore.__version__") == []


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["publish", "--help"], ["log", "--help"]])
def test_cli_help_loads_no_heavy_module(argv: list[str]) -> None:
    code = (
        "import contextlib, io\nfrom deltastore.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main({argv!r})\n"
        "    except SystemExit:\n        pass"
    )
    assert _loaded_after(code) == []


def test_lazy_names_resolve_to_the_real_classes() -> None:
    import deltastore
    from deltastore.read.subscriber import Subscriber
    from deltastore.write.publisher import Publisher

    assert deltastore.Publisher is Publisher and deltastore.Subscriber is Subscriber
    assert set(deltastore.__all__) <= set(dir(deltastore))
    with pytest.raises(AttributeError):
        deltastore.NoSuchThing  # noqa: B018


#: What a command that reads versions and moves no tensors must not import (docs/cli.md).
TENSOR_LIBS = ("torch", "numpy", "safetensors", "boto3", "botocore", "fsspec", "matplotlib")


def _run_cli(argv: list[str]) -> tuple[int, list[str]]:
    """``deltastore ARGV`` in a fresh interpreter: its exit code and the heavy modules it loaded."""
    code = (
        "import contextlib, io, json, sys\nfrom deltastore.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    rc = main({argv!r})\n"
        f"print(json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    rc, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    return rc, loaded


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch

    from deltastore import Publisher

    url = str(tmp_path_factory.mktemp("startup") / "store")
    state = {"w": torch.zeros(8, 8), "b": torch.ones(8)}
    with Publisher(url) as pub:
        pub.publish(state, step=0)
        state["w"][1, 1] = 1.0
        pub.publish(state, step=1)
    return url


@pytest.mark.parametrize("argv", [
    ["log", "{url}"], ["log", "{url}", "--json"], ["status", "{url}"], ["status", "{url}", "--json"],
    ["inspect", "{url}"], ["inspect", "{url}", "--version", "1", "--json"], ["gc", "{url}", "--dry-run"],
    ["pin", "{url}", "1"], ["unpin", "{url}", "1"], ["keygen", "{url}-key.pem"],
], ids=lambda argv: " ".join(a for a in argv if not a.startswith("{url}")))
def test_commands_that_move_no_tensors_load_no_tensor_library(argv: list[str], store_url: str) -> None:
    rc, loaded = _run_cli([a.format(url=store_url) for a in argv])
    assert rc == 0
    assert [m for m in loaded if m in TENSOR_LIBS] == []


@pytest.mark.parametrize("argv", [
    ["log"], ["log", "s3:/typo"], ["pull", "S3://bucket/run", "out.safetensors"], ["compact", "{url}", "--base", "-5"],
    ["publish", "{url}", "model.safetensors", "--anchor-every", "0"], ["pull", "{url}", "out.safetensors", "--version", "0"],
    ["aggregate", "{url}", "--site", "bad"],
], ids=lambda argv: " ".join(a for a in argv if a != "{url}"))
def test_usage_errors_load_no_heavy_module(argv: list[str], store_url: str) -> None:
    rc, loaded = _run_cli([a.format(url=store_url) for a in argv])
    assert rc == 2
    assert loaded == []
