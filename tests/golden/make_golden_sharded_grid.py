"""Write the sharded column-grid golden store under tests/golden/ (run once; the files are committed).

Written by deltastore at design 011 D11 (branch GS, the first writer of column grids in
sharded layouts), with::

    python tests/golden/make_golden_sharded_grid.py        # from the repository root

It refuses to overwrite existing files unless ``--force`` is given: the files were written by
this release and must be read, bit for bit, by every later one (tests/test_sharded.py). Inputs
are deterministic; manifests carry random ids and times, so a second run gives other bytes:
never regenerate them.

``store-sharded-grid/``
    Three ranks (gloo) publishing tests/test_sharded.py's ``golden_grid_model`` with
    ``slice_align=4, column_slices=("g", "d"), chunk_bytes=16, anchor_every=3``: v1 an anchor,
    v2 and v3 deltas, v4 an anchor with deltas. ``g`` [12, 8] float32: chunk_cols 2 (4 column
    blocks), chunk_rows 2, pieces [0, 4), [4, 8), [8, 12) (parts 0, 1, 2: 8 chunks each, part 1
    from chunk 8); ``d`` [9, 8, 3] bfloat16: chunk_cols 2 (trailing dimension 3), chunk_rows 1,
    pieces of 3 rows; ``b`` [5] float32 whole on rank 2, no grid.
``store-sharded-grid-expected/vN.safetensors``
    Every version as published.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    store, expected = HERE / "store-sharded-grid", HERE / "store-sharded-grid-expected"
    if (store.exists() or expected.exists()) and not args.force:
        print(f"{store} exists: golden files are written once (pass --force to overwrite)", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    from tests.test_sharded import golden_grid_model, run_ranks

    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(expected, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(3, f"file://{store}", "grid_golden", Path(tmp))
    for r in results:
        if set(r) != {"rank", "infos"}:
            raise SystemExit(f"a rank failed: {r}")
    if [k for _, k in results[0]["infos"]] != ["anchor", "delta", "delta", "anchor"]:
        raise SystemExit(f"unexpected versions: {results[0]['infos']}")
    expected.mkdir()
    for v in range(1, 5):
        save_file({k: t.contiguous() for k, t in golden_grid_model(v).items()}, str(expected / f"v{v}.safetensors"))
    print(f"wrote {store} and {expected}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
