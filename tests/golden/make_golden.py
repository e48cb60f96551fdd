"""Write the golden files under tests/golden/ (run once; the files are committed as data).

The files were produced by deltastore at commit 9a91ec2 (the codec as one module, before it
became the ``deltastore/codec/`` package), with::

    python tests/golden/make_golden.py          # from the repository root

Running it again on later code is how one would *extend* the goldens; it refuses to overwrite
existing files unless ``--force`` is given, because the point of the files is that they were
written by an older release and are read, byte for byte, by every later one
(tests/test_golden.py).

What it writes:

``segments/index.json`` and ``segments/*.npy.gz`` / ``segments/*.seg``
    For each case: deterministic inputs (``old``/``new`` raw bit patterns as unsigned arrays,
    one gzipped ``.npy`` each, identical arrays stored once) and the segment bytes each
    encoder produced from them: ``full/1`` (the private v1 encoder), ``full/2`` with and
    without ``float_bits``, the v1 delta encoder
    (``xor-sparse/1``/``xor-dense/1``) and today's (``add-sparse/1``/``add-dense/1``), plus a
    few composed deltas (three arrays a, b, c). The index records each segment's codec, the
    encoder and its arguments, so the test can decode it and re-encode with today's writers.
``store-schema1/``
    A small store written by the Publisher into a local directory: only the store objects
    (``HEAD``, ``manifests/``, ``blobs/``), not the local backend's lock directory.
``store-schema1-expected/vN.safetensors``
    The state dict of every version N, as published.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from deltastore import codec  # noqa: E402

SEED = 20261201

# family -> (unsigned dtype, IEEE float bit patterns?)
FAMILIES = {
    "bf16": (np.uint16, True),
    "fp16": (np.uint16, True),
    "fp32": (np.uint32, True),
    "fp64": (np.uint64, True),
    "uint8": (np.uint8, False),
    "bool": (np.uint8, False),
    "int64": (np.uint64, False),
}

# bit patterns that a lossy or float-typed path would break, per float family
SPECIALS = {
    "bf16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FC1, 0x7FFF, 0xFFFF, 0x7F81,
             0xFF81, 0x0001, 0x007F, 0x8001, 0x807F, 0x0040, 0x0080, 0x7F7F, 0xFF7F],
    "fp16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7E01, 0x7FFF, 0xFFFF, 0x7C01,
             0x0001, 0x03FF, 0x8001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF],
    "fp32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FC00001,
             0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x00000001, 0x007FFFFF, 0x80000001, 0x00800000,
             0x7F7FFFFF],
    "fp64": [0x0, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
             0x7FF8000000000001, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0x7FF0000000000001,
             0x1, 0x000FFFFFFFFFFFFF, 0x8000000000000001, 0x0010000000000000],
    "uint8": [0, 1, 127, 128, 255],
    "bool": [0, 1],
    "int64": [0, 1, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF],
}


def weights(family: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Bit patterns of realistic values for the family (weights ~ N(0, 0.02), small ints)."""
    dt, _ = FAMILIES[family]
    x = rng.normal(0.0, 0.02, n)
    if family == "bf16":
        return (x.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    if family == "fp16":
        return x.astype(np.float16).view(np.uint16)
    if family == "fp32":
        return x.astype(np.float32).view(np.uint32)
    if family == "fp64":
        return x.view(np.uint64).copy()
    if family == "bool":
        return (rng.random(n) < 0.3).astype(np.uint8)
    if family == "uint8":
        return rng.integers(0, 256, n).astype(np.uint8)
    return rng.integers(-1000, 1000, n).astype(np.int64).view(np.uint64)


def step(family: str, old: np.ndarray, idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``old`` changed at ``idx``: +-1..2 ulp for floats (an Adam step), random for the rest."""
    new = old.copy()
    if family == "bool":
        new[idx] ^= np.uint8(1)
    elif FAMILIES[family][1]:
        d = rng.choice(np.array([-2, -1, 1, 2]), idx.size).astype(np.int64)
        new[idx] = (old[idx].astype(np.int64) + d).astype(old.dtype)
    else:
        r = rng.integers(1, 1 << min(8 * old.itemsize - 1, 20), idx.size).astype(old.dtype)
        new[idx] = old[idx] + r  # wraps: never equal to old
    return new


def cases(rng: np.random.Generator):
    """(name, family, old or None, new) for every case."""
    for fam, (dt, floating) in FAMILIES.items():
        specials = np.array(SPECIALS[fam], dtype=dt)
        yield f"{fam}-empty", fam, None, np.zeros(0, dtype=dt)
        one = weights(fam, 1, rng)
        yield f"{fam}-one", fam, one, step(fam, one, np.array([0]), rng)
        # specials: every special becomes every other one, in a shuffled order
        sp_new = specials[rng.permutation(specials.size)]
        yield f"{fam}-specials", fam, specials, sp_new
        # sparse: ~2 % changed, with realistic values (4000 bytes of elements per array)
        n = 4000 // np.dtype(dt).itemsize
        w = weights(fam, n, rng)
        yield f"{fam}-sparse", fam, w, step(fam, w, np.sort(rng.choice(n, n // 50, replace=False)), rng)
        # dense: every element moves by a small step (add-dense wins) / at random (xor-dense)
        yield f"{fam}-dense-step", fam, w, step(fam, w, np.arange(n), rng)
        r = rng.integers(0, 256, n * np.dtype(dt).itemsize, dtype=np.uint8).view(dt)
        yield f"{fam}-dense-random", fam, w, r
        # long gaps: positions 300+ apart (escaped gaps, 2-byte gap planes)
        idx = np.array([0, 3, 400, n - 3, n - 2, n - 1])
        yield f"{fam}-long-gaps", fam, w, step(fam, w, idx, rng)
        if fam == "bf16":
            # large enough for full/2's paired exponent form to win (MIN_PAIR_COUNT = 4096)
            n = 16384
            w2 = weights(fam, n, rng)
            w2[rng.choice(n, 5, replace=False)] = specials[:5]  # a few escaped exponents
            yield f"{fam}-pairs", fam, w2, step(fam, w2, np.sort(rng.choice(n, n // 100, replace=False)), rng)
    # 4-byte gaps (a gap >= 2**16 + 255) and 4-byte gap escapes: width 1 keeps it small
    n = 70_000
    old = np.zeros(n, dtype=np.uint8)
    new = old.copy()
    new[[5, 69_990]] = [1, 200]
    yield "uint8-huge-gap", "uint8", old, new


# cases whose ``new`` is nearly another case's: full encoders are not run on them (size)
NO_FULL = ("-dense-step", "-long-gaps")


def encoders(name: str, family: str):
    """(label, function(old, new) -> Segment | None, JSON-able description)."""
    floating = FAMILIES[family][1]
    level3 = family in ("bf16", "uint8")  # an int level next to the tuned default, on two widths
    if not name.endswith(NO_FULL):
        yield "full2", lambda o, n: codec.encode_full(n), {"fn": "full2", "float_bits": False}
        if floating:
            yield "full2-float", lambda o, n: codec.encode_full(n, float_bits=True), {"fn": "full2", "float_bits": True}
        if level3:
            yield ("full2-level3", lambda o, n: codec.encode_full(n, level=3),
                   {"fn": "full2", "float_bits": False, "level": 3})
    yield "add", lambda o, n: codec.encode_delta(o, n), {"fn": "add"}
    if level3:
        yield "add-level3", lambda o, n: codec.encode_delta(o, n, level=3), {"fn": "add", "level": 3}


class Arrays:
    """Saves arrays as gzipped ``.npy`` (mtime 0: the same array gives the same bytes), each
    distinct array once."""

    def __init__(self, out: Path):
        self.out = out
        self.by_digest: dict[str, str] = {}

    def save(self, a: np.ndarray, name: str) -> str:
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        raw = buf.getvalue()
        digest = hashlib.sha256(raw).hexdigest()
        if digest not in self.by_digest:
            fname = f"{name}.npy.gz"
            with open(self.out / fname, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as g:
                g.write(raw)
            self.by_digest[digest] = fname
        return self.by_digest[digest]


def write_segments(out: Path) -> dict:
    rng = np.random.default_rng(SEED)
    out.mkdir(parents=True)
    arrays = Arrays(out)
    index = {"seed": SEED, "cases": [], "compose": []}
    seen: set[tuple[str, int]] = set()
    for name, fam, old, new in cases(rng):
        entry = {"name": name, "family": fam, "dtype": new.dtype.str, "count": int(new.size),
                 "old": None, "new": arrays.save(new, f"{name}.new"), "segments": []}
        if old is not None:
            entry["old"] = arrays.save(old, f"{name}.old")
        for label, fn, desc in encoders(name, fam):
            if desc["fn"] == "add" and old is None:
                continue
            seg = fn(old, new)
            if seg is None:
                continue
            fname = f"{name}.{label}.seg"
            (out / fname).write_bytes(seg.data)
            entry["segments"].append({"file": fname, "codec": seg.codec, "n_changed": seg.n_changed, **desc})
            h = codec.peek_header(seg.data)
            seen.add((seg.codec, new.itemsize))
            seen.add((f"{seg.codec} transform {h.transform}", new.itemsize))
            if h.n_gap_escaped:
                seen.add((f"{seg.codec} gap width {h.gap_width}", new.itemsize))
        index["cases"].append(entry)
    # compose: a -> b -> c, per family; xor+xor, add+add, and the mixed pairs (with base)
    for fam in ("bf16", "fp32", "uint8"):
        n = 1000
        a = weights(fam, n, rng)
        b = step(fam, a, np.sort(rng.choice(n, 60, replace=False)), rng)
        c = step(fam, b, np.sort(rng.choice(n, 60, replace=False)), rng)
        c[:10] = a[:10]  # some changes cancel
        files = {k: arrays.save(v, f"compose-{fam}.{k}") for k, v in (("a", a), ("b", b), ("c", c))}
        deltas = {"add": (codec.encode_delta(a, b), codec.encode_delta(b, c))}
        for fa, fb in (("add", "add"),):
            sa, sb = deltas[fa][0], deltas[fb][1]
            r = codec.compose_deltas(sa.data, sb.data, codec_a=sa.codec, codec_b=sb.codec, dtype=a.dtype, count=n)
            names = {}
            for k, s in (("a", sa), ("b", sb), ("result", r)):
                names[k] = f"compose-{fam}.{fa}-{fb}.{k}.seg"
                (out / names[k]).write_bytes(s.data)
            index["compose"].append({
                "family": fam, "dtype": a.dtype.str, "count": n, "arrays": files,
                "a": {"file": names["a"], "codec": sa.codec}, "b": {"file": names["b"], "codec": sb.codec},
                "result": {"file": names["result"], "codec": r.codec, "n_changed": r.n_changed},
            })
    want = {(c, w) for c in codec.KNOWN_CODECS for w in (1, 2, 4, 8)}
    missing = want - seen
    assert not missing, f"no golden segment for {sorted(missing)}"
    for extra in (("full/2 transform 1", 2), ("full/2 transform 2", 2), ("full/2 transform 1", 8),
                  ("add-sparse/1 gap width 2", 1), ("add-sparse/1 gap width 4", 1)):
        assert extra in seen, f"no golden segment with {extra}"
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def write_store(store_dir: Path, expected_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore

    g = torch.Generator().manual_seed(SEED)

    def bf16(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {
        "embed.weight": bf16(64, 48),
        "layer.0.weight": bf16(64, 64),
        "layer.0.bias": torch.zeros(64, dtype=torch.float32),
        "norm.weight": torch.ones(64, dtype=torch.float16),
        "steps": torch.tensor([0], dtype=torch.int64),
        "mask": torch.rand(40, generator=g) < 0.5,
        "table": torch.randint(0, 256, (33,), generator=g, dtype=torch.int64).to(torch.uint8),
        "scale": torch.tensor([1.0, -0.0, float("nan")], dtype=torch.float64),
    }
    expected_dir.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp())
    try:
        # small chunks so that tensors span several chunks (and chunks of every codec appear)
        with deltastore.Publisher(str(tmp / "store"), writer_id="golden", threads=1,
                                  chunk_bytes=2048, anchor_every=4) as pub:

            def publish(step_, **kw):
                info = pub.publish(sd, step=step_, metadata={"golden": True}, **kw)
                save_file({k: v.contiguous() for k, v in sd.items()},
                          str(expected_dir / f"v{info.version}.safetensors"))
                return info

            publish(0)  # v1: anchor
            for s in range(1, 6):  # v2-v4 deltas, v5 an anchor (anchor_every=4) with deltas, v6 a delta
                for k in ("embed.weight", "layer.0.weight"):
                    t = sd[k].view(torch.int16)
                    idx = torch.randperm(t.numel(), generator=g)[: t.numel() // 50]
                    t.view(-1)[idx] += torch.randint(-2, 3, (idx.numel(),), generator=g, dtype=torch.int16)
                sd["layer.0.bias"] += 1e-3 * s
                sd["steps"] += 1
                if s == 3:
                    sd["norm.weight"][5] = float("-inf")
                    sd["mask"] = ~sd["mask"]
                publish(s)
            # v7: a dense step, every element of one tensor moves
            sd["embed.weight"] = (sd["embed.weight"].float() * 1.01).to(torch.bfloat16)
            publish(6)
            # v8: a layout change (a new tensor, a resized one), published as an anchor; v9 a delta
            sd["layer.1.weight"] = bf16(32, 32)
            sd["layer.0.bias"] = torch.zeros(100, dtype=torch.float32)
            publish(7, anchor=True)
            sd["layer.1.weight"].view(torch.int16)[0, :5] += 1
            publish(8)
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
    targets = [HERE / "segments", HERE / "store-schema1", HERE / "store-schema1-expected"]
    for t in targets:
        if t.exists():
            if not args.force:
                sys.exit(f"{t} exists; golden files are written once (--force to overwrite)")
            shutil.rmtree(t)
    write_segments(targets[0])
    write_store(targets[1], targets[2])


if __name__ == "__main__":
    main()
