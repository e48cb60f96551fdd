"""The user documentation, wherever deltastore is installed.

A wheel carries docs/*.md and docs/design/*.md as ``deltastore/_docs/`` (copied by setup.py's
build step); an editable install or a checkout reads the repository's docs/ folder. ``deltastore
docs NAME`` prints one; the CLI's ``--help`` texts point there, never to a path of a checkout.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent


def root() -> Path | None:
    """The folder holding the documents, or None when this installation has none."""
    for candidate in (_PACKAGE / "_docs", _PACKAGE.parent / "docs"):
        if (candidate / "cli.md").is_file():
            return candidate
    return None


def names() -> list[str]:
    """The documents by name (``cli``, ``api``, ``SPEC``, ``design/005-history-lifecycle``, ...)."""
    base = root()
    if base is None:
        return []
    return sorted(str(p.relative_to(base).with_suffix("")) for p in [*base.glob("*.md"), *base.glob("design/*.md")])


def find(name: str) -> Path | None:
    """The document called ``name`` (case-insensitive, with or without ``.md``; a design
    document also by its number, e.g. ``005``), or None."""
    wanted = name.removesuffix(".md").lower()
    base = root()
    for n in names():
        stem = n.lower()
        if wanted in (stem, stem.removeprefix("design/")) or (
            stem.startswith("design/") and wanted.isdigit() and stem[len("design/"):].startswith(wanted.zfill(3) + "-")
        ):
            assert base is not None
            return base / f"{n}.md"
    return None
