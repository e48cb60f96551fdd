"""The column-grid scenarios of :func:`testkit.ranks.run_ranks` (design 011 D11): a gridded model
published by row-sharded ranks, and the golden sharded grid store (tests/golden/make_golden.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from deltastore.errors import ShardMismatchError
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
from testkit.rank_env import head_version, record_pack_reads

#: The gridded tensor ``w`` (120 × 1000 bf16, split 60 | 60 by rows over two ranks): with
#: ``slice_align=4`` and 16 KiB chunks a grid of 250 columns × 30 rows (30 divides the piece
#: boundary), 4 row blocks × 4 column blocks; ``o`` matches ``column_slices`` but is too small
#: for a grid; ``b`` is whole on the last rank.
GRID_ROWS, GRID_COLS, GRID_CHUNK_ROWS, GRID_CHUNK_COLS = 120, 1000, 30, 250


GRID_LAYOUT = LayoutPolicy(chunk_bytes=16 * 1024, slice_align=4, column_slices=("w", "o"))


GRID_OPTIONS: dict[str, Any] = {"writer_policy": WriterPolicy(threads=1), "anchor_policy": AnchorPolicy(every=3),
                                "layout_policy": GRID_LAYOUT}


def grid_model(version: int) -> dict[str, torch.Tensor]:
    """The whole gridded model at ``version``: a few elements of each tensor change per version
    (scattered over ``w``'s row and column blocks)."""
    g = torch.Generator().manual_seed(99)
    state = {"w": torch.randn(GRID_ROWS, GRID_COLS, generator=g).to(torch.bfloat16),
             "o": torch.randn(8, 16, generator=g), "b": torch.randn(5, generator=g)}
    return _stepped(state, version, seed=1000, count=6, by=0.5)


def _stepped(state: dict[str, torch.Tensor], version: int, *, seed: int, count: int,
             by: float) -> dict[str, torch.Tensor]:
    """``state`` moved to ``version``: at each version after the first, ``count`` random elements
    of every tensor (drawn with seed ``seed + version``) grow by ``by``."""
    for v in range(2, version + 1):
        g = torch.Generator().manual_seed(seed + v)
        for name in state:
            flat = state[name].view(-1)
            idx = torch.randint(0, flat.numel(), (count,), generator=g)
            flat[idx] = flat[idx] + by
    return state


def grid_rank_state(version: int, rank: int, world: int) -> dict[str, Any]:
    from deltastore.write.sharded import Rows

    full = grid_model(version)
    per = -(-GRID_ROWS // world)
    start, stop = min(rank * per, GRID_ROWS), min((rank + 1) * per, GRID_ROWS)
    out: dict[str, Any] = {"w": Rows(full["w"][start:stop].clone(), start, GRID_ROWS), "o": full["o"]}
    if rank == world - 1:
        out["b"] = full["b"]
    return out


def scenario_grid(rank: int, world: int, url: str) -> dict[str, Any]:
    """Versions 1-4 of a gridded model (anchor_every=3, publish_async); a restarted publisher resumes from the
    store (its own grid rows, read back) for version 5; then publishers whose ranks disagree on
    ``column_slices`` are refused, committing nothing."""
    from deltastore.write.sharded import ShardedPublisher

    out: dict[str, Any] = {"infos": []}
    with ShardedPublisher(url, **GRID_OPTIONS) as pub:
        # publish_async: the first anchor's reference copy (grid units in unit order) is adopted
        # on its path too, and the deltas after it are planned ahead of their base's commit
        futures = [pub.publish_async(grid_rank_state(v, rank, world), step=v) for v in range(1, 5)]
        pub.flush()
        for f in futures:
            info = f.result(timeout=0)
            out["infos"].append((info.version, info.kind, info.bytes_stored))
        out["first_chunk"] = pub._share.first_chunk["w"] if "w" in pub._share.first_chunk else None
    with ShardedPublisher(url, **GRID_OPTIONS) as pub:  # restarted: no reference copy
        reads = record_pack_reads(pub)
        info = pub.publish(grid_rank_state(5, rank, world), step=5)
        out["infos"].append((info.version, info.kind, info.bytes_stored))
        out["reads"] = list(reads)
        info = pub.publish(grid_rank_state(6, rank, world), step=6)  # steady: a delta on the resumed rows
        out["infos"].append((info.version, info.kind, info.bytes_stored))
    try:
        cols = ("w",) if rank == 0 else ("w", "o")
        ShardedPublisher(url, **{**GRID_OPTIONS, "layout_policy": dataclasses.replace(GRID_LAYOUT, column_slices=cols)})
        out["disagree"] = None
    except ShardMismatchError as e:
        out["disagree"] = str(e)
    out["head"] = head_version(url)
    return out


#: The golden sharded grid store (tests/golden/make_golden.py sharded-grid): three ranks, 4 row
#: pieces each; ``g`` (12, 8) f32 and ``d`` (9, 8, 3) bf16 gridded for TP=4 (chunk_cols 2).
GOLDEN_GRID_OPTIONS: dict[str, Any] = {
    "writer_policy": WriterPolicy(threads=1), "anchor_policy": AnchorPolicy(every=3),
    "layout_policy": LayoutPolicy(chunk_bytes=16, slice_align=4, column_slices=("g", "d")),
}


def golden_grid_model(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {"g": torch.randn(12, 8, generator=g), "d": torch.randn(9, 8, 3, generator=g).to(torch.bfloat16),
             "b": torch.randn(5, generator=g)}
    return _stepped(state, version, seed=70, count=3, by=0.25)


def scenario_grid_golden(rank: int, world: int, url: str) -> dict[str, Any]:
    """Versions 1-4 of :func:`golden_grid_model` by ``world`` ranks, each holding an equal row
    range of ``g`` and ``d``. The policy's small-tensor floor is lifted in these processes
    (tensors this small get no grid otherwise)."""
    from deltastore.layout import tensors
    from deltastore.write.sharded import Rows, ShardedPublisher

    tensors.SLICE_CHUNK_MIN_BYTES = 0
    infos = []
    with ShardedPublisher(url, **GOLDEN_GRID_OPTIONS) as pub:
        for v in range(1, 5):
            full = golden_grid_model(v)
            state: dict[str, Any] = {}
            for name in ("g", "d"):
                per = full[name].shape[0] // world
                state[name] = Rows(full[name][rank * per:(rank + 1) * per].clone(), rank * per, full[name].shape[0])
            if rank == world - 1:
                state["b"] = full["b"]
            info = pub.publish(state, step=v)
            infos.append((info.version, info.kind))
    return {"infos": infos}
