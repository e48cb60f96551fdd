"""Write the column-grid golden store under tests/golden/ (run once; the files are committed as data).

Written by deltastore at design 011 D10 step 5 (branch G5 on G3's step 3: the first writer of
column grids), with::

    python tests/golden/make_golden_grid.py          # from the repository root

It refuses to overwrite existing files: the point of the files is that they were written by an
older release and are read, bit for bit, by every later one (tests/test_golden_grid.py). Inputs
are deterministic (fixed seeds), but manifests carry random ids and times, so running it again
gives other bytes: the files are written once, never regenerated.

The writer's grid policy (``column_slices``, D10 step 4) never grids tensors this small, so the
layouts come from step 3's test hook ``Publisher._explicit_specs``: readers never depend on the
policy. No new schema number (011 D7): grid layouts are schema 3, or 4 with groups.

What it writes:

``store-grid/``
    ``grid2d`` bf16 (70, 100) with ``chunk_rows`` 16 and ``chunk_cols`` 24 (5 × 5 chunks, ragged
    both ways), ``grid3d`` fp32 (12, 10, 3) with ``chunk_cols`` 4 (trailing elements; 3 × 3
    chunks), ``plain`` bf16 (40, 16) without a grid, and six 0-d/1-D fp32 ``norm.*``.
    v1 an anchor, v2 a sparse delta, v3 a dense delta (every element of ``grid2d`` changes),
    v4 a sparse delta, the squash S(2, 4) registered by a compactor; v5 a ``resume=False``
    anchor whose layout gives ``grid3d`` ``chunk_cols`` 3, v6 a delta; v7 a ``resume=False``
    anchor that groups the small tensors (schema 4; grid tensors are never grouped), v8 a delta.
``store-grid-expected/vN.safetensors`` and ``sha256.json``
    The state dict of every version N, as published, and each tensor's SHA-256.
``store-grid-facts.json``
    What the generator did (anchors, each version's schema and ``chunk_cols``, the squash), and
    what a column reader fetches: per version and rank of ``COLUMN_WORLDS``, the chunks a pull
    of only the grid tensors cut along dimension 1 reads, and the bytes of their segments.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from make_golden_schema3 import _copy_store, _write_shas  # noqa: E402

SEED = 20261202
VERSIONS = 8
ANCHORS = (1, 5, 7)
SQUASH_BASE, SQUASH_TO = 2, 4
GRIDS = ("grid2d", "grid3d")
#: The column readers recorded in the facts: degrees the grid was not made for (it has none).
COLUMN_WORLDS = (2, 4)


def _specs(grid3d_cols: int) -> dict:
    from deltastore.layout.tensors import TensorSpec

    return {"grid2d": TensorSpec("grid2d", "bfloat16", (70, 100), 16, (), 24),
            "grid3d": TensorSpec("grid3d", "float32", (12, 10, 3), 5, (), grid3d_cols)}


def column_reads(url: str, version: int) -> dict[str, dict[str, object]]:
    """Per ``"world/rank"``: the chunks (``"name:index"``) and segment bytes a pull of
    ``version`` reads with the grid tensors cut along dimension 1 (from the plan)."""
    from deltastore.format.history import History
    from deltastore.read.plan import layout, plan_from_anchor
    from deltastore.layout.select import Selection, resolve
    from deltastore.storage import open_store

    h = History(open_store(url))
    head = h.read_head()[0]
    key, m = h.find(version, head)
    ms = h.anchor_chain(key, m)
    specs = layout(ms[0][1])
    plans = plan_from_anchor(ms, specs)
    out: dict[str, dict[str, object]] = {}
    for world in COLUMN_WORLDS:
        for rank in range(world):
            res = resolve(Selection(names=GRIDS, shard=(1, rank, world)), specs)
            read = [p for p in plans if (p.name, p.index) in res.chunks]
            out[f"{world}/{rank}"] = {"chunks": sorted(f"{p.name}:{p.index}" for p in read),
                                      "edges": sorted(f"{n}:{i}" for n, i in res.edges),
                                      "bytes": sum(p.cost for p in read)}
    return out


def write_grid(store_dir: Path, expected_dir: Path, facts_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
    from deltastore.lifecycle.compact import compact
    from deltastore.format.history import History
    from deltastore.storage import open_store

    g = torch.Generator().manual_seed(SEED)
    sd: dict[str, torch.Tensor] = {
        "grid2d": (torch.randn(70, 100, generator=g) * 0.02).to(torch.bfloat16),
        "grid3d": torch.randn(12, 10, 3, generator=g),
        "plain": (torch.randn(40, 16, generator=g) * 0.02).to(torch.bfloat16),
    }
    for i in range(5):
        sd[f"norm.{i}"] = torch.ones(16, dtype=torch.float32) + i
    sd["norm.scale"] = torch.tensor(1.5, dtype=torch.float32)  # 0-d
    sd["grid3d"][0, 0, 0] = float("nan")  # special values inside a block
    sd["grid3d"][11, 9, 2] = -0.0

    def nudge(dense: bool = False) -> None:
        for k, t in sd.items():
            v = t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).view(-1)
            if dense and k == "grid2d":
                v += 1
                continue
            idx = torch.randperm(v.numel(), generator=g)[: max(1, v.numel() // 40)]
            v[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=v.dtype)

    def publish(pub, version: int, kind: str) -> None:
        info = pub.publish(sd, step=version, metadata={"golden": "grid"})
        assert info.version == version and info.kind == kind, info
        save_file({k: v.contiguous() for k, v in sd.items()}, str(expected_dir / f"v{version}.safetensors"))

    expected_dir.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp())
    url = str(tmp / "store")
    writer, resumed = WriterPolicy(writer_id="golden-grid", threads=1), WriterPolicy(writer_id="golden-grid", threads=1, resume=False)
    anchors = AnchorPolicy("every", every=100)
    try:
        with deltastore.Publisher(url, writer_policy=writer, anchor_policy=anchors,
                                  layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=False)) as pub:
            pub._explicit_specs = _specs(4)
            for v in range(1, SQUASH_TO + 1):
                if v > 1:
                    nudge(dense=v == 3)
                publish(pub, v, "anchor" if v == 1 else "delta")
        rep = compact(url, bases=[SQUASH_BASE], writer="golden-grid-compactor", threads=1)
        assert rep.registered and [(s.from_, s.to) for s in rep.squashes] == [(SQUASH_BASE, SQUASH_TO)], rep
        sq = rep.squashes[0]
        with deltastore.Publisher(url, writer_policy=resumed, anchor_policy=anchors,
                                  layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=False)) as pub:
            pub._explicit_specs = _specs(3)
            for v in (5, 6):
                nudge()
                publish(pub, v, "anchor" if v == 5 else "delta")
        with deltastore.Publisher(url, writer_policy=resumed, anchor_policy=anchors,
                                  layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=True)) as pub:
            pub._explicit_specs = _specs(3)
            for v in (7, 8):
                nudge()
                publish(pub, v, "anchor" if v == 7 else "delta")

        h = History(open_store(url))
        head = h.read_head()[0]
        per_version = {}
        for v in range(1, VERSIONS + 1):
            _, m = h.find(v, head)
            layout = h.layout(m.layout)
            cols = dict(zip(layout.name, layout.chunk_cols))
            per_version[f"v{v}"] = {"schema": m.schema_, "kind": m.kind,
                                    "chunk_cols": {n: cols[n] for n in GRIDS},
                                    "groups": {row: [mm.name for mm in ms] for row, ms in layout.members().items()},
                                    "column_reads": column_reads(url, v)}
        assert [v for v in range(1, VERSIONS + 1) if per_version[f"v{v}"]["kind"] == "anchor"] == list(ANCHORS)
        assert per_version["v7"]["schema"] == 4 and per_version["v7"]["groups"], per_version["v7"]
        assert per_version["v1"]["chunk_cols"] == {"grid2d": 24, "grid3d": 4}, per_version["v1"]
        assert per_version["v5"]["chunk_cols"] == {"grid2d": 24, "grid3d": 3}, per_version["v5"]
        facts = {
            "versions": VERSIONS,
            "anchors": list(ANCHORS),
            "grids": list(GRIDS),
            "column_worlds": list(COLUMN_WORLDS),
            "per_version": per_version,
            "squash": {"from": sq.from_, "to": sq.to, "key": sq.key, "bytes": sq.bytes, "chain_bytes": sq.chain_bytes},
        }
        facts_path.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        _copy_store(tmp / "store", store_dir)
        _write_shas(expected_dir)
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    store, expected, facts = HERE / "store-grid", HERE / "store-grid-expected", HERE / "store-grid-facts.json"
    for p in (store, expected, facts):
        if p.exists():
            raise SystemExit(f"{p} exists: golden files are written once, never regenerated")
    write_grid(store, expected, facts)
    print(f"wrote {store}, {expected} and {facts}")


if __name__ == "__main__":
    main()
