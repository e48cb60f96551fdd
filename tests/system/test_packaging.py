"""The distribution's name and license: every install hint in the tree names the distribution
pyproject.toml builds (not the unrelated ``deltastore`` of the package index), with an extra it
declares, and the license file the metadata points at is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="pyproject.toml is read with tomllib (Python 3.11+)")

ROOT = Path(__file__).resolve().parents[2]
#: Where install hints are written: the package (errors, docstrings, CLI help), the docs and
#: everything else that a user reads or runs.
SCANNED = ("deltastore", "docs", "examples", "infra", "benchmarks", "campaigns", "testkit", "tests")
SUFFIXES = {".py", ".md", ".txt", ".toml", ".sh", ".yaml", ".yml"}
#: ``<name>[<extras>]`` where <name> is ``deltastore`` or a distribution spelled from it.
EXTRA_HINT = re.compile(r"(?<![\w./-])(deltastore(?:[-_.][\w.-]*)?)\[([\w,\s-]+)\]")
#: A ``pip install`` of a name spelled from deltastore (quoted or not), without extras.
BARE_HINT = re.compile(r"pip install\s+[\"']?(deltastore(?:[-_.][\w.-]*)?)(?![\w\[.-])")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for top in SCANNED:
        out += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES and p.is_file()
                and "__pycache__" not in p.parts]
    return out


def _hints() -> list[tuple[str, str, str]]:
    """(file, name, extras) of every ``name[extras]`` hint, and (file, name, "") of every bare
    ``pip install name``."""
    found = []
    for path in _files():
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = str(path.relative_to(ROOT))
        found += [(rel, m.group(1), m.group(2)) for m in EXTRA_HINT.finditer(text)]
        found += [(rel, m.group(1), "") for m in BARE_HINT.finditer(text)]
    return found


def test_every_install_hint_names_this_distribution_and_one_of_its_extras() -> None:
    project = _project()
    name, extras = project["name"], set(project["optional-dependencies"])
    assert name != "deltastore"  # the index's deltastore is another project
    hints = _hints()
    wrong = [h for h in hints if h[1] != name]
    assert not wrong, f"install hints that do not name {name!r}: {wrong}"
    unknown = [h for h in hints if any(e.strip() not in extras for e in h[2].split(",") if h[2])]
    assert not unknown, f"install hints with an extra pyproject.toml does not declare: {unknown}"
    # the hints users meet at run time are among those checked
    files = {h[0] for h in hints}
    for where in ("deltastore/format/signing.py", "deltastore/devserver.py", "deltastore/cli/plot.py",
                  "deltastore/integrations/transformers.py", "README.md", "docs/integrations.md"):
        assert where in files, where


def test_the_runtime_hints_match_the_project_name() -> None:
    from deltastore.devserver import INSTALL_HINT

    assert INSTALL_HINT == f'pip install "{_project()["name"]}[dev]"'


def test_the_license_file_is_the_one_the_metadata_points_at() -> None:
    project = _project()
    assert project["license"] == {"file": "LICENSE"}
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_the_version_is_the_one_pyproject_declares() -> None:
    import deltastore

    # __version__ is a literal so that `import deltastore` and `deltastore --version` need no
    # installed metadata (a checkout, an editable install made before a version bump)
    assert deltastore.__version__ == _project()["version"]


def test_the_built_package_carries_py_typed_and_the_docs(tmp_path: Path) -> None:
    """build_py is the step of ``pip wheel`` that gathers the package's files (the wheel adds only
    the compiled kernels and metadata); running it alone keeps this check to a second."""
    import subprocess
    import sys

    lib = tmp_path / "lib"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    package = lib / "deltastore"
    assert (package / "py.typed").is_file()
    for doc in ("api.md", "cli.md", "SPEC.md"):
        assert (package / "_docs" / doc).read_text(encoding="utf-8") == (ROOT / "docs" / doc).read_text(encoding="utf-8")
