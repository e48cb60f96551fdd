"""Write the schema-3 golden stores under tests/golden/ (run once; the files are committed as data).

Written by deltastore at the issue-8 integration (branch i8-int @ 6bff21f, the first writer of
schema 3: compact manifests, layout objects, attempt-scoped packs, back pointers, the history
index with floor and pins, squashes), with::

    python tests/golden/make_golden_schema3.py          # from the repository root

It refuses to overwrite existing files unless ``--force`` is given: the point of the files is
that they were written by an older release and are read, bit for bit, by every later one
(tests/test_golden.py). Inputs are deterministic (fixed seeds), but manifests carry random ids
(lineage, commit ids, attempt-scoped keys) and times, so running it again gives other bytes:
the files are written once, never regenerated.

What it writes:

``store-schema3/``
    v1 an anchor, v2–v3 deltas, v4 an anchor with a new layout (a tensor added, one resized,
    one removed), v5–v7 deltas, v8 an anchor of the same layout, v9–v12 deltas (2-D tensors
    throughout); then a compactor registers the squash S(9, 12) in the history index, and a
    real GC (``keep_last=4``, v2 and v6 pinned, no grace) raises the floor to 8 and deletes
    what no kept version needs (the manifests of v3 and v7; v1, v4, v5 stay as the chains of
    the pins need them, but are collected for readers). Every object GC left is copied (HEAD,
    ``manifests/``, ``objects/``, ``gc/``), not the local backend's lock directory.
``store-schema3-expected/vN.safetensors``
    The state dict of every version N (collected ones too), as published.
``store-mixed/``
    The schema-2 golden store (``store-schema2``, v1–v7, v6–v7 signed) continued by this
    release's publisher: v8 an (upgrade) anchor in schema 3, v9–v10 schema-3 deltas.
``store-mixed-expected/vN.safetensors``
    Its versions (v1–v7 are copies of ``store-schema2-expected``).
``*-expected/sha256.json``
    For every version, the SHA-256 of each tensor's raw little-endian bytes (with its dtype and
    shape): a check on the safetensors files themselves.
``store-schema3-facts.json``
    What the generator did (floor, pins, the squash, the GC's deleted keys, the zstd version
    that compressed the manifests), for the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

SEED = 20261203
#: Store objects a golden store may hold (the local backend's lock directory is not one).
STORE_PARTS = ("HEAD", "manifests", "objects", "blobs", "gc")
KEEP_LAST = 4
#: Pinned below the floor: one of the first layout, one of the second.
PINNED = [2, 6]
SQUASH_BASE = 9
VERSIONS = 12


def _copy_store(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for part in STORE_PARTS:
        p = src / part
        if p.exists():
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst / part)
    left = sorted(set(os.listdir(src)) - set(STORE_PARTS) - {".deltastore-locks"})
    assert not left, f"unexpected store objects: {left}"


def _tensor_sha(t) -> str:
    import torch

    t = t.contiguous()
    raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(raw).hexdigest()


def _write_shas(expected_dir: Path) -> None:
    from safetensors.torch import load_file

    out = {}
    for p in sorted(expected_dir.glob("v*.safetensors"), key=lambda p: int(p.stem[1:])):
        sd = load_file(str(p))
        out[p.stem] = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "sha256": _tensor_sha(v)}
                       for k, v in sorted(sd.items())}
    (expected_dir / "sha256.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def write_schema3(store_dir: Path, expected_dir: Path, facts_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore
    from deltastore.lifecycle.compact import compact
    from deltastore.lifecycle.gc import collect
    from deltastore.format.models import SCHEMA_VERSION

    assert SCHEMA_VERSION == 3, "the schema-3 golden store must be written by a schema-3 writer"
    g = torch.Generator().manual_seed(SEED)

    def bf16(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {
        "embed.weight": bf16(40, 32),
        "layer.0.weight": bf16(32, 32),
        "layer.0.bias": torch.zeros(32, dtype=torch.float32),
        "norm.weight": torch.ones(32, dtype=torch.float16),
        "steps": torch.tensor([0], dtype=torch.int64),
        "mask": torch.rand(30, generator=g) < 0.5,
        "scale": torch.tensor([1.0, -0.0, float("nan")], dtype=torch.float64),
    }
    # the same few elements move at every step (as under a small learning rate): a squash over
    # several versions is then smaller than the chain it replaces
    hot = {}

    def nudge(*names):
        for k in names:
            t = sd[k].view(torch.int16).view(-1)
            if (k, t.numel()) not in hot:
                hot[(k, t.numel())] = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 40)]
            idx = hot[(k, t.numel())]
            t[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)

    expected_dir.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp())
    url = str(tmp / "store")

    def publish(pub, step_, **kw):
        info = pub.publish(sd, step=step_, metadata={"golden": 3}, **kw)
        assert info.version == step_ + 1
        save_file({k: v.contiguous() for k, v in sd.items()}, str(expected_dir / f"v{info.version}.safetensors"))
        return info

    try:
        with deltastore.Publisher(url, writer_id="golden3", threads=1, chunk_bytes=1024,
                                  anchor_policy="every", anchor_every=100) as pub:
            publish(pub, 0)  # v1 anchor
            for s in (1, 2):  # v2-v3 deltas
                nudge("embed.weight", "layer.0.weight")
                sd["steps"] += 1
                if s == 2:
                    sd["mask"] = ~sd["mask"]
                    sd["layer.0.bias"] += 1e-3
                publish(pub, s)
            # v4: a layout change (new tensor, resized tensor, removed tensor), as an anchor
            sd["layer.1.weight"] = bf16(24, 24)
            sd["layer.0.bias"] = torch.zeros(40, dtype=torch.float32)
            del sd["scale"]
            sd["steps"] += 1
            publish(pub, 3, anchor=True)
            for s in range(4, 12):  # v5-v7 deltas, v8 an anchor (same layout), v9-v12 deltas
                nudge("layer.0.weight", "layer.1.weight")
                sd["steps"] += 1
                if s == 5:
                    sd["norm.weight"][3] = float("-inf")
                publish(pub, s, anchor=s == 7)
        rep = compact(url, bases=[SQUASH_BASE], writer="golden3-compactor", threads=1)
        assert rep.registered and [(s.from_, s.to) for s in rep.squashes] == [(SQUASH_BASE, VERSIONS)], rep
        sq = rep.squashes[0]
        assert sq.bytes < sq.chain_bytes, rep
        gc = collect(url, keep_last=KEEP_LAST, keep_versions=PINNED, grace_s=0, unsafe_grace_ok=True,
                     writer="golden3-gc")
        assert gc.floor_after == VERSIONS - KEEP_LAST and gc.pins == PINNED, gc
        assert gc.deleted_objects > 0, gc
        import zstandard

        facts = {
            # encode_manifest is zstd (level 3) of canonical JSON: the same bytes only with the
            # same libzstd, so the test compares bytes where the version matches
            "zstd": {"zstandard": zstandard.__version__, "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION))},
            "versions": VERSIONS, "floor": gc.floor_after, "pins": gc.pins, "keep_last": KEEP_LAST,
            "squash": {"from": sq.from_, "to": sq.to, "key": sq.key, "sha256": sq.sha256, "bytes": sq.bytes,
                       "chain_bytes": sq.chain_bytes},
            "gc": {"kept_versions": gc.kept_versions, "deleted": gc.deleted, "deleted_objects": gc.deleted_objects,
                   "deleted_bytes": gc.deleted_bytes},
        }
        facts_path.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        _copy_store(tmp / "store", store_dir)
        _write_shas(expected_dir)
    finally:
        shutil.rmtree(tmp)


def write_mixed(store_dir: Path, expected_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    import deltastore

    src2, exp2 = HERE / "store-schema2", HERE / "store-schema2-expected"
    g = torch.Generator().manual_seed(SEED + 1)
    tmp = Path(tempfile.mkdtemp())
    url = tmp / "store"
    try:
        shutil.copytree(src2, url)
        shutil.copytree(exp2, expected_dir)
        sd = load_file(str(exp2 / "v7.safetensors"))

        def nudge(k):
            t = sd[k].view(torch.int16).view(-1)
            idx = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 40)]
            t[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)

        with deltastore.Publisher(str(url), writer_id="golden-mixed", threads=1, chunk_bytes=1024,
                                  anchor_policy="every", anchor_every=100) as pub:
            for s in (7, 8, 9):  # v8 the upgrade anchor (its parent is schema 2), v9-v10 deltas
                nudge("layer.0.weight")
                nudge("embed.weight")
                sd["steps"] += 1
                info = pub.publish(sd, step=s, metadata={"golden": "mixed"})
                assert info.version == s + 1
                save_file({k: v.contiguous() for k, v in sd.items()}, str(expected_dir / f"v{info.version}.safetensors"))
        _copy_store(url, store_dir)
        _write_shas(expected_dir)
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files")
    args = ap.parse_args()
    s3 = [HERE / "store-schema3", HERE / "store-schema3-expected", HERE / "store-schema3-facts.json"]
    mixed = [HERE / "store-mixed", HERE / "store-mixed-expected"]
    for t in s3 + mixed:
        if t.exists():
            if not args.force:
                sys.exit(f"{t} exists; golden files are written once (--force to overwrite)")
            shutil.rmtree(t) if t.is_dir() else t.unlink()
    write_schema3(*s3)
    write_mixed(*mixed)


if __name__ == "__main__":
    main()
