"""HEAD and manifest documents (SPEC §3–4): round trips, strict typed parsing, and size."""

from __future__ import annotations

import dataclasses
import json
import random
import uuid

import pydantic
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import (
    CorruptObjectError,
    DeltastoreError,
    IntegrityError,
    Publisher,
    UnsupportedSchemaError,
)
from deltastore.format.keys import HEAD_KEY, manifest_key, sha256_hex
from deltastore.format.manifest import encode_manifest, parse_manifest
from deltastore.format.models import Head, Manifest, ObjectRef, dump
from deltastore.format.parse import parse_head
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.manifest_docs import encode_manifest_doc, layout_fetcher, make_layout, make_manifest, read_manifest_doc
from testkit.tensors import small_state, snapshot

PROPS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

hexes = st.text("0123456789abcdef", min_size=64, max_size=64)
lineages = st.text("0123456789abcdef", min_size=32, max_size=32)


@st.composite
def heads(draw) -> Head:
    version = draw(st.integers(0, 10**9))
    digest = None if version == 0 else draw(hexes)  # version 0: a claimed store, no manifest yet
    index = None
    if draw(st.booleans()):
        index = ObjectRef(key=f"objects/{'0' * 32}/{draw(hexes)}.index.json.zst", sha256=draw(hexes))
    return Head(
        version=version,
        manifest=None if digest is None else manifest_key(version, digest),
        manifest_sha256=digest,
        commit_id=draw(st.text(max_size=40)),
        writer=draw(st.text(max_size=40)),
        epoch=draw(st.integers(0, 2**40)),
        updated=draw(st.text(max_size=30)),
        lineage=draw(lineages),
        index=index,
    )


@PROPS
@given(heads())
def test_head_round_trips(h: Head) -> None:
    data = dump(h)
    assert parse_head(data) == h
    assert dump(parse_head(data)) == data
    doc = json.loads(data)
    assert doc["schema"] == h.schema_ == 3 and doc["lineage"] == h.lineage


def test_dump_is_independent_of_key_order() -> None:
    h = Head(version=0, manifest=None, manifest_sha256=None, commit_id="c", writer="w", epoch=0, updated="t", lineage="ab" * 16)
    doc = json.loads(dump(h))
    shuffled = json.dumps(dict(reversed(list(doc.items())))).encode()
    assert dump(parse_head(shuffled)) == dump(h)


# --- documents from a real store --------------------------------------------------------------


def _store_of(objects: dict[str, bytes]):
    """A fresh memory store holding ``objects`` (each test changes its own copy)."""
    store = open_store(f"memory://manifest-{uuid.uuid4().hex}")
    for k, v in objects.items():
        store.put(k, v, mode="overwrite")
    return store


def _published(states: list, **kw) -> dict[str, bytes]:
    url = f"memory://manifest-{uuid.uuid4().hex}"
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(**kw)) as pub:
        for state, options in states:
            pub.publish(state, **options)
        return {m.key: pub.store.get(m.key) for m in pub.store.list("") if not m.key.startswith(".")}


@pytest.fixture(scope="module")
def real() -> dict:
    """A real store's delta manifest (v2: step 5), its bytes, HEAD and every object."""
    s0 = small_state(0)
    s1 = snapshot(s0)
    s1["t0"][0, 0] += 1
    objects = _published([(s0, {"metadata": {"a": [1, 2]}}), (s1, {"step": 5})], chunk_bytes=256)
    head = json.loads(objects[HEAD_KEY])
    return {"objects": objects, "key": head["manifest"], "manifest": objects[head["manifest"]], "head": objects[HEAD_KEY]}


def _parse(store, data: bytes, key: str, expected: str | None = None) -> Manifest:
    return parse_manifest(data, key, expected, layout=layout_fetcher(store))


def _doc(real) -> dict:
    """The real delta as its in-memory JSON document (tensors and blobs inline)."""
    return read_manifest_doc(_store_of(real["objects"]), real["key"])


def _parse_doc(doc: dict, objects: dict[str, bytes]) -> Manifest:
    """``doc`` stored as a writer would store it (columnar, against its layout), then parsed."""
    store = _store_of(objects)
    data, key = encode_manifest_doc(store, doc)
    return _parse(store, data, key)


def _zst(doc: dict) -> tuple[bytes, str]:
    """A columnar document as one zstd frame, and its key (no checks: hostile documents too)."""
    data = zstandard.ZstdCompressor(level=3).compress(json.dumps(doc).encode())
    version = doc.get("version") if type(doc.get("version")) is int and doc["version"] > 0 else 2
    return data, manifest_key(version, sha256_hex(data))


def _columnar(real) -> dict:
    return json.loads(zstandard.ZstdDecompressor().decompress(real["manifest"]))


def test_every_truncated_manifest_is_a_typed_error(real) -> None:
    store = _store_of(real["objects"])
    data, key = real["manifest"], real["key"]
    for n in range(len(data)):
        cut = data[:n]
        with pytest.raises(IntegrityError):  # the content address catches it first
            _parse(store, cut, key)
        rekeyed = manifest_key(2, sha256_hex(cut))
        with pytest.raises(CorruptObjectError) as exc:  # and the parser, if it is re-keyed
            _parse(store, cut, rekeyed)
        assert rekeyed in str(exc.value)


def test_every_truncated_head_is_a_typed_error(real) -> None:
    data = real["head"]
    parse_head(data)
    for n in range(len(data)):
        with pytest.raises(CorruptObjectError, match="HEAD"):
            parse_head(data[:n])


weird = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3) | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)


@PROPS
@given(data=st.data())
def test_mutated_head_parses_or_raises_a_typed_error(real, data) -> None:
    doc = json.loads(real["head"])
    field = data.draw(st.sampled_from(sorted(doc)))
    if data.draw(st.booleans()):
        del doc[field]
    else:
        doc[field] = data.draw(weird)
    try:
        parse_head(json.dumps(doc).encode())
    except DeltastoreError as e:
        assert isinstance(e, (CorruptObjectError, UnsupportedSchemaError)), repr(e)


@pytest.mark.parametrize(
    "why, mutate",
    [
        ("parent not version - 1", lambda d: d.update(parent=d["version"] - 2)),
        ("parent without parent_manifest", lambda d: d.update(parent_manifest=None)),
        ("delta without delta_base", lambda d: d.update(delta_base=None)),
        ("anchor that is not its own anchor", lambda d: d.update(kind="anchor")),
        ("anchor after the version", lambda d: d.update(anchor=d["version"] + 1)),
        ("version 0", lambda d: d.update(version=0)),
        ("unknown kind", lambda d: d.update(kind="snapshot")),
        ("unknown state digest", lambda d: d.update(state_digest="md5")),
        ("wrong format", lambda d: d.update(format="deltastore.head")),
        ("extra field", lambda d: d.update(surprise=1)),
        ("delta chunk without delta", lambda d: d["tensors"][0]["chunks"][0].update(delta=None)),
        ("chunk_rows 0", lambda d: d["tensors"][0].update(chunk_rows=0)),
        ("no lineage", lambda d: d.pop("lineage")),
        ("lineage null", lambda d: d.update(lineage=None)),
    ],
)
def test_inconsistent_manifest_is_corrupt(real, why: str, mutate) -> None:
    """(Segments that do not fill their packs are refused by the columnar checks:
    tests/format/test_manifest_encoding.py HOSTILE.)"""
    doc = _doc(real)
    assert doc["kind"] == "delta"
    mutate(doc)
    with pytest.raises(CorruptObjectError):
        _parse_doc(doc, real["objects"])


@pytest.mark.parametrize("schema", [0, 1, 2, 6, 99, "1", "3", True, None])
def test_other_schemas_are_unsupported(real, schema) -> None:
    store = _store_of(real["objects"])
    raw, key = _zst({**_columnar(real), "schema": schema})
    with pytest.raises(UnsupportedSchemaError, match="schema") as e:
        _parse(store, raw, key)
    assert key in str(e.value)
    with pytest.raises(UnsupportedSchemaError, match="schema"):
        parse_head(json.dumps({**json.loads(real["head"]), "schema": schema}).encode())


def test_writers_write_their_schema_with_one_lineage(real) -> None:
    from deltastore.format.models import HEAD_SCHEMA, SCHEMA_VERSION

    doc, head = _columnar(real), json.loads(real["head"])
    assert doc["schema"] == SCHEMA_VERSION and head["schema"] == HEAD_SCHEMA
    assert len(doc["lineage"]) == 32 and doc["lineage"] == head["lineage"]
    assert doc["signature"] is None


@pytest.mark.parametrize("what", ["manifest", "head"])
@pytest.mark.parametrize("lineage", [None, "", "AB" * 16, "ab" * 15, "ab" * 17, 5])
def test_a_well_formed_lineage_is_required(real, what: str, lineage) -> None:
    doc = _columnar(real) if what == "manifest" else json.loads(real["head"])
    if lineage is None:
        del doc["lineage"]
    else:
        doc["lineage"] = lineage
    with pytest.raises(CorruptObjectError):
        if what == "manifest":
            _parse(_store_of(real["objects"]), *_zst(doc))
        else:
            parse_head(json.dumps(doc).encode())


def test_manifest_digest_must_match_key_and_head(real) -> None:
    store = _store_of(real["objects"])
    data, key = real["manifest"], real["key"]
    _parse(store, data, key, sha256_hex(data))
    with pytest.raises(IntegrityError, match=key):
        _parse(store, data, key, "0" * 64)
    with pytest.raises(IntegrityError):
        _parse(store, data + b" ", key)


# --- manifests grow with what changed ---------------------------------------------------------


def test_delta_manifest_lists_only_what_changed() -> None:
    url = f"memory://manifest-size-{uuid.uuid4().hex}"
    state = {f"layer{i:04d}.weight": torch.full((4, 4), float(i), dtype=torch.bfloat16) for i in range(2000)}
    state["big"] = torch.zeros(4096, 8, dtype=torch.bfloat16)
    with Publisher(url, writer_policy=WriterPolicy(threads=2, skip_unchanged=False),
                   layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=False)) as pub:
        a = pub.publish(state)
        store = pub.store
        anchor_size = len(json.dumps(read_manifest_doc(store, a.manifest)))  # the anchor lists all 2001 tensors
        nxt = dict(state)
        nxt["layer1234.weight"] = state["layer1234.weight"].clone()
        nxt["layer1234.weight"][1, 2] = 7.0
        nxt["big"] = state["big"].clone()
        nxt["big"][3000, 5] = 1.0  # one chunk of a 64-chunk tensor
        d = pub.publish(nxt)
        data = store.get(d.manifest)
        doc = read_manifest_doc(store, d.manifest)
        assert d.kind == "delta"
        assert [t["name"] for t in doc["tensors"]] == ["layer1234.weight", "big"]
        big = doc["tensors"][1]
        assert [c["index"] for c in big["chunks"]] == [3000 // big["chunk_rows"]]
        assert len(data) < 3000, len(data)
        assert anchor_size > 100 * len(data)
        assert (d.tensors_changed, d.elements_changed) == (2, 2)
        assert doc["stats"]["tensors_total"] == 2001
        assert doc["stats"]["bytes_stored"] == sum(b["size"] for b in doc["blobs"])
        # An unchanged publish: an empty delta manifest.
        e = pub.publish(nxt)
        assert read_manifest_doc(store, e.manifest)["tensors"] == [] and len(store.get(e.manifest)) < 1000
        # skip_unchanged (the default): the same state again commits nothing and writes no object.
        pub.writer_policy = dataclasses.replace(pub.writer_policy, skip_unchanged=True)
        before = {o.key for o in store.list("")}
        again = pub.publish(nxt)
        assert again.version == e.version and {o.key for o in store.list("")} == before


def test_real_manifest_fields(real) -> None:
    doc = _doc(real)
    head = json.loads(real["head"])
    assert head["manifest"] == real["key"] and head["manifest_sha256"] == sha256_hex(real["manifest"])
    assert head["version"] == doc["version"] == 2 and head["commit_id"] == doc["commit_id"]
    assert (doc["parent"], doc["kind"], doc["anchor"], doc["delta_base"], doc["step"]) == (1, "delta", 1, 1, 5)
    assert doc["parent_manifest"].startswith("manifests/000000000001-") and doc["parent_manifest"].endswith(".json.zst")
    assert doc["state_digest"] == "xxh3-128" and doc["created"].endswith("Z")
    for b in doc["blobs"]:
        assert b["key"] == f"objects/{doc['commit_id']}/{b['sha256']}.pack" and b["role"] in ("f", "d")


# --- hostile manifests: every structural lie is a CorruptObjectError naming the object --------


@pytest.fixture(scope="module")
def anchor() -> dict:
    """A real anchor manifest with a multi-chunk tensor, a 0-d tensor and an empty tensor: its
    in-memory document and the store's objects."""
    state = {
        "w": torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    objects = _published([(state, {})], chunk_bytes=512)
    key = json.loads(objects[HEAD_KEY])["manifest"]
    doc = read_manifest_doc(_store_of(objects), key)
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert len(w["chunks"]) == 4 and doc["kind"] == "anchor"
    return {"doc": doc, "objects": objects}


def _w(doc: dict) -> dict:
    return next(t for t in doc["tensors"] if t["name"] == "w")


def test_real_anchor_parses(anchor) -> None:
    m = _parse_doc(anchor["doc"], anchor["objects"])
    assert {t.name: len(t.chunks) for t in m.tensors} == {"w": 4, "scalar": 1, "empty": 1}


@pytest.mark.parametrize(
    "why, mutate, named",
    [
        ("chunk index past the last chunk", lambda d: _w(d)["chunks"][3].update(index=4), "w"),
        # out of (tensor, chunk) order: the columnar table refuses the row before the tensor is known
        ("chunk index far out of range", lambda d: _w(d)["chunks"][1].update(index=10**6), None),
        ("duplicate chunk index", lambda d: _w(d)["chunks"][1].update(index=0), None),
        ("anchor lacks a chunk", lambda d: _w(d).update(chunks=_w(d)["chunks"][:3]), "w"),
        ("0-d tensor with chunk 1", lambda d: next(t for t in d["tensors"] if t["name"] == "scalar")["chunks"][0].update(index=1), "scalar"),
        ("empty tensor with chunk 1", lambda d: next(t for t in d["tensors"] if t["name"] == "empty")["chunks"][0].update(index=1), "empty"),
        ("negative dimension", lambda d: _w(d).update(shape=[-64, 8]), "w"),
        ("huge dimension", lambda d: _w(d).update(shape=[2**70, 8]), "w"),
        ("element count overflows int64", lambda d: _w(d).update(shape=[2**40, 2**40]), "w"),
        ("dtype __class__", lambda d: _w(d).update(dtype="__class__"), "w"),
        ("dtype Tensor", lambda d: _w(d).update(dtype="Tensor"), "w"),
        ("quantized dtype", lambda d: _w(d).update(dtype="qint8"), "w"),
        ("n_changed above the chunk's elements", lambda d: _w(d)["chunks"][0]["full"].update(n_changed=16 * 8 + 1), "w"),
        ("huge epoch", lambda d: d.update(epoch=2**63), None),
        ("huge step", lambda d: d.update(step=-(2**63) - 1), None),
    ],
)
def test_structurally_impossible_anchor_is_corrupt(anchor, why: str, mutate, named: str | None) -> None:
    """D8/D11: chunk indices, shapes, dtypes and numbers are checked before any planning (a
    tensor listed twice cannot be said in a columnar table; offsets and pack sizes follow from
    the fill rule: tests/format/test_manifest_encoding.py HOSTILE)."""
    doc = json.loads(json.dumps(anchor["doc"]))
    mutate(doc)
    store = _store_of(anchor["objects"])
    data, key = encode_manifest_doc(store, doc)
    with pytest.raises(CorruptObjectError) as exc:
        _parse(store, data, key)
    assert key in str(exc.value) or "layout" in str(exc.value)
    if named:
        assert repr(named) in str(exc.value) or f"{named}[" in str(exc.value), str(exc.value)


def test_delta_whose_anchor_is_itself_is_corrupt(real) -> None:
    doc = _doc(real)
    doc["anchor"] = doc["version"]
    with pytest.raises(CorruptObjectError):
        _parse_doc(doc, real["objects"])


def test_manifest_key_must_carry_its_version(real) -> None:
    """D12: the key's version prefix is part of the address; a manifest filed under another
    version's key (a parent link that skips one) is corrupt."""
    store = _store_of(real["objects"])
    data = real["manifest"]
    digest = sha256_hex(data)
    _parse(store, data, manifest_key(2, digest))
    for key in (manifest_key(3, digest), manifest_key(1, digest), f"manifests/x-{digest}.json.zst",
                f"objects/{'0' * 32}/{digest}.pack"):
        with pytest.raises(CorruptObjectError, match="version|manifest key"):
            _parse(store, data, key)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # RecursionError in json
        '{"a":' * 5_000 + "1" + "}" * 5_000,
        "1" * 5_000,  # ValueError: int max str digits
        '{"schema": 3, "version": ' + "9" * 5_000 + "}",
    ],
    ids=["deep-list", "deep-object", "long-int", "long-int-field"],
)
def test_hostile_json_is_corrupt_not_a_python_error(text: str) -> None:
    data = text.encode()
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(data)
    frame = zstandard.ZstdCompressor(level=3).compress(data)
    with pytest.raises(CorruptObjectError):
        parse_manifest(frame, manifest_key(1, sha256_hex(frame)), layout=lambda ref: pytest.fail("no layout is read"))


def test_deep_metadata_is_corrupt(real) -> None:
    doc = _columnar(real)
    deep: dict = {}
    node = deep
    for _ in range(500):  # parses, but would break json.dumps / pydantic further down
        node["x"] = {}
        node = node["x"]
    doc["metadata"] = deep
    with pytest.raises(CorruptObjectError, match="nested"):
        _parse(_store_of(real["objects"]), *_zst(doc))


@pytest.mark.parametrize("field, value", [("version", 2**63), ("epoch", 2**64), ("version", -1)])
def test_head_numbers_are_bounded(real, field: str, value: int) -> None:
    doc = json.loads(real["head"])
    doc[field] = value
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(json.dumps(doc).encode())


def test_head_over_the_size_cap_is_corrupt(real) -> None:
    from deltastore.format.parse import MAX_HEAD_BYTES

    doc = json.loads(real["head"])
    doc["writer"] = "w" * MAX_HEAD_BYTES
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(json.dumps(doc).encode())


@pytest.mark.parametrize("manifest, sha, version", [
    ("", "0" * 64, 1),                                                       # the empty key
    ("manifests/../HEAD", "0" * 64, 1),                                      # escapes manifests/
    ("manifests/000000000002-" + "a" * 64 + ".json.zst", "a" * 64, 1),      # another version's key
    ("manifests/000000000001-" + "a" * 64 + ".json.zst", "b" * 64, 1),      # digest disagrees
    ("manifests/000000000001-" + "a" * 64 + ".json", "a" * 64, 1),          # not a manifest key
    (None, None, 3),                                                         # no manifest, version 3
])  # fmt: skip
def test_head_must_name_a_well_formed_manifest_key(manifest, sha, version):
    doc = {"format": "deltastore.head", "schema": 3, "version": version, "manifest": manifest,
           "manifest_sha256": sha, "commit_id": "c", "writer": "w", "epoch": 1, "updated": "t",
           "lineage": "0" * 32}
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(json.dumps(doc).encode())


def test_table_entries_are_built_as_model_construct_builds_them() -> None:
    """The read path builds chunk-table entries without pydantic's per-call field walk; with
    this pydantic that shortcut must build exactly what ``model_construct`` builds (else the
    import-time check turns it off, and this test says so)."""
    from deltastore.format import models as mf
    from deltastore.format import tables

    assert tables._FAST_CONSTRUCT, "the fast entry constructor was turned off for this pydantic"
    seg = dict(blob=1, offset=4096, length=77, sha256="ab" * 32, codec="add-sparse/1", n_changed=5)
    for cls, values in [
        (mf.SegmentRef, seg),
        (mf.ChunkEntry, dict(index=3, digest="cd" * 16, full=None, delta=mf.SegmentRef.model_construct(**seg))),
        (mf.TensorEntry, dict(name="w", dtype="bfloat16", shape=(4, 8), chunk_rows=2, chunks=())),
    ]:
        fast, slow = tables.unchecked_entry(cls, **values), cls.model_construct(**values)
        assert type(fast) is cls
        assert fast == slow and hash(fast) == hash(slow)
        assert fast.model_dump() == slow.model_dump() and fast.model_dump_json() == slow.model_dump_json()
        assert fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__
        with pytest.raises(pydantic.ValidationError):  # still frozen
            fast.__setattr__(next(iter(values)), values[next(iter(values))])


def test_table_entries_share_one_fields_set_that_nothing_changes() -> None:
    """Entries naming every field share their class's fields-set (one object for the collector
    to track, not one per entry): copies, updates and pickling must leave it as it was."""
    import copy
    import pickle

    from deltastore.format import models as mf
    from deltastore.format import tables

    seg = dict(blob=1, offset=4096, length=77, sha256="ab" * 32, codec="add-sparse/1", n_changed=5)
    a, b = tables.unchecked_entry(mf.SegmentRef, **seg), tables.unchecked_entry(mf.SegmentRef, **{**seg, "offset": 0})
    shared = a.__pydantic_fields_set__
    assert shared is b.__pydantic_fields_set__ and shared == set(mf.SegmentRef.model_fields)
    before = set(shared)
    moved = a.model_copy(update={"offset": 5})
    assert moved.offset == 5 and a.offset == 4096 and moved.__pydantic_fields_set__ is not shared
    deep = copy.deepcopy(b)
    assert deep == b and deep.__pydantic_fields_set__ is not shared
    back = pickle.loads(pickle.dumps(a))
    assert back == a and back.__pydantic_fields_set__ is not shared
    with pytest.raises(pydantic.ValidationError):  # frozen: no assignment adds to the set
        a.offset = 1
    assert shared == before and b.model_fields_set == before
    # not every field named: a set of its own, as model_construct gives
    part = tables._fast_construct(mf.SegmentRef, {"blob": 1})
    assert part.__pydantic_fields_set__ == {"blob"} and part.__pydantic_fields_set__ is not shared


# --- the writer's self-check -----------------------------------------------------------------


def _round_trip_returns(m: Manifest, layout) -> bool:
    """The reference for encode_manifest's check: decode the document, check it as a reader
    does, and compare canonical JSON."""
    import deltastore.format.manifest as mf
    from deltastore.format.checks import check_manifest

    raw = json.dumps(mf._manifest_doc(m, layout), sort_keys=True, separators=(",", ":")).encode()
    try:
        back = mf._manifest_from_doc(json.loads(raw), layout, "<reference>")
        check_manifest(back, "<reference>")
    except CorruptObjectError:
        return False
    return dump(back) == dump(m)


def _seg(m: Manifest, pick: int) -> tuple[int, int, str] | None:
    """(tensor, chunk, role) of the ``pick``-th segment of ``m`` (modulo their number)."""
    found = [(ti, ci, role) for ti, t in enumerate(m.tensors) for ci, c in enumerate(t.chunks)
             for role, s in (("full", c.full), ("delta", c.delta)) if s is not None]
    return found[pick % len(found)] if found else None


def _with_chunk(m: Manifest, ti: int, ci: int, **update) -> Manifest:
    t = m.tensors[ti]
    chunks = list(t.chunks)
    chunks[ci] = chunks[ci].model_copy(update=update)
    tensors = list(m.tensors)
    tensors[ti] = t.model_copy(update={"chunks": tuple(chunks)})
    return m.model_copy(update={"tensors": tuple(tensors)})


def _with_segment(m: Manifest, pick: int, **update) -> Manifest:
    where = _seg(m, pick)
    if where is None:
        return m
    ti, ci, role = where
    seg = getattr(m.tensors[ti].chunks[ci], role)
    return _with_chunk(m, ti, ci, **{role: seg.model_copy(update=update)})


def _with_tensor(m: Manifest, pick: int, **update) -> Manifest:
    if not m.tensors:
        return m
    tensors = list(m.tensors)
    ti = pick % len(tensors)
    tensors[ti] = tensors[ti].model_copy(update=update)
    return m.model_copy(update={"tensors": tuple(tensors)})


def _split(m: Manifest, pick: int) -> Manifest:
    """One tensor listed as two entries (its chunks cut in two runs)."""
    many = [i for i, t in enumerate(m.tensors) if len(t.chunks) > 1]
    if not many:
        return m
    t = m.tensors[many[pick % len(many)]]
    i = m.tensors.index(t)
    a, b = t.model_copy(update={"chunks": t.chunks[:1]}), t.model_copy(update={"chunks": t.chunks[1:]})
    return m.model_copy(update={"tensors": m.tensors[:i] + (a, b) + m.tensors[i + 1:]})


# Each returns a manifest that model_copy built without validation: what a buggy writer
# (or compaction, or a caller of the library) could hand to encode_manifest.
_MUTATIONS = {
    "none": lambda m, k: m,
    "reversed tensors": lambda m, k: m.model_copy(update={"tensors": tuple(reversed(m.tensors))}),
    "a tensor twice": lambda m, k: m.model_copy(update={"tensors": m.tensors + m.tensors[-1:]}),
    "a tensor dropped": lambda m, k: m.model_copy(update={"tensors": m.tensors[:-1]}),
    "a tensor without chunks": lambda m, k: _with_tensor(m, k, chunks=()),
    "a tensor in two runs": _split,
    "chunks reversed": lambda m, k: _with_tensor(m, k, chunks=tuple(reversed(m.tensors[k % len(m.tensors)].chunks)) if m.tensors else ()),
    "chunks as a list": lambda m, k: _with_tensor(m, k, chunks=list(m.tensors[k % len(m.tensors)].chunks) if m.tensors else ()),
    "another dtype": lambda m, k: _with_tensor(m, k, dtype="float64"),
    "another shape": lambda m, k: _with_tensor(m, k, shape=(7, 7, 7)),
    "shape as bools": lambda m, k: _with_tensor(m, k, shape=tuple(bool(d) if d in (0, 1) else d for d in m.tensors[k % len(m.tensors)].shape) if m.tensors else ()),
    "chunk_rows as float": lambda m, k: _with_tensor(m, k, chunk_rows=float(m.tensors[k % len(m.tensors)].chunk_rows) if m.tensors else 1),
    "segment offset + 1": lambda m, k: _with_segment(m, k, offset=_seg(m, k) and getattr(m.tensors[_seg(m, k)[0]].chunks[_seg(m, k)[1]], _seg(m, k)[2]).offset + 1),
    "segment blob + 1": lambda m, k: _with_segment(m, k, blob=_seg(m, k) and getattr(m.tensors[_seg(m, k)[0]].chunks[_seg(m, k)[1]], _seg(m, k)[2]).blob + 1),
    "segment offset as bool": lambda m, k: _with_segment(m, k, offset=False),
    "segment blob as bool": lambda m, k: _with_segment(m, k, blob=False),
    "segment n_changed as bool": lambda m, k: _with_segment(m, k, n_changed=False),
    "segment length as float": lambda m, k: _with_segment(m, k, length=float(_seg(m, k) and getattr(m.tensors[_seg(m, k)[0]].chunks[_seg(m, k)[1]], _seg(m, k)[2]).length or 0)),
    "segment sha256 upper case": lambda m, k: _with_segment(m, k, sha256="AB" * 32),
    "segment codec renamed": lambda m, k: _with_segment(m, k, codec="other/9"),
    "chunk index as bool": lambda m, k: _with_chunk(m, k % len(m.tensors), 0, index=False) if m.tensors else m,
    "chunk index + 100": lambda m, k: _with_chunk(m, k % len(m.tensors), 0, index=m.tensors[k % len(m.tensors)].chunks[0].index + 100) if m.tensors and m.tensors[k % len(m.tensors)].chunks else m,
    "chunk digest upper case": lambda m, k: _with_chunk(m, k % len(m.tensors), 0, digest="CD" * 16) if m.tensors and m.tensors[k % len(m.tensors)].chunks else m,
    "full and delta swapped": lambda m, k: _with_chunk(m, k % len(m.tensors), 0, full=m.tensors[k % len(m.tensors)].chunks[0].delta, delta=m.tensors[k % len(m.tensors)].chunks[0].full) if m.tensors and m.tensors[k % len(m.tensors)].chunks else m,
    "a pack one byte longer": lambda m, k: m.model_copy(update={"blobs": tuple(b.model_copy(update={"size": b.size + 1}) for b in m.blobs)}),
    "packs reversed": lambda m, k: m.model_copy(update={"blobs": tuple(reversed(m.blobs))}),
    "version as bool": lambda m, k: m.model_copy(update={"version": True}),
    "metadata with a tuple": lambda m, k: m.model_copy(update={"metadata": {"tags": ("a", "b")}}),
    "metadata with a float": lambda m, k: m.model_copy(update={"metadata": {"lr": 1.0}}),
    "step as bool": lambda m, k: m.model_copy(update={"step": True}),
    "a delta without delta_base": lambda m, k: m.model_copy(update={"delta_base": None}),
}


#: Damage the round trip let through and encode_manifest refuses: a bool where the decoder
#: builds an int, in a field the document does not carry (a segment's pack and offset follow
#: from the fill rule, a tensor's shape comes from the layout). pydantic writes ``False`` there
#: as ``0``, so the canonical JSON of the decoded manifest matched; encode_manifest compares
#: values with their types and refuses it, since decoding does not return those objects (a
#: writer never builds them).
_REFUSED_BY_TYPE_ONLY = {"segment offset as bool", "segment blob as bool", "shape as bools"}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), n_tensors=st.integers(1, 12), kind=st.sampled_from(["anchor", "delta"]),
       mutation=st.sampled_from(sorted(_MUTATIONS)), pick=st.integers(0, 1000))
def test_encode_check_agrees_with_the_round_trip(seed, n_tensors, kind, mutation, pick) -> None:
    """encode_manifest proves without building the decoded manifest that its bytes decode to
    exactly ``m``: for valid manifests and for every kind of damage a writer could do, it
    refuses what the full round trip (decode, reader's checks, canonical JSON compared)
    refuses, accepts what it accepts (but for values of another type than the decoder's), and
    what it accepts parses back to ``m`` byte for byte."""
    rng = random.Random(seed)
    layout = make_layout(rng, n_tensors)
    m = make_manifest(rng, layout, kind=kind, changed=0.5, with_delta=rng.random() < 0.5, max_pack_segments=4)
    m = _MUTATIONS[mutation](m, pick)
    try:
        reference = _round_trip_returns(m, layout)
    except (ValueError, TypeError) as e:  # before any check: not in the layout, not JSON
        with pytest.raises(type(e)):
            encode_manifest(m, layout)
        return
    try:
        data = encode_manifest(m, layout)
    except ValueError as e:
        assert "cannot be encoded" in str(e) or "canonical" in str(e)
        assert not reference or mutation in _REFUSED_BY_TYPE_ONLY, f"refused what the round trip accepts: {e}"
        return
    assert reference, "accepted what the round trip refuses"
    key = manifest_key(m.version, sha256_hex(data))
    assert dump(parse_manifest(data, key, layout=layout)) == dump(m)
    if mutation == "none":
        assert parse_manifest(data, key, layout=layout) == m


@pytest.mark.parametrize("store_name", ["store-schema3", "store-schema4", "store-grid", "store-sharded",
                                        "store-sharded-grid", "store-federated/site-a"])
def test_the_writers_check_accepts_exactly_the_entries_the_reader_builds(store_name: str) -> None:
    """Both walk the chunk rows by one function (_row_entries): on every manifest of
    the golden stores (a sharded version's joined parts too), the entries the reader builds
    pass the writer's check, and any one of them changed does not."""
    from pathlib import Path

    import deltastore.format.manifest as mf
    from deltastore.format.models import Layout
    from deltastore.format.objects import decode_object
    from deltastore.storage import open_store

    root = Path(__file__).resolve().parents[1] / "golden" / store_name
    store = open_store(str(root))
    keys = [str(f.relative_to(root)) for f in sorted(root.glob("manifests/*.json.zst"))]
    assert keys
    for key in keys:
        doc = json.loads(zstandard.ZstdDecompressor().decompress(store.get(key)))
        lref = doc["layout"]
        layout = decode_object(Layout, store.get(lref["key"]), lref["key"], lref["sha256"])
        def fetch(ref, store=store):
            return store.get(ref.key)

        built = mf._manifest_from_doc(json.loads(json.dumps(doc)), layout, key, fetch)
        _, rows = mf._decode_tables(json.loads(json.dumps(doc)), layout, key, fetch)
        assert built.tensors and mf._entries_differ(built.tensors, rows, layout) is None, key
        t = built.tensors[-1]
        c = t.chunks[-1]
        for changed in (t.model_copy(update={"chunks": t.chunks[:-1]}),
                        t.model_copy(update={"chunks": t.chunks[:-1] + (c.model_copy(update={"digest": "0" * 32}),)}),
                        t.model_copy(update={"name": t.name + "x"})):
            assert mf._entries_differ(built.tensors[:-1] + (changed,), rows, layout) is not None, key
        assert mf._entries_differ(built.tensors[:-1], rows, layout) is not None, key
