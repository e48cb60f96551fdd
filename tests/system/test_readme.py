"""The README's promises hold: the two commands CI runs are there under their markers, the
quickstart runs as written, the architecture tree is the package's, and its links resolve."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

#: The commands a newcomer copies and .ci/run executes (it reads the line after the marker).
COMMANDS = {
    "demo-command": 'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[demo]" && .venv/bin/python examples/demo.py',
    "test-command": 'python3 -m venv .venv && .venv/bin/pip install --no-compile torch==2.13.0 -e ".[test,bench,trl]" && .venv/bin/python -m pytest -n auto --maxprocesses 8',
}


def _block_after(marker: str) -> str:
    """The fenced code block that follows ``<!-- marker -->``."""
    m = re.search(r"<!-- " + re.escape(marker) + r" -->\n```\w*\n(.*?)\n```", README, re.S)
    assert m, f"README.md: no code block after <!-- {marker} -->"
    return m.group(1)


@pytest.mark.parametrize("marker", sorted(COMMANDS))
def test_the_commands_are_under_their_markers(marker: str) -> None:
    assert _block_after(marker) == COMMANDS[marker]


def test_the_quickstart_runs() -> None:
    code = _block_after("quickstart")
    assert len(code.splitlines()) <= 16  # a quickstart, not a tutorial
    # a store of its own: memory stores live as long as the process, and a rerun would resume
    assert code.count('"memory://quickstart"') == 1
    code = code.replace('"memory://quickstart"', f'"memory://quickstart-{uuid.uuid4().hex}"')
    exec(compile(code, "README.md quickstart", "exec"), {})  # its own asserts check the pull


def test_the_architecture_tree_is_the_package() -> None:
    tree = re.search(r"```\ndeltastore/\n(.*?)```", README, re.S)
    assert tree, "README.md: no package tree under Architecture"
    drawn = set(re.findall(r"^[├└]── (\S+)", tree.group(1), re.M))
    package = ROOT / "deltastore"
    real = {p.name + "/" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name != "_docs"}
    real |= {p.name for p in package.glob("*.py") if p.name != "__main__.py"}
    assert drawn == real, f"drawn but absent: {sorted(drawn - real)}; present but not drawn: {sorted(real - drawn)}"


def test_local_links_resolve() -> None:
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_it_speaks_to_users() -> None:
    """Words for a newcomer: no format or decision numbers, no run labels."""
    found = re.findall(r"schema \d|design \d{3}|\bsession \d+|§\s*\d|zombie|attempt-scoped", README, re.I)
    assert found == []
