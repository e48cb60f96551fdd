"""Keys that a store's content names (SPEC §9): a HEAD, manifest, part manifest, history index or
squash manifest that names an object by a key no store accepts ('../../etc', '', 'a//b') is
refused when it is decoded, as CorruptObjectError naming that object, before anything is read
through the key.

Every key-bearing field of every object of the golden stores is mutated in turn, the object is
stored under its new content address (and the objects above it re-pointed), and decoded as a
reader decodes it, over a store that raises InvalidKeyError for an invalid key: a key that
reached the store would surface as that error, not as CorruptObjectError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from deltastore import CorruptObjectError
from deltastore.format.keys import HEAD_KEY, digest_from_key, sha256_hex
from deltastore.format.manifest import parse_manifest
from deltastore.format.models import Index, Layout, SquashManifest
from deltastore.format.objects import decode_object
from deltastore.format.parse import parse_head
from deltastore.storage import open_store
from testkit.stores import mutated

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
STORES = ("store-schema3", "store-schema4", "store-grid", "store-sharded", "store-sharded-grid",
          "store-federated/global", "store-federated/site-a", "store-federated/site-b")
BAD_KEYS = ("../../etc", "", "a//b")
#: Fields whose value is a key of the store (besides the items of ``back``); user metadata is not.
KEY_FIELDS = {"key", "manifest", "parent_manifest", "anchor_manifest", "from_manifest", "to_manifest"}
#: Every kind of ref (object kind, field path with list positions as []) the golden stores
#: hold, plus a manifest's own squash refs (added below: no golden manifest lists one). The
#: test must see each, so it cannot pass by finding nothing to mutate.
EXPECTED_REFS = {
    ("HEAD", "manifest"), ("HEAD", "index.key"),
    ("manifest", "layout.key"), ("manifest", "packs.[].key"),
    ("manifest", "parent_manifest"), ("manifest", "anchor_manifest"), ("manifest", "back.[]"),
    ("manifest", "squashes.[].key"), ("manifest", "parts.[].key"), ("manifest", "base.manifest"),
    ("part manifest", "layout.key"), ("part manifest", "packs.[].key"),
    ("history index", "pins.[].manifest"), ("history index", "squashes.[].key"), ("history index", "previous.key"),
    ("squash manifest", "layout.key"), ("squash manifest", "blobs.[].key"), ("squash manifest", "from_manifest"),
    ("squash manifest", "to_manifest"),
}  # fmt: skip


def _kind(key: str) -> str | None:
    if key == HEAD_KEY:
        return "HEAD"
    if key.startswith("manifests/"):
        return "manifest"
    for suffix, kind in ((".part.json.zst", "part manifest"), (".index.json.zst", "history index"),
                         (".squash.json.zst", "squash manifest")):
        if key.endswith(suffix):
            return kind
    return None  # packs, layouts (which name no key), GC records


def _doc(key: str, raw: bytes) -> Any:
    return json.loads(zstandard.ZstdDecompressor().decompress(raw) if key.endswith(".zst") else raw)


def _stored(key: str, doc: Any) -> tuple[str, bytes]:
    """``doc`` stored as ``key``'s kind stores it, and its new content address."""
    raw = json.dumps(doc).encode()
    if key.endswith(".zst"):
        raw = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    if key == HEAD_KEY:
        return key, raw
    old = digest_from_key(key)
    return key.replace(old, sha256_hex(raw)), raw


def _key_paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Paths of the string fields of ``doc`` that hold a store key."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if prefix or k != "metadata":
                yield from _key_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _key_paths(v, (*prefix, i))
    elif isinstance(doc, str) and prefix and (prefix[-1] in KEY_FIELDS or (len(prefix) > 1 and prefix[-2] == "back")):
        yield prefix


def _name(path: tuple) -> str:
    return ".".join("[]" if isinstance(p, int) else p for p in path)




def _objects(store_dir: Path) -> dict[str, bytes]:
    return {str(f.relative_to(store_dir)): f.read_bytes() for f in sorted(store_dir.rglob("*")) if f.is_file()}


def _cases() -> Iterator[tuple[str, str, tuple, str]]:
    """(store, object key, field path, kind) of every key-bearing field of the golden stores."""
    for name in STORES:
        for key, raw in _objects(GOLDEN / name).items():
            kind = _kind(key)
            if kind is not None:
                for path in _key_paths(_doc(key, raw)):
                    yield name, key, path, kind


CASES = list(_cases())


def test_the_cases_cover_every_kind_of_ref() -> None:
    seen = {(kind, _name(path)) for _, _, path, kind in CASES} | {("manifest", "squashes.[].key")}
    assert seen == EXPECTED_REFS, f"refs seen but not expected: {seen - EXPECTED_REFS}, expected but not seen: {EXPECTED_REFS - seen}"


def _decoder(objects: dict[str, bytes], url: str):
    """Decode an object as a reader does, through a store holding ``objects`` (whose get
    raises InvalidKeyError for an invalid key, as every backend does)."""
    store = open_store(url)
    for k, v in objects.items():
        store.put(k, v, mode="overwrite")

    def layout(ref):
        return decode_object(Layout, store.get(ref.key), ref.key, ref.sha256)

    def decode(key: str, raw: bytes) -> Any:
        kind = _kind(key)
        if kind == "HEAD":
            return parse_head(raw)
        if kind == "manifest":
            return parse_manifest(raw, key, layout=layout, parts=lambda ref: store.get(ref.key))
        return decode_object({"history index": Index, "squash manifest": SquashManifest}[kind], raw, key)

    return store, decode


def _owner(objects: dict[str, bytes], part_key: str) -> str:
    """The manifest that lists part manifest ``part_key``."""
    return next(k for k, v in objects.items()
                if _kind(k) == "manifest" and any(p["key"] == part_key for p in _doc(k, v).get("parts", ())))


def _refuses(decode, key: str, raw: bytes, named: str) -> None:
    with pytest.raises(CorruptObjectError) as info:
        decode(key, raw)
    msg = str(info.value)
    assert "invalid key" in msg, msg
    assert (named if named == HEAD_KEY else repr(named)) in msg, f"the error does not name {named!r}: {msg}"


@pytest.mark.parametrize("bad", BAD_KEYS)
@pytest.mark.parametrize("store_name, key, path, kind", CASES,
                         ids=[f"{s}:{k.rsplit('/', 1)[-1][:24]}:{_name(p)}" for s, k, p, _ in CASES])
def test_an_invalid_key_is_refused_where_the_content_names_it(store_name: str, key: str, path: tuple, kind: str,
                                                              bad: str) -> None:
    objects = _objects(GOLDEN / store_name)
    doc = mutated(_doc(key, objects[key]), path, bad)
    new_key, raw = _stored(key, doc)
    store, decode = _decoder({**objects, new_key: raw}, f"memory://keys-{store_name}-{sha256_hex(raw)[:16]}")
    with store:
        if kind != "part manifest":
            _refuses(decode, new_key, raw, new_key)
            return
        # a part manifest is read through the version that lists it: re-point that version
        owner = _owner(objects, key)
        odoc = _doc(owner, objects[owner])
        i = next(j for j, p in enumerate(odoc["parts"]) if p["key"] == key)
        odoc["parts"][i].update(key=new_key, sha256=sha256_hex(raw))
        owner_key, owner_raw = _stored(owner, odoc)
        store.put(owner_key, owner_raw, mode="overwrite")
        _refuses(decode, owner_key, owner_raw, new_key)


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_a_manifests_own_squash_ref_with_an_invalid_key_is_refused(bad: str) -> None:
    """No golden manifest lists a squash of its own (they are in the index): add one."""
    objects = _objects(GOLDEN / "store-schema3")
    index_key = next(k for k in objects if _kind(k) == "history index")
    ref = _doc(index_key, objects[index_key])["squashes"][0]
    head = json.loads(objects[HEAD_KEY])
    doc = _doc(head["manifest"], objects[head["manifest"]])
    doc["squashes"] = [{**ref, "key": bad}]
    new_key, raw = _stored(head["manifest"], doc)
    store, decode = _decoder({**objects, new_key: raw}, f"memory://keys-own-squash-{sha256_hex(raw)[:16]}")
    with store:
        _refuses(decode, new_key, raw, new_key)
    # and the same manifest with the valid key parses (the test above can fail only on the key)
    ok_key, ok_raw = _stored(head["manifest"], {**doc, "squashes": [ref]})
    store, decode = _decoder({**objects, ok_key: ok_raw}, f"memory://keys-own-squash-ok-{sha256_hex(ok_raw)[:16]}")
    with store:
        assert decode(ok_key, ok_raw).squashes[0].key == ref["key"]


@pytest.mark.parametrize("store_name", STORES)
def test_the_golden_objects_themselves_decode(store_name: str) -> None:
    """The unmutated objects pass the same decoder: every key a writer wrote is valid."""
    objects = _objects(GOLDEN / store_name)
    store, decode = _decoder(objects, f"memory://keys-golden-{store_name}")
    with store:
        decoded = [decode(k, v) for k, v in objects.items() if _kind(k) not in (None, "part manifest")]
    assert decoded
