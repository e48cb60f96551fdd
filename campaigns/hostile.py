"""Hostile campaign: crafted and fuzzed HEADs, manifests and segments; readers raise only
DeltastoreError, and never hand out wrong bits.

A valid history (versions 1–4, anchors at 1 and 4) is published once; each trial copies it to a
fresh prefix, lets a worker hold version 3, then writes one hostile object with every SHA-256
correct (so only the reader's own checks stand between it and the user): first the hand-crafted
cases below (out-of-range and duplicate chunk indices, negative and absurd shapes, unknown and
``__class__`` dtypes, deep JSON, 5,000-digit integers, a chain that skips a version, wrong codec
ids, segments past the end of their pack, garbage segment bytes, ...), then hypothesis-generated
mutations of HEAD and the top manifest (a value anywhere in the document replaced or removed).

Readers: ``pull()``, the worker's ``pull_into``, ``log()``, and the CLI's ``verify --all`` and
``log`` (in process). Counted as wrong errors: any exception that is not a DeltastoreError, a
CLI traceback or multi-line error, and ``log``/``verify`` accepting a chain that is not
consecutive. Counted as corrupt applies: a read that succeeds with the original layout but other
bits than the version it reports, or a failed ``pull_into`` that changed the worker's weights.

With ``--formats`` the template is published in those serving formats too, the fuzzed documents
include the top version's manifest of the first format's stream (named anew, with its SHA-256,
by a rewritten top manifest), and a ``pull()`` of that format reads too.

Trials = hostile stores.  ``python -m campaigns.hostile --backend seaweedfs --trials 200``
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

from campaigns.common import Tally, campaign_options, fresh_url, main, parser
from campaigns.corruption import cli, cli_args, judge_cli
from testkit.manifest_docs import json_paths

#: The template history: versions 1-4 with anchors at 1 and 4, so the top manifest is an
#: anchor (full and delta segments) whose parent chain holds deltas.
VERSIONS = 4
ANCHOR_EVERY = 3
#: The version the worker holds when the hostile object appears (one behind the top).
HELD = 3
#: Nesting depth of the deep-JSON cases: far past Python's recursion limit.
_DEEP = 100_000


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _pack_ref(doc: dict[str, Any], pack: bytes, role: str) -> dict[str, Any]:
    """A pack entry for ``pack`` in ``doc``: under the manifest's attempt, with a role."""
    return {"key": f"objects/{doc['commit_id']}/{_sha(pack)}.pack", "size": len(pack), "sha256": _sha(pack), "role": role}


class Hostile:
    """One trial's store: a copy of the template, and ways to write hostile objects into it."""

    def __init__(self, store: Any, head: dict[str, Any], manifests: dict[int, tuple[str, dict[str, Any]]]):
        self.store = store
        self.head = head
        self.manifests = manifests  # version -> (key, doc)

    def put_manifest_raw(self, version: int, raw: bytes, *, point_head: bool = True) -> str:
        """Store ``raw`` (JSON text, not checked) as a manifest is stored: one zstd frame."""
        import zstandard

        raw = zstandard.ZstdCompressor(level=3).compress(raw)
        key = f"manifests/{version:012d}-{_sha(raw)}.json.zst"
        self.store.put(key, raw, mode="overwrite")
        if point_head:
            h = dict(self.head, manifest=key, manifest_sha256=_sha(raw))
            self.store.put("HEAD", json.dumps(h).encode(), mode="overwrite")
        return key

    def put_manifest(self, doc: dict[str, Any], *, point_head: bool = True) -> str:
        """Store an in-memory manifest document as a writer stores it (columnar zstd, a new
        layout object if its tensors changed; see testkit/manifest_docs.py)."""
        from testkit.manifest_docs import encode_manifest_doc

        raw, key = encode_manifest_doc(self.store, doc)
        self.store.put(key, raw, mode="overwrite")
        if point_head:
            h = dict(self.head, manifest=key, manifest_sha256=_sha(raw))
            self.store.put("HEAD", json.dumps(h).encode(), mode="overwrite")
        return key

    def put_stream_manifest_raw(self, fmt: str, raw: bytes) -> None:
        """Store ``raw`` (JSON text, not checked) as the top version's manifest of format
        ``fmt``'s stream, and a top manifest naming it (key and SHA-256), HEAD pointing there."""
        import zstandard

        raw = zstandard.ZstdCompressor(level=3).compress(raw)
        key = f"streams/{fmt}/manifests/{VERSIONS:012d}-{_sha(raw)}.json.zst"
        self.store.put(key, raw, mode="overwrite")
        top = self.top_stored()
        for ref in top.get("streams") or ():
            if ref.get("format") == fmt:
                ref.update(key=key, sha256=_sha(raw))
        self.put_manifest_raw(VERSIONS, json.dumps(top, sort_keys=True).encode())

    def stream_stored(self, fmt: str) -> dict[str, Any]:
        """The top version's stored manifest document of format ``fmt``'s stream, as JSON."""
        import zstandard

        ref = next(r for r in self.top_stored()["streams"] if r["format"] == fmt)
        return json.loads(zstandard.ZstdDecompressor().decompress(self.store.get(ref["key"])))

    def put_head(self, doc: dict[str, Any]) -> None:
        self.store.put("HEAD", json.dumps(doc).encode(), mode="overwrite")

    def top(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.manifests[VERSIONS][1]))

    def top_stored(self) -> dict[str, Any]:
        """The head manifest's stored document (columnar), as JSON."""
        import zstandard

        return json.loads(zstandard.ZstdDecompressor().decompress(self.store.get(self.manifests[VERSIONS][0])))

    def resign_segment(self, doc: dict[str, Any], mutate: Callable[[bytes], bytes], which: str = "full") -> None:
        """Replace one segment's bytes in a copy of its pack; fix every SHA-256 in ``doc``."""
        for t in doc["tensors"]:
            for c in t["chunks"]:
                seg = c.get(which)
                if seg:
                    blob = doc["blobs"][seg["blob"]]
                    pack = bytearray(self.store.get(blob["key"]))
                    a, b = seg["offset"], seg["offset"] + seg["length"]
                    new = mutate(bytes(pack[a:b]))
                    pack[a:b] = new
                    ref = _pack_ref(doc, bytes(pack), blob.get("role") or "f")
                    self.store.put(ref["key"], bytes(pack), mode="overwrite")
                    blob.update(ref)
                    seg["sha256"] = _sha(new)
                    return


def _first_multi_chunk(doc: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in doc["tensors"] if len(t["chunks"]) >= 2)


def crafted() -> list[tuple[str, Callable[[Hostile], None]]]:
    """Hand-crafted hostile stores (name, writer); each one a defect seen or feared."""

    def m(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Hostile], None]:
        def write(h: Hostile) -> None:
            doc = h.top()
            fn(doc)
            h.put_manifest(doc)
        return write

    def chunk_out_of_range(doc):  # D8: indices 0 and n of an n-chunk tensor
        t = _first_multi_chunk(doc)
        t["chunks"][-1]["index"] = len(t["chunks"])

    def chunk_duplicate(doc):  # D8
        t = _first_multi_chunk(doc)
        t["chunks"][-1]["index"] = t["chunks"][0]["index"]

    def chunk_negative(doc):
        _first_multi_chunk(doc)["chunks"][0]["index"] = -1

    def tensor_duplicate(doc):  # D8: duplicate names
        doc["tensors"].append(json.loads(json.dumps(doc["tensors"][0])))

    def shape(value):
        def f(doc):
            doc["tensors"][0]["shape"] = value
        return f

    def dtype(value):
        def f(doc):
            doc["tensors"][0]["dtype"] = value
        return f

    def codec(value):
        def f(doc):
            for t in doc["tensors"]:
                for c in t["chunks"]:
                    if c.get("full"):
                        c["full"]["codec"] = value
                        return
        return f

    def seg_past_end(doc):
        for t in doc["tensors"]:
            for c in t["chunks"]:
                if c.get("full"):
                    c["full"]["offset"] = doc["blobs"][c["full"]["blob"]]["size"] + 10
                    return

    def blob_index(doc):
        for t in doc["tensors"]:
            for c in t["chunks"]:
                if c.get("full"):
                    c["full"]["blob"] = len(doc["blobs"]) + 3
                    return

    def chunk_rows(value):
        def f(doc):
            doc["tensors"][0]["chunk_rows"] = value
        return f

    def schema2(doc):
        doc["schema"] = 2

    def skip_version(h: Hostile) -> None:  # D12: parent link skips version 3
        doc = h.top()
        doc["parent_manifest"] = h.manifests[VERSIONS - 2][0]
        doc["parent"] = VERSIONS - 2
        h.put_manifest(doc)

    def skip_version_keep_parent(h: Hostile) -> None:  # D12: parent says 3, link goes to 2
        doc = h.top()
        doc["parent_manifest"] = h.manifests[VERSIONS - 2][0]
        h.put_manifest(doc)

    def deep_metadata(h: Hostile) -> None:  # D11: RecursionError
        raw = json.dumps(h.top_stored(), sort_keys=True, separators=(",", ":"))
        raw = raw.replace('"metadata":{}', '"metadata":{"x":' + "[" * _DEEP + "]" * _DEEP + "}", 1)
        h.put_manifest_raw(VERSIONS, raw.encode())

    def deep_head(h: Hostile) -> None:  # D11
        raw = json.dumps(h.head)[:-1] + ', "x": ' + "[" * _DEEP + "]" * _DEEP + "}"
        h.store.put("HEAD", raw.encode(), mode="overwrite")

    def huge_int_head(h: Hostile) -> None:  # D11: ValueError from int()
        raw = json.dumps(h.head).replace(f'"version": {VERSIONS}', '"version": ' + "9" * 5000, 1)
        h.store.put("HEAD", raw.encode(), mode="overwrite")

    def huge_int_manifest(h: Hostile) -> None:  # D11
        raw = json.dumps(h.top_stored(), sort_keys=True, separators=(",", ":"))
        raw = raw.replace('"metadata":{}', '"metadata":{"n":' + "7" * 5000 + "}", 1)
        h.put_manifest_raw(VERSIONS, raw.encode())

    def nan_field(h: Hostile) -> None:
        raw = json.dumps(h.head).replace(f'"epoch": {h.head["epoch"]}', '"epoch": NaN', 1)
        h.store.put("HEAD", raw.encode(), mode="overwrite")

    def head_version_mismatch(h: Hostile) -> None:
        h.put_head(dict(h.head, version=VERSIONS + 5))

    def head_traversal(h: Hostile) -> None:
        h.put_head(dict(h.head, manifest="manifests/../../../etc/passwd"))

    def head_null_manifest(h: Hostile) -> None:
        h.put_head(dict(h.head, manifest=None))

    def head_not_object(h: Hostile) -> None:
        h.store.put("HEAD", b"[1, 2, 3]", mode="overwrite")

    def head_binary(h: Hostile) -> None:
        h.store.put("HEAD", bytes(range(256)), mode="overwrite")

    def garbage_segment(which):
        def f(h: Hostile) -> None:
            doc = h.top()
            rnd = random.Random(1)
            h.resign_segment(doc, lambda b: bytes(rnd.getrandbits(8) for _ in b), which)
            h.put_manifest(doc)
        return f

    def zeroed_segment(h: Hostile) -> None:
        doc = h.top()
        h.resign_segment(doc, lambda b: bytes(len(b)))
        h.put_manifest(doc)

    def truncated_segment_header(h: Hostile) -> None:
        doc = h.top()
        h.resign_segment(doc, lambda b: b[:3] + bytes(len(b) - 3))
        h.put_manifest(doc)

    def chunk_out_of_range_empty(h: Hostile) -> None:  # D8: indices 0..n-2 and n, chunk n-1 never written
        import numpy as np

        from deltastore import codec
        from deltastore.layout.tensors import state_digest

        doc = h.top()
        t = _first_multi_chunk(doc)
        width = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32, "int64": np.uint64, "uint8": np.uint8}[t["dtype"]]
        empty = np.empty(0, dtype=width)
        seg = codec.encode_full(empty)
        pack = bytes(seg.data)
        ref = _pack_ref(doc, pack, "f")
        h.store.put(ref["key"], pack, mode="overwrite")
        doc["blobs"].append(ref)
        last = t["chunks"][-1]
        last["index"] = len(t["chunks"])
        last["digest"] = state_digest(empty)
        last["full"] = {"blob": len(doc["blobs"]) - 1, "offset": 0, "length": len(pack), "sha256": _sha(pack),
                        "codec": seg.codec, "n_changed": 0}
        last.pop("delta", None)
        h.put_manifest(doc)

    def wrong_digest(doc):
        _first_multi_chunk(doc)["chunks"][0]["digest"] = "0" * 32

    def huge_shape_tiny_pack(doc):  # D11: declared size with nothing behind it
        doc["tensors"][0]["shape"] = [2**40, 32]

    # The first ones span every defect class: a bounded run (CI) takes a prefix of this list.
    return [
        ("D8 chunk index out of range, empty segment", chunk_out_of_range_empty),
        ("D11 negative shape", m(shape([-1, 32]))),
        ("D11 deep JSON in metadata", deep_metadata),
        ("D11 5000-digit integer in HEAD", huge_int_head),
        ("D12 parent link skips a version", skip_version_keep_parent),
        ("dtype __class__", m(dtype("__class__"))),
        ("garbage full segment (hashes fixed)", garbage_segment("full")),
        ("HEAD is binary", head_binary),
        ("D11 absurd shape", m(huge_shape_tiny_pack)),
        ("D11 deep JSON in HEAD", deep_head),
        ("D12 chain skips a version", skip_version),
        ("D8 chunk index out of range", m(chunk_out_of_range)),
        ("D8 duplicate chunk index", m(chunk_duplicate)),
        ("D8 negative chunk index", m(chunk_negative)),
        ("D8 duplicate tensor name", m(tensor_duplicate)),
        ("D11 shape not a list", m(shape("64x32"))),
        ("unknown dtype", m(dtype("float128"))),
        ("dtype of other width", m(dtype("float64"))),
        ("unknown codec", m(codec("zip/9"))),
        ("codec id empty", m(codec(""))),
        ("segment past the end of its pack", m(seg_past_end)),
        ("blob index out of range", m(blob_index)),
        ("chunk_rows 0", m(chunk_rows(0))),
        ("chunk_rows huge", m(chunk_rows(2**62))),
        ("schema 2", m(schema2)),
        ("wrong chunk digest", m(wrong_digest)),
        ("D11 5000-digit integer in a manifest", huge_int_manifest),
        ("NaN in HEAD", nan_field),
        ("HEAD version mismatch", head_version_mismatch),
        ("HEAD manifest key escapes the store", head_traversal),
        ("HEAD manifest null at version 4", head_null_manifest),
        ("HEAD is a JSON list", head_not_object),
        ("garbage delta segment of an anchor (hashes fixed)", garbage_segment("delta")),
        ("zeroed segment (hashes fixed)", zeroed_segment),
        ("segment header kept, body zeroed (hashes fixed)", truncated_segment_header),
    ]


# --- fuzzed -------------------------------------------------------------------------------


def _set(doc: Any, path: tuple, value: Any, delete: bool) -> Any:
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def fuzz_cases(seed: int, n: int, stream: str | None = None) -> list[tuple[str, Callable[[Hostile], None]]]:
    """``n`` hostile stores from hypothesis: one value of HEAD or the top manifest replaced (or
    of the top version's manifest of format ``stream``'s stream)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    # Integers are small or absurd: allocating an absurd size fails at once, while sizes in
    # between would take the machine's memory (D11's "3 KB of packs, 2 GiB resident" is left out).
    scalars = st.one_of(
        st.none(), st.booleans(),
        st.integers(-5, 70), st.integers(2**40, 2**70), st.integers(-(2**63), -1),
        st.floats(allow_nan=False), st.text(max_size=12),
        st.sampled_from(["bfloat16", "float32", "__class__", "full/2", "add-sparse/1", "xor-dense/1", "anchor",
                         "delta", "manifests/x.json", "blobs/00/00", "HEAD", "../HEAD"]),
    )  # fmt: skip
    values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=5), c, max_size=3)), max_leaves=6)
    cases: list[tuple[str, Callable[[Hostile], None]]] = []
    kinds = ["HEAD", "manifest", "manifest", *(["stream manifest"] if stream else [])]

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)
    @given(which=st.sampled_from(kinds), pick=st.integers(0, 10**9), value=values, delete=st.booleans())
    def collect(which: str, pick: int, value: Any, delete: bool) -> None:
        def write(h: Hostile, which=which, pick=pick, value=value, delete=delete) -> None:
            doc = {"HEAD": lambda: json.loads(json.dumps(h.head)), "manifest": h.top_stored,
                   "stream manifest": lambda: h.stream_stored(stream)}[which]()
            paths = [p for p in json_paths(doc) if p]
            path = paths[pick % len(paths)]
            doc = _set(doc, path, value, delete and isinstance(path[-1], str))
            if which == "HEAD":
                h.store.put("HEAD", json.dumps(doc).encode(), mode="overwrite")
            elif which == "manifest":
                h.put_manifest_raw(VERSIONS, json.dumps(doc, sort_keys=True).encode())
            else:
                h.put_stream_manifest_raw(stream, json.dumps(doc, sort_keys=True).encode())
        cases.append((f"fuzz {which}", write))

    collect()
    return cases[:n]


# --- the campaign -------------------------------------------------------------------------


def run(server: Any, args: Any) -> Tally:
    from campaigns.model import CHUNK_BYTES, Oracle, serving_formats, with_layout
    from deltastore import DeltastoreError, Publisher, Subscriber
    from deltastore.serving.formats import derive
    from deltastore.storage import open_store
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
    from testkit.manifest_docs import read_manifest_doc

    tally = Tally("hostile", server.kind)
    options = campaign_options(server)
    oracle = Oracle(args.seed)
    model = oracle.model(0)
    formats = serving_formats(args.formats)
    fmt = formats[0] if formats else None
    t0 = time.monotonic()
    template = fresh_url(server, "hostile-template")
    with open_store(template, storage_options=options) as tstore:
        with with_layout(Publisher(template, store=tstore, writer_policy=WriterPolicy(threads=1),
                                   anchor_policy=AnchorPolicy(every=ANCHOR_EVERY),
                                   layout_policy=LayoutPolicy(chunk_bytes=CHUNK_BYTES), formats=formats),
                         args.grid) as pub:
            for k in range(VERSIONS):
                pub.publish(model.state(k), step=k)
        objects = {m.key: tstore.get(m.key) for m in tstore.list()}
        manifests: dict[int, tuple[str, dict[str, Any]]] = {}
        for key in objects:
            if key.startswith("manifests/"):
                doc = read_manifest_doc(tstore, key)  # schema 3: the in-memory shape
                manifests[doc["version"]] = (key, doc)
    head = json.loads(objects["HEAD"])
    layout = {t["name"]: (t["dtype"], list(t["shape"])) for t in manifests[1][1]["tensors"]}
    served_layout = None if fmt is None else {
        n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in derive(model.state(0), fmt).items()}

    handmade = crafted()
    n_fuzz = args.fuzz if args.fuzz is not None else max(0, args.trials - len(handmade))
    cases = handmade[: max(0, args.trials - n_fuzz)]
    if n_fuzz:
        cases += fuzz_cases(args.seed, n_fuzz, None if fmt is None else fmt.name)
    for i, (name, write) in enumerate(cases):
        url = fresh_url(server, "hostile")
        with open_store(url, storage_options=options) as store:
            for key, data in objects.items():
                store.put(key, data, mode="overwrite")
            worker = Subscriber(url, store=store, threads=1)
            target = worker.pull(HELD)
            try:
                write(Hostile(store, head, manifests))
            except (RecursionError, ValueError, KeyError, TypeError, IndexError) as e:
                tally.note("case not written", f"{name}: {type(e).__name__}: {e}")
                worker.close()
                continue
            tally.faults["crafted" if not name.startswith("fuzz") else name] += 1
            label = f"case {i} ({name})"

            def judge(what: str, fn: Callable[[], tuple[Any, int | None]], served: bool = False) -> bool:
                try:
                    state, version = fn()
                except DeltastoreError as e:
                    tally.error(e)
                    tally.note(f"{type(e).__name__}", f"{label}: {what}: {' '.join(str(e).split())[:200]}")
                    return False
                except BaseException as e:  # noqa: BLE001 - the point: an untyped error escaped
                    tally.wrong(f"untyped {type(e).__name__}", f"{label}: {what}: {''.join(traceback.format_exception_only(type(e), e)).strip()[:300]}")
                    return False
                if state is not None:
                    got = {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()}
                    same_layout = got == (served_layout if served else layout)
                    if same_layout and (version is None or not 1 <= version <= VERSIONS):
                        tally.corrupt(f"{label}: {what} returned version {version}, which does not exist")
                    elif same_layout:  # version v holds step v-1
                        why = oracle.differs_in(fmt if served else None, state, version - 1)
                        if why is not None:
                            tally.corrupt(f"{label}: {what} returned version {version} with wrong bits: {why}")
                return True

            def pull_latest():
                with Subscriber(url, store=store, threads=1) as sub:
                    return sub.pull(), sub.version

            def forward():
                info = worker.pull_into(target)
                return target, info.version if info else worker.version

            judge("pull()", pull_latest)
            if fmt is not None:

                def pull_format():
                    with Subscriber(url, store=store, threads=1, format=fmt.name) as sub:
                        return sub.pull(), sub.version

                judge(f"pull() of {fmt.name}", pull_format, served=True)
            if not judge("pull_into", forward):
                why = oracle.differs(target, HELD - 1)
                if why is not None:
                    tally.corrupt(f"{label}: failed pull_into changed the weights: {why}")
            worker.close()

            def log():
                with Subscriber(url, store=store, threads=1) as sub:
                    versions = [v.version for v in sub.log()]
                if versions != list(range(1, len(versions) + 1)):
                    tally.wrong("log accepted a broken chain", f"{label}: log gave versions {versions}")
                return None, None

            judge("log()", log)
            for argv in (["verify", url, "--all"], ["log", url]):
                code, stderr, exc = cli([*argv, *cli_args(server)])
                must_fail = argv[0] == "verify" and name.startswith("D12")
                judge_cli(tally, f"{label}: deltastore {argv[0]}", code, stderr, exc, must_fail=must_fail)
            tally.trials += 1
            for m in store.list():
                store.delete(m.key)
    tally.seconds = time.monotonic() - t0
    tally.extra["seconds_per_trial"] = round(tally.seconds / max(1, tally.trials), 3)
    return tally


def build_parser():
    p = parser("hostile", 200, __doc__ or "")
    p.add_argument("--fuzz", type=int, help="how many of the trials are fuzzed (default: those beyond the hand-crafted cases)")
    return p


if __name__ == "__main__":
    raise SystemExit(main("hostile", run, build_parser()))
