"""Format stability of column grids (design 011 D7): the golden store written by the first grid
writer (tests/golden/make_golden.py grid) is read bit for bit by this release and every later
one: whole, by column slices, and by ``pull_into`` from every earlier version, with every chunk
digest checked against slicing of the expected tensors. The golden files are never rewritten:
the store is copied first."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from deltastore import Subscriber
from deltastore.format.history import History
from deltastore.layout.select import Selection
from deltastore.read.plan import layout
from deltastore.storage import open_store

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
STORE = GOLDEN / "store-grid"
EXPECTED = GOLDEN / "store-grid-expected"
FACTS = json.loads((GOLDEN / "store-grid-facts.json").read_text())
N = FACTS["versions"]


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    dst = tmp_path_factory.mktemp("grid") / "store"
    shutil.copytree(STORE, dst)
    return str(dst)


def _expected(v: int) -> dict[str, torch.Tensor]:
    return load_file(str(EXPECTED / f"v{v}.safetensors"))


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for k in want:
        assert (got[k].dtype, tuple(got[k].shape), _raw(got[k])) == (want[k].dtype, tuple(want[k].shape), _raw(want[k])), (what, k)


def _columns(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    out = {}
    for n in FACTS["grids"]:
        c = state[n].shape[1]
        out[n] = state[n][:, rank * c // world:(rank + 1) * c // world].contiguous()
    return out


def test_expected_files_match_their_sidecar() -> None:
    shas = json.loads((EXPECTED / "sha256.json").read_text())
    assert sorted(shas) == sorted(f"v{v}" for v in range(1, N + 1))
    for v in range(1, N + 1):
        assert {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                    "sha256": hashlib.sha256(_raw(t)).hexdigest()}
                for k, t in _expected(v).items()} == shas[f"v{v}"], v


def test_layouts_and_chunk_digests_are_the_recorded_grids(url: str) -> None:
    """Every version's layout has the recorded schema and ``chunk_cols``; every chunk digest of
    every grid tensor is the XXH3-128 of its block ``W[r0:r1, c0:c1]`` sliced by torch."""
    h = History(open_store(url))
    head = h.read_head()[0]
    assert head.schema_ == 3
    for v in range(1, N + 1):
        facts = FACTS["per_version"][f"v{v}"]
        _, m = h.find(v, head)
        lay = h.layout(m.layout)
        assert (m.schema_, lay.schema_, m.kind) == (facts["schema"], facts["schema"], facts["kind"]), v
        assert {n: c for n, c in zip(lay.name, lay.chunk_cols) if n in FACTS["grids"]} == facts["chunk_cols"], v
        assert {row: [mm.name for mm in ms] for row, ms in lay.members().items()} == facts["groups"], v
        specs = layout(m)
        entries = {t.name: t for t in m.tensors}
        want = _expected(v)
        for n in FACTS["grids"]:
            spec = specs[n]
            assert spec.chunk_cols == facts["chunk_cols"][n]
            k, inner = spec.chunk_cols, spec.row_elems // spec.shape[1]
            if m.kind == "anchor":
                assert [e.index for e in entries[n].chunks] == list(range(spec.n_chunks)), (v, n)
            for e in entries[n].chunks:
                r0, r1, e0, e1 = spec.chunk_block(e.index)
                c0, c1 = e0 // inner, e1 // inner
                assert c1 - c0 <= k
                block = want[n][r0:r1, c0:c1].contiguous()
                assert e.digest == xxhash.xxh3_128_hexdigest(_raw(block)), (v, n, e.index)


@pytest.mark.parametrize("version", range(1, N + 1))
def test_pull(url: str, version: int) -> None:
    with Subscriber(url, threads=1) as sub:
        _assert_same(sub.pull(version), _expected(version), f"pull({version})")


def test_pull_into_from_every_earlier_version(url: str) -> None:
    with Subscriber(url, threads=1) as sub:
        for start in range(1, N):
            target = sub.pull(start)
            for v in range(start + 1, N + 1):
                sub.pull_into(target, v)
                _assert_same(target, _expected(v), f"pull_into {start} → {v}")


@pytest.mark.parametrize("world", FACTS["column_worlds"])
def test_column_slices_read_the_recorded_chunks(url: str, world: int) -> None:
    """A column reader of the grid tensors reads exactly the recorded chunks (no more bytes
    than their segments), holds its columns bit for bit, and fast-forwards them."""
    for rank in range(world):
        sel = Selection(names=tuple(FACTS["grids"]), shard=(1, rank, world))
        with Subscriber(url, threads=1, select=sel) as sub:
            mine = None
            for v in range(1, N + 1):
                rec = FACTS["per_version"][f"v{v}"]["column_reads"][f"{world}/{rank}"]
                _, m = sub._reader.resolve(v)
                res = sub._reader.partial.resolved(layout(m))
                assert sorted(f"{n}:{i}" for n, i in res.chunks) == rec["chunks"], (v, rank)
                assert sorted(f"{n}:{i}" for n, i in res.edges) == rec["edges"], (v, rank)
                if mine is None or v in FACTS["anchors"]:
                    before = sub.bytes_fetched
                    mine = sub.pull(v)
                    assert sub.bytes_fetched - before <= rec["bytes"], (v, rank)
                else:
                    sub.pull_into(mine, v)
                _assert_same(mine, _columns(_expected(v), rank, world), f"v{v} rank {rank}/{world}")
