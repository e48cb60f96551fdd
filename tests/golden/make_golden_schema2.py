"""Write the schema-2 golden store under tests/golden/ (run once; the files are committed as data).

Written by deltastore at commit 47edebe (the last writer of schema 2, before issue 8 made the
publisher write schema 3), with::

    python tests/golden/make_golden_schema2.py          # from the repository root

It refuses to overwrite existing files unless ``--force`` is given: the point of the files is
that they were written by an older release and are read, bit for bit, by every later one
(tests/test_golden.py).

What it writes:

``store-schema2/``
    A small store written by the Publisher into a local directory (only ``HEAD``,
    ``manifests/``, ``blobs/``): v1 an anchor, v2–v3 deltas, v4 an anchor with a new layout (a
    tensor added, one resized, one removed), v5 a delta; then a second publisher, holding an
    Ed25519 key, takes over and publishes v6 (an anchor) and v7 (a delta), both signed.
``store-schema2-expected/vN.safetensors``
    The state dict of every version N, as published.
``store-schema2-signing.pub``
    The public key that signed v6 and v7 (the private key is derived from a fixed seed,
    :data:`SIGNING_SEED`, so nothing secret is committed that matters).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

SEED = 20261202
#: Raw Ed25519 private key bytes (a test key: it signs golden data, nothing else).
SIGNING_SEED = hashlib.sha256(b"deltastore golden schema 2").digest()


def signing_key():
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.from_private_bytes(SIGNING_SEED)


def write_store(store_dir: Path, expected_dir: Path, pub_path: Path) -> None:
    import torch
    from cryptography.hazmat.primitives import serialization
    from safetensors.torch import save_file

    import deltastore
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
    from deltastore.format.manifest import SCHEMA_VERSION

    assert SCHEMA_VERSION == 2, "the schema-2 golden store must be written by a schema-2 writer"
    g = torch.Generator().manual_seed(SEED)

    def bf16(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {
        "embed.weight": bf16(48, 40),
        "layer.0.weight": bf16(40, 40),
        "layer.0.bias": torch.zeros(40, dtype=torch.float32),
        "norm.weight": torch.ones(40, dtype=torch.float16),
        "steps": torch.tensor([0], dtype=torch.int64),
        "mask": torch.rand(30, generator=g) < 0.5,
        "scale": torch.tensor([1.0, -0.0, float("nan")], dtype=torch.float64),
    }

    def nudge(*names):
        for k in names:
            t = sd[k].view(torch.int16)
            idx = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 40)]
            t.view(-1)[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)

    expected_dir.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp())
    url = str(tmp / "store")

    def publish(pub, step_, **kw):
        info = pub.publish(sd, step=step_, metadata={"golden": 2}, **kw)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(expected_dir / f"v{info.version}.safetensors"))
        return info

    try:
        # small chunks so that tensors span several chunks
        with deltastore.Publisher(url, writer_policy=WriterPolicy(writer_id="golden2", threads=1),
                                  anchor_policy=AnchorPolicy(every=100), layout_policy=LayoutPolicy(chunk_bytes=1024)) as pub:
            publish(pub, 0)  # v1 anchor
            nudge("embed.weight", "layer.0.weight")
            sd["steps"] += 1
            publish(pub, 1)  # v2 delta
            nudge("layer.0.weight")
            sd["layer.0.bias"] += 1e-3
            sd["mask"] = ~sd["mask"]
            sd["steps"] += 1
            publish(pub, 2)  # v3 delta
            # v4: a layout change (new tensor, resized tensor, removed tensor), as an anchor
            sd["layer.1.weight"] = bf16(24, 24)
            sd["layer.0.bias"] = torch.zeros(64, dtype=torch.float32)
            del sd["scale"]
            sd["steps"] += 1
            publish(pub, 3, anchor=True)
            nudge("layer.1.weight", "embed.weight")
            sd["norm.weight"][3] = float("-inf")
            sd["steps"] += 1
            publish(pub, 4)  # v5 delta
        key = signing_key()
        with deltastore.Publisher(url, signing_key=key,
                                  writer_policy=WriterPolicy(writer_id="golden2-signed", threads=1),
                                  anchor_policy=AnchorPolicy(every=100), layout_policy=LayoutPolicy(chunk_bytes=1024)) as pub:
            sd["steps"] += 1
            publish(pub, 5, anchor=True)  # v6 signed anchor
            nudge("layer.0.weight", "layer.1.weight")
            sd["steps"] += 1
            publish(pub, 6)  # v7 signed delta
        pub_path.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        src = tmp / "store"
        store_dir.mkdir(parents=True)
        for part in ("HEAD", "manifests", "blobs"):
            p = src / part
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, store_dir / part)
        left = sorted(set(os.listdir(src)) - {"HEAD", "manifests", "blobs", ".deltastore-locks"})
        assert not left, f"unexpected store objects: {left}"
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files")
    args = ap.parse_args()
    targets = [HERE / "store-schema2", HERE / "store-schema2-expected", HERE / "store-schema2-signing.pub"]
    for t in targets:
        if t.exists():
            if not args.force:
                sys.exit(f"{t} exists; golden files are written once (--force to overwrite)")
            shutil.rmtree(t) if t.is_dir() else t.unlink()
    write_store(*targets)


if __name__ == "__main__":
    main()
