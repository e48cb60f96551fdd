"""Hostile HEADs and manifests, fuzzed (defects D8, D11, D12 of docs/reliability.md): whatever a
damaged or malicious store holds, readers raise only deltastore's typed errors, apply nothing halfway, and allocate
nothing beyond the caps.

Mutations of real documents: type swaps, huge/negative/5,000-digit integers, deep nesting, long
strings, removed and duplicated entries. Each mutated object is correctly content-addressed
(the re-signed chain up to HEAD too), so only the readers' semantic checks stand in the way.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltastore import (
    CorruptObjectError,
    DeltastoreError,
    FormatError,
    HistoryReplacedError,
    IntegrityError,
    LayoutMismatchError,
    NotFoundError,
    Publisher,
    Subscriber,
    VersionNotFoundError,
)
from deltastore.format.keys import HEAD_KEY, manifest_key, sha256_hex
from deltastore.format.manifest import parse_manifest
from deltastore.format.parse import parse_head
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.manifest_docs import json_paths
from testkit.tensors import assert_bits_equal, small_state, snapshot, sparse_edit

#: The declared-model cap every fuzzed subscriber runs under (the real store holds ~6 KiB).
CAP = 1 << 20

_DEEP = "\x00deep\x00"
_BIGINT = "\x00bigint\x00"
_ids = itertools.count()


@pytest.fixture(scope="module")
def pristine() -> dict[str, Any]:
    """Objects of a real store: versions 1 (anchor), 2, 3 (deltas), multi-chunk tensors."""
    import numpy as np

    url = f"memory://hostile-src-{next(_ids)}"
    states = [small_state(0, n=3, rows=32)]
    for i in range(2):
        states.append(sparse_edit(states[-1], np.random.default_rng(i), 0.05))
    with Publisher(url, writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=256)) as pub:
        for s in states:
            pub.publish(s, metadata={"note": "fuzz", "n": [1, 2]})
        objects = {m.key: pub.store.get(m.key) for m in pub.store.list()}
    head = json.loads(objects[HEAD_KEY])
    chain = []  # manifest keys, oldest first
    key = head["manifest"]
    while key is not None:
        chain.append(key)
        key = _load(key, objects[key])["parent_manifest"]
    chain.reverse()
    return {"objects": objects, "chain": chain, "states": [snapshot(s) for s in states]}


def _load(key: str, raw: bytes) -> Any:
    """The JSON document stored under ``key`` (a manifest: the decompressed columnar document)."""
    if key.endswith(".json.zst"):
        import zstandard

        raw = zstandard.ZstdDecompressor().decompress(raw)
    return json.loads(raw)


def _store_as(key: str, doc: Any, depth: int, version: int) -> tuple[bytes, str]:
    """Manifest ``doc`` stored as a manifest is (one zstd frame), and its content-addressed key."""
    import zstandard

    raw = zstandard.ZstdCompressor(level=3).compress(_encode(doc, depth))
    return raw, manifest_key(version, sha256_hex(raw))


hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from([-1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.sampled_from(["__class__", "Tensor", "qint8", "../../etc", "bfloat16", "float64", "anchor", "delta"]),
    st.integers(1, 50_000).map(lambda n: "x" * n),
    st.just(_DEEP),
    st.just(_BIGINT),
    st.lists(st.integers(-5, 2**40), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


hostile_ints = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([-1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.just(_BIGINT),
)
hostile_strings = st.one_of(
    st.sampled_from(["__class__", "Tensor", "qint8", "bits16", "", "../../etc", "bfloat16", "float64",
                     "anchor", "delta", "full/1", "xor-dense/1", "lz77/9", "manifests/000000000001-x.json"]),
    st.integers(1, 50_000).map(lambda n: "x" * n),
)  # fmt: skip


def _mutate(doc: Any, data: st.DataObject) -> Any:
    """Apply 1-3 random mutations to a JSON document (in place, returns it).

    A field is picked by its name first (then one of its occurrences), so the few layout
    fields are hit as often as the many segment fields; a replacement is drawn for the field's
    type half of the time (integer or string attacks) and from anything otherwise.
    """
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in json_paths(doc) if p]
        if not paths:
            return doc
        by_name: dict[str, list[tuple]] = {}
        for p in paths:
            by_name.setdefault("[]" if isinstance(p[-1], int) else p[-1], []).append(p)
        path = data.draw(st.sampled_from(by_name[data.draw(st.sampled_from(sorted(by_name)))]))
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        action = data.draw(st.sampled_from(["replace", "replace", "replace", "delete", "duplicate", "extra"]))
        last = path[-1]
        if action == "delete":
            del parent[last]
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(last, json.loads(json.dumps(parent[last])))
        elif action == "extra" and isinstance(parent, dict):
            parent[data.draw(st.text(min_size=1, max_size=4))] = data.draw(hostile_values)
        else:
            old = parent[last]
            typed = hostile_ints if isinstance(old, int) and not isinstance(old, bool) else hostile_strings if isinstance(old, str) else hostile_values
            parent[last] = data.draw(st.one_of(typed, hostile_values))
    return doc


def _encode(doc: Any, depth: int) -> bytes:
    data = json.dumps(doc).encode()
    data = data.replace(json.dumps(_DEEP).encode(), b"[" * depth + b"]" * depth)
    return data.replace(json.dumps(_BIGINT).encode(), b"9" * 5000)


#: What a reader may raise about a store's content (SPEC §9); LayoutMismatchError when a
#: mutated store changed the layout under pull_into, HistoryReplacedError when a mutated link no
#: longer leads back to the held version. Not InvalidStateDictError: that blames the caller's
#: state dict.
READER_ERRORS = (IntegrityError, FormatError, NotFoundError, VersionNotFoundError, LayoutMismatchError,
                 HistoryReplacedError)


def _typed_only(call) -> Any:
    """Run ``call``; anything that escapes must be one of the reader's errors."""
    try:
        return call()
    except READER_ERRORS:
        return None
    except DeltastoreError as e:
        pytest.fail(f"{type(e).__name__} is not a reader's error: {e}"[:500])
    except BaseException as e:  # noqa: BLE001 - the assertion is the point
        pytest.fail(f"{type(e).__name__} escaped: {e!r}"[:500])


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(data=st.data(), depth=st.sampled_from([3, 150, 5_000, 200_000]))
def test_parsers_raise_only_typed_errors(pristine, data, depth: int) -> None:
    objects = pristine["objects"]
    key = data.draw(st.sampled_from(pristine["chain"]))
    layouts = _layout_of_objects(objects)
    for what, raw in (("head", objects[HEAD_KEY]), ("manifest", objects[key])):
        doc = _mutate(json.loads(raw) if what == "head" else _load(key, raw), data)
        if what == "head":
            mutated = _encode(doc, depth)
            _typed_only(lambda: parse_head(mutated))
        else:
            version = doc.get("version") if isinstance(doc, dict) and isinstance(doc.get("version"), int) else 1
            version = version if 0 <= version < 10**12 else 1
            mutated, mkey = _store_as(key, doc, depth, version)
            _typed_only(lambda: parse_manifest(mutated, mkey, layout=layouts))


def _layout_of_objects(objects: dict[str, bytes]):
    """parse_manifest's ``layout`` for a manifest of ``objects``."""
    from deltastore.format.models import Layout
    from deltastore.format.objects import decode_object

    def layout(ref):
        if ref.key not in objects:  # as a store answers a key it does not hold (not a bare KeyError)
            raise NotFoundError(f"{ref.key!r} does not exist")
        return decode_object(Layout, objects[ref.key], ref.key, ref.sha256)

    return layout


def _publish_mutated(store, pristine: dict, data: st.DataObject, depth: int) -> None:
    """Mutate HEAD or one manifest of the chain; re-sign the chain above it and HEAD."""
    objects, chain = pristine["objects"], pristine["chain"]
    for k, v in objects.items():
        store.put(k, v, mode="overwrite")
    target = data.draw(st.sampled_from(["head"] + list(range(len(chain)))))
    head = json.loads(objects[HEAD_KEY])
    if target == "head":
        store.put(HEAD_KEY, _encode(_mutate(head, data), depth), mode="overwrite")
        return
    prev_key = None
    for i, key in enumerate(chain):
        doc = _load(key, objects[key])
        if i < target:
            continue
        version = doc["version"]
        if i == target:
            doc = _mutate(doc, data)
        elif isinstance(doc, dict):
            doc["parent_manifest"] = prev_key
            if "back" in doc:
                doc["back"] = []  # skip pointers are hints; the re-signed chain has new keys
        raw, prev_key = _store_as(key, doc, depth, version)
        store.put(prev_key, raw, mode="overwrite")
    head.update(manifest=prev_key, manifest_sha256=sha256_hex(raw))
    store.put(HEAD_KEY, json.dumps(head).encode(), mode="overwrite")


@FUZZ
@given(data=st.data(), depth=st.sampled_from([3, 150, 5_000]))
def test_subscriber_on_a_mutated_store_raises_only_typed_errors(pristine, data, depth: int) -> None:
    url = f"memory://hostile-{next(_ids)}"
    allocated: list[int] = []
    real_empty = torch.empty

    def counting_empty(*args, **kw):
        t = real_empty(*args, **kw)
        allocated.append(t.numel() * t.element_size())
        return t

    with open_store(url) as store:
        for k, v in pristine["objects"].items():
            store.put(k, v, mode="overwrite")
        with Subscriber(url, store=store, threads=1, max_model_bytes=CAP) as sub, pytest.MonkeyPatch.context() as mp:
            target = sub.pull(1)
            before = snapshot(target)
            _publish_mutated(store, pristine, data, depth)
            mp.setattr(torch, "empty", counting_empty)
            if _typed_only(lambda: sub.pull_into(target)) is None:
                assert_bits_equal(target, before, "a failed pull_into changed the target")
                assert sub.version == 1
            _typed_only(sub.log)
            _typed_only(sub.pull)
            _typed_only(lambda: sub.pull(2))
            _typed_only(lambda: sub.verify(all_versions=True))
        with Subscriber(url, store=store, threads=1, max_model_bytes=CAP) as fresh:
            _typed_only(fresh.latest)
            _typed_only(fresh.pull)
    assert sum(allocated) <= 3 * CAP, f"allocated {sum(allocated)} bytes under a {CAP}-byte cap"


@pytest.mark.parametrize("bad_key", ["../../etc", ""])
def test_a_manifest_naming_its_layout_by_an_invalid_key_is_corrupt(pristine, bad_key: str) -> None:
    """A key the store's content names and the store refuses to look up (a path escape, an empty
    key) is corrupt content: CorruptObjectError naming it, not the store's InvalidKeyError (the
    fuzzer above found this once in CI)."""
    objects, chain = pristine["objects"], pristine["chain"]
    key = chain[-1]  # HEAD's manifest
    doc = _load(key, objects[key])
    assert isinstance(doc.get("layout"), dict)
    doc["layout"]["key"] = bad_key
    raw, mkey = _store_as(key, doc, 3, doc["version"])
    url = f"memory://hostile-{next(_ids)}"
    with open_store(url) as store:
        for k, v in objects.items():
            store.put(k, v, mode="overwrite")
        store.put(mkey, raw, mode="overwrite")
        head = json.loads(objects[HEAD_KEY])
        head.update(manifest=mkey, manifest_sha256=sha256_hex(raw))
        store.put(HEAD_KEY, json.dumps(head).encode(), mode="overwrite")
        with Subscriber(url, store=store, threads=1, max_model_bytes=CAP) as sub:
            with pytest.raises(CorruptObjectError, match="invalid key"):
                sub.pull()


_GOLDEN3 = __import__("pathlib").Path(__file__).resolve().parents[1] / "golden" / "store-schema3"


@pytest.mark.parametrize("bad_key", ["../../etc", "", "a//b"])
@pytest.mark.parametrize("where", ["manifest:layout.key", "manifest:packs.0.key", "manifest:parent_manifest",
                                   "manifest:anchor_manifest", "manifest:back.0", "HEAD:index.key",
                                   "index:pins.0.manifest", "index:squashes.0.key", "index:previous.key"])
def test_a_subscriber_on_a_store_naming_an_invalid_key_raises_only_typed_errors(where: str, bad_key: str) -> None:
    """Each kind of ref in HEAD, the head manifest and the history index of the golden schema-3
    store (floor 8, pins 2 and 6, a squash 9→12) set to a key no store accepts, the objects
    above it re-pointed: every reader call raises only a reader's error (never the store's
    InvalidKeyError), and the object naming the key is refused as CorruptObjectError."""
    import zstandard

    objects = {str(f.relative_to(_GOLDEN3)): f.read_bytes() for f in _GOLDEN3.rglob("*") if f.is_file()}
    head = json.loads(objects[HEAD_KEY])
    what, path = where.split(":")
    steps = [int(p) if p.isdigit() else p for p in path.split(".")]

    def mutated(doc: Any) -> Any:
        node = doc
        for p in steps[:-1]:
            node = node[p]
        node[steps[-1]] = bad_key
        return doc

    def restore(key: str, doc: Any) -> str:
        raw = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(json.dumps(doc).encode())
        new = key.replace(key.rsplit("/", 1)[-1].split(".")[0].rsplit("-", 1)[-1], sha256_hex(raw))
        objects[new] = raw
        return new

    if what == "HEAD":
        head = mutated(head)
    elif what == "manifest":
        new = restore(head["manifest"], mutated(_load(head["manifest"], objects[head["manifest"]])))
        head.update(manifest=new, manifest_sha256=sha256_hex(objects[new]))
    else:
        new = restore(head["index"]["key"], mutated(_load(head["index"]["key"], objects[head["index"]["key"]])))
        head["index"].update(key=new, sha256=sha256_hex(objects[new]))
    objects[HEAD_KEY] = json.dumps(head).encode()
    url = f"memory://hostile-keys-{next(_ids)}"
    refused: list[str] = []

    def call(fn) -> None:
        try:
            fn()
        except CorruptObjectError as e:
            refused.append(str(e))
        except READER_ERRORS:
            pass
        except BaseException as e:  # noqa: BLE001 - the assertion is the point
            pytest.fail(f"{type(e).__name__} escaped: {e!r}"[:500])

    with open_store(url) as store:
        for k, v in objects.items():
            store.put(k, v, mode="overwrite")
        with Subscriber(url, store=store, threads=1, max_model_bytes=CAP) as sub:
            call(sub.latest)
            call(sub.pull)
            call(lambda: sub.pull(2))  # pinned versions below the floor (pins.0 is version 2)
            call(lambda: sub.pull(6))
            call(lambda: sub.pull(9))
            call(sub.log)
    assert any("invalid key" in msg for msg in refused), f"nothing refused the invalid key: {refused}"
