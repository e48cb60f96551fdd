"""History lifecycle benchmark: catch-up cost, bytes per version, retention under GC.

    python -m benchmarks.history [--quick] [--out benchmarks/results/history.json]
    python -m benchmarks.history --table benchmarks/results/history.json   # markdown tables

Three measurements, on the real RL workloads (``rl-1e-6``, ``rl-3e-6``: MiniLM fine-tuned with
AdamW, ``benchmarks.workload``; extended to 64 optimizer steps so that a worker can be 64
versions behind: the cached steps are regenerated when fewer exist, about a minute each):

1. **Catch-up.** Workers holding version ``head − k`` (k = 1, 8, 64; each pulled its version
   right after it was published, so its manifest cache is what a real worker's would be) fast-
   forward to head through a store wrapper that counts every GET (HEAD, manifests, index,
   layouts, squash manifests, packs) and its bytes. Compared with the size of ONE squashed
   delta from the worker's version to head, two ways: the compactor's
   (``compact(store, bases=[...], register=True)``; then a second set of workers catches up
   with the squashes registered), and composed offline from the chain's stored delta segments
   with ``codec.compose_deltas`` per chunk (segments only, no squash manifest; labelled
   ``offline``).
2. **Bytes per version.** For every delta version: its delta packs, its stored manifest object
   (and layout object when one is written), what a worker following every version fetched
   (all GETs), against the order-0 entropy estimate of the step (``peers.entropy_bytes``, the
   ``/ H0`` reference of docs/benchmarks.md).
3. **Retention.** 1,000 versions of a tiny Llama-shaped decoder (``benchmarks.models``, d_model
   64, trained by AdamW at lr 1e-6 on next-token prediction over the workloads' corpus) with
   ``deltastore.lifecycle.gc.collect(store, keep_last=..., grace_s=0)`` every 50 versions; the
   store's size (sum of listed object sizes) after every version, a worker lagging 30
   versions (heartbeating its version to the ledger) and a worker holding an early version
   that GC collected, resumed (same Subscriber) and restarted (fresh Subscriber): each must end
   bit-exact.

``--quick`` replaces the MiniLM workloads with a tiny MLP trained by AdamW on a synthetic
regression task (no transformers needed) and runs 200 retention versions: about 15 s.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import itertools
import json
import logging
import platform
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltastore.lifecycle.compact import compact
from deltastore.lifecycle.gc import collect
from deltastore.lifecycle.index import read_index
from deltastore.storage.base import GetResult, ObjectMeta, Store
from deltastore.write.policy import WriterPolicy
from benchmarks.history_report import markdown, plot, plot_svg
from testkit.tensors import state_sha256

logger = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Catch-up distances: a worker one, eight and 64 versions behind.
CATCHUP_KS = (1, 8, 64)
CATCHUP_WORKLOADS = ("rl-1e-6", "rl-3e-6")
# The retention run: 1,000 versions, GC every 50.
RETENTION_VERSIONS = 1000
GC_EVERY = 50
# GC's default keep-last (design 005 D2); the lagging worker below it is kept by the ledger.
KEEP_LAST = 10
# The lagging worker of the goal.
LAG = 30
# The worker that is restarted holds this version, collected long before the end.
RESTART_FROM = 5
# --quick: enough versions for three GC rounds and a 30-version lag; about 15 s here.
QUICK_RETENTION_VERSIONS = 200
# Threads for publisher and subscribers: the machine has two cores.
THREADS = 2
# Tiny decoder for the retention run: ~4M parameters (8 MB bf16), mostly the embedding and the
# untied LM head (the tokenizer's 30,522 tokens); an optimizer step plus a publish is ~0.1 s.
TINY_DECODER = {"name": "tf-tiny", "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 192}
# Tiny MLP of --quick and the smoke test: lr and init chosen so that a few % of bf16 elements
# change per step, as at RL learning rates on a real model (|update| ≈ lr against ulp(|w|)).
MLP_DIMS = (64, 256, 256, 32)
MLP_LR = 3e-6
MLP_INIT_STD = 0.02
MLP_BATCH = 32
SEED = 1234


# --- a store that counts what a reader fetches ---------------------------------------------------


def key_kind(key: str) -> str:
    """What a key holds, by the naming of SPEC (schemas 1–3)."""
    if key == "HEAD":
        return "head"
    if key.startswith("manifests/"):
        return "manifest"
    if key.startswith("workers/"):
        return "ledger"
    name = key.rsplit("/", 1)[-1]
    for part in ("squash", "index", "layout"):
        if f".{part}." in name:
            return part
    if name.endswith(".pack"):
        return "pack"
    return "other"


class CountingStore(Store):
    """Delegates to ``inner`` and counts every read request and the bytes it returned, by kind.

    Reads are ``get`` (whole or ranged), ``get_with_meta``, ``get_if_changed`` (a 304 counts as
    a request of 0 bytes), ``head`` and ``list``; any ``get_range`` a newer Store grows is
    counted too. Writes are passed through uncounted.
    """

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.conditional_writes_need_probe = getattr(inner, "conditional_writes_need_probe", False)
        self._lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def _note(self, key: str, n: int) -> None:
        kind = key_kind(key)
        with self._lock:
            self.requests[kind] += 1
            self.bytes[kind] += n

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """(requests, bytes) by kind so far."""
        with self._lock:
            return dict(self.requests), dict(self.bytes)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        data = self.inner.get(key, byte_range=byte_range)
        self._note(key, len(data))
        return data

    def get_range(self, key: str, *args: Any, **kwargs: Any) -> Any:  # only if the inner store has it
        data = self.inner.get_range(key, *args, **kwargs)  # type: ignore[attr-defined]
        self._note(key, len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0)
        return data

    def get_with_meta(self, key: str) -> GetResult:
        r = self.inner.get_with_meta(key)
        self._note(key, len(r.data))
        return r

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        r = self.inner.get_if_changed(key, etag)
        self._note(key, 0 if r is None else len(r.data))
        return r

    def head(self, key: str) -> ObjectMeta:
        self._note(key, 0)
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        self._note(prefix or "other", 0)
        return self.inner.list(prefix)

    def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> ObjectMeta:
        return self.inner.put(key, data, mode=mode)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def __getattr__(self, name: str) -> Any:  # anything a newer Store grows
        return getattr(self.inner, name)

    def close(self) -> None:
        """The inner store belongs to the caller."""


def _diff(after: tuple[dict, dict], before: tuple[dict, dict]) -> dict[str, Any]:
    req = {k: v - before[0].get(k, 0) for k, v in after[0].items() if v - before[0].get(k, 0)}
    byt = {k: v - before[1].get(k, 0) for k, v in after[1].items() if v - before[1].get(k, 0)}
    return {"requests": req, "bytes": byt, "total_requests": sum(req.values()),
            "total_bytes": sum(byt.values())}


def _jsonable(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "to_json"):
        out = obj.to_json()
        return json.loads(out) if isinstance(out, (str, bytes)) else _jsonable(out)
    if dataclasses.is_dataclass(obj):
        return _jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json", by_alias=True)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    return repr(obj)


def _revision() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --- state sources -------------------------------------------------------------------------------


def digest(sd: StateDict) -> str:
    """SHA-256 over names, dtypes, shapes and raw bits of every tensor, in name order."""
    return state_sha256(sd)


def bit_equal(a: StateDict, b: StateDict) -> bool:
    """Same names, dtypes, shapes and bits (``torch.equal`` on integer views: NaN, -0.0 safe)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    return True


def mlp_states(steps: int, seed: int = SEED) -> Iterator[StateDict]:
    """A tiny MLP trained by AdamW on a fixed synthetic regression task; bf16 export per step.

    Real gradients and a real optimizer (not noise): the updates have Adam's structure, so the
    changed fraction falls as the second moment builds up, as on the real workloads.
    """
    g = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(MLP_DIMS)):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) * MLP_INIT_STD)
            lin.bias.copy_(torch.randn(b, generator=g) * MLP_INIT_STD)
        layers.append(lin)
        if i < len(MLP_DIMS) - 2:
            layers += [torch.nn.LayerNorm(b), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    teacher = torch.randn(MLP_DIMS[0], MLP_DIMS[-1], generator=g) / MLP_DIMS[0] ** 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=MLP_LR, weight_decay=0.0)

    def export() -> StateDict:
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}

    yield export()
    for _ in range(steps):
        x = torch.randn(MLP_BATCH, MLP_DIMS[0], generator=g)
        y = torch.tanh(x @ teacher)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield export()


def decoder_states(steps: int) -> Iterator[StateDict]:
    """The tiny Llama-shaped decoder, trained like the tf* workloads (not cached on disk)."""
    from benchmarks.models import SHAPES
    from benchmarks.workload import WORKLOADS, iter_states

    base = SHAPES["tf125m"]
    shape = dataclasses.replace(base, **TINY_DECODER)
    spec = dataclasses.replace(WORKLOADS["tf125m-rl-1e-6"], name="tf-tiny-rl-1e-6", steps=steps,
                               model=shape)
    return iter_states(spec)


def workload_states(name: str, steps: int) -> Iterator[StateDict]:
    """Steps 0..steps of a cached workload (generated first when fewer steps are cached)."""
    from benchmarks.workload import ensure_workload, load_step

    ensure_workload(name, steps)
    for s in range(steps + 1):
        yield load_step(name, s)


# --- reading the store ---------------------------------------------------------------------------


def _history(store: Store) -> Any:
    from deltastore.format.history import History

    return History(store)


def _head(history: Any) -> Any:
    got = history.read_head()
    if got is None:
        raise RuntimeError("empty store")
    return got[0]


def _unsigned(dtype_name: str) -> np.dtype:
    from deltastore.layout.tensors import DTYPE_WIDTHS

    return np.dtype(f"u{DTYPE_WIDTHS[dtype_name]}")


def _chunk_values(t: torch.Tensor, chunk_rows: int, index: int, count: int) -> np.ndarray:
    flat = t.detach().contiguous().reshape(-1)
    row = 1
    for d in t.shape[1:]:
        row *= d
    start = index * chunk_rows * row if t.dim() else 0
    width = flat.element_size()
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).numpy()
    return bits[start:start + count].view(np.dtype(f"u{width}"))


def offline_squash(store: Store, from_version: int, to_version: int, old: StateDict,
                   new: StateDict, *, direct: bool = False) -> dict[str, Any]:
    """Bytes of one squashed delta ``from → to`` composed from the stored deltas, per chunk.

    Each chunk's delta segments of versions from+1..to are composed with
    ``codec.compose_deltas``; a chunk that has no delta segment in some version of the chain
    (an anchor written without deltas) is encoded directly with ``codec.encode_delta`` from the
    two states (the same delta by construction). Segment bytes only: no squash manifest.
    ``direct=True`` encodes every chunk that way (a cross-check of the composition).
    """
    from deltastore.codec.compose import compose_deltas
    from deltastore.codec.delta import encode_delta
    from deltastore.format.models import chunk_elements

    history = _history(store)
    head = _head(history)
    key, m = history.find(to_version, head)
    chain = history.chain(key, m, down_to=from_version + 1)
    per_chunk: dict[tuple[str, int], list[tuple[bytes, str] | None]] = collections.defaultdict(list)
    specs: dict[str, tuple[str, tuple[int, ...], int]] = {}
    segs_read = 0
    for _, mm in chain:
        for te in mm.tensors:
            specs[te.name] = (te.dtype, tuple(te.shape), te.chunk_rows)
            for ch in te.chunks:
                if ch.delta is not None:
                    blob = mm.blobs[ch.delta.blob]
                    data = store.get(blob.key, byte_range=(ch.delta.offset, ch.delta.offset + ch.delta.length))
                    per_chunk[(te.name, ch.index)].append((data, ch.delta.codec))
                    segs_read += 1
                elif ch.full is not None and mm.kind == "anchor" and mm.delta_base is None:
                    per_chunk[(te.name, ch.index)].append(None)  # a snapshot without a delta: no bridge
    total = composed = direct = cancelled = 0
    for (name, index), segs in per_chunk.items():
        dtype, shape, chunk_rows = specs[name]
        count = chunk_elements(shape, chunk_rows, index)
        udt = _unsigned(dtype)
        if direct or any(s is None for s in segs):
            seg = encode_delta(_chunk_values(old[name], chunk_rows, index, count),
                               _chunk_values(new[name], chunk_rows, index, count))
            n = 0 if seg is None else len(seg.data)
            direct += 1
        else:
            data: bytes | None = None
            codec = ""
            for b, codec_b in segs:
                if data is None:  # nothing yet, or what came before cancelled out
                    data, codec = b, codec_b
                    continue
                out = compose_deltas(data, b, codec_a=codec, codec_b=codec_b, dtype=udt, count=count)
                data, codec = (None, "") if out is None else (out.data, out.codec)
            n = 0 if data is None else len(data)
            composed += 1
        cancelled += n == 0
        total += n
    return {"bytes": total, "chunks_composed": composed, "chunks_encoded_directly": direct,
            "chunks_cancelled": cancelled, "segments_read": segs_read, "versions": len(chain)}


def _blob_sizes(m: Any, roles: Iterable[str | None] | None = None) -> int:
    return sum(b.size for b in m.blobs if roles is None or getattr(b, "role", None) in roles)


def _delta_pack_bytes(m: Any) -> int:
    """Bytes of the packs a worker following every version fetches for ``m``: every pack of a
    delta version; of an anchor version, the packs its delta segments are in."""
    if m.kind == "delta":
        return _blob_sizes(m)
    used = {ch.delta.blob for te in m.tensors for ch in te.chunks if ch.delta is not None}
    return sum(m.blobs[i].size for i in used)


def _object_size(store: Store, key: str) -> int:
    return store.head(key).size


def store_size(store: Store) -> tuple[int, int]:
    """(objects, bytes) of everything listed in the store."""
    n = size = 0
    for meta in store.list(""):
        n += 1
        size += meta.size
    return n, size


# --- 1 + 2: catch-up and bytes per version -------------------------------------------------------


def _squash_from_index(store: Store, frm: int, to: int) -> dict[str, Any] | None:
    """The registered squash ``frm → to``: packs + squash manifest bytes, or None."""
    history = _history(store)
    head = _head(history)
    idx = read_index(history, head)
    if idx is None:
        return None
    refs = [r for r in idx.squashes if r.from_ == frm and r.to == to]
    if not refs:
        return None
    ref = refs[-1]
    manifest_bytes = _object_size(store, ref.key)
    packs = None
    try:
        if hasattr(history, "squash"):
            sq = history.squash(ref)
        else:
            from deltastore.format.models import SquashManifest
            from deltastore.format.objects import decode_object

            sq = decode_object(SquashManifest, store.get(ref.key), ref.key, ref.sha256)
        packs = sum(b.size for b in sq.blobs)
    except Exception as e:  # noqa: BLE001 - a figure missing is reported, not fatal
        logger.warning("cannot read squash %s: %s", ref.key, e)
    return {"key": ref.key, "ref_bytes": ref.bytes, "manifest_bytes": manifest_bytes,
            "pack_bytes": packs,
            "bytes": (packs + manifest_bytes) if packs is not None else ref.bytes}


def catchup(name: str, states: Iterable[StateDict], n: int, ks: Sequence[int], workdir: Path) -> dict[str, Any]:
    """Publish ``n`` states, measure catch-up from head − k and bytes per version (see module doc).

    Only the states the checks need are kept (previous, the workers' versions, the last), so a
    64-step MiniLM run holds a few models in memory, not 65.
    """
    from benchmarks.peers import entropy_bytes
    from deltastore import Publisher, Subscriber
    from deltastore.storage import open_store

    ks = [k for k in ks if n - k >= 1]
    raw = open_store(str(workdir / f"store-{name}"))
    holders = {k: n - k for k in ks}
    sets = ["chain", "compacted"]
    workers: dict[tuple[str, int], tuple[Any, CountingStore]] = {}
    for s in sets:
        for k in ks:
            cs = CountingStore(raw)
            workers[(s, k)] = (Subscriber(raw.url, store=cs, threads=THREADS), cs)
    targets: dict[tuple[str, int], StateDict] = {}
    follower_cs = CountingStore(raw)
    follower = Subscriber(raw.url, store=follower_cs, threads=THREADS)
    follow_target: StateDict | None = None
    per_version: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    pub = Publisher(raw.url, store=raw, writer_policy=WriterPolicy(threads=THREADS))
    history = _history(raw)
    kept: dict[int, StateDict] = {}
    prev: StateDict | None = None
    model_bytes = 0
    try:
        for v, state in enumerate(states, start=1):
            if v > n:
                break
            if v in holders.values() or v == n:
                kept[v] = state
            model_bytes = sum(t.numel() * t.element_size() for t in state.values())
            info = pub.publish(state, step=v - 1)
            before = follower_cs.snapshot()
            if follow_target is None:
                follow_target = follower.pull()
            else:
                follower.pull_into(follow_target)
            fetched = _diff(follower_cs.snapshot(), before)
            if not bit_equal(follow_target, state):
                raise AssertionError(f"{name}: follower not bit-exact at version {v}")
            for (s, k), (sub, _) in workers.items():
                if holders[k] == v:
                    targets[(s, k)] = sub.pull(v)
            key, m = history.find(v, _head(history))
            row: dict[str, Any] = {"version": v, "kind": m.kind, "manifest_key": key,
                                   "manifest_bytes": _object_size(raw, key),
                                   "pack_bytes": _delta_pack_bytes(m), "all_pack_bytes": _blob_sizes(m),
                                   "follower_fetched": fetched}
            layout = getattr(m, "layout", None)
            if layout is not None and (v == 1 or layout.key != per_version[-1].get("layout_key")):
                row["layout_bytes"] = _object_size(raw, layout.key)
            row["layout_key"] = None if layout is None else layout.key
            if prev is not None:
                row["h0_bytes"] = entropy_bytes(prev, state)
            prev = state
            per_version.append(row)
            logger.info("%s: version %d (%s) published, %d pack bytes", name, v, info.kind, row["pack_bytes"])
        publish_s = time.perf_counter() - t_start

        results: list[dict[str, Any]] = []
        if len(per_version) != n:
            raise ValueError(f"{name}: {len(per_version)} states, {n} expected")
        final = kept[n]
        squash_offline = {k: offline_squash(raw, n - k, n, kept[n - k], final) for k in ks}

        def run_set(s: str, squash: dict[int, dict[str, Any] | None]) -> None:
            for k in ks:
                sub, cs = workers[(s, k)]
                before = cs.snapshot()
                fetched_before = sub.bytes_fetched
                t0 = time.perf_counter()
                sub.pull_into(targets[(s, k)])
                dt = time.perf_counter() - t0
                got = _diff(cs.snapshot(), before)
                exact = bit_equal(targets[(s, k)], final)
                off = squash_offline[k]["bytes"]
                real = squash.get(k)
                results.append({
                    "set": s, "k": k, "from": n - k, "to": n, "seconds": dt,
                    "fetched_bytes": got["total_bytes"], "fetched_by_kind": got["bytes"],
                    "requests": got["total_requests"], "requests_by_kind": got["requests"],
                    "manifest_requests": got["requests"].get("manifest", 0),
                    "metadata_requests": sum(v for kk, v in got["requests"].items() if kk != "pack"),
                    "subscriber_bytes_fetched": sub.bytes_fetched - fetched_before,
                    "squash_offline_bytes": off,
                    "ratio_offline": got["total_bytes"] / off if off else None,
                    "squash_bytes": None if real is None else real["bytes"],
                    "ratio": (got["total_bytes"] / real["bytes"]) if real and real["bytes"] else None,
                    "chain_delta_bytes": sum(r["pack_bytes"] for r in per_version[n - k:]),
                    "bit_exact": exact,
                })
                logger.info("%s %s k=%d: fetched %d B in %d requests (offline squash %d B)", name, s, k,
                            got["total_bytes"], got["total_requests"], off)

        run_set("chain", {})
        compact_info: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            rep = compact(raw, bases=[n - k for k in ks], register=True)
            compact_info["seconds"] = time.perf_counter() - t0
            compact_info["report"] = _jsonable(rep)
            squash = {k: _squash_from_index(raw, n - k, n) for k in ks}
            compact_info["squashes"] = {str(k): sq for k, sq in squash.items()}
            # The chain set's ratios against the compactor's squash too.
            for r in results:
                sq = squash.get(r["k"])
                if sq and sq["bytes"]:
                    r["squash_bytes"] = sq["bytes"]
                    r["ratio"] = r["fetched_bytes"] / sq["bytes"]
            run_set("compacted", squash)
        except Exception as e:  # reported in the results, the rest still stands
            logger.exception("compaction failed")
            compact_info["error"] = f"{type(e).__name__}: {e}"
    finally:
        pub.close()
        follower.close()
        for sub, _ in workers.values():
            sub.close()

    deltas = [r for r in per_version if r["version"] > 1 and r.get("h0_bytes")]
    only_delta = [r for r in deltas if r["kind"] == "delta"]
    per_version_summary = _bytes_summary(only_delta)
    per_version_summary["versions"] = len(only_delta)
    per_version_summary["all_versions_incl_anchors"] = _bytes_summary(deltas)
    return {
        "workload": name, "versions": n, "model_bytes": model_bytes,
        "publisher": {"anchor_every": pub.anchor_policy.every, "anchor_policy": pub.anchor_policy.rule},
        "anchors": [r["version"] for r in per_version if r["kind"] == "anchor"],
        "publish_s": publish_s, "catchup": results, "squash_offline": {str(k): v for k, v in squash_offline.items()},
        "compact": compact_info, "bytes_per_version": per_version_summary,
        "per_version": [{k: v for k, v in r.items() if k not in ("manifest_key", "layout_key")} for r in per_version],
    }


def _bytes_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {}

    def med(f: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(f(r) for r in rows)

    return {
        "pack_bytes": med(lambda r: r["pack_bytes"]),
        "manifest_bytes": med(lambda r: r["manifest_bytes"]),
        "h0_bytes": med(lambda r: r["h0_bytes"]),
        "follower_fetched_bytes": med(lambda r: r["follower_fetched"]["total_bytes"]),
        "follower_requests": med(lambda r: r["follower_fetched"]["total_requests"]),
        "pack_over_h0": med(lambda r: r["pack_bytes"] / r["h0_bytes"]),
        "pack_manifest_over_h0": med(lambda r: (r["pack_bytes"] + r["manifest_bytes"] + r.get("layout_bytes", 0))
                                     / r["h0_bytes"]),
        "manifest_over_pack": med(lambda r: r["manifest_bytes"] / r["pack_bytes"]),
        "fetched_over_h0": med(lambda r: r["follower_fetched"]["total_bytes"] / r["h0_bytes"]),
    }


# --- 3: retention --------------------------------------------------------------------------------


def retention(states: Iterable[StateDict], versions: int, *, gc_every: int = GC_EVERY,
              keep_last: int = KEEP_LAST, lag: int = LAG, restart_from: int = RESTART_FROM,
              csv_path: Path | None = None) -> dict[str, Any]:
    """Publish ``versions`` states with GC every ``gc_every``; track store size and two workers."""
    from deltastore import Publisher, Subscriber
    from deltastore.fleet.ledger import HeartbeatWriter
    from deltastore.storage import open_store

    store = open_store(f"memory://history-bench-{uuid.uuid4().hex[:8]}")
    pub = Publisher(store.url, store=store, writer_policy=WriterPolicy(threads=THREADS))
    lag_cs, restart_cs = CountingStore(store), CountingStore(store)
    lagger = Subscriber(store.url, store=lag_cs, threads=THREADS)
    beats = HeartbeatWriter(store, "lagging-worker")
    restarter = Subscriber(store.url, store=restart_cs, threads=THREADS)
    lag_target: StateDict | None = None
    old_target: StateDict | None = None
    digests: dict[int, str] = {}
    rows: list[dict[str, Any]] = []
    gc_runs: list[dict[str, Any]] = []
    lag_checks = lag_fail = 0
    lag_errors: list[str] = []
    last: StateDict | None = None
    aborted: str | None = None
    t0 = time.perf_counter()
    try:
        for v, state in enumerate(states, start=1):
            if v > versions:
                break
            try:
                pub.publish(state, step=v - 1)
            except Exception as e:  # a publisher broken by GC is a result, not a crash
                logger.exception("retention: publish of version %d failed", v)
                aborted = f"publish of version {v} failed: {type(e).__name__}: {e}"
                break
            digests[v] = digest(state)
            last = state
            if v == restart_from:
                old_target = restarter.pull(v)
            lv = v - lag
            if lv >= 1:
                try:
                    if lag_target is None:
                        lag_target = lagger.pull(lv)
                    else:
                        lagger.pull_into(lag_target, version=lv)
                    lag_checks += 1
                    lag_fail += digest(lag_target) != digests[lv]
                    beats.beat(lv, force=True)
                except Exception as e:  # noqa: BLE001 - counted; the goal is that none happens
                    lag_errors.append(f"v{v}: {type(e).__name__}: {e}")
                    lag_target = None
                    lagger = Subscriber(store.url, store=lag_cs, threads=THREADS)
            for old in [k for k in digests if k < v - lag - 1]:
                del digests[old]  # only the lagging window is compared
            gc_row = None
            if v % gc_every == 0:
                g0 = time.perf_counter()
                try:
                    rep = collect(store, keep_last=keep_last, grace_s=0.0, unsafe_grace_ok=True)
                    gc_row = {"version": v, "seconds": time.perf_counter() - g0, "report": _jsonable(rep)}
                except Exception as e:  # reported
                    logger.exception("gc failed at version %d", v)
                    gc_row = {"version": v, "error": f"{type(e).__name__}: {e}"}
                gc_runs.append(gc_row)
            n_obj, size = store_size(store)
            rows.append({"version": v, "objects": n_obj, "bytes": size, "gc": int(gc_row is not None)})
            if v % 100 == 0:
                logger.info("retention: version %d, %d objects, %d bytes", v, n_obj, size)
        elapsed = time.perf_counter() - t0
        assert last is not None
        head = len(rows)
        final = {k: t.clone() for k, t in last.items()}

        def finish(label: str, sub: Any, cs: CountingStore, target: StateDict | None) -> dict[str, Any]:
            out: dict[str, Any] = {"worker": label}
            if target is None:
                out["error"] = "never pulled"
                return out
            if sub is None:  # a restarted process: a fresh Subscriber, the tensors it kept
                sub = Subscriber(store.url, store=cs, threads=THREADS)
            before = cs.snapshot()
            try:
                sub.pull_into(target)
                out["outcome"] = "pull_into"
            except Exception as e:  # noqa: BLE001 - the recovery a real worker does: pull afresh
                out["pull_into_error"] = f"{type(e).__name__}: {e}"
                fresh_sub = Subscriber(store.url, store=cs, threads=THREADS)
                got = fresh_sub.pull()
                for k, t in got.items():
                    target[k].copy_(t)
                out["outcome"] = "pull() after pull_into failed"
            out["fetched"] = _diff(cs.snapshot(), before)
            out["bit_exact"] = bit_equal(target, final)
            return out

        lag_result = finish("lagging", lagger, lag_cs, lag_target)
        lag_result.update(checks=lag_checks, mismatches=lag_fail, errors=lag_errors[:10],
                          n_errors=len(lag_errors))
        resumed = finish("resumed", restarter, restart_cs,
                         None if old_target is None else {k: t.clone() for k, t in old_target.items()})
        restarted = finish("restarted", None, CountingStore(store), old_target)
    finally:
        try:
            pub.close()
        except Exception:  # already reported through ``aborted``
            logger.exception("retention: closing the publisher failed")
    sizes = [r["bytes"] for r in rows]
    if csv_path is not None:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["version", "objects", "bytes", "gc"])
            w.writeheader()
            w.writerows(rows)
    half = sizes[len(sizes) // 2:]
    return {
        "versions": head, "gc_every": gc_every, "keep_last": keep_last,
        "lag": lag, "restart_from": restart_from, "seconds": elapsed,
        "model_bytes": sum(t.numel() * t.element_size() for t in final.values()),
        "final_bytes": sizes[-1], "max_bytes": max(sizes), "final_objects": rows[-1]["objects"],
        "max_bytes_second_half": max(half), "min_bytes_second_half": min(half),
        "bytes_at": {str(v): sizes[v - 1] for v in sorted({gc_every, 2 * gc_every, head // 2, head}) if 1 <= v <= head},
        "gc_runs": gc_runs, "workers": [lag_result, resumed, restarted],
        "sizes": sizes,
        "aborted": aborted,
    }


def run(*, quick: bool, out: Path, ks: Sequence[int] = CATCHUP_KS, workloads: Sequence[str] | None = None,
        retention_versions: int | None = None, gc_every: int = GC_EVERY, keep_last: int = KEEP_LAST,
        lag: int = LAG, restart_from: int = RESTART_FROM, skip_retention: bool = False,
        skip_catchup: bool = False) -> dict[str, Any]:
    """Everything, written to ``out`` (JSON) with ``.csv``, ``.md`` and a plot (``.png`` with
    matplotlib, else ``.svg``) beside it."""
    torch.set_num_threads(1)  # deltastore's own threads do the work
    steps = max(ks)
    res: dict[str, Any] = {"revision": _revision(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "quick": quick, "python": platform.python_version(),
                           "torch": torch.__version__, "catchup": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds-history-") as tmp:
        names = [] if skip_catchup else list(workloads) if workloads is not None else (["tiny-mlp"] if quick else list(CATCHUP_WORKLOADS))
        for name in names:
            states = mlp_states(steps) if name == "tiny-mlp" else workload_states(name, steps)
            res["catchup"].append(catchup(name, states, steps + 1, ks, Path(tmp)))
    if not skip_retention:
        n = retention_versions or (QUICK_RETENTION_VERSIONS if quick else RETENTION_VERSIONS)
        source = mlp_states(n) if quick else decoder_states(n)
        res["retention"] = retention(source, n, gc_every=gc_every, keep_last=keep_last, lag=lag,
                                     restart_from=restart_from, csv_path=out.with_suffix(".csv"))
        res["retention"]["source"] = "tiny MLP" if quick else f"tiny decoder {TINY_DECODER}"
        if plot(res["retention"]["sizes"], gc_every, out.with_suffix(".png")):
            res["retention"]["plot"] = str(out.with_suffix(".png").name)
        else:
            plot_svg(res["retention"]["sizes"], gc_every, out.with_suffix(".svg"))
            res["retention"]["plot"] = str(out.with_suffix(".svg").name)
    res["seconds"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny MLP instead of MiniLM; 200 retention versions")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "history.json",
                   help="JSON results (CSV, markdown and PNG written beside it)")
    p.add_argument("--workloads", nargs="+", default=None, help="catch-up workloads (default rl-1e-6 rl-3e-6)")
    p.add_argument("--ks", type=int, nargs="+", default=list(CATCHUP_KS))
    p.add_argument("--retention-versions", type=int, default=None)
    p.add_argument("--no-retention", action="store_true")
    p.add_argument("--no-catchup", action="store_true")
    p.add_argument("--table", type=Path, default=None, help="print the markdown tables of a results JSON and exit")
    args = p.parse_args(argv)
    if args.table is not None:
        print(markdown(json.loads(args.table.read_text())), end="")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = run(quick=args.quick, out=args.out, ks=args.ks, workloads=args.workloads,
              retention_versions=args.retention_versions, skip_retention=args.no_retention,
              skip_catchup=args.no_catchup)
    print(markdown(res), end="")
    print(f"results: {args.out} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
