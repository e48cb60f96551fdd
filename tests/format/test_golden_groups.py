"""Format stability of schema 4 (design 007): the golden store written by the first schema-4
writer (tests/golden/make_golden.py schema4) is read bit for bit by this release
and every later one. The golden files are never rewritten: the store is copied first."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltastore import Subscriber
from deltastore.errors import UnsupportedSchemaError
from deltastore.format.history import History
from deltastore.storage import open_store

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
STORE4 = GOLDEN / "store-schema4"
EXPECTED4 = GOLDEN / "store-schema4-expected"
FACTS4 = json.loads((GOLDEN / "store-schema4-facts.json").read_text())
N4 = FACTS4["versions"]


@pytest.fixture
def url(tmp_path: Path) -> str:
    dst = tmp_path / "store4"
    shutil.copytree(STORE4, dst)
    return str(dst)


def _expected(v: int) -> dict[str, torch.Tensor]:
    return load_file(str(EXPECTED4 / f"v{v}.safetensors"))


def _sha(t: torch.Tensor) -> str:
    t = t.contiguous()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for k in want:
        assert (got[k].dtype, tuple(got[k].shape), _sha(got[k])) == (want[k].dtype, tuple(want[k].shape), _sha(want[k])), (what, k)


def test_expected_files_match_their_sidecar() -> None:
    shas = json.loads((EXPECTED4 / "sha256.json").read_text())
    assert sorted(shas) == sorted(f"v{v}" for v in range(1, N4 + 1))
    for v in range(1, N4 + 1):
        assert {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
                for k, t in _expected(v).items()} == shas[f"v{v}"], v


def test_every_manifest_and_layout_is_schema4_with_the_recorded_groups(url: str) -> None:
    h = History(open_store(url))
    head = h.read_head()[0]
    assert head.schema_ == 3  # schema 4 left HEAD alone
    for v in range(1, N4 + 1):
        _, m = h.find(v, head)
        layout = h.layout(m.layout)
        assert m.schema_ == layout.schema_ == 4, v
        assert {row: [mm.name for mm in ms] for row, ms in layout.members().items()} == FACTS4["groups"], v
        assert [n for n in layout.name if n not in FACTS4["groups"]] == FACTS4["ungrouped"], v
        assert m.kind == ("anchor" if v in FACTS4["anchors"] else "delta"), v


@pytest.mark.parametrize("version", range(1, N4 + 1))
def test_pull(url: str, version: int) -> None:
    with Subscriber(url, threads=1) as sub:
        _assert_same(sub.pull(version), _expected(version), f"pull({version})")
        assert set(sub.layout()) == set(_expected(version))


def test_pull_into_walks_every_version_in_place(url: str) -> None:
    with Subscriber(url, threads=1) as sub:
        target = sub.pull(1)
        for v in range(2, N4 + 1):
            sub.pull_into(target, v)
            _assert_same(target, _expected(v), f"pull_into({v})")


def test_stage_and_swap(url: str) -> None:
    with Subscriber(url, threads=1) as sub:
        target = sub.pull(3)
        sub.swap(sub.stage(target, 7), target)
        _assert_same(target, _expected(7), "stage+swap 3→7")


def test_the_squash_is_used_at_its_base(url: str) -> None:
    sq = FACTS4["squash"]
    with Subscriber(url, threads=1) as sub:
        target = sub.pull(sq["from"])
        before = sub.bytes_fetched
        sub.pull_into(target)
        assert sub.bytes_fetched - before == sq["bytes"] < sq["chain_bytes"]
        _assert_same(target, _expected(sq["to"]), "through the squash")


def test_a_schema3_reader_refuses_it_cleanly(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deltastore.format.parse.READABLE_SCHEMAS", (3,))
    with Subscriber(url, threads=1) as sub, pytest.raises(UnsupportedSchemaError, match="schema 4"):
        sub.pull()
