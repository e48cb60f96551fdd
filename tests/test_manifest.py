"""HEAD and manifest documents (SPEC §3–4): round trips, strict typed parsing, and size."""

from __future__ import annotations

import dataclasses
import json
import random
import uuid

import pydantic
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import (
    CorruptObjectError,
    DeltastoreError,
    IntegrityError,
    Publisher,
    UnsupportedSchemaError,
)
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from deltastore.format.manifest import (
    HEAD_KEY,
    BlobRef,
    ChunkEntry,
    Head,
    Manifest,
    SegmentRef,
    Stats,
    TensorEntry,
    blob_key,
    chunk_count,
    chunk_elements,
    digest_from_key,
    dump,
    encode_manifest,
    manifest_key,
    parse_head,
    parse_manifest,
    sha256_hex,
)
from tests._helpers import small_state, snapshot
from tests.test_schema3 import make_layout, make_manifest


def _key(version: int, digest: str) -> str:
    """The key of a schema-1/2 (plain JSON) manifest: what these tests parse and mutate."""
    return manifest_key(version, digest, schema=2)


def _store_copy_as_schema2(store) -> dict[str, bytes | str]:
    """HEAD's manifest and HEAD as a schema-2 publisher stored them: the bytes themselves when
    the publisher wrote schema 2, else the same version re-expressed as schema 2 (inline
    tensors, ``blobs/`` keys, no schema-3 fields), so that these JSON tests do not depend on the
    schema the publisher writes."""
    from deltastore.format.history import History

    history = History(store)
    head = history.read_head()[0]
    m = history.manifest(head.manifest)
    if m.schema_ < 3:
        return {"key": head.manifest, "manifest": store.get(head.manifest), "head": store.get(HEAD_KEY),
                "written_schema": m.schema_, "written_head_schema": head.schema_}
    fields = ("version", "parent", "kind", "anchor", "delta_base", "step", "created", "writer", "epoch", "commit_id",
              "metadata", "lineage", "tensors", "signature")
    m2 = Manifest(
        schema=2, **{k: getattr(m, k) for k in fields},
        parent_manifest=None if m.parent is None else _key(m.parent, digest_from_key(m.parent_manifest)),
        blobs=tuple(BlobRef(key=blob_key(b.sha256), size=b.size, sha256=b.sha256) for b in m.blobs),
        stats=m.stats.model_copy(update={"delta_bytes": None, "full_bytes": None, "cum_delta_bytes": None}),
    )
    data = dump(m2)
    key = _key(m2.version, sha256_hex(data))
    head2 = Head(schema=2, version=head.version, manifest=key, manifest_sha256=sha256_hex(data), commit_id=head.commit_id,
                 writer=head.writer, epoch=head.epoch, updated=head.updated, lineage=head.lineage)
    return {"key": key, "manifest": data, "head": dump(head2), "written_schema": m.schema_, "written_head_schema": head.schema_}


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hexes = st.text("0123456789abcdef", min_size=64, max_size=64)
lineages = st.text("0123456789abcdef", min_size=32, max_size=32)
names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


@st.composite
def manifests(draw) -> Manifest:
    """Manifests that satisfy every SPEC §3 invariant (so parse_manifest must accept them)."""
    version = draw(st.integers(1, 10**9))
    has_parent = version > 1 and draw(st.booleans())
    kind = "delta" if has_parent and draw(st.booleans()) else "anchor"
    if kind == "delta":
        has_parent = True
    parent = version - 1 if has_parent else None
    anchor = version if kind == "anchor" else draw(st.integers(1, version - 1))
    delta_base = parent if kind == "delta" else (parent if has_parent and draw(st.booleans()) else None)
    blob_sizes = draw(st.lists(st.integers(0, 10**6), min_size=0, max_size=3))
    blobs = tuple(BlobRef(key=blob_key(h), size=s, sha256=h) for h, s in zip(draw(st.lists(hexes, min_size=len(blob_sizes), max_size=len(blob_sizes))), blob_sizes))

    def seg(elements: int):
        if not blobs:
            return None
        b = draw(st.integers(0, len(blobs) - 1))
        size = blobs[b].size
        off = draw(st.integers(0, size))
        length = draw(st.integers(0, size - off))
        return SegmentRef(blob=b, offset=off, length=length, sha256=draw(hexes),
                          codec=draw(st.sampled_from(["full/1", "xor-sparse/1", "xor-dense/1"])),
                          n_changed=draw(st.integers(0, elements)))  # fmt: skip

    tensors = []
    if blobs:
        for name in draw(st.lists(names, max_size=3, unique=True)):
            shape = tuple(draw(st.lists(st.integers(0, 10**5), max_size=3)))
            if kind == "anchor":  # an anchor lists every chunk: keep their number small
                n = draw(st.integers(1, 3))
                rows = max(1, -(-shape[0] // n)) if shape else draw(st.integers(1, 10**6))
            else:
                rows = draw(st.integers(1, 10**6))
            n_chunks = chunk_count(shape, rows)
            indices = range(n_chunks) if kind == "anchor" else sorted(draw(st.sets(st.integers(0, min(n_chunks, 51) - 1), min_size=1, max_size=3)))
            chunks = []
            for idx in indices:
                elements = chunk_elements(shape, rows, idx)
                full = seg(elements) if kind == "anchor" else None
                delta = seg(elements) if delta_base is not None and (kind == "delta" or draw(st.booleans())) else None
                chunks.append(ChunkEntry(index=idx, digest=draw(st.text("0123456789abcdef", min_size=32, max_size=32)), full=full, delta=delta))
            tensors.append(TensorEntry(name=name, dtype=draw(st.sampled_from(["bfloat16", "float32", "int64", "bool"])),
                                       shape=shape, chunk_rows=rows, chunks=tuple(chunks)))  # fmt: skip
    return Manifest(
        version=version,
        parent=parent,
        parent_manifest=_key(parent, draw(hexes)) if parent else None,
        kind=kind,
        anchor=anchor,
        delta_base=delta_base,
        step=draw(st.none() | st.integers(-(2**62), 2**62)),
        created=draw(st.text(max_size=30)),
        writer=draw(st.text(max_size=30)),
        epoch=draw(st.integers(0, 2**40)),
        commit_id=draw(st.text(max_size=40)),
        metadata=draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
        blobs=blobs,
        tensors=tuple(tensors),
        stats=Stats(**{f: draw(st.integers(0, 2**50)) for f in Stats.model_fields}),
        **_schema_fields(draw),
    )


def _schema_fields(draw) -> dict:
    """Schema 1 (no lineage; what older releases wrote) or schema 2 (lineage required)."""
    if draw(st.booleans()):
        return {"schema_": 1}
    return {"schema_": 2, "lineage": draw(lineages)}


@st.composite
def heads(draw) -> Head:
    version = draw(st.integers(0, 10**9))
    digest = None if version == 0 else draw(hexes)  # version 0: a claimed store, no manifest yet
    return Head(
        version=version,
        manifest=None if digest is None else _key(version, digest),
        manifest_sha256=digest,
        commit_id=draw(st.text(max_size=40)),
        writer=draw(st.text(max_size=40)),
        epoch=draw(st.integers(0, 2**40)),
        updated=draw(st.text(max_size=30)),
        **_schema_fields(draw),
    )


@PROPS
@given(manifests())
def test_manifest_round_trips(m: Manifest) -> None:
    data = dump(m)
    digest = sha256_hex(data)
    key = _key(m.version, digest)
    assert digest_from_key(key) == digest
    back = parse_manifest(data, key, digest)
    assert back == m
    assert dump(back) == data, "dump is canonical"
    doc = json.loads(data)
    assert doc["schema"] == m.schema_ and doc["format"] == "deltastore.manifest" and doc["parts"] == []
    if m.schema_ == 1:
        assert "lineage" not in doc and "signature" not in doc, "schema-1 bytes as schema 1 wrote them"
    else:
        assert doc["lineage"] == m.lineage and doc["signature"] is None


@PROPS
@given(heads())
def test_head_round_trips(h: Head) -> None:
    data = dump(h)
    assert parse_head(data) == h
    assert dump(parse_head(data)) == data
    doc = json.loads(data)
    assert doc["schema"] == h.schema_
    assert ("lineage" in doc) == (h.schema_ == 2)


def test_dump_is_independent_of_key_order() -> None:
    h = Head(version=0, manifest=None, manifest_sha256=None, commit_id="c", writer="w", epoch=0, updated="t", lineage="ab" * 16)
    doc = json.loads(dump(h))
    shuffled = json.dumps(dict(reversed(list(doc.items())))).encode()
    assert dump(parse_head(shuffled)) == dump(h)


# --- documents from a real store --------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> dict[str, bytes | str]:
    url = f"memory://manifest-{uuid.uuid4().hex}"
    s0 = small_state(0)
    s1 = snapshot(s0)
    s1["t0"][0, 0] += 1
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=256)) as pub:
        pub.publish(s0, metadata={"a": [1, 2]})
        pub.publish(s1, step=5)
        return _store_copy_as_schema2(pub.store)


def test_every_truncated_manifest_is_a_typed_error(real) -> None:
    data, key = real["manifest"], real["key"]
    for n in range(len(data)):
        cut = data[:n]
        with pytest.raises(IntegrityError):  # the content address catches it first
            parse_manifest(cut, key)
        rekeyed = _key(2, sha256_hex(cut))
        with pytest.raises(CorruptObjectError) as exc:  # and the parser, if it is re-keyed
            parse_manifest(cut, rekeyed)
        assert rekeyed in str(exc.value)


def test_every_truncated_head_is_a_typed_error(real) -> None:
    data = real["head"]
    parse_head(data)
    for n in range(len(data)):
        with pytest.raises(CorruptObjectError, match="HEAD"):
            parse_head(data[:n])


def _rekey(doc: dict) -> tuple[bytes, str]:
    data = json.dumps(doc).encode()
    return data, _key(2, sha256_hex(data))


weird = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3) | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@PROPS
@given(data=st.data())
def test_mutated_manifest_parses_or_raises_a_typed_error(real, data) -> None:
    """Whatever a damaged or foreign manifest holds, the parser raises only our errors."""
    doc = json.loads(real["manifest"])
    paths = [p for p in _paths(doc) if p]
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    action = data.draw(st.sampled_from(["delete", "replace", "extra"]))
    if action == "delete":
        del parent[path[-1]]
    elif action == "replace":
        parent[path[-1]] = data.draw(weird)
    elif isinstance(parent, dict):
        parent[data.draw(st.text(min_size=1, max_size=4))] = data.draw(weird)
    raw, key = _rekey(doc)
    try:
        m = parse_manifest(raw, key)
    except DeltastoreError as e:
        assert isinstance(e, (CorruptObjectError, UnsupportedSchemaError)), repr(e)
        assert key in str(e)
    else:
        assert isinstance(m, Manifest)


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


def _doc(real) -> dict:
    return json.loads(real["manifest"])


@pytest.mark.parametrize(
    "why, mutate",
    [
        ("parent not version - 1", lambda d: d.update(parent=d["version"] - 2)),
        ("parent without parent_manifest", lambda d: d.update(parent_manifest=None)),
        ("delta without delta_base", lambda d: d.update(delta_base=None)),
        ("anchor that is not its own anchor", lambda d: d.update(kind="anchor")),
        ("anchor after the version", lambda d: d.update(anchor=d["version"] + 1)),
        ("version 0", lambda d: d.update(version=0)),
        ("parts in schema 1", lambda d: d.update(parts=[{"key": "x"}])),
        ("unknown kind", lambda d: d.update(kind="snapshot")),
        ("unknown state digest", lambda d: d.update(state_digest="md5")),
        ("wrong format", lambda d: d.update(format="deltastore.head")),
        ("extra field", lambda d: d.update(surprise=1)),
        ("delta chunk without delta", lambda d: d["tensors"][0]["chunks"][0].update(delta=None)),
        ("segment names a missing blob", lambda d: d["tensors"][0]["chunks"][0]["delta"].update(blob=9)),
        ("segment past the end of its blob", lambda d: d["tensors"][0]["chunks"][0]["delta"].update(offset=10**9)),
        ("negative length", lambda d: d["tensors"][0]["chunks"][0]["delta"].update(length=-1)),
        ("chunk_rows 0", lambda d: d["tensors"][0].update(chunk_rows=0)),
    ],
)
def test_inconsistent_manifest_is_corrupt(real, why: str, mutate) -> None:
    doc = _doc(real)
    assert doc["kind"] == "delta"
    mutate(doc)
    raw, key = _rekey(doc)
    with pytest.raises(CorruptObjectError):
        parse_manifest(raw, key)


@pytest.mark.parametrize("schema", [0, 5, 99, "1", "2", True, None])
def test_other_schemas_are_unsupported(real, schema) -> None:
    for what, data in (("manifest", real["manifest"]), ("head", real["head"])):
        doc = json.loads(data)
        doc["schema"] = schema
        raw, key = _rekey(doc)
        with pytest.raises(UnsupportedSchemaError, match="schema"):
            parse_manifest(raw, key) if what == "manifest" else parse_head(raw)


# --- schema 2 fields (lineage, signature) and schema-1 documents -----------------------------


def test_writers_write_their_schema_with_one_lineage(real) -> None:
    from deltastore.format.manifest import SCHEMA_VERSION

    assert real["written_schema"] == real["written_head_schema"] == SCHEMA_VERSION
    doc, head = _doc(real), json.loads(real["head"])
    assert doc["schema"] == head["schema"] == 2
    assert len(doc["lineage"]) == 32 and doc["lineage"] == head["lineage"]
    assert doc["signature"] is None


@pytest.mark.parametrize("what", ["manifest", "head"])
def test_schema_1_documents_parse_and_must_not_carry_schema_2_fields(real, what: str) -> None:
    doc = json.loads(real[what])
    doc["schema"] = 1
    del doc["lineage"]
    if what == "manifest":
        del doc["signature"]
    raw, key = _rekey(doc)
    parsed = parse_manifest(raw, key) if what == "manifest" else parse_head(raw)
    assert parsed.schema_ == 1 and parsed.lineage is None
    assert json.loads(dump(parsed)) == doc, "a schema-1 document dumps without the new fields"
    for field, value in (("lineage", "ab" * 16), ("signature", None), ("signature", {"alg": "ed25519", "key_id": "0" * 16, "value": "A" * 86 + "=="})):
        if what == "head" and field == "signature":
            continue
        bad = dict(doc, **{field: value})
        raw, key = _rekey(bad)
        with pytest.raises(CorruptObjectError, match="schema"):
            parse_manifest(raw, key) if what == "manifest" else parse_head(raw)


@pytest.mark.parametrize("what", ["manifest", "head"])
@pytest.mark.parametrize("lineage", [None, "", "AB" * 16, "ab" * 15, "ab" * 17, 5])
def test_schema_2_requires_a_well_formed_lineage(real, what: str, lineage) -> None:
    doc = json.loads(real[what])
    if lineage is None:
        del doc["lineage"]
    else:
        doc["lineage"] = lineage
    raw, key = _rekey(doc)
    with pytest.raises(CorruptObjectError):
        parse_manifest(raw, key) if what == "manifest" else parse_head(raw)


def test_manifest_digest_must_match_key_and_head(real) -> None:
    data, key = real["manifest"], real["key"]
    parse_manifest(data, key, sha256_hex(data))
    with pytest.raises(IntegrityError, match=key):
        parse_manifest(data, key, "0" * 64)
    with pytest.raises(IntegrityError):
        parse_manifest(data + b" ", key)


# --- manifests grow with what changed ---------------------------------------------------------


def test_delta_manifest_lists_only_what_changed() -> None:
    url = f"memory://manifest-size-{uuid.uuid4().hex}"
    state = {f"layer{i:04d}.weight": torch.full((4, 4), float(i), dtype=torch.bfloat16) for i in range(2000)}
    state["big"] = torch.zeros(4096, 8, dtype=torch.bfloat16)
    with Publisher(url, writer_policy=WriterPolicy(threads=2, skip_unchanged=False),
                   layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=False)) as pub:
        a = pub.publish(state)
        store = pub.store
        anchor_size = len(json.dumps(_in_memory_doc(store, a.manifest)))  # the anchor lists all 2001 tensors
        nxt = dict(state)
        nxt["layer1234.weight"] = state["layer1234.weight"].clone()
        nxt["layer1234.weight"][1, 2] = 7.0
        nxt["big"] = state["big"].clone()
        nxt["big"][3000, 5] = 1.0  # one chunk of a 64-chunk tensor
        d = pub.publish(nxt)
        data = store.get(d.manifest)
        doc = _in_memory_doc(store, d.manifest)
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
        assert _in_memory_doc(store, e.manifest)["tensors"] == [] and len(store.get(e.manifest)) < 1000
        # skip_unchanged (the default): the same state again commits nothing and writes no object.
        pub.writer_policy = dataclasses.replace(pub.writer_policy, skip_unchanged=True)
        before = {o.key for o in store.list("")}
        again = pub.publish(nxt)
        assert again.version == e.version and {o.key for o in store.list("")} == before


def _in_memory_doc(store, key: str) -> dict:
    """A manifest of any schema as its in-memory JSON document (schema 3: tensors rebuilt)."""
    from deltastore.format.history import History

    return json.loads(dump(History(store).manifest(key)))


def test_real_manifest_fields(real) -> None:
    doc = _doc(real)
    head = json.loads(real["head"])
    assert head["manifest"] == real["key"] and head["manifest_sha256"] == sha256_hex(real["manifest"])
    assert head["version"] == doc["version"] == 2 and head["commit_id"] == doc["commit_id"]
    assert (doc["parent"], doc["kind"], doc["anchor"], doc["delta_base"], doc["step"]) == (1, "delta", 1, 1, 5)
    assert doc["parent_manifest"].startswith("manifests/000000000001-")
    assert doc["state_digest"] == "xxh3-128" and doc["created"].endswith("Z")
    for b in doc["blobs"]:
        assert b["key"] == blob_key(b["sha256"])


# --- hostile manifests: every structural lie is a CorruptObjectError naming the object --------


@pytest.fixture(scope="module")
def anchor_doc() -> dict:
    """A real anchor manifest with a multi-chunk tensor, a 0-d tensor and an empty tensor."""
    url = f"memory://manifest-anchor-{uuid.uuid4().hex}"
    state = {
        "w": torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=512)) as pub:
        pub.publish(state)
        doc = json.loads(_store_copy_as_schema2(pub.store)["manifest"])
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert len(w["chunks"]) == 4 and doc["kind"] == "anchor"
    return doc


def _w(doc: dict) -> dict:
    return next(t for t in doc["tensors"] if t["name"] == "w")


def _parse_doc(doc: dict):
    data = json.dumps(doc).encode()
    return parse_manifest(data, _key(doc["version"], sha256_hex(data)))


def test_real_anchor_parses(anchor_doc) -> None:
    m = _parse_doc(anchor_doc)
    assert {t.name: len(t.chunks) for t in m.tensors} == {"w": 4, "scalar": 1, "empty": 1}


@pytest.mark.parametrize(
    "why, mutate, named",
    [
        ("chunk index past the last chunk", lambda d: _w(d)["chunks"][3].update(index=4), "w"),
        ("chunk index far out of range", lambda d: _w(d)["chunks"][1].update(index=10**6), "w"),
        ("duplicate chunk index", lambda d: _w(d)["chunks"][1].update(index=0), "w"),
        ("anchor lacks a chunk", lambda d: _w(d).update(chunks=_w(d)["chunks"][:3]), "w"),
        ("0-d tensor with chunk 1", lambda d: next(t for t in d["tensors"] if t["name"] == "scalar")["chunks"][0].update(index=1), "scalar"),
        ("empty tensor with chunk 1", lambda d: next(t for t in d["tensors"] if t["name"] == "empty")["chunks"][0].update(index=1), "empty"),
        ("duplicate tensor name", lambda d: d["tensors"].append(json.loads(json.dumps(_w(d)))), "w"),
        ("negative dimension", lambda d: _w(d).update(shape=[-64, 8]), "w"),
        ("huge dimension", lambda d: _w(d).update(shape=[2**70, 8]), "w"),
        ("element count overflows int64", lambda d: _w(d).update(shape=[2**40, 2**40]), "w"),
        ("dtype __class__", lambda d: _w(d).update(dtype="__class__"), "w"),
        ("dtype Tensor", lambda d: _w(d).update(dtype="Tensor"), "w"),
        ("quantized dtype", lambda d: _w(d).update(dtype="qint8"), "w"),
        ("n_changed above the chunk's elements", lambda d: _w(d)["chunks"][0]["full"].update(n_changed=16 * 8 + 1), "w"),
        ("segment offset past its blob", lambda d: _w(d)["chunks"][0]["full"].update(offset=d["blobs"][0]["size"]), "w"),
        ("huge offset", lambda d: _w(d)["chunks"][0]["full"].update(offset=2**64), "w"),
        ("huge blob size", lambda d: d["blobs"][0].update(size=2**64), None),
        ("huge epoch", lambda d: d.update(epoch=2**63), None),
        ("huge step", lambda d: d.update(step=-(2**63) - 1), None),
    ],
)
def test_structurally_impossible_anchor_is_corrupt(anchor_doc, why: str, mutate, named: str | None) -> None:
    """D8/D11: chunk indices, names, shapes, dtypes and numbers are checked before any planning."""
    doc = json.loads(json.dumps(anchor_doc))
    mutate(doc)
    data = json.dumps(doc).encode()
    key = _key(doc["version"], sha256_hex(data))
    with pytest.raises(CorruptObjectError) as exc:
        parse_manifest(data, key)
    assert key in str(exc.value)
    if named:
        assert repr(named) in str(exc.value) or f"{named}[" in str(exc.value), str(exc.value)


def test_delta_whose_anchor_is_itself_is_corrupt(real) -> None:
    doc = _doc(real)
    doc["anchor"] = doc["version"]
    with pytest.raises(CorruptObjectError):
        _parse_doc(doc)


def test_manifest_key_must_carry_its_version(real) -> None:
    """D12: the key's version prefix is part of the address; a manifest filed under another
    version's key (a parent link that skips one) is corrupt."""
    data = real["manifest"]
    digest = sha256_hex(data)
    parse_manifest(data, _key(2, digest))
    for key in (_key(3, digest), _key(1, digest), f"manifests/x-{digest}.json", f"blobs/{digest[:2]}/{digest}"):
        with pytest.raises(CorruptObjectError, match="version|manifest key"):
            parse_manifest(data, key)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,  # RecursionError in json
        '{"a":' * 5_000 + "1" + "}" * 5_000,
        "1" * 5_000,  # ValueError: int max str digits
        '{"schema": 1, "version": ' + "9" * 5_000 + "}",
    ],
    ids=["deep-list", "deep-object", "long-int", "long-int-field"],
)
def test_hostile_json_is_corrupt_not_a_python_error(text: str) -> None:
    data = text.encode()
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(data)
    with pytest.raises(CorruptObjectError):
        parse_manifest(data, _key(1, sha256_hex(data)))


def test_deep_metadata_is_corrupt(real) -> None:
    doc = _doc(real)
    deep: dict = {}
    node = deep
    for _ in range(500):  # parses, but would break json.dumps / pydantic further down
        node["x"] = {}
        node = node["x"]
    doc["metadata"] = deep
    with pytest.raises(CorruptObjectError, match="nested"):
        _parse_doc(doc)


@pytest.mark.parametrize("field, value", [("version", 2**63), ("epoch", 2**64), ("version", -1)])
def test_head_numbers_are_bounded(real, field: str, value: int) -> None:
    doc = json.loads(real["head"])
    doc[field] = value
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(json.dumps(doc).encode())


def test_head_over_the_size_cap_is_corrupt(real) -> None:
    from deltastore.format.manifest import MAX_HEAD_BYTES

    doc = json.loads(real["head"])
    doc["writer"] = "w" * MAX_HEAD_BYTES
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(json.dumps(doc).encode())


@pytest.mark.parametrize("manifest, sha, version", [
    ("", "0" * 64, 1),                                                       # the empty key
    ("manifests/../HEAD", "0" * 64, 1),                                      # escapes manifests/
    ("manifests/000000000002-" + "a" * 64 + ".json", "a" * 64, 1),          # another version's key
    ("manifests/000000000001-" + "a" * 64 + ".json", "b" * 64, 1),          # digest disagrees
    (None, None, 3),                                                         # no manifest, version 3
])  # fmt: skip
def test_head_must_name_a_well_formed_manifest_key(manifest, sha, version):
    doc = {"format": "deltastore.head", "schema": 2, "version": version, "manifest": manifest,
           "manifest_sha256": sha, "commit_id": "c", "writer": "w", "epoch": 1, "updated": "t",
           "lineage": "0" * 32}
    with pytest.raises(CorruptObjectError, match="HEAD"):
        parse_head(json.dumps(doc).encode())


def test_table_entries_are_built_as_model_construct_builds_them() -> None:
    """The read path builds chunk-table entries without pydantic's per-call field walk; with
    this pydantic that shortcut must build exactly what ``model_construct`` builds (else the
    import-time check turns it off, and this test says so)."""
    from deltastore.format import manifest as mf

    assert mf._FAST_CONSTRUCT, "the fast entry constructor was turned off for this pydantic"
    seg = dict(blob=1, offset=4096, length=77, sha256="ab" * 32, codec="add-sparse/1", n_changed=5)
    for cls, values in [
        (mf.SegmentRef, seg),
        (mf.ChunkEntry, dict(index=3, digest="cd" * 16, full=None, delta=mf.SegmentRef.model_construct(**seg))),
        (mf.TensorEntry, dict(name="w", dtype="bfloat16", shape=(4, 8), chunk_rows=2, chunks=())),
    ]:
        fast, slow = mf.unchecked_entry(cls, **values), cls.model_construct(**values)
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

    from deltastore.format import manifest as mf

    seg = dict(blob=1, offset=4096, length=77, sha256="ab" * 32, codec="add-sparse/1", n_changed=5)
    a, b = mf.unchecked_entry(mf.SegmentRef, **seg), mf.unchecked_entry(mf.SegmentRef, **{**seg, "offset": 0})
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
    part = mf._fast_construct(mf.SegmentRef, {"blob": 1})
    assert part.__pydantic_fields_set__ == {"blob"} and part.__pydantic_fields_set__ is not shared


# --- the writer's self-check (design 006, session 18, task T) ----------------------------------


def _round_trip_returns(m: Manifest, layout) -> bool:
    """The check encode_manifest made before session 18, kept here as the reference: decode the
    document, check it as a reader does, and compare canonical JSON."""
    import deltastore.format.manifest as mf

    raw = json.dumps(mf._manifest_doc(m, layout), sort_keys=True, separators=(",", ":")).encode()
    try:
        back = mf._manifest_from_doc(json.loads(raw), layout, "<reference>")
        mf._check_manifest(back, "<reference>")
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


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    key = manifest_key(m.version, sha256_hex(data), schema=3)
    assert dump(parse_manifest(data, key, layout=layout)) == dump(m)
    if mutation == "none":
        assert parse_manifest(data, key, layout=layout) == m


@pytest.mark.parametrize("store_name", ["store-mixed", "store-schema3", "store-schema4", "store-sharded",
                                        "store-sharded-grid", "store-federated/site-a"])
def test_the_writers_check_accepts_exactly_the_entries_the_reader_builds(store_name: str) -> None:
    """Both walk the chunk rows by one function (_row_entries): on every schema-3/4 manifest of
    the golden stores (a sharded version's joined parts too), the entries the reader builds
    pass the writer's check, and any one of them changed does not."""
    from pathlib import Path

    import deltastore.format.manifest as mf
    from deltastore.storage import open_store

    root = Path(__file__).parent / "golden" / store_name
    store = open_store(str(root))
    keys = [str(f.relative_to(root)) for f in sorted(root.glob("manifests/*.json.zst"))]
    assert keys
    for key in keys:
        doc = mf.manifest_document(store.get(key), key)
        lref = doc["layout"]
        layout = mf.decode_object(mf.Layout, store.get(lref["key"]), lref["key"], lref["sha256"])
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
