"""Startup manners: ``import deltastore`` and ``deltastore --help`` import no heavy library.

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
    from deltastore.publish import Publisher
    from deltastore.pull import Subscriber

    assert deltastore.Publisher is Publisher and deltastore.Subscriber is Subscriber
    assert set(deltastore.__all__) <= set(dir(deltastore))
    with pytest.raises(AttributeError):
        deltastore.NoSuchThing  # noqa: B018
