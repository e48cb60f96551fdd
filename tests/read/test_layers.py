"""The read path's modules and the layout below it: each concept in its own module, and values,
not private names, crossing between them; layout/ is below read/ and never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import deltastore

PACKAGE = Path(deltastore.__file__).parent
LAYERS = ("read", "layout")
#: No module of these layers grows past this many lines (one concept each).
MAX_MODULE_LINES = 800


def _modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py"))


def _imports(path: Path) -> list[ast.ImportFrom]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and not n.level]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


@pytest.mark.parametrize("layer", LAYERS)
def test_no_private_name_is_imported_from_another_module(layer: str) -> None:
    found = [
        f"{_module_name(p)}: from {n.module} import {a.name}"
        for p in _modules(layer)
        for n in _imports(p)
        if (n.module or "").startswith("deltastore") and n.module != _module_name(p)
        for a in n.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert found == []


def test_layout_imports_nothing_of_the_read_path() -> None:
    found = [f"{_module_name(p)}: {n.module}" for p in _modules("layout") for n in _imports(p)
             if (n.module or "").startswith("deltastore.read")]
    assert found == []


@pytest.mark.parametrize("layer", LAYERS)
def test_every_module_is_of_a_readable_size(layer: str) -> None:
    sizes = {_module_name(p): len(p.read_text().splitlines()) for p in _modules(layer)}
    assert {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES} == {}
