"""Format stability: golden files of the current format (tests/golden/, written by
tests/golden/make_golden.py) are read bit for bit, and written byte for byte.

- every golden segment decodes to exactly the recorded bits (``decode_full``; ``apply_delta``
  forward and inverse), for every codec id and width;
- today's writers (``full/2``, ``add-sparse/1``, ``add-dense/1``) re-encode the golden inputs
  to byte-identical segments, and composing golden deltas gives the golden result: a change to
  the writers that alters bytes must be deliberate (new golden files and a note in
  docs/codec-format.md), never silent;
- the schema-3 golden store (anchors, deltas, a layout change, the history index with floor and
  pins, a squash, a GC) is readable by Subscriber: ``pull`` of every live version equals the
  recorded safetensors, ``pull_into`` walks each version forward in place, ``log`` lists them;
- every manifest, layout, part manifest, history index and squash manifest of every golden store
  is re-encoded by today's encoders to exactly its stored bytes (the stores carry random attempt
  ids and times, so they are not regenerated: this is what proves today's writers write them).

The golden files are never rewritten by the tests: a store is copied to a temporary directory
before it is opened.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deltastore import Subscriber, codec

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SEGMENTS = GOLDEN / "segments"
INDEX = json.loads((SEGMENTS / "index.json").read_text())


def _array(name: str) -> np.ndarray:
    with gzip.open(SEGMENTS / name, "rb") as f:
        return np.load(f, allow_pickle=False)


def _seg(name: str) -> bytes:
    return (SEGMENTS / name).read_bytes()


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


SEGMENT_CASES = [
    pytest.param(case, seg, id=seg["file"].removesuffix(".seg"))
    for case in INDEX["cases"]
    for seg in case["segments"]
]


def test_golden_covers_every_codec_and_width():
    seen = {(s["codec"], np.dtype(c["dtype"]).itemsize) for c in INDEX["cases"] for s in c["segments"]}
    assert seen == {(c, w) for c in codec.KNOWN_CODECS for w in (1, 2, 4, 8)}


@pytest.mark.parametrize("case, seg", SEGMENT_CASES)
def test_golden_segment_decodes(case, seg):
    data = _seg(seg["file"])
    new = _array(case["new"])
    dt = new.dtype
    h = codec.peek_header(data)
    assert (h.codec, h.width, h.count, h.total_size) == (seg["codec"], dt.itemsize, case["count"], len(data))
    assert h.n_changed == seg["n_changed"]
    if seg["codec"] in codec.FULL_CODECS:
        out = codec.decode_full(data, codec=seg["codec"], dtype=dt, count=case["count"])
        assert out.dtype == dt and _bits(out) == _bits(new)
        return
    old = _array(case["old"])
    t = old.copy()
    codec.apply_delta(t, data, codec=seg["codec"])
    assert _bits(t) == _bits(new)
    codec.apply_delta(t, data, codec=seg["codec"], inverse=True)
    assert _bits(t) == _bits(old)
    assert int(np.count_nonzero(old != new)) == seg["n_changed"]


def _reencode(seg: dict, old: np.ndarray | None, new: np.ndarray) -> codec.Segment | None:
    kw = {"level": seg["level"]} if "level" in seg else {}
    if seg["fn"] == "full2":
        return codec.encode_full(new, float_bits=seg["float_bits"], **kw)
    assert seg["fn"] == "add", seg
    return codec.encode_delta(old, new, **kw)


@pytest.mark.parametrize("case, seg", SEGMENT_CASES)
def test_writers_reproduce_golden_bytes(case, seg):
    old = _array(case["old"]) if case["old"] else None
    new = _array(case["new"])
    out = _reencode(seg, old, new)
    assert out is not None
    assert (out.codec, out.n_changed) == (seg["codec"], seg["n_changed"])
    assert out.data == _seg(seg["file"])


@pytest.mark.parametrize(
    "comp", INDEX["compose"], ids=[c["result"]["file"].removesuffix(".result.seg") for c in INDEX["compose"]]
)
def test_golden_compose(comp):
    a, b, c = (_array(comp["arrays"][k]) for k in ("a", "b", "c"))
    sa, sb, want = (_seg(comp[k]["file"]) for k in ("a", "b", "result"))
    r = codec.compose_deltas(sa, sb, codec_a=comp["a"]["codec"], codec_b=comp["b"]["codec"],
                             dtype=a.dtype, count=comp["count"])
    assert r is not None
    assert (r.codec, r.n_changed, r.data) == (comp["result"]["codec"], comp["result"]["n_changed"], want)
    t = a.copy()
    codec.apply_delta(t, want, codec=comp["result"]["codec"])
    assert _bits(t) == _bits(c)
    assert b is not None  # the middle state: the two input deltas pass through it
    t = a.copy()
    codec.apply_delta(t, sa, codec=comp["a"]["codec"])
    assert _bits(t) == _bits(b)


def test_the_generator_writes_the_golden_segments_again():
    """tests/golden/make_golden.py regenerates the committed segments byte for byte (the
    stores hold random ids: their objects are checked by re-encoding, below)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(GOLDEN / "make_golden.py"), "--check", "segments"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "segments: same" in r.stdout, r.stdout + r.stderr


# --- the golden schema-3 store --------------------------------------------------------------


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), f"{what}: {name}"
        gb = g.contiguous().view(-1).view(torch.uint8) if g.numel() else g.new_empty(0, dtype=torch.uint8)
        wb = w.contiguous().view(-1).view(torch.uint8) if w.numel() else w.new_empty(0, dtype=torch.uint8)
        assert torch.equal(gb, wb), f"{what}: {name} differs"


def _layout(sd: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}


STORE3 = GOLDEN / "store-schema3"
EXPECTED3 = GOLDEN / "store-schema3-expected"
FACTS3 = json.loads((GOLDEN / "store-schema3-facts.json").read_text())
N_VERSIONS3 = FACTS3["versions"]
FLOOR3 = FACTS3["floor"]
PINS3 = FACTS3["pins"]
LIVE3 = sorted(set(PINS3) | set(range(FLOOR3, N_VERSIONS3 + 1)))
COLLECTED3 = sorted(set(range(1, N_VERSIONS3 + 1)) - set(LIVE3))
INSPECT_SNAPSHOT = GOLDEN / "store-schema3-inspect-v10.txt"


def _copy(src: Path, tmp_path: Path, name: str) -> str:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return str(dst)


@pytest.fixture
def store3_url(tmp_path) -> str:
    return _copy(STORE3, tmp_path, "store3")


def _load(expected_dir: Path, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(expected_dir / f"v{version}.safetensors"))


def _sha(t: torch.Tensor) -> str:
    import hashlib

    t = t.contiguous()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


@pytest.mark.parametrize("expected_dir, n", [(EXPECTED3, N_VERSIONS3)], ids=["schema3"])
def test_golden_schema3_expected_match_sidecar(expected_dir, n):
    """The per-tensor SHA-256 sidecar agrees with the safetensors files (a damaged expected
    file would otherwise make every other test wrong in the same way)."""
    shas = json.loads((expected_dir / "sha256.json").read_text())
    assert sorted(shas) == sorted(f"v{v}" for v in range(1, n + 1))
    for v in range(1, n + 1):
        sd = _load(expected_dir, v)
        assert {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
                for k, t in sd.items()} == shas[f"v{v}"], f"v{v}"


def test_golden_schema3_store_log(store3_url):
    """Versions below the floor were collected: the log starts at the floor."""
    with Subscriber(store3_url, threads=1) as sub:
        log = sub.log()
        assert [v.version for v in log] == list(range(FLOOR3, N_VERSIONS3 + 1))
        assert [v.kind for v in log] == ["anchor"] + ["delta"] * (N_VERSIONS3 - FLOOR3)
        assert all(v.writer == "golden3" and v.metadata == {"golden": 3} for v in log)
        assert [sub.info(v).kind for v in PINS3] == ["delta", "delta"]


@pytest.mark.parametrize("version", LIVE3)
def test_golden_schema3_store_pull(store3_url, version):
    with Subscriber(store3_url, threads=1) as sub:
        _assert_bit_equal(sub.pull(version), _load(EXPECTED3, version), f"pull({version})")


def test_golden_schema3_store_pull_latest(store3_url):
    with Subscriber(store3_url, threads=1) as sub:
        _assert_bit_equal(sub.pull(), _load(EXPECTED3, N_VERSIONS3), "pull()")


@pytest.mark.parametrize("version", COLLECTED3)
def test_golden_schema3_store_collected(store3_url, version):
    """Collected versions raise VersionCollectedError (learnt from the index, whether or not
    their manifest is still there because a pinned version's chain needs it)."""
    from deltastore.errors import VersionCollectedError

    with Subscriber(store3_url, threads=1) as sub, pytest.raises(VersionCollectedError) as e:
        sub.pull(version)
    assert (e.value.version, e.value.floor, sorted(e.value.pins)) == (version, FLOOR3, PINS3)


def test_golden_schema3_store_gc_deleted_what_it_reported(store3_url):
    """The manifests GC deleted are gone from the store, and the ones it kept are there."""
    names = {p.name for p in (STORE3 / "manifests").iterdir()}
    deleted = {k.split("/", 1)[1] for k in FACTS3["gc"]["deleted"]["manifests"]}
    assert deleted and not deleted & names
    assert sorted(int(n[:12]) for n in deleted) == [v for v in COLLECTED3 if v not in (1, 4, 5)]
    assert all(n.endswith(".json.zst") for n in names)


@pytest.mark.parametrize("start", [v for v in LIVE3 if v < N_VERSIONS3])
def test_golden_schema3_store_pull_into(store3_url, start):
    """From each live version: step by step to every later live version of its layout, and in
    one jump to the latest (pinned versions below the floor catch up through the anchor)."""
    from deltastore.errors import LayoutMismatchError

    expected = {v: _load(EXPECTED3, v) for v in LIVE3}
    same = [v for v in LIVE3 if v > start and _layout(expected[v]) == _layout(expected[start])]
    if not same:  # v2 (first layout, pinned): the next live version has another layout
        with Subscriber(store3_url, threads=1) as sub:
            target = sub.pull(start)
            with pytest.raises(LayoutMismatchError):
                sub.pull_into(target)
            _assert_bit_equal(target, expected[start], "untouched after a refused pull_into")
        return
    with Subscriber(store3_url, threads=1) as sub:
        target = sub.pull(start)
        for v in same:
            info = sub.pull_into(target, v)
            assert info is not None and info.version == v
            _assert_bit_equal(target, expected[v], f"pull_into {start} -> {v}")
        assert sub.pull_into(target) is None
    with Subscriber(store3_url, threads=1) as sub:
        target = sub.pull(start)
        assert sub.pull_into(target).version == N_VERSIONS3
        _assert_bit_equal(target, expected[N_VERSIONS3], f"pull_into {start} -> latest in one step")


def _pull_before_gc(sub: Subscriber, version: int, monkeypatch) -> dict[str, torch.Tensor]:
    """What a worker that pulled ``version`` before the GC holds: the subscriber reads that
    version's manifest (still in the store, a pin's chain needs it) as it did before the floor
    rose, then sees the real index."""
    name = next(p.name for p in (STORE3 / "manifests").iterdir() if int(p.name[:12]) == version)
    key = f"manifests/{name}"
    with monkeypatch.context() as mp:
        mp.setattr(sub._reader, "resolve", lambda v: (key, sub._reader.history.manifest(key)))
        return sub.pull(version)


def test_golden_schema3_store_pull_into_from_collected(store3_url, monkeypatch, caplog):
    """A worker holding v5 (collected since: below the floor, not pinned; its manifest kept
    for v6's chain) catches up to the latest through the anchor v8, bit-exact."""
    import logging

    held = 5
    assert held in COLLECTED3
    expected = _load(EXPECTED3, N_VERSIONS3)
    with Subscriber(store3_url, threads=1) as sub:
        target = _pull_before_gc(sub, held, monkeypatch)
        _assert_bit_equal(target, _load(EXPECTED3, held), f"pull({held}) before the GC")
        assert sub.version == held
        with caplog.at_level(logging.INFO, logger="deltastore.read"):
            info = sub.pull_into(target)
        assert info is not None and info.version == N_VERSIONS3
        _assert_bit_equal(target, expected, f"pull_into {held} (collected) -> latest")
    assert f"version {held} was collected (floor {FLOOR3}); catching up from anchor {FLOOR3}" in caplog.text


def test_golden_schema3_store_squash_used_at_its_base(store3_url):
    """A worker at the squash's base fetches exactly the squash's packs to reach its end
    (not the chain of deltas), and the result is bit-exact."""
    sq = FACTS3["squash"]
    assert sq["bytes"] < sq["chain_bytes"]
    with Subscriber(store3_url, threads=1) as sub:
        target = sub.pull(sq["from"])
        before = sub.bytes_fetched
        info = sub.pull_into(target, sq["to"])
        assert info is not None and info.version == sq["to"]
        assert sub.bytes_fetched - before == sq["bytes"]
        _assert_bit_equal(target, _load(EXPECTED3, sq["to"]), f"pull_into via the squash {sq['from']} -> {sq['to']}")
    # the same catch-up without squashes (a subscriber that trusts signatures does not use
    # them, SPEC §12, but this store is unsigned): read the chain instead
    with Subscriber(store3_url, threads=1) as sub:
        sub._reader.catchup.use_squashes = False
        target = sub.pull(sq["from"])
        before = sub.bytes_fetched
        sub.pull_into(target, sq["to"])
        assert sub.bytes_fetched - before > sq["bytes"]
        _assert_bit_equal(target, _load(EXPECTED3, sq["to"]), "pull_into via the chain")


def _inspect(url: str, version: int, capsys) -> str:
    from deltastore.cli import main

    capsys.readouterr()
    assert main(["inspect", url, "--version", str(version)]) == 0
    return capsys.readouterr().out


def test_golden_schema3_inspect_snapshot(store3_url, capsys):
    """``deltastore inspect`` of v10 (a delta: skip pointers, a layout object, packs with roles) equals the checked-in snapshot (made from
    the golden bytes, which never change)."""
    assert _inspect(store3_url, 10, capsys) == INSPECT_SNAPSHOT.read_text()


@pytest.mark.parametrize("version", [1, 3])
def test_golden_schema3_inspect_collected_version(store3_url, capsys, version):
    """``deltastore inspect`` of a collected version says it was collected (as pull does),
    not that the store was damaged (v3: GC deleted its manifest) nor prints it (v1: its
    manifest is still there for a pin's chain)."""
    from deltastore.cli import main

    assert main(["inspect", store3_url, "--version", str(version)]) != 0
    assert "collected" in capsys.readouterr().err


def test_golden_schema3_inspect_pinned_version(store3_url, capsys):
    """A pinned version below the floor is inspected through its pin."""
    assert "version         2" in _inspect(store3_url, 2, capsys)


#: Every golden store of the current format, by its directory under tests/golden/.
CURRENT_STORES = ("store-schema3", "store-schema4", "store-grid", "store-sharded", "store-sharded-grid",
                  "store-federated/global", "store-federated/site-a", "store-federated/site-b")


def test_golden_schema3_head_of_another_schema_is_refused(store3_url):
    """A reader refuses a HEAD of a schema it does not read, older or newer, naming it."""
    from deltastore.errors import UnsupportedSchemaError

    head = Path(store3_url) / "HEAD"
    doc = json.loads(head.read_bytes())
    for schema, words in ((2, "earlier format"), (4, "upgrade deltastore")):
        head.write_text(json.dumps({**doc, "schema": schema}))
        with Subscriber(store3_url, threads=1) as sub, pytest.raises(UnsupportedSchemaError, match=words):
            sub.pull()


@pytest.mark.parametrize("name", CURRENT_STORES)
def test_golden_objects_are_written_byte_for_byte(name, tmp_path):
    """Every manifest, layout, part manifest, history index and squash manifest of the golden
    store re-encodes to exactly its stored bytes (its canonical JSON, and with the libzstd that
    wrote them, the zstd frame): today's encoders write the current format as it was written."""
    import zstandard

    from deltastore.format.history import History
    from deltastore.format.manifest import encode_manifest
    from deltastore.format.models import Index, Layout, ObjectRef, SquashManifest, Stats, piece_part
    from deltastore.format.objects import decode_object, encode_object
    from deltastore.format.parts import encode_part
    from deltastore.storage import open_store

    same_zstd = ".".join(map(str, zstandard.ZSTD_VERSION)) == FACTS3["zstd"]["libzstd"]
    dctx = zstandard.ZstdDecompressor()
    root = Path(_copy(GOLDEN / name, tmp_path, "store"))
    store = open_store(str(root))
    history = History(store)
    kinds = {".layout.json.zst": Layout, ".index.json.zst": Index, ".squash.json.zst": SquashManifest}
    seen: dict[str, int] = {}
    for key, data in _stored_objects(root):
        if key.startswith("manifests/"):
            m = history.manifest(key)
            layout = history.layout(m.layout)
            parts = {p.key: store.get(p.key) for p in m.parts}
            out, what = encode_manifest(m, layout, parts or None), "manifest"
            for ref in m.parts:  # each part manifest, from the chunks of its pieces
                doc = json.loads(dctx.decompress(parts[ref.key]))
                tensors = []
                for t in m.tensors:
                    ti = layout.name.index(t.name)
                    chunks = tuple(c for c in t.chunks if piece_part(layout, ti, c.index) == ref.part)
                    if chunks:
                        tensors.append(t.model_copy(update={"chunks": chunks}))
                blobs = [b for b in m.blobs if b.key in {p["key"] for p in doc["packs"]}]
                got = encode_part(schema=doc["schema"], version=doc["version"], part=ref.part, commit_id=doc["commit_id"],
                                  lineage=doc["lineage"], layout_ref=ObjectRef(**doc["layout"]), layout=layout,
                                  tensors=tensors, blobs=blobs, stats=Stats(**doc["stats"]))
                assert dctx.decompress(got) == dctx.decompress(parts[ref.key]), ref.key
                if same_zstd:
                    assert got == parts[ref.key], ref.key
                seen["part manifest"] = seen.get("part manifest", 0) + 1
        elif key.endswith(".part.json.zst"):
            continue  # checked with its version above
        else:
            cls = next(c for s, c in kinds.items() if key.endswith(s))
            out, what = encode_object(decode_object(cls, data, key)), cls.__name__
        seen[what] = seen.get(what, 0) + 1
        assert dctx.decompress(out) == dctx.decompress(data), key
        if same_zstd:
            assert out == data, key
    assert seen.get("manifest", 0) >= 2 and seen.get("Layout", 0) >= 1, seen
    if name.startswith("store-sharded"):
        assert seen.get("part manifest", 0) >= 3, seen
    if name == "store-schema3":
        assert seen.get("Index", 0) >= 1 and seen.get("SquashManifest", 0) >= 1, seen


def _stored_objects(root: Path):
    """(key, bytes) of every manifest and zstd object of a golden store."""
    for p in sorted(root.rglob("*.zst")):
        yield p.relative_to(root).as_posix(), p.read_bytes()


def test_golden_schema3_files_untouched_by_reading(store3_url):
    assert sorted(p.name for p in STORE3.iterdir()) == ["HEAD", "gc", "manifests", "objects"]
