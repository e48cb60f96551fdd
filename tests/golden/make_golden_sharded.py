"""Write the sharded golden store under tests/golden/ (run once; the files are committed).

Written by deltastore at issue 12 (branch i12-shard, the first writer of sharded versions:
parts, part manifests and sharded layouts, SPEC §8, design 010), with::

    python tests/golden/make_golden_sharded.py        # from the repository root

It refuses to overwrite existing files unless ``--force`` is given: the files were written by
this release and must be read, bit for bit, by every later one (tests/test_sharded.py). Inputs
are deterministic; manifests carry random ids and times, so a second run gives other bytes:
never regenerate them.

``store-sharded/``
    Three ranks (gloo) publishing tests/test_sharded.py's model with ``anchor_every=3``: v1 an
    anchor, v2 and v3 deltas, v4 an anchor with deltas. Tensor ``a`` [10, 6] bf16 is split in
    pieces of rows [0, 4), [4, 8), [8, 10) (parts 0, 1, 2; chunk_rows 4); ``c`` is whole on
    rank 0, ``b`` whole on rank 2, the 0-d ``s`` passed by every rank (owned by rank 0).
``store-sharded-expected/vN.safetensors``
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
    store, expected = HERE / "store-sharded", HERE / "store-sharded-expected"
    if (store.exists() or expected.exists()) and not args.force:
        print(f"{store} exists: golden files are written once (pass --force to overwrite)", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    from tests.test_sharded import full_model, run_ranks

    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(expected, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(3, f"file://{store}", "versions", Path(tmp))
    for r in results:
        if set(r) != {"rank", "infos"}:
            raise SystemExit(f"a rank failed: {r}")
    expected.mkdir()
    for v in range(1, 5):
        save_file({k: t.contiguous() for k, t in full_model(v).items()}, str(expected / f"v{v}.safetensors"))
    print(f"wrote {store} and {expected}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
