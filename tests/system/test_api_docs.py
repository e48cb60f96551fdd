"""docs/api.md is the reference of the public API: every public name has a section, and every
parameter of each public callable, constructor and public method is named in it, so that the
reference cannot drift silently from the code."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Protocol

import pytest

import deltastore
import deltastore.errors

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _all(module: str) -> list[str]:
    """A module's ``__all__``: a name it starts exporting needs a section before this passes."""
    return list(importlib.import_module(module).__all__)


#: The documented subpackages: their ``__all__``, or the public names of a module without one.
DOCUMENTED: dict[str, list[str]] = {
    "deltastore": list(deltastore.__all__),
    "deltastore.federated": _all("deltastore.federated"),
    "deltastore.cli": _all("deltastore.cli"),
    "deltastore.serving": _all("deltastore.serving"),
    "deltastore.integrations.trl": ["DeltastoreWeightTransfer"],
    "deltastore.integrations.transformers": ["DeltastoreCallback"],
    "deltastore.integrations.vllm": ["DeltastoreWorkerExtension", "VLLMServerSync"],
    "deltastore.integrations.sglang": ["SGLangSync", "EngineApplier", "ServerApplier"],
    "deltastore.integrations.rollout": ["RolloutSidecar", "ServedVersionWorker"],
    "deltastore.integrations.hostcopy": ["HostCopy", "ServedVersion"],
    "deltastore.integrations.peft": _all("deltastore.integrations.peft"),
    "deltastore.integrations.adapters": _all("deltastore.integrations.adapters"),
    "deltastore.read.changes": ["changed_tensors", "changed_rows", "row_ranges", "merge_spans"],
    "deltastore.layout.select": ["Selection"],
    "deltastore.lifecycle.compact": ["compact", "CompactReport", "CompactPolicy"],
    "deltastore.lifecycle.index": ["pin", "unpin"],
    "deltastore.devserver": ["start", "seaweedfs", "moto", "S3Server"],
}


def _errors() -> list[str]:
    return sorted(n for n, o in vars(deltastore.errors).items()
                  if isinstance(o, type) and issubclass(o, BaseException) and o.__module__ == "deltastore.errors")


def _public() -> list[tuple[str, str]]:
    """Every documented (module, name) but the errors (the error table has them). Names only:
    the modules are imported by the test, not when the suite is collected (the integrations
    import their frameworks, seconds in every process that collects)."""
    errors = set(_errors())
    return [(module, name) for module, names in DOCUMENTED.items() for name in names if name not in errors]


def _sections(text: str) -> dict[str, str]:
    """``### `Name` `` heading → its text up to the next heading of level 2 or 3 (its ``####``
    subsections included). A heading may name several (``Publisher.flush``, ``Publisher.close``)."""
    out: dict[str, str] = {}
    parts = re.split(r"(?m)^(#{2,3} .*)$", text)
    for head, body in zip(parts[1::2], parts[2::2]):
        for name in re.findall(r"`([\w.]+)`", head):
            out[name.rsplit(".", 1)[-1]] = out.get(name.rsplit(".", 1)[-1], "") + head + body
    return out


def _params(obj: object) -> list[tuple[str, str]]:
    """(where, parameter) of a function, or of a class's constructor and public methods and
    properties (a property is listed under its own name)."""
    def of(fn: object, where: str) -> list[tuple[str, str]]:
        try:
            sig = inspect.signature(fn)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return []
        return [(where, p) for p in sig.parameters if p not in ("self", "cls")]

    if not isinstance(obj, type):
        return of(obj, "")
    # A Protocol is never built: its __init__ is typing's stand-in (*args, **kwargs).
    built = not getattr(obj, "_is_protocol", False) and (
        obj.__init__ is not object.__init__ or dataclasses.is_dataclass(obj))
    found = of(obj, "constructor") if built else []
    for name, member in vars(obj).items():
        if name.startswith("_") or (dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}):
            continue
        if isinstance(member, property):
            found.append((name, name))
        elif isinstance(member, (staticmethod, classmethod)):
            found += [(name, name)] + of(member.__func__, name)
        elif inspect.isfunction(member):
            found += [(name, name)] + of(member, name)
    return found


def _named(section: str, word: str) -> bool:
    """``word`` appears as code: `` `word` ``, `` `word=…` ``, `` `word(…)` `` or `` `word[…]` ``,
    or in a code span or block that starts with it."""
    return re.search(r"`" + re.escape(word) + r"(?=[`=(\[ ,:.])", section) is not None


@pytest.fixture(scope="module")
def sections() -> dict[str, str]:
    return _sections(API_MD.read_text(encoding="utf-8"))


@pytest.mark.parametrize(("module", "name"), _public())
def test_every_public_name_has_a_section_naming_each_parameter(sections: dict[str, str], module: str, name: str) -> None:
    obj = getattr(importlib.import_module(module), name)
    assert not (isinstance(obj, type) and issubclass(obj, BaseException)), (
        f"{module}.{name} is an error class outside deltastore.errors, where the error table looks")
    assert name in sections, f"docs/api.md has no `### `{name}`` section for {module}.{name}"
    missing = [f"{where}: {p}" if where else p for where, p in _params(obj) if not _named(sections[name], p)]
    assert not missing, f"docs/api.md, section {name} ({module}): undocumented parameters {missing}"


def test_every_error_is_in_the_error_table_with_its_bases() -> None:
    text = API_MD.read_text(encoding="utf-8")
    table = text[text.index("\n## Errors"):]
    for name in _errors():
        cls = getattr(deltastore.errors, name)
        row = re.search(r"(?m)^\| `" + name + r"`( †)? \| ([^|]+) \|", table)
        assert row, f"docs/api.md: no row for {name} in the error table"
        bases = [b.strip(" `") for b in row.group(2).split(",")]
        assert bases == [b.__name__ for b in cls.__bases__], f"{name}: the table says {bases}"
        assert (row.group(1) is not None) == (name in deltastore.__all__), f"{name}: † marks an export of deltastore"


def test_the_parameter_check_sees_a_missing_parameter() -> None:
    def f(url: str, *, brand_new: int = 0) -> None: ...
    assert [p for _, p in _params(f)] == ["url", "brand_new"]
    assert not _named("`f(url)`: `url` the store", "brand_new")
    assert _named("- `brand_new` (`int`): new", "brand_new")


def test_a_protocol_is_checked_by_its_methods_not_a_constructor() -> None:
    class Engine(Protocol):
        def load(self, name: str) -> None: ...

    assert _params(Engine) == [("load", "load"), ("load", "name")]


def test_the_reference_points_at_the_spec_rather_than_numbering_decisions() -> None:
    text = API_MD.read_text(encoding="utf-8")
    assert re.findall(r"\bschema \d|\bdesign \d{3}|\bD\d+\b", text) == []
    # a section number only as a link into the spec
    assert re.findall(r"(?<!\[)SPEC §[\d.]+(?!\]\(SPEC\.md)", text) == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_the_reference_land_on_a_heading() -> None:
    root = API_MD.parents[1]
    anchors = {_anchor(h) for h in re.findall(r"(?m)^#{1,4} (.*)$", API_MD.read_text(encoding="utf-8"))}
    sources = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "examples").glob("*.md")]
    broken = [f"{src.relative_to(root)}: #{a}" for src in sources
              for a in re.findall(r"(?:api\.md)?#([\w-]+)\)", src.read_text(encoding="utf-8"))
              if (src == API_MD or "api.md#" + a in src.read_text(encoding="utf-8")) and a not in anchors]
    assert broken == []
