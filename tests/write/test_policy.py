"""The writers' policies (deltastore/write/policy.py): values validated once, shared by every
writer, and the small constructors they make possible."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import deltastore
from deltastore.federated import Aggregator, BasedWriter, Site
from deltastore.write.chain import VersionChain
from deltastore.write.policy import (
    DEFAULT_ANCHOR_EVERY,
    AnchorPolicy,
    AsyncPolicy,
    LayoutPolicy,
    WriterPolicy,
)
from deltastore.write.publisher import Publisher
from deltastore.write.sharded import ShardedPublisher

PACKAGE = Path(deltastore.__file__).parent
#: The most parameters a writer's constructor takes (``self`` not counted): the Publisher's
#: where (url, store, storage_options), what is served (dtype, formats), the signing key, five
#: policy values (writer, anchor, layout, async, compact) and where its metrics are served.
MAX_PARAMETERS = 12


@pytest.mark.parametrize("cls", [Publisher, ShardedPublisher, BasedWriter, Site, Aggregator, VersionChain])
def test_constructors_take_policies_not_long_argument_lists(cls: type) -> None:
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert len(params) <= MAX_PARAMETERS, params


def test_both_publishers_take_the_same_policies() -> None:
    def policies(cls: type) -> dict[str, object]:
        return {n: p.annotation for n, p in inspect.signature(cls.__init__).parameters.items() if n.endswith("_policy")}

    shared = policies(ShardedPublisher)
    assert set(shared) == {"writer_policy", "anchor_policy", "layout_policy"}
    assert {n: policies(Publisher)[n] for n in shared} == shared


def test_policies_are_frozen_and_normalised_once() -> None:
    anchors = AnchorPolicy(every=4)
    assert (anchors.rule, anchors.every) == ("every", 4)  # ``every`` alone: the fixed cadence
    assert AnchorPolicy("every").every == DEFAULT_ANCHOR_EVERY
    assert (AnchorPolicy().rule, AnchorPolicy().every) == ("cost", None)
    layout = LayoutPolicy(slice_align=8, column_slices=["*.o_proj.weight"])
    assert layout.column_slices == ("*.o_proj.weight",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        anchors.every = 5  # type: ignore[misc]
    # replace() validates again: a value derived from a valid one is checked like a new one
    with pytest.raises(ValueError, match="column_slices needs slice_align"):
        dataclasses.replace(layout, slice_align=None)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: AnchorPolicy("sometimes"), "anchor rule"),
    (lambda: AnchorPolicy(every=0), "anchor every"),
    (lambda: AnchorPolicy(cost_ratio=float("inf")), "cost_ratio"),
    (lambda: AnchorPolicy(cost_ratio=True), "cost_ratio"),
    (lambda: WriterPolicy(max_attempt_s=7 * 3600), "max_attempt_s"),
    (lambda: WriterPolicy(threads=0), "threads"),
    (lambda: WriterPolicy(writer_id=""), "writer_id"),
    (lambda: LayoutPolicy(chunk_bytes=0), "chunk_bytes"),
    (lambda: LayoutPolicy(slice_align=True), "slice_align"),
    (lambda: LayoutPolicy(slice_align=8, column_slices="*.o_proj.weight"), "column_slices must be a sequence"),
    (lambda: LayoutPolicy(column_slices=("w",)), "column_slices needs slice_align"),
    (lambda: LayoutPolicy(group_small_tensors="yes"), "group_small_tensors"),
    (lambda: AsyncPolicy("newest"), "async mode"),
    (lambda: AsyncPolicy(max_pending=0), "max_pending"),
])
def test_bad_policies_are_refused_when_made(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_keyword_of_the_old_api_is_refused_before_any_io(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")  # opening it would raise BucketNotFoundError
    with pytest.raises(TypeError, match="unexpected keyword argument 'anchor_every'"):
        Publisher(missing, anchor_every=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"layout_policy must be LayoutPolicy\(...\)"):
        Publisher(missing, layout_policy={"chunk_bytes": 1024})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        Publisher(missing, dtype=torch.int8)


def test_the_policies_are_public() -> None:
    for name in ("AnchorPolicy", "AsyncPolicy", "LayoutPolicy", "WriterPolicy"):
        assert name in deltastore.__all__ and getattr(deltastore, name).__module__ == "deltastore.write.policy"


# --- the write layer's imports ---------------------------------------------------------------------

#: The modules whose imports are checked: the writers and their federated and index siblings.
CHECKED = ("write", "federated", "lifecycle/index.py")


def _modules() -> list[Path]:
    out: list[Path] = []
    for name in CHECKED:
        path = PACKAGE / name
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def test_no_private_name_is_imported_across_modules() -> None:
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deltastore"):
                found += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
    assert not found


def test_the_write_path_imports_the_read_path_only_lazily() -> None:
    """write → read is one-way and deferred (a publisher resumes through the read path); the
    read path never imports the write path."""
    for path in _modules():
        if "write" not in path.parts:
            continue
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [n.module or "" for n in top if isinstance(n, ast.ImportFrom)] + [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in names if m.startswith("deltastore.read")], path
    for path in sorted((PACKAGE / "read").rglob("*.py")):
        assert "deltastore.write" not in path.read_text(), path
