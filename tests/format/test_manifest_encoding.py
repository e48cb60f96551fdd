"""Schema-3 manifests (design 005 D8, SPEC §3): the compact encoding round-trips exactly, hostile
bytes are refused with typed errors naming the object, signatures survive, and it is small."""

from __future__ import annotations

import json
import random

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore.errors import (
    CorruptObjectError,
    IntegrityError,
    SignatureError,
    UnsupportedSchemaError,
)
from deltastore.format.keys import manifest_key, manifest_key_version, object_key, sha256_hex
from deltastore.format.manifest import encode_manifest, parse_manifest
from deltastore.format.models import Index, Layout, Manifest, ObjectRef, chunk_count, dump
from deltastore.format.objects import decode_object, encode_object
from testkit.manifest_docs import LINEAGE, make_layout, make_manifest, random_hex
from testkit.stores import mutated

PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _store(m: Manifest, layout: Layout) -> tuple[bytes, str]:
    data = encode_manifest(m, layout)
    return data, manifest_key(m.version, sha256_hex(data))


# --- round trips --------------------------------------------------------------------------


@PROPS
@given(seed=st.integers(0, 2**32), n_tensors=st.integers(0, 150), kind=st.sampled_from(["anchor", "delta"]),
       with_delta=st.booleans(), changed=st.floats(0, 1), max_pack=st.integers(1, 30), version=st.integers(2, 10**6))
def test_schema3_round_trip(seed, n_tensors, kind, with_delta, changed, max_pack, version) -> None:
    rng = random.Random(seed)
    layout = make_layout(rng, n_tensors)
    m = make_manifest(rng, layout, kind=kind, version=version, changed=changed, with_delta=with_delta,
                      max_pack_segments=max_pack)
    data, key = _store(m, layout)
    assert key.endswith(".json.zst") and manifest_key_version(key) == version
    assert zstandard.frame_content_size(data) > 0
    assert parse_manifest(data, key, layout=layout) == m
    assert dump(parse_manifest(data, key, layout=lambda ref: layout)) == dump(m)
    # the document has no tensor names: they live in the layout only
    raw = zstandard.ZstdDecompressor().decompress(data)
    assert b'"tensors"' not in raw and b'"blobs"' not in raw
    assert all(name.encode() not in raw for name in layout.name)


def test_schema3_decoded_delta_lists_changed_tensors_in_layout_order() -> None:
    """A delta lists only tensors with changed chunks, in layout order."""
    rng = random.Random(1)
    layout = make_layout(rng, 30)
    m = make_manifest(rng, layout, kind="delta", changed=0.05)
    listed = [t.name for t in m.tensors]
    assert 0 < len(listed) < 30
    data, key = _store(m, layout)
    got = parse_manifest(data, key, layout=layout)
    assert [t.name for t in got.tensors] == listed == [n for n in layout.name if n in listed]
    assert all(t.chunks for t in got.tensors)


def test_schema3_needs_its_layout() -> None:
    rng = random.Random(2)
    layout = make_layout(rng, 3)
    m = make_manifest(rng, layout, kind="anchor")
    data, key = _store(m, layout)
    with pytest.raises(ValueError, match="layout"):
        parse_manifest(data, key)
    with pytest.raises(ValueError, match="layout"):
        encode_manifest(m)
    with pytest.raises(ValueError, match="not in its layout"):
        encode_manifest(m, make_layout(random.Random(3), 3, names=["x", "y", "z"]))


def test_schema3_encoder_refuses_non_canonical_order() -> None:
    """Decoding returns tensors in layout order; a manifest in another order would not survive
    the round trip (and its signature would not verify), so the encoder refuses it."""
    rng = random.Random(4)
    layout = make_layout(rng, 6)
    m = make_manifest(rng, layout, kind="anchor")
    swapped = m.model_copy(update={"tensors": tuple(reversed(m.tensors))})
    with pytest.raises(ValueError, match="cannot be encoded|canonical"):
        encode_manifest(swapped, layout)
    gap = m.model_copy(update={"blobs": tuple(b.model_copy(update={"size": b.size + 1}) for b in m.blobs)})
    with pytest.raises(ValueError, match="fill"):
        encode_manifest(gap, layout)


def test_manifest_keys() -> None:
    assert manifest_key(1, "a" * 64).endswith("-" + "a" * 64 + ".json.zst")
    assert manifest_key_version(manifest_key(7, "a" * 64)) == 7
    assert manifest_key_version("manifests/000000000007-" + "a" * 64 + ".json") is None  # schemas 1 and 2
    assert manifest_key_version("manifests/000000000007-" + "a" * 64 + ".json.gz") is None


# --- signatures -----------------------------------------------------------------------------


def test_schema3_signature_survives_encoding(tmp_path) -> None:
    from deltastore.format.signing import (
        TrustedKeys,
        generate_key_files,
        load_private_key,
        sign_manifest,
    )

    priv, pub = generate_key_files(tmp_path / "k.pem")
    rng = random.Random(6)
    layout = make_layout(rng, 12)
    m = sign_manifest(make_manifest(rng, layout, kind="delta"), load_private_key(priv))
    data, key = _store(m, layout)
    got = parse_manifest(data, key, layout=layout)
    TrustedKeys([pub]).verify(key, got)
    # a reader given a different layout (other dtypes under the same names) gets other tensors:
    # the signature covers them, so it fails
    other = layout.model_copy(update={"dtype": tuple("int8" if d != "int8" else "uint8" for d in layout.dtype)})
    with pytest.raises(SignatureError):
        TrustedKeys([pub]).verify(key, parse_manifest(data, key, layout=other))


# --- other schema-3 objects ---------------------------------------------------------------


def test_objects_are_zstd_frames_and_round_trip() -> None:
    rng = random.Random(7)
    layout = make_layout(rng, 20)
    data = encode_object(layout)
    assert zstandard.frame_content_size(data) > 0
    key = object_key(random_hex(rng, 32), sha256_hex(data), ".layout.json.zst")
    assert decode_object(Layout, data, key) == layout
    idx = Index(lineage=LINEAGE, generation=1, floor=1, writer="gc", created="2026-12-01T10:00:00.000Z")
    data = encode_object(idx)
    assert decode_object(Index, data, object_key("0" * 32, sha256_hex(data), ".index.json.zst")) == idx
    with pytest.raises(IntegrityError):
        decode_object(Index, data, object_key("0" * 32, "f" * 64, ".index.json.zst"))


def test_layouts_a_reader_cannot_read_are_refused() -> None:
    """Sharded layouts (tests/write/test_sharded.py), column grids (tests/layout/test_grid_store.py) and
    grids in sharded layouts are read, as long as a grid's pieces start on a row block; pieces
    off chunk boundaries are refused, pieces without parts (or parts without pieces) are
    corrupt."""
    rng = random.Random(8)
    layout = make_layout(rng, 3)
    grid = Layout(schema=3, name=("g",), dtype=("bfloat16",), shape=((8, 6),), chunk_rows=(2,), chunk_cols=(4,),
                  pieces=((4,),), piece_parts=((1, 0),), parts=2)
    data = encode_object(grid)
    assert decode_object(Layout, data, object_key("0" * 32, sha256_hex(data), ".layout.json.zst")) == grid
    unaligned = grid.model_copy(update={"pieces": ((3,),)})
    data = encode_object(unaligned)
    with pytest.raises(UnsupportedSchemaError, match="chunk boundary"):
        decode_object(Layout, data, object_key("0" * 32, sha256_hex(data), ".layout.json.zst"))
    cases = (
        ({"parts": 2}, CorruptObjectError, "needs pieces"),
        ({"pieces": (None, (3,), None)}, CorruptObjectError, "unsharded layout"),
    )
    for change, error, match in cases:
        bad = layout.model_copy(update=change)
        data = encode_object(bad)
        key = object_key("0" * 32, sha256_hex(data), ".layout.json.zst")
        with pytest.raises(error, match=match):
            decode_object(Layout, data, key)
        m = make_manifest(rng, layout, kind="anchor")
        mdata, mkey = _store(m, layout)
        with pytest.raises(error, match=match):
            parse_manifest(mdata, mkey, layout=bad)


# --- hostile bytes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base() -> tuple[Manifest, Layout, dict]:
    rng = random.Random(9)
    layout = make_layout(rng, 10)
    m = make_manifest(rng, layout, kind="anchor", with_delta=True, changed=0.5, version=9, max_pack_segments=3)
    data, _ = _store(m, layout)
    assert len(m.blobs) >= 3
    return m, layout, json.loads(zstandard.ZstdDecompressor().decompress(data))


def _frame(doc: dict, **kw) -> tuple[bytes, str]:
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    data = zstandard.ZstdCompressor(level=3, **kw).compress(raw)
    return data, manifest_key(doc.get("version", 9) if isinstance(doc.get("version"), int) else 9, sha256_hex(data))


def test_hostile_base_parses(base) -> None:
    m, layout, doc = base
    data, key = _frame(doc)
    assert parse_manifest(data, key, layout=layout) == m


def _lengths_off_by_one(doc):
    lengths = list(doc["segments"]["length"])
    lengths[0] += 1
    lengths[1] -= 1 if lengths[1] > 1 else -1
    return ("segments", "length"), lengths


HOSTILE = {
    "pack too big": lambda d: (("packs", 0, "size"), d["packs"][0]["size"] + 1),
    "pack too small": lambda d: (("packs", 0, "size"), d["packs"][0]["size"] - 1),
    "segment crosses pack": _lengths_off_by_one,
    "extra pack": lambda d: (("packs",), d["packs"] + [d["packs"][0]]),
    "pack role differs": lambda d: (("packs", 0, "role"), "f" if d["packs"][0]["role"] == "d" else "d"),
    "segment role differs": lambda d: (("segments", "role"), ("f" if d["segments"]["role"][0] == "d" else "d") + d["segments"]["role"][1:]),
    "unknown role": lambda d: (("segments", "role"), "x" + d["segments"]["role"][1:]),
    "rows out of order": lambda d: (("chunks", "tensor"), list(reversed(d["chunks"]["tensor"]))),
    "duplicate row": lambda d: (("chunks", "chunk"), [d["chunks"]["chunk"][0]] * len(d["chunks"]["chunk"])),
    "tensor out of layout": lambda d: (("chunks", "tensor"), d["chunks"]["tensor"][:-1] + [10]),
    "negative tensor": lambda d: (("chunks", "tensor"), [-1] + d["chunks"]["tensor"][1:]),
    "chunk out of range": lambda d: (("chunks", "chunk"), d["chunks"]["chunk"][:-1] + [10**6]),
    "digest short": lambda d: (("chunks", "digest"), d["chunks"]["digest"][:-1]),
    "digest long": lambda d: (("chunks", "digest"), d["chunks"]["digest"] + "00"),
    "digest upper": lambda d: (("chunks", "digest"), d["chunks"]["digest"].upper()),
    "sha short": lambda d: (("segments", "sha256"), d["segments"]["sha256"][:-64]),
    "sha not hex": lambda d: (("segments", "sha256"), "g" + d["segments"]["sha256"][1:]),
    "segment row out of range": lambda d: (("segments", "row"), [10**6] + d["segments"]["row"][1:]),
    "two segments one role": lambda d: (("segments", "row"), [d["segments"]["row"][1]] + d["segments"]["row"][1:]),
    "codec out of range": lambda d: (("segments", "codec"), [99] + d["segments"]["codec"][1:]),
    "column lengths differ": lambda d: (("segments", "n_changed"), d["segments"]["n_changed"][1:]),
    "bool for int": lambda d: (("segments", "length"), [True] + d["segments"]["length"][1:]),
    "string for int": lambda d: (("chunks", "chunk"), ["0"] + d["chunks"]["chunk"][1:]),
    "tables missing": lambda d: (("segments",), None),
    "extra table field": lambda d: (("chunks", "extra"), []),
    "tensors inline": lambda d: (("tensors",), []),
    "pack key not a pack": lambda d: (("packs", 0, "key"), "blobs/aa/" + d["packs"][0]["sha256"]),
    "back wrong version": lambda d: (("back",), list(reversed(d["back"]))),
    "no layout": lambda d: (("layout",), None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_schema3_manifest_refused(base, case) -> None:
    _m, layout, doc = base
    path, value = HOSTILE[case](doc)
    data, key = _frame(mutated(doc, path, value))
    with pytest.raises(CorruptObjectError) as e:
        parse_manifest(data, key, layout=layout)
    assert key in str(e.value)


def test_hostile_frames_refused(base) -> None:
    _m, layout, doc = base
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    cases = {
        "no content size": zstandard.ZstdCompressor(level=3, write_content_size=False).compress(raw),
        "not zstd": raw,
        "truncated": zstandard.ZstdCompressor(level=3).compress(raw)[:-5],
        "two frames": zstandard.ZstdCompressor(level=3).compress(raw) * 2,
        "empty": b"",
    }
    for name, data in cases.items():
        key = manifest_key(9, sha256_hex(data))
        with pytest.raises(CorruptObjectError, match="manifest") as e:
            parse_manifest(data, key, layout=layout)
        assert key in str(e.value), name
    # a frame that decompresses past the limit is refused before it is decompressed
    bomb = zstandard.ZstdCompressor(level=3).compress(b" " * (4 << 20))
    key = manifest_key(9, sha256_hex(bomb))
    with pytest.raises(CorruptObjectError, match="decompresses to"):
        parse_manifest(bomb, key, layout=layout, max_bytes=1 << 20)
    # a frame lying about its content size (declares less than it holds)
    small = zstandard.ZstdCompressor(level=3).compress(b"{}")
    params = zstandard.get_frame_parameters(small)
    assert params.content_size == 2
    with pytest.raises(CorruptObjectError):
        lie = bytearray(zstandard.ZstdCompressor(level=3).compress(raw))
        lie[5] ^= 0x01  # the content-size field of the frame header: now it lies
        key = manifest_key(9, sha256_hex(bytes(lie)))
        parse_manifest(bytes(lie), key, layout=layout)


def test_hostile_schema_mismatches(base) -> None:
    _m, layout, doc = base
    # parts (SPEC §8) are read, but not with tables of their own nor with an unsharded layout
    data, key = _frame(mutated(doc, ("parts",), [{"part": 0}]))
    with pytest.raises(CorruptObjectError, match="malformed"):
        parse_manifest(data, key, layout=layout)
    ref = {"part": 0, "key": "objects/" + "0" * 32 + "/00000-" + "a" * 64 + ".part.json.zst", "sha256": "a" * 64,
           "writer": "w", "bytes": 1}
    data, key = _frame(mutated(doc, ("parts",), [ref]))
    with pytest.raises(CorruptObjectError, match="own tables must be empty"):
        parse_manifest(data, key, layout=layout)
    data, key = _frame(mutated(doc, ("schema",), 6))
    with pytest.raises(UnsupportedSchemaError):
        parse_manifest(data, key, layout=layout)
    # serving streams (SPEC §15) are schema 5: an older schema carrying them is corrupt
    stream = {"format": "fp8-block128", "key": "streams/fp8-block128/" + key, "sha256": "a" * 64, "bytes": 1}
    data, key = _frame(mutated(doc, ("streams",), [stream]))
    with pytest.raises(CorruptObjectError, match="no streams"):
        parse_manifest(data, key, layout=layout)
    data, key = _frame(mutated(mutated(doc, ("streams",), [stream, stream]), ("schema",), 5))
    with pytest.raises(CorruptObjectError, match="each format once"):
        parse_manifest(data, key, layout=layout)
    data, key = _frame(mutated(mutated(doc, ("streams",), [stream]), ("schema",), 5))
    assert parse_manifest(data, key, layout=layout).stream_ref("fp8-block128").bytes == 1
    # schema 4 (design 007) is readable, but only with a schema-4 layout
    data, key = _frame(mutated(doc, ("schema",), 4))
    with pytest.raises(CorruptObjectError, match="schema-3 layout"):
        parse_manifest(data, key, layout=layout)
    data, key = _frame(mutated(doc, ("schema",), 2))
    with pytest.raises(UnsupportedSchemaError, match="earlier format") as e:
        parse_manifest(data, key, layout=layout)
    assert key in str(e.value)
    # the key's digest covers the compressed bytes
    data, key = _frame(doc)
    with pytest.raises(IntegrityError):
        parse_manifest(data, manifest_key(9, sha256_hex(zstandard.ZstdDecompressor().decompress(data))), layout=layout)
    # filed under another version
    with pytest.raises(CorruptObjectError, match="not the version its key names"):
        parse_manifest(data, manifest_key(8, sha256_hex(data)), layout=layout)


# --- size ------------------------------------------------------------------------------------

#: Tensor names of a MiniLM-like model (103 tensors), the shape of the design's measurements.
def _minilm_names() -> list[str]:
    names = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
             "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
    for i in range(6):
        p = f"encoder.layer.{i}."
        for part in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                     "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm"):
            names += [p + part + ".weight", p + part + ".bias"]
    names += ["pooler.dense.weight", "pooler.dense.bias"]
    return names[:103] + [f"extra.{i}" for i in range(103 - len(names))]


def test_schema3_manifest_is_several_times_smaller() -> None:
    rng = random.Random(10)
    names = _minilm_names()
    assert len(names) == 103
    layout = make_layout(rng, 103, names=names)
    # ~90 changed chunks over 103 tensors, in a few packs
    n_chunks = sum(chunk_count(layout.shape[ti], layout.chunk_rows[ti]) for ti in range(103))
    assert n_chunks >= 90
    m3 = make_manifest(rng, layout, kind="delta", version=5000, changed=90 / n_chunks, max_pack_segments=40)
    n_rows = sum(len(t.chunks) for t in m3.tensors)
    assert 60 <= n_rows <= 130, n_rows
    data, _key = _store(m3, layout)
    # the in-memory form as canonical JSON (tensors inline, named), skip pointers included
    inline = dump(m3.model_copy(update={"back": (), "anchor_manifest": None}))
    assert m3.back
    assert len(data) < len(inline) / 3, (len(data), len(inline))


# --- History: layouts, index, squashes, skip pointers -----------------------------


class _CountingStore:
    """A MemoryStore that counts GETs per key."""

    def __init__(self, name: str):
        import uuid

        from deltastore.storage._memory import MemoryStore

        self.inner = MemoryStore(f"memory://schema3-{name}-{uuid.uuid4().hex}")
        self.url = self.inner.url
        self.gets: list[str] = []

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return self.inner.get(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _write_chain(n: int, *, anchor_every: int = 0, with_back: bool = True, name: str = "chain"):
    """Versions 1..n of schema 3 in a store (an anchor at 1 and every anchor_every), as a
    writer lays them out; returns (store, head, keys, layout)."""
    from deltastore.format.models import Head

    store = _CountingStore(name)
    rng = random.Random(n)
    layout = make_layout(rng, 6)
    ldata = encode_object(layout)
    attempt0 = random_hex(rng, 32)
    lref = ObjectRef(key=object_key(attempt0, sha256_hex(ldata), ".layout.json.zst"), sha256=sha256_hex(ldata))
    store.inner.put(lref.key, ldata, mode="create")
    keys: dict[int, str] = {}
    anchor = 1
    for v in range(1, n + 1):
        kind = "anchor" if v == 1 or (anchor_every and (v - 1) % anchor_every == 0) else "delta"
        if kind == "anchor":
            anchor = v
        m = make_manifest(rng, layout, kind=kind, version=v, changed=0.3)
        m = m.model_copy(update={
            "parent_manifest": keys.get(v - 1), "anchor": anchor,
            "anchor_manifest": None if kind == "anchor" else keys[anchor],
            "delta_base": None if kind == "anchor" else v - 1, "chain_start": anchor,
            "back": tuple(keys[v - 2**j] for j in range(1, 63) if v - 2**j >= 1) if with_back else (),
            "layout": lref,
        })
        data = encode_manifest(m, layout)
        keys[v] = manifest_key(v, sha256_hex(data))
        store.inner.put(keys[v], data, mode="create")
    head = Head(schema=3, version=n, manifest=keys[n], manifest_sha256=keys[n].split("-")[-1].split(".")[0],
                commit_id=attempt0, writer="w", epoch=1, updated="2026-12-01T10:00:00.000Z", lineage=LINEAGE)
    return store, head, keys, layout


def test_history_reads_schema3_with_its_layout() -> None:
    from deltastore.format.history import History

    store, head, keys, layout = _write_chain(5)
    h = History(store)
    key, m = h.head_manifest(head)
    assert key == keys[5] and [t.name for t in m.tensors] == [n for n in layout.name if n in {t.name for t in m.tensors}]
    assert h.layout(m.layout) == layout
    layout_gets = [k for k in store.gets if k.endswith(".layout.json.zst")]
    for v in range(1, 6):
        h.find(v, head)
    assert [k for k in store.gets if k.endswith(".layout.json.zst")] == layout_gets  # cached
    assert [i.version for i in h.log(head)] == [1, 2, 3, 4, 5]


def test_history_find_uses_skip_pointers() -> None:
    from deltastore.format.history import History

    store, head, keys, _ = _write_chain(200, name="find")
    h = History(store)
    h.head_manifest(head)
    store.gets.clear()
    key, m = h.find(3, head)
    assert (key, m.version) == (keys[3], 3)
    manifest_gets = [k for k in store.gets if k.startswith("manifests/")]
    # 197 = 128 + 64 + 4 + 1: four hops, not 197 parent links
    assert len(manifest_gets) <= 8, manifest_gets
    # and without skip pointers it walks every link
    store2, head2, _, _ = _write_chain(40, with_back=False, name="noback")
    h2 = History(store2)
    h2.head_manifest(head2)
    store2.gets.clear()
    assert h2.find(1, head2)[1].version == 1
    assert len([k for k in store2.gets if k.startswith("manifests/")]) == 39


def test_history_chain_with_skip_pointers_is_complete_and_checked() -> None:
    from deltastore.format.history import History

    store, head, keys, _ = _write_chain(70, anchor_every=32, name="chain")
    h = History(store, cache_entries=4)  # a small cache: the chain must not depend on it
    key, m = h.head_manifest(head)
    ms = h.chain(key, m, down_to=m.anchor)
    assert [x.version for _, x in ms] == list(range(65, 71))
    assert [k for k, _ in ms] == [keys[v] for v in range(65, 71)]
    ms = h.chain(key, m, down_to=3)
    assert [x.version for _, x in ms] == list(range(3, 71))
    assert [k for k, _ in ms] == [keys[v] for v in range(3, 71)]
    assert [x.version for _, x in h.anchor_chain(key, m)] == list(range(65, 71))


def test_history_refuses_a_skip_pointer_to_the_wrong_version() -> None:
    """Keys carry versions, so a back entry naming the wrong version is refused when the
    manifest is encoded or parsed; a manifest reached through back must also be the version its
    position names, and share the anchor of the manifest it was reached from when in its span."""
    from deltastore.format.history import History

    store, _head, keys, layout = _write_chain(9, name="badback")
    m9 = parse_manifest(store.inner.get(keys[9]), keys[9], layout=layout)
    bad = m9.model_copy(update={"back": (keys[7], keys[3], keys[1])})
    with pytest.raises(ValueError, match="back"):
        encode_manifest(bad, layout)
    h = History(store)
    m5 = h.manifest(keys[5])
    with pytest.raises(CorruptObjectError, match="not 4"):
        History._check_skip(keys[9], m9, keys[5], m5, 4)
    other_span = m9.model_copy(update={"anchor": 4})
    with pytest.raises(CorruptObjectError, match="cannot be on one chain"):
        History._check_skip(keys[9], other_span, keys[5], m5, 5)
    History._check_skip(keys[9], m9, keys[5], m5, 5)


def test_history_index_and_squash() -> None:
    from deltastore.format.history import History
    from deltastore.format.models import Head, SquashManifest, SquashRef

    store, head, keys, _layout = _write_chain(4, name="index")
    h = History(store)
    assert h.index(head) is None
    idx = Index(lineage=LINEAGE, generation=1, floor=1, writer="gc", created="2026-12-01T10:00:00.000Z")
    data = encode_object(idx)
    ref = ObjectRef(key=object_key("1" * 32, sha256_hex(data), ".index.json.zst"), sha256=sha256_hex(data))
    store.inner.put(ref.key, data, mode="create")
    head_i = head.model_copy(update={"index": ref})
    assert h.index(head_i) == idx
    other = head_i.model_copy(update={"lineage": "f" * 32})
    h2 = History(store)
    with pytest.raises(CorruptObjectError, match="lineage"):
        h2.index(other)
    sq = SquashManifest(**{"from": 2, "to": 4}, from_manifest=keys[2], to_manifest=keys[4], commit_id="2" * 32,
                        lineage=LINEAGE, writer="c", created="2026-12-01T10:00:00.000Z")
    sdata = encode_object(sq)
    skey = object_key("2" * 32, sha256_hex(sdata), ".squash.json.zst")
    store.inner.put(skey, sdata, mode="create")
    sref = SquashRef(**{"from": 2, "to": 4}, key=skey, sha256=sha256_hex(sdata), bytes=len(sdata))
    assert h.squash(sref) == sq
    with pytest.raises(CorruptObjectError, match="squashes 2 → 4"):
        History(store).squash(sref.model_copy(update={"from_": 1}))
    from deltastore.errors import NotFoundError

    with pytest.raises(NotFoundError):
        h.squash(sref.model_copy(update={"key": object_key("3" * 32, sref.sha256, ".squash.json.zst")}))
    assert isinstance(head_i, Head)


def test_history_tolerates_missing_skip_targets() -> None:
    """Skip pointers are hints: with their targets gone, find and chain walk parent links."""
    from deltastore.format.history import History

    store, head, keys, _ = _write_chain(20, name="missing")
    for v in (18, 16, 12, 4):
        store.inner.delete(keys[v])
    h = History(store)
    assert h.find(10, head)[0] == keys[10]
    key, m = h.head_manifest(head)
    assert [x.version for _, x in h.chain(key, m, down_to=19)] == [19, 20]
    from deltastore.errors import NotFoundError

    with pytest.raises(NotFoundError, match="missing"):
        h.chain(key, m, down_to=2)  # version 18 is needed: the parent walk reports it


# --- deltastore inspect ------------------------------------------------------------------------


def test_inspect_schema3(capsys) -> None:
    from deltastore.cli import main
    from deltastore.format.keys import HEAD_KEY

    store, head, keys, layout = _write_chain(6, name="inspect")
    store.inner.put(HEAD_KEY, dump(head))
    url = store.url
    assert main(["inspect", url, "--version", "5"]) == 0
    out = capsys.readouterr().out
    m5 = parse_manifest(store.inner.get(keys[5]), keys[5], layout=layout)
    assert f"manifest        {keys[5]}" in out and "schema          3" in out and "version         5" in out
    assert f"layout          {m5.layout.key}" in out
    for i, name in enumerate(layout.name):
        assert f"[{i}] {name}  {layout.dtype[i]}" in out
    for j, k in enumerate(m5.back, 1):
        assert f"v{5 - 2**j:<12} {k}" in out
    for b in m5.blobs:
        assert f"role {b.role}" in out and b.key in out
    for t in m5.tensors:
        for c in t.chunks:
            assert f"chunk {c.index}  digest {c.digest}" in out
            for seg in (c.delta, c.full):
                if seg is not None:
                    assert f"pack {seg.blob} @ {seg.offset} +{seg.length}  {seg.codec}" in out and seg.sha256 in out
    assert "cum_delta_bytes=3" in out
    assert main(["inspect", url, "--version", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(dump(m5))
    assert main(["inspect", url]) == 0
    assert "version         6" in capsys.readouterr().out
    assert main(["inspect", url, "--version", "99"]) == 1
    assert "version 99" in capsys.readouterr().err


# --- manifests of an earlier format (schemas 1 and 2) ------------------------------------------


def test_a_schema2_manifest_is_refused_as_an_earlier_format(base) -> None:
    """A plain-JSON manifest (schemas 1 and 2, under a ``.json`` key) and a schema-3 manifest
    that links to one are refused with UnsupportedSchemaError naming the object; a ``blobs/``
    pack key is not a pack key (CorruptObjectError)."""
    m, layout, doc = base
    plain = json.dumps({**{k: doc[k] for k in ("version", "kind", "lineage")}, "schema": 2,
                        "format": "deltastore.manifest"}).encode()
    key = "manifests/000000000009-" + sha256_hex(plain) + ".json"
    with pytest.raises(UnsupportedSchemaError, match="earlier format") as e:
        parse_manifest(plain, key, layout=layout)
    assert key in str(e.value)
    for path, link in ((("parent_manifest",), "manifests/000000000008-" + "a" * 64 + ".json"),
                       (("back", 1), "manifests/000000000005-" + "a" * 64 + ".json")):
        data, key = _frame(mutated(doc, path, link))
        with pytest.raises(UnsupportedSchemaError, match="earlier format") as e:
            parse_manifest(data, key, layout=layout)
        assert key in str(e.value) and link in str(e.value)
    data, key = _frame(mutated(doc, ("packs", 0, "key"), "blobs/" + doc["packs"][0]["sha256"][:2] + "/" + doc["packs"][0]["sha256"]))
    with pytest.raises(CorruptObjectError, match="blobs/") as e:
        parse_manifest(data, key, layout=layout)
    assert key in str(e.value)


def test_real_publisher_delta_size(tmp_path) -> None:
    """A MiniLM-shaped model (103 tensors) published by today's publisher, one delta of ~90
    changed chunks: its schema-3 manifest against today's JSON."""
    import torch

    import deltastore
    from deltastore.write.policy import LayoutPolicy, WriterPolicy

    g = torch.Generator().manual_seed(0)
    names = _minilm_names()
    sd = {}
    for n in names:
        if n.endswith("bias") or "LayerNorm" in n:
            sd[n] = torch.randn(384, generator=g).bfloat16()
        elif "word_embeddings" in n:
            sd[n] = torch.randn(3000, 384, generator=g).bfloat16()
        elif "intermediate" in n:
            sd[n] = torch.randn(1536, 384, generator=g).bfloat16()
        elif "output.dense" in n and "attention" not in n:
            sd[n] = torch.randn(384, 1536, generator=g).bfloat16()
        else:
            sd[n] = torch.randn(384, 384, generator=g).bfloat16()
    url = str(tmp_path / "store")
    with deltastore.Publisher(url, writer_policy=WriterPolicy(writer_id="size", threads=1),
                              layout_policy=LayoutPolicy(chunk_bytes=64 * 1024)) as pub:
        pub.publish(sd, step=0)
        changed = 0
        for n in names:  # touch ~90 chunks: one element in one chunk of most tensors
            if changed < 90:
                sd[n].view(-1)[0] += 1
                changed += 1
        pub.publish(sd, step=1)
    from deltastore.format.history import History
    from deltastore.storage import open_store

    history = History(open_store(url))
    head = history.read_head()[0]
    (_akey, anchor), (dkey, delta) = history.chain(head.manifest, history.manifest(head.manifest), down_to=1)
    rows = sum(len(t.chunks) for t in delta.tensors)
    layout = history.layout(anchor.layout)
    data, key = _store(delta, layout)
    assert parse_manifest(data, key, layout=layout) == delta
    assert len(history.store.get(dkey)) == len(data)
    inline = dump(delta)  # the in-memory form as JSON: tensors inline, with names
    assert 60 <= rows <= 140
    assert len(data) < len(inline) / 3, (len(data), len(inline))


def _doc_paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _doc_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield from _doc_paths(v, (*prefix, i))


_weird = (st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.text(max_size=70)
          | st.lists(st.integers(-3, 10**6), max_size=4) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_schema3_manifest_fails_only_with_typed_errors(base, data) -> None:
    """Any field of a schema-3 document replaced by anything: parsing either succeeds (and the
    result passes the SPEC checks) or raises a DeltastoreError naming the manifest."""
    from deltastore.errors import DeltastoreError

    _m, layout, doc = base
    paths = [p for p in _doc_paths(doc) if p]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(_weird)
    bad = mutated(doc, path, value)
    raw = json.dumps(bad, sort_keys=True, separators=(",", ":")).encode()
    blob = zstandard.ZstdCompressor(level=3).compress(raw)
    key = manifest_key(9, sha256_hex(blob))
    try:
        parse_manifest(blob, key, layout=layout)
    except DeltastoreError as e:
        assert key in str(e)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_layout_fails_only_with_typed_errors(base, data) -> None:
    """A hostile layout object: decode_object either refuses it with a typed error naming it,
    or the manifest read with it is refused with a typed error (or still parses)."""
    from deltastore.errors import DeltastoreError

    _m, layout, mdoc = base
    doc = json.loads(dump(layout))
    path = data.draw(st.sampled_from([p for p in _doc_paths(doc) if p]))
    bad = mutated(doc, path, data.draw(_weird))
    blob = zstandard.ZstdCompressor(level=3).compress(json.dumps(bad, sort_keys=True, separators=(",", ":")).encode())
    key = object_key("0" * 32, sha256_hex(blob), ".layout.json.zst")
    try:
        bad = decode_object(Layout, blob, key)
    except DeltastoreError as e:
        assert key in str(e)
        return
    mdata, mkey = _frame(mdoc)
    try:
        parse_manifest(mdata, mkey, layout=bad)
    except DeltastoreError as e:
        assert mkey in str(e)


def test_history_manifest_cache_is_bounded_by_bytes() -> None:
    from deltastore.format.history import PARSED_CHUNK_BYTES, History

    store, head, keys, _ = _write_chain(30, name="cachebytes")
    h = History(store, cache_bytes=40 * PARSED_CHUNK_BYTES)
    key, m = h.head_manifest(head)
    h.chain(key, m, down_to=1)
    held = list(h._manifests.values())
    assert 1 <= len(held) < 30
    assert h._manifest_bytes == sum(8 * 1024 + PARSED_CHUNK_BYTES * sum(len(t.chunks) for t in x.tensors) for x in held)
    assert h._manifest_bytes <= 40 * PARSED_CHUNK_BYTES or len(held) == 1
    h.manifest(keys[3])  # evicted ones are fetched again
    assert list(h._manifests)[-1] == keys[3]


def test_manifest_docs_helpers_round_trip_and_repack() -> None:
    """testkit.manifest_docs: an unchanged in-memory document is stored byte for byte as the
    encoder stores it; dropping chunks repacks so the result is a valid manifest."""
    from testkit.manifest_docs import encode_manifest_doc, read_manifest_doc, write_manifest_doc

    store, head, keys, layout = _write_chain(3, name="docs")
    for v in (1, 2, 3):
        doc = read_manifest_doc(store, keys[v])
        assert encode_manifest_doc(store, doc)[1] == keys[v]
    doc = read_manifest_doc(store, keys[1])
    doc["tensors"] = [t for t in doc["tensors"] if len(t["chunks"]) == 1] + [
        dict(t, chunks=t["chunks"][1:]) for t in doc["tensors"] if len(t["chunks"]) > 1]
    doc["tensors"].sort(key=lambda t: layout.name.index(t["name"]))
    # the packs do not exist in this store: only their sizes follow the dropped chunks
    key = write_manifest_doc(store, doc)
    with pytest.raises(CorruptObjectError, match="anchor lists"):
        parse_manifest(store.inner.get(key), key, layout=layout)
