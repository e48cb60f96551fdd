"""`deltastore docs` prints the reference from the installed package, and `--help` points to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deltastore.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_help_points_to_documentation_that_is_installed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "deltastore docs" in out and "docs/" not in out  # no path that exists only in a checkout


def test_docs_lists_and_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs"]) == 0
    listing = capsys.readouterr().out.split()
    assert {"cli", "api", "SPEC", "design/005-history-lifecycle"} <= set(listing)
    assert main(["docs", "cli"]) == 0
    assert capsys.readouterr().out == (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert main(["docs", "005"]) == 0
    assert capsys.readouterr().out.startswith("# 005")


def test_an_unknown_document_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "no-such-page"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("deltastore: error:") and "no-such-page" in err[0]


def test_the_build_step_bundles_the_docs_into_the_package(tmp_path: Path) -> None:
    """What a wheel carries: setup.py's build_py copies docs/ into deltastore/_docs/."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    bundled = tmp_path / "deltastore" / "_docs"
    assert (bundled / "cli.md").read_bytes() == (ROOT / "docs" / "cli.md").read_bytes()
    assert (bundled / "design" / "001-commit-protocol.md").is_file()


def test_output_to_a_closed_pipe_is_not_an_error() -> None:
    proc = subprocess.run(f"{sys.executable} -m deltastore.cli docs SPEC | head -c 10", shell=True, cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.stdout == "# deltasto" and "Error" not in proc.stderr
