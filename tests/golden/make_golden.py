"""Write the golden files of the current format under tests/golden/ (the files are committed as
data and read, byte for byte, by tests/format/test_golden*.py, tests/write/test_sharded.py and
tests/federated/test_federated_golden.py)::

    python tests/golden/make_golden.py                  # every target, into tests/golden/
    python tests/golden/make_golden.py schema3 grid     # some targets
    python tests/golden/make_golden.py --out DIR        # into another directory
    python tests/golden/make_golden.py --check          # regenerate into a temporary directory
                                                        # and compare with the committed files

It refuses to overwrite existing files unless ``--force`` is given: the point of the files is
that a later release reads them as this one wrote them.

Targets (each deterministic in its inputs: fixed seeds, one encode thread):

``segments``
    ``segments/``: for each case, inputs (``old``/``new`` raw bit patterns, one gzipped ``.npy``
    each, identical arrays stored once) and the segment each encoder produced from them
    (``full/2`` with and without ``float_bits``, ``add-*``, some at zstd level 3), plus composed
    deltas; ``index.json`` records each segment's codec, encoder and arguments.
``schema3``
    ``store-schema3/``: v1 an anchor, v2–v3 deltas, v4 an anchor with a new layout (a tensor
    added, one resized, one removed), v5–v7 deltas, v8 an anchor of the same layout, v9–v12
    deltas; a compactor registers the squash S(9, 12) in the history index, and a GC
    (``keep_last=4``, v2 and v6 pinned, no grace) raises the floor to 8 and deletes what no kept
    version needs. ``store-schema3-expected/`` (every version's state dict), and
    ``store-schema3-facts.json`` (floor, pins, the squash, the GC's deleted keys, the zstd
    version that compressed the objects).
``schema4``
    ``store-schema4/``: small tensors grouped into rows (the grouping policy shrunk: several
    groups per dtype, groups cut into chunks that split members, 0-d members, NaN and -0.0
    payloads, tensors left ungrouped); v1 and v5 anchors, deltas between, the squash S(2, 8).
    Its layout object records ``chunk_rows`` 128 for the 0-d ``step`` (chunk bytes over the
    element width, as its writer chose); today's writer chooses 1, so ``--check`` reports that
    one object as different (readers take any ``chunk_rows`` of a 0-d tensor: it is one chunk).
``grid``
    ``store-grid/``: column grids (``chunk_cols``), ragged both ways and with trailing
    dimensions, written through the publisher's explicit layout hook (the grid policy never
    grids tensors this small); a squash, a ``resume=False`` anchor with another grid, and an
    anchor that groups the small tensors (schema 4). The facts record what a column reader
    fetches per version and rank.
``sharded``
    ``store-sharded/``: three ranks (gloo) publishing tests/write/test_sharded.py's model with
    ``anchor_every=3`` (parts, part manifests and sharded layouts).
``sharded-grid``
    ``store-sharded-grid/``: three ranks publishing ``golden_grid_model``: column grids in a
    sharded layout.
``federated``
    ``store-federated/{global,site-a,site-b}``: a global store and two sites whose versions are
    based on the global versions (schema 4's ``base``).
``federated-compressed``
    ``store-federated-compressed/{global,site-a}``: a site of the compressed tier (SPEC §14.1):
    two rounds of based versions whose manifests carry ``compression``, and the global version
    merged from the first.
``streams``
    ``store-streams/``: serving streams (schema 5): a bf16 state published with ``formats``
    ``bf16`` (the versions themselves), ``fp8-block128`` and ``mxfp8``; v1 and v4 anchors, deltas
    between; quantized weights with ragged blocks, NaN, ±Inf, -0.0 and an all-zero block, a
    weight MXFP8 keeps in bf16 (last dimension not a multiple of 32), kept embeddings and norms.
    ``store-streams-expected/<format>/`` holds each version in each format.

Every store target also writes ``<store>-expected/`` (each version's state dict as
safetensors, and for most a ``sha256.json`` of each tensor's raw bytes). A store's manifests,
history index, squash and part manifests carry random attempt ids, lineages and times, so a
second run writes other bytes for them: ``--check`` compares what is deterministic (packs and
layout objects by content, the expected state dicts, the facts but for ids), and
tests/format/test_golden.py proves the rest by re-encoding every stored object to its stored bytes.
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
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from deltastore import codec  # noqa: E402
from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy  # noqa: E402

#: Store objects a golden store may hold (the local backend's lock directory is not one).
STORE_PARTS = ("HEAD", "manifests", "objects", "gc", "streams")


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


# --- segments -----------------------------------------------------------------------------


SEGMENTS_SEED = 20261201

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
    rng = np.random.default_rng(SEGMENTS_SEED)
    out.mkdir(parents=True)
    arrays = Arrays(out)
    index = {"seed": SEGMENTS_SEED, "cases": [], "compose": []}
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


# --- schema3 ------------------------------------------------------------------------------


SCHEMA3_SEED = 20261203
KEEP_LAST = 4
#: Pinned below the floor: one of the first layout, one of the second.
PINNED = [2, 6]
SCHEMA3_SQUASH_BASE = 9
SCHEMA3_VERSIONS = 12


def write_schema3(store_dir: Path, expected_dir: Path, facts_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore
    from deltastore.lifecycle.compact import compact
    from deltastore.lifecycle.gc import collect
    g = torch.Generator().manual_seed(SCHEMA3_SEED)

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
        with deltastore.Publisher(url, writer_policy=WriterPolicy(writer_id="golden3", threads=1),
                                  layout_policy=LayoutPolicy(chunk_bytes=1024), anchor_policy=AnchorPolicy(every=100)) as pub:
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
        rep = compact(url, bases=[SCHEMA3_SQUASH_BASE], writer="golden3-compactor", threads=1)
        assert rep.registered and [(s.from_, s.to) for s in rep.squashes] == [(SCHEMA3_SQUASH_BASE, SCHEMA3_VERSIONS)], rep
        sq = rep.squashes[0]
        assert sq.bytes < sq.chain_bytes, rep
        gc = collect(url, keep_last=KEEP_LAST, keep_versions=PINNED, grace_s=0, unsafe_grace_ok=True,
                     writer="golden3-gc")
        assert gc.floor_after == SCHEMA3_VERSIONS - KEEP_LAST and gc.pins == PINNED, gc
        assert gc.deleted_objects > 0, gc
        import zstandard

        facts = {
            # encode_manifest is zstd (level 3) of canonical JSON: the same bytes only with the
            # same libzstd, so the test compares bytes where the version matches
            "zstd": {"zstandard": zstandard.__version__, "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION))},
            "versions": SCHEMA3_VERSIONS, "floor": gc.floor_after, "pins": gc.pins, "keep_last": KEEP_LAST,
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


# --- schema4 ------------------------------------------------------------------------------


SCHEMA4_SEED = 20261201
SCHEMA4_VERSIONS = 8
SCHEMA4_SQUASH_BASE = 2


def write_schema4(store_dir: Path, expected_dir: Path, facts_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore
    import deltastore.layout.groups as groups
    from deltastore.format.history import History
    from deltastore.lifecycle.compact import compact
    from deltastore.storage import open_store

    groups.GROUP_MEMBER_MAX_BYTES = 512
    groups.GROUP_TARGET_BYTES = 512
    g = torch.Generator().manual_seed(SCHEMA4_SEED)

    def bf16(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd: dict[str, torch.Tensor] = {}
    for i in range(12):
        sd[f"layer.{i}.norm.weight"] = torch.ones(16, dtype=torch.float32) + i
        sd[f"layer.{i}.bias"] = bf16(24)
        if i % 4 == 0:
            sd[f"layer.{i}.proj"] = bf16(32, 16)  # 1 KiB: above the (shrunk) member limit
        sd[f"layer.{i}.expert.w"] = bf16(4, 8)
    sd["step"] = torch.tensor(0, dtype=torch.int64)  # 0-d
    sd["scale"] = torch.tensor(1.5, dtype=torch.float32)  # 0-d, groups with the fp32 norms
    sd["specials"] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40], dtype=torch.float32)
    sd["mask"] = torch.rand(30, generator=g) < 0.5  # a lonely bool: never a group of one
    nan = torch.tensor([0x7FC1, 0xFFC3 - 0x10000, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    sd["bf16.payloads"] = nan.clone()

    def nudge():
        for k, t in sd.items():
            if t.dtype == torch.bfloat16 and t.numel() > 8:
                v = t.view(torch.int16).view(-1)
                idx = torch.randperm(v.numel(), generator=g)[: max(1, v.numel() // 50)]
                v[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)
        sd["step"] += 1
        sd["specials"] = sd["specials"].roll(1)
        sd["bf16.payloads"] = sd["bf16.payloads"].roll(1)

    expected_dir.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp())
    url = str(tmp / "store")
    try:
        with deltastore.Publisher(url, writer_policy=WriterPolicy(writer_id="golden4", threads=1),
                                  layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=True),
                                  anchor_policy=AnchorPolicy(every=4)) as pub:
            for s in range(SCHEMA4_VERSIONS):
                if s:
                    nudge()
                info = pub.publish(sd, step=s, metadata={"golden": 4})
                assert info.version == s + 1 and info.kind == ("anchor" if s in (0, 4) else "delta"), info
                save_file({k: v.contiguous() for k, v in sd.items()}, str(expected_dir / f"v{info.version}.safetensors"))
        rep = compact(url, bases=[SCHEMA4_SQUASH_BASE], writer="golden4-compactor", threads=1)
        assert rep.registered and [(s.from_, s.to) for s in rep.squashes] == [(SCHEMA4_SQUASH_BASE, SCHEMA4_VERSIONS)], rep
        sq = rep.squashes[0]
        h = History(open_store(url))
        head = h.read_head()[0]
        _, m = h.find(1, head)
        layout = h.layout(m.layout)
        assert m.schema_ == 4 and layout.schema_ == 4, (m.schema_, layout.schema_)
        members = layout.members()
        assert len(members) >= 4 and "mask" in layout.name and "layer.0.proj" in layout.name, layout.name
        facts = {
            "versions": SCHEMA4_VERSIONS,
            "anchors": [1, 5],
            "groups": {row: [mm.name for mm in ms] for row, ms in members.items()},
            "ungrouped": [n for n in layout.name if n not in members],
            "squash": {"from": sq.from_, "to": sq.to, "key": sq.key, "bytes": sq.bytes, "chain_bytes": sq.chain_bytes},
        }
        facts_path.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        _copy_store(tmp / "store", store_dir)
        _write_shas(expected_dir)
    finally:
        shutil.rmtree(tmp)


# --- streams ------------------------------------------------------------------------------


STREAMS_SEED = 20261206
STREAMS_VERSIONS = 6
STREAMS_FORMATS = ("bf16", "fp8-block128", "mxfp8")


def write_streams(store_dir: Path, expected_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore
    from deltastore.serving.formats import derive, serving_format

    g = torch.Generator().manual_seed(STREAMS_SEED)

    def bf16(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    sd = {
        "model.embed_tokens.weight": bf16(40, 64, scale=1.0),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": bf16(200, 64),   # ragged: 2 × 1 blocks of 128
        "model.layers.0.self_attn.o_proj.weight": bf16(64, 160),
        "model.layers.0.mlp.down_proj.weight": bf16(64, 150),      # 150 % 32 ≠ 0: mxfp8 keeps it
        "model.layers.0.mlp.up_proj.weight": torch.zeros(130, 64, dtype=torch.bfloat16),  # all-zero blocks
        "lm_head.weight": bf16(40, 64, scale=1.0),
    }
    o = sd["model.layers.0.self_attn.o_proj.weight"]
    o[0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=torch.bfloat16)
    o[5, 140] = 300.0  # a large block maximum

    def nudge():
        for k, t in sd.items():
            if "up_proj" in k or "layernorm" in k:
                continue
            v = t.view(torch.int16).view(-1)
            idx = torch.randperm(v.numel(), generator=g)[: max(1, v.numel() // 40)]
            v[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)
        sd["model.layers.0.self_attn.o_proj.weight"][0, :4] = torch.tensor(
            [float("nan"), float("inf"), float("-inf"), -0.0], dtype=torch.bfloat16)

    tmp = Path(tempfile.mkdtemp())
    url = str(tmp / "store")
    try:
        with deltastore.Publisher(url, formats=STREAMS_FORMATS,
                                  writer_policy=WriterPolicy(writer_id="golden-streams", threads=1),
                                  layout_policy=LayoutPolicy(chunk_bytes=4096),
                                  anchor_policy=AnchorPolicy(every=3)) as pub:
            for s in range(STREAMS_VERSIONS):
                if s:
                    nudge()
                info = pub.publish(sd, step=s, metadata={"golden": "streams"})
                assert info.version == s + 1 and info.kind == ("anchor" if s in (0, 3) else "delta"), info
                assert info.formats == STREAMS_FORMATS, info.formats
                for name in STREAMS_FORMATS:
                    d = expected_dir / name
                    d.mkdir(parents=True, exist_ok=True)
                    got = derive(sd, serving_format(name))
                    save_file({k: v.contiguous() for k, v in got.items()}, str(d / f"v{info.version}.safetensors"))
        _copy_store(tmp / "store", store_dir)
        for name in STREAMS_FORMATS:
            _write_shas(expected_dir / name)
    finally:
        shutil.rmtree(tmp)


# --- grid ---------------------------------------------------------------------------------


GRID_SEED = 20261202
GRID_VERSIONS = 8
ANCHORS = (1, 5, 7)
GRID_SQUASH_BASE, GRID_SQUASH_TO = 2, 4
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
    from deltastore.layout.select import Selection, resolve
    from deltastore.read.plan import layout, plan_from_anchor
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
    from deltastore.format.history import History
    from deltastore.lifecycle.compact import compact
    from deltastore.storage import open_store

    g = torch.Generator().manual_seed(GRID_SEED)
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
    writer = WriterPolicy(writer_id="golden-grid", threads=1)
    fresh = WriterPolicy(writer_id="golden-grid", threads=1, resume=False)
    common = dict(anchor_policy=AnchorPolicy(every=100))
    try:
        with deltastore.Publisher(url, writer_policy=writer, layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=False), **common) as pub:
            pub._explicit_specs = _specs(4)
            for v in range(1, GRID_SQUASH_TO + 1):
                if v > 1:
                    nudge(dense=v == 3)
                publish(pub, v, "anchor" if v == 1 else "delta")
        rep = compact(url, bases=[GRID_SQUASH_BASE], writer="golden-grid-compactor", threads=1)
        assert rep.registered and [(s.from_, s.to) for s in rep.squashes] == [(GRID_SQUASH_BASE, GRID_SQUASH_TO)], rep
        sq = rep.squashes[0]
        with deltastore.Publisher(url, writer_policy=fresh, layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=False), **common) as pub:
            pub._explicit_specs = _specs(3)
            for v in (5, 6):
                nudge()
                publish(pub, v, "anchor" if v == 5 else "delta")
        with deltastore.Publisher(url, writer_policy=fresh, layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=True), **common) as pub:
            pub._explicit_specs = _specs(3)
            for v in (7, 8):
                nudge()
                publish(pub, v, "anchor" if v == 7 else "delta")

        h = History(open_store(url))
        head = h.read_head()[0]
        per_version = {}
        for v in range(1, GRID_VERSIONS + 1):
            _, m = h.find(v, head)
            layout = h.layout(m.layout)
            cols = dict(zip(layout.name, layout.chunk_cols))
            per_version[f"v{v}"] = {"schema": m.schema_, "kind": m.kind,
                                    "chunk_cols": {n: cols[n] for n in GRIDS},
                                    "groups": {row: [mm.name for mm in ms] for row, ms in layout.members().items()},
                                    "column_reads": column_reads(url, v)}
        assert [v for v in range(1, GRID_VERSIONS + 1) if per_version[f"v{v}"]["kind"] == "anchor"] == list(ANCHORS)
        assert per_version["v7"]["schema"] == 4 and per_version["v7"]["groups"], per_version["v7"]
        assert per_version["v1"]["chunk_cols"] == {"grid2d": 24, "grid3d": 4}, per_version["v1"]
        assert per_version["v5"]["chunk_cols"] == {"grid2d": 24, "grid3d": 3}, per_version["v5"]
        facts = {
            "versions": GRID_VERSIONS,
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


# --- sharded, sharded-grid ----------------------------------------------------------------


def write_sharded(store: Path, expected: Path, scenario: str = "versions") -> None:
    """Three ranks (gloo) publishing versions 1-4 of tests/write/test_sharded.py's ``scenario``."""
    from safetensors.torch import save_file

    from testkit.grid_ranks import golden_grid_model
    from testkit.ranks import full_model, run_ranks

    model = {"versions": full_model, "grid_golden": golden_grid_model}[scenario]
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(3, f"file://{store}", scenario, Path(tmp))
    for r in results:
        if set(r) != {"rank", "infos"}:
            raise SystemExit(f"a rank failed: {r}")
    if [k for _, k in results[0]["infos"]] != ["anchor", "delta", "delta", "anchor"]:
        raise SystemExit(f"unexpected versions: {results[0]['infos']}")
    for p in store.rglob("*"):  # the local backend's lock directory is not part of the format
        if p.is_dir() and p.name.startswith("."):
            shutil.rmtree(p)
    expected.mkdir(parents=True)
    for v in range(1, 5):
        save_file({k: t.contiguous() for k, t in model(v).items()}, str(expected / f"v{v}.safetensors"))


# --- federated ----------------------------------------------------------------------------


def state0() -> dict:
    import torch

    g = torch.Generator().manual_seed(11)
    return {
        "emb": (torch.randn(64, 16, generator=g) * 0.02).to(torch.bfloat16),
        "w": (torch.randn(32, 16, generator=g) * 0.02).to(torch.bfloat16),
        "b": torch.zeros(16, dtype=torch.bfloat16),
        "count": torch.tensor([0, 0], dtype=torch.int64),
    }


def trained(w: dict, site: int, rnd: int) -> dict:
    import torch

    out = {n: t.clone() for n, t in w.items()}
    g = torch.Generator().manual_seed(100 * rnd + site)
    rows = torch.randint(0, 64, (4,), generator=g)
    out["emb"][rows] = (out["emb"][rows].float() + torch.randn(4, 16, generator=g) * 0.01).to(torch.bfloat16)
    out["b"][site] = torch.tensor(-0.0 if site else 0.5, dtype=torch.bfloat16)
    out["count"][site] += rnd + 1
    return out


def write_federated(store: Path, expected: Path) -> None:
    """A global store (v1 an anchor, v2 the merge of round 1) and two sites, each with v1 based
    on global v1 and v2 on global v2."""
    import torch
    from safetensors.torch import save_file

    from deltastore.federated import Aggregator, Site

    g = store / "global"
    sites = {"a": store / "site-a", "b": store / "site-b"}
    for p in (g, *sites.values(), expected):
        p.mkdir(parents=True)
    with Aggregator(str(g), {k: str(v) for k, v in sites.items()}, dtype=torch.bfloat16, poll_interval_s=0.05,
                    writer_policy=WriterPolicy(threads=1, writer_id="golden-aggregator"),
                    layout_policy=LayoutPolicy(chunk_bytes=512)) as agg:
        agg.start(state0())
        save_file(agg.state(), str(expected / "global-v1.safetensors"))
        ss = {k: Site(str(g), str(v), dtype=torch.bfloat16,
                      writer_policy=WriterPolicy(threads=1, writer_id=f"golden-site-{k}")) for k, v in sites.items()}
        for rnd in range(2):
            for i, (k, s) in enumerate(ss.items()):
                r = s.run_round(lambda w, i=i, rnd=rnd: trained(w, i, rnd), num_examples=1 + i)
                save_file(trained(s.weights, i, rnd), str(expected / f"site-{k}-v{r.published.version}.safetensors"))
            if rnd == 0:
                report = agg.run_round()
                save_file(agg.state(), str(expected / f"global-v{report.published.version}.safetensors"))
        for s in ss.values():
            s.close()
    for p in store.rglob("*"):  # the local backend's lock directory is not part of the format
        if p.is_dir() and p.name.startswith("."):
            shutil.rmtree(p)


def write_federated_compressed(store: Path, expected: Path) -> None:
    """A global store (v1 an anchor, v2 the merge of round 1) and one site of the compressed
    tier (density 0.05, 2 bits, error feedback) with v1 based on global v1 and v2 on global v2."""
    import torch
    from safetensors.torch import save_file

    from deltastore.federated import Aggregator, Compression, Compressor, ResultPolicy, Site

    g, site = store / "global", store / "site-a"
    for p in (g, site, expected):
        p.mkdir(parents=True)
    comp = Compression(density=0.05, bits=2)
    with Aggregator(str(g), {"a": str(site)}, dtype=torch.bfloat16, poll_interval_s=0.05,
                    results=ResultPolicy(accept_compressed=True),
                    writer_policy=WriterPolicy(threads=1, writer_id="golden-aggregator"),
                    layout_policy=LayoutPolicy(chunk_bytes=512)) as agg:
        agg.start(state0())
        save_file(agg.state(), str(expected / "global-v1.safetensors"))
        mirror = Compressor(comp)  # what the site sends, recomputed for the expected files
        with Site(str(g), str(site), dtype=torch.bfloat16, compression=comp,
                  writer_policy=WriterPolicy(threads=1, writer_id="golden-site-a")) as s:
            for rnd in range(2):
                r = s.run_round(lambda w, rnd=rnd: {n: t.float() if t.is_floating_point() else t
                                                     for n, t in trained(w, 0, rnd).items()})
                sent = mirror.compress({n: t.float() if t.is_floating_point() else t
                                        for n, t in trained(s.weights, 0, rnd).items()}, s.weights)
                save_file(sent, str(expected / f"site-a-v{r.published.version}.safetensors"))
                if rnd == 0:
                    report = agg.run_round()
                    save_file(agg.state(), str(expected / f"global-v{report.published.version}.safetensors"))
    for p in store.rglob("*"):  # the local backend's lock directory is not part of the format
        if p.is_dir() and p.name.startswith("."):
            shutil.rmtree(p)


# --- targets ------------------------------------------------------------------------------

#: target -> (the paths it writes, relative to the output directory; the writer)
TARGETS: dict[str, tuple[tuple[str, ...], Callable[..., None]]] = {
    "segments": (("segments",), lambda out: write_segments(out / "segments")),
    "schema3": (("store-schema3", "store-schema3-expected", "store-schema3-facts.json"),
                lambda out: write_schema3(out / "store-schema3", out / "store-schema3-expected",
                                          out / "store-schema3-facts.json")),
    "schema4": (("store-schema4", "store-schema4-expected", "store-schema4-facts.json"),
                lambda out: write_schema4(out / "store-schema4", out / "store-schema4-expected",
                                          out / "store-schema4-facts.json")),
    "grid": (("store-grid", "store-grid-expected", "store-grid-facts.json"),
             lambda out: write_grid(out / "store-grid", out / "store-grid-expected", out / "store-grid-facts.json")),
    "sharded": (("store-sharded", "store-sharded-expected"),
                lambda out: write_sharded(out / "store-sharded", out / "store-sharded-expected")),
    "sharded-grid": (("store-sharded-grid", "store-sharded-grid-expected"),
                     lambda out: write_sharded(out / "store-sharded-grid", out / "store-sharded-grid-expected",
                                               "grid_golden")),
    "streams": (("store-streams", "store-streams-expected"),
                lambda out: write_streams(out / "store-streams", out / "store-streams-expected")),
    "federated": (("store-federated", "store-federated-expected"),
                  lambda out: write_federated(out / "store-federated", out / "store-federated-expected")),
    "federated-compressed": (("store-federated-compressed", "store-federated-compressed-expected"),
                             lambda out: write_federated_compressed(out / "store-federated-compressed",
                                                                    out / "store-federated-compressed-expected")),
}

#: Fields of the facts that name objects with random ids (attempts, run ids), count the bytes of
#: such objects (their ids and times are compressed with them), or record the run's zstd.
_RANDOM_FACTS = ("key", "sha256", "deleted", "deleted_bytes", "zstd")


def _without_random(doc):
    if isinstance(doc, dict):
        return {k: _without_random(v) for k, v in doc.items() if k not in _RANDOM_FACTS}
    if isinstance(doc, list):
        return [_without_random(v) for v in doc]
    return doc


def _content(root: Path) -> dict[str, list[str]]:
    """What a store holds that its random ids do not change: the digests of its packs and
    layout objects, the number of objects of every other kind, the expected files' bytes."""
    out: dict[str, list[str]] = {}
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        kind = next((k for k in (".pack", ".layout.json.zst", ".part.json.zst", ".index.json.zst", ".squash.json.zst",
                                 ".json.zst", ".safetensors", "facts.json", "sha256.json", "HEAD", ".json")
                     if rel.endswith(k)), "other")
        where = rel.split("/", 1)[0] if "/" in rel else ""
        if kind in (".pack", ".layout.json.zst"):  # content-addressed and deterministic
            out.setdefault(f"{where} {kind}", []).append(p.name.rsplit("/", 1)[-1])
        elif kind in (".safetensors", "sha256.json"):
            out.setdefault(f"{where} {kind}", []).append(f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()}")
        elif kind == "facts.json":
            out[f"{rel}"] = [json.dumps(_without_random(json.loads(p.read_text())), sort_keys=True)]
        else:
            out.setdefault(f"{where} {kind}", []).append("")
    return {k: sorted(v) for k, v in out.items()}


def check(targets: list[str]) -> int:
    """Regenerate ``targets`` into a temporary directory and compare with tests/golden/."""
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name in targets:
            paths, write = TARGETS[name]
            write(out)
            for rel in paths:
                a, b = HERE / rel, out / rel
                if name == "segments":
                    same = _tree_bytes(a) == _tree_bytes(b)
                    what = "byte for byte"
                elif b.is_file():
                    same = _content_of_file(a) == _content_of_file(b)
                    what = "but for random ids"
                else:
                    ca, cb = _content(a), _content(b)
                    same = ca == cb
                    what = "packs and layouts by content, expected files byte for byte, object counts"
                    for k in sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k)):
                        print(f"  {rel} {k}: committed {sorted(set(ca.get(k, [])) - set(cb.get(k, [])))[:4]}, "
                              f"regenerated {sorted(set(cb.get(k, [])) - set(ca.get(k, [])))[:4]}")
                print(f"{rel}: {'same' if same else 'DIFFERENT'} ({what})")
                failed += not same
    return 1 if failed else 0


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _content_of_file(p: Path) -> str:
    return json.dumps(_without_random(json.loads(p.read_text())), sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", choices=[[]] + list(TARGETS), metavar="TARGET",
                    help=f"what to write ({', '.join(TARGETS)}; default: all)")
    ap.add_argument("--out", type=Path, default=HERE, help="the directory to write into (default: tests/golden)")
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files")
    ap.add_argument("--check", action="store_true", help="regenerate into a temporary directory and compare")
    args = ap.parse_args(argv)
    targets = args.targets or list(TARGETS)
    if args.check:
        return check(targets)
    for name in targets:
        paths, write = TARGETS[name]
        for rel in paths:
            p = args.out / rel
            if p.exists():
                if not args.force:
                    sys.exit(f"{p} exists; golden files are written once (--force to overwrite)")
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        args.out.mkdir(parents=True, exist_ok=True)
        write(args.out)
        print(f"wrote {', '.join(str(args.out / rel) for rel in paths)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
