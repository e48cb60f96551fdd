"""Scale out, the read side: partial pulls, a far link, fan-out.

    python -m benchmarks.scale [--steps 4] [--workers 32] [--only SECTION] [--workload W]
    python -m benchmarks.scale --only grid --workload tf265m-rl-1e-6 --steps 6 --reps 5

Everything runs against a real S3 server (moto or SeaweedFS, deltastore.devserver) on 127.0.0.1, with the
cached RL workload ``rl-1e-6`` (MiniLM, 22.7M parameters, bf16, real AdamW steps at lr 1e-6;
benchmarks/workload.py). Four measurements, one run, figures side by side:

``partial``
    A worker holding 1/8 of the model, by names (a contiguous block of tensors holding 1/8 of
    the bytes, as a pipeline stage) and by rows (rank 3 of 8 of every tensor with ≥ 8 rows,
    the rest whole), against a whole subscriber: bytes fetched for the first pull and per
    version after it, for the publisher's default chunking (plain 16 MiB chunks),
    ``Publisher(slice_align=8)`` (16 MiB target, edges on the 1/8 row slices), and 12 KiB
    (see CHUNKINGS).
    On a Llama-shaped model (``--workload tf265m-rl-1e-6``) also a tensor-parallel rank (rank 3
    of 8: q, k, v, gate, up and the vocabulary cut by rows, ``ROW_PARALLEL`` (o, down) by
    columns, norms whole; every rank's figures too, except with the default chunking) and a
    third chunking, ``slice_align=8`` with a column grid on ``ROW_PARALLEL`` (design 011);
    the 12 KiB chunking is left out there. Held bytes and spare bytes (edge chunks' bits kept
    beside the user's tensors) are reported with the bytes read.
    Every partial result is checked bit-exact against torch's slice of the full state.
``chunking``
    What ``slice_align=8`` costs a whole worker against the default chunking (plain 16 MiB
    chunks), interleaved on a local store: chunks, delta and manifest bytes, publish and
    ``pull_into`` time per version.
``grid`` (only when asked: ``--only grid``, on a Llama-shaped ``--workload``)
    What the column grid costs a whole worker (design 011 D10 step 6): ``slice_align=8`` with
    and without ``column_slices=ROW_PARALLEL``, interleaved ``--reps`` times on a tmpfs store,
    publisher and worker each in a fresh interpreter: delta publish, anchor, ``pull``,
    ``pull_into`` and chain ``pull`` times with each call's peak RSS rise; grid / none ratios.
``far``
    A worker behind testkit.shaper.LinkShaper (100 Mbit/s, 80 ms RTT, 0.1 % packet loss),
    the publisher next to the bucket, on SeaweedFS where it is installed (it keeps connections
    alive, as S3 does; moto closes each one, so every request would pay a second RTT) or moto
    (``--far-server``); the worker's requests and new connections are counted per version.
    Time from the start of ``publish`` to fresh weights in
    the worker's tensors: deltastore (publish, then the worker's ``pull_into`` through the
    link) against full-checkpoint sync (``safetensors.save_file``, upload, then the worker's
    download through the link with boto3's TransferManager — 8 MiB ranged GETs on 10
    connections, as ``aws s3 cp`` — and ``load_file``). Per-element costs for docs/scale.md.
``fanout``
    M worker processes (forked) follow one publisher on one moto server: requests and bytes
    per worker per version, HEAD-to-applied latency (publish return → the worker's follow
    yields the version), every worker bit-exact with the last version at the end.

This machine has 2 cores shared with other work: times are noisy; ratios within a section
come from the same run. Results: benchmarks/results/scale.{json,md}.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.grid_ab import bench_grid_ab, grid_markdown
from deltastore import PollPolicy, Publisher, Subscriber
from deltastore.write.policy import AnchorPolicy, LayoutPolicy
from deltastore.layout.select import ROW_PARALLEL, Selection
from deltastore.storage import open_store
from deltastore.layout.tensors import bits

RESULTS = Path(__file__).parent / "results"
WORKLOAD = "rl-1e-6"
#: The far worker: 100 Mbit/s, 80 ms RTT, 0.1 % loss.
FAR = {"bytes_per_s": 12.5e6, "rtt_s": 0.08, "loss": 0.001}
#: Chunkings measured for partial pulls, as ``(label, chunk_bytes, slice_align, column_slices)``:
#: the publisher's default (plain 16 MiB chunks: most MiniLM tensors one chunk),
#: ``slice_align=8`` at the same target (chunk edges on the 1/8 row slices where rows allow,
#: deltastore.layout.tensors.slice_chunk_rows), ``slice_align=8`` with a column grid on the row-parallel
#: weights (design 011: only where the model has them, i.e. Llama-shaped), and 12 KiB (16 rows
#: of the 384-wide matrices, which divide every 1/8 slice of them; the hand-picked setting the
#: default rule needs; MiniLM only).
CHUNKINGS = (("default (16 MiB)", 16 * 1024 * 1024, None, None), ("slice_align=8", 16 * 1024 * 1024, 8, None),
             ("slice_align=8 + grid", 16 * 1024 * 1024, 8, ROW_PARALLEL), ("12 KiB", 12 * 1024, None, None))
#: Column-parallel weights of a Llama-shaped model (vLLM cuts them by rows, dimension 0, as it
#: does the vocabulary of the embedding and lm_head); the row-parallel ones are ROW_PARALLEL,
#: cut by columns. A TP rank of the partial benchmark holds these two sets cut, norms whole.
COLUMN_PARALLEL = ("*.q_proj.weight", "*.k_proj.weight", "*.v_proj.weight", "*.gate_proj.weight",
                   "*.up_proj.weight", "*embed_tokens.weight", "lm_head.weight")
#: The tensor-parallel degree of the partial benchmark's TP row, and the rank shown.
TP, TP_RANK = 8, 3

#: boto3 TransferManager settings of the full-checkpoint baseline (its defaults: 8 MiB parts,
#: 10 threads): what ``aws s3 cp`` of one safetensors file does.
BASELINE_PART_BYTES = 8 * 1024 * 1024
BASELINE_CONCURRENCY = 10


def _states(steps: int, workload: str = WORKLOAD) -> list[dict[str, torch.Tensor]]:
    from benchmarks.workload import load_step

    return [load_step(workload, s) for s in range(steps + 1)]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k].contiguous()), bits(b[k].contiguous())) for k in a)


def _changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    n = sum(int((bits(a[k]) != bits(b[k])).sum()) for k in a)
    return n / sum(t.numel() for t in a.values())


class _Counting:
    """A store that counts requests and body bytes (delegates everything else)."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.requests = 0
        self.bytes = 0
        self.idle_polls = 0  # conditional GETs of HEAD answered 304 (no body)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _n(self, data: Any) -> Any:
        self.requests += 1
        body = data if isinstance(data, (bytes, bytearray, memoryview)) else getattr(data, "data", None)
        self.bytes += len(body) if body is not None else 0
        return data

    def get(self, key: str, **kw: Any) -> bytes:
        return self._n(self._inner.get(key, **kw))

    def get_with_meta(self, key: str) -> Any:
        return self._n(self._inner.get_with_meta(key))

    def get_if_changed(self, key: str, etag: str | None) -> Any:
        got = self._n(self._inner.get_if_changed(key, etag))
        self.idle_polls += got is None
        return got

    def head(self, key: str) -> Any:
        return self._n(self._inner.head(key))

    def exists(self, key: str) -> bool:
        self.requests += 1
        return self._inner.exists(key)

    def list(self, prefix: str = "") -> Any:
        self.requests += 1
        return self._inner.list(prefix)


# --- partial ----------------------------------------------------------------------------------


def _name_block(state: dict[str, torch.Tensor], fraction: float, start: str) -> tuple[str, ...]:
    """A contiguous block of tensor names, from ``start``, holding about ``fraction`` of the bytes."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    names, got, on = [], 0, False
    for n, t in state.items():
        on = on or n.startswith(start)
        if on and got < fraction * total:
            names.append(n)
            got += t.numel() * t.element_size()
    return tuple(names)


def _match(name: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is not None and any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _cut(state: dict[str, torch.Tensor], sel: Selection) -> dict[str, torch.Tensor]:
    """What ``sel`` should hold of ``state``, by torch slicing (the oracle of the partial rows):
    ``shard_dims``' first matching pattern, else ``shard_names`` (default: every tensor with a
    dimension) cut along ``shard``'s dim; part ``r`` of ``w`` is ``[r·n//w, (r+1)·n//w)``."""
    out = {}
    for n, t in state.items():
        if not _match(n, sel.names):
            continue
        if sel.shard is not None:
            dim, r, w = sel.shard
            dims = [d for p, d in sel.shard_dims or () if fnmatch.fnmatchcase(n, p)]
            if dims:
                dim = dims[0]
            elif not (_match(n, sel.shard_names) if sel.shard_names is not None else t.dim() > 0):
                dim = None
            if dim is not None:
                n_ = t.shape[dim]
                t = t.narrow(dim, r * n_ // w, (r + 1) * n_ // w - r * n_ // w)
        out[n] = t.contiguous()
    return out


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _llama_shaped(state: dict[str, torch.Tensor]) -> bool:
    return any(_match(n, ROW_PARALLEL) for n in state) and any(_match(n, COLUMN_PARALLEL) for n in state)


def tp_selection(rank: int, world: int = TP) -> Selection:
    """A tensor-parallel rank of a Llama-shaped model, as vLLM cuts it: column-parallel weights
    (q, k, v, gate, up, the vocabulary) by rows, row-parallel ones (o, down) by columns, norms
    replicated."""
    return Selection(shard=(0, rank, world), shard_names=COLUMN_PARALLEL + ROW_PARALLEL,
                     shard_dims=dict.fromkeys(ROW_PARALLEL, 1))


def _partial_pull(url: str, opts: dict[str, Any], sel: Selection | None,
                  states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One subscriber: ``pull(1)``, then ``pull_into`` each later version; bytes read, bytes held,
    spare bits kept beside the user's tensors (edge chunks, deltastore.layout.select), bit-exactness
    against the torch slice of the last state."""
    with Subscriber(url, storage_options=opts, select=sel) as sub:
        held = sub.pull(1)
        first = sub.bytes_fetched
        per = []
        for v in range(2, len(states) + 1):
            b = sub.bytes_fetched
            sub.pull_into(held, v)
            per.append(sub.bytes_fetched - b)
        want = states[-1] if sel is None else _cut(states[-1], sel)
        partial = sub._reader.partial  # noqa: SLF001 - the benchmark reports the spare bits it keeps
        spare = 0 if partial is None else sum(a.nbytes for a in partial.spare.values())
        return {"first_pull_bytes": first, "per_version_bytes": per, "held_bytes": _nbytes(held),
                "spare_bytes": spare, "bit_exact": _equal(held, want)}


def bench_partial(server: Any, states: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Bytes a worker holding 1/8 reads, per chunking: by names, by rows, and on a Llama-shaped
    model a TP rank (rank TP_RANK of TP; every rank's first pull and per-version bytes too,
    except for the default chunking, where each rank reads nearly the whole model)."""
    s0 = states[0]
    start = "encoder.layer.2." if any(n.startswith("encoder.layer.2.") for n in s0) else "model.layers.4."
    by_names = Selection(names=_name_block(s0, 1 / 8, start))
    tall = tuple(n for n, t in s0.items() if t.dim() and t.shape[0] >= 8)
    by_rows = Selection(shard=(0, 3, 8), shard_names=tall)
    llama = _llama_shaped(s0)
    sels: list[tuple[str, Selection | None]] = [("whole", None), ("names 1/8", by_names), ("rows 3 of 8", by_rows)]
    if llama:
        sels.append((f"TP rank {TP_RANK} of {TP}", tp_selection(TP_RANK)))
    out = []
    for label_, chunk, align, cols in CHUNKINGS:
        if (cols is not None and not llama) or (chunk < 1024 * 1024 and llama):
            continue  # the grid needs row-parallel weights; 12 KiB chunks of a 531 MB model: ~45,000
        url = server.url(f"scale-partial-{uuid.uuid4().hex[:8]}")
        opts = server.storage_options()
        with Publisher(url, storage_options=opts, anchor_policy=AnchorPolicy(every=1000),
                       layout_policy=LayoutPolicy(chunk_bytes=chunk, slice_align=align, column_slices=cols)) as pub:
            for s in states:
                pub.publish(s)
        row: dict[str, Any] = {"chunking": label_, "chunk_bytes": chunk, "slice_align": align,
                               "column_slices": list(cols) if cols else None}
        for label, sel in sels:
            row[label] = _partial_pull(url, opts, sel, states)
        whole = row["whole"]
        for label, _ in sels[1:]:
            r = row[label]
            r["first_pull_ratio"] = r["first_pull_bytes"] / whole["first_pull_bytes"]
            r["per_version_ratio"] = sum(r["per_version_bytes"]) / max(1, sum(whole["per_version_bytes"]))
            r["held_ratio"] = r["held_bytes"] / whole["held_bytes"]
            r["spare_ratio"] = r["spare_bytes"] / whole["held_bytes"]
        if llama and align is not None:
            ranks = []
            for rank in range(TP):
                r = row[sels[-1][0]] if rank == TP_RANK else _partial_pull(url, opts, tp_selection(rank), states)
                ranks.append({"rank": rank, "first_pull_ratio": r["first_pull_bytes"] / whole["first_pull_bytes"],
                              "per_version_ratio": sum(r["per_version_bytes"]) / max(1, sum(whole["per_version_bytes"])),
                              "held_ratio": r["held_bytes"] / whole["held_bytes"],
                              "spare_ratio": r["spare_bytes"] / whole["held_bytes"], "bit_exact": r["bit_exact"]})
            row["tp_ranks"] = ranks
        out.append(row)
    return out


def bench_chunking(states: list[dict[str, torch.Tensor]], reps: int = 3) -> dict[str, Any]:
    """What slice-aligned chunks cost a whole worker: ``slice_align=8`` against the default
    (plain 16 MiB chunks), interleaved ``reps`` times on a local store (tmpfs where there is one):
    chunks, delta and manifest bytes per version, delta publish and ``pull_into`` time (medians)."""
    import shutil
    import tempfile

    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    runs: dict[str, list[dict[str, float]]] = {"default (plain 16 MiB)": [], "slice_align=8": []}
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]
        for label in order:
            d = tempfile.mkdtemp(dir=root, prefix="scale-chunking-")
            url = os.path.join(d, "store")
            try:
                pub_s, sizes, mans = [], [], []
                align = 8 if label.startswith("slice_align") else None
                with Publisher(url, anchor_policy=AnchorPolicy(every=1000),
                               layout_policy=LayoutPolicy(slice_align=align)) as pub:
                    pub.publish(states[0])
                    for s in states[1:]:
                        t = time.perf_counter()
                        info = pub.publish(s)
                        pub_s.append(time.perf_counter() - t)
                        sizes.append(info.bytes_stored)
                        mans.append(os.path.getsize(os.path.join(url, info.manifest)))
                with Subscriber(url) as sub:
                    held = sub.pull(1)
                    chunks = sum(u.n_chunks for u in sub.units().values())
                    pull_s = []
                    for v in range(2, len(states) + 1):
                        t = time.perf_counter()
                        sub.pull_into(held, v)
                        pull_s.append(time.perf_counter() - t)
                    assert _equal(held, states[-1]), "not bit-exact"
            finally:
                shutil.rmtree(d, ignore_errors=True)
            runs[label].append({"chunks": chunks, "delta_bytes": statistics.median(sizes),
                                "manifest_bytes": statistics.median(mans), "publish_s": statistics.median(pub_s),
                                "pull_into_s": statistics.median(pull_s)})
    return {"reps": reps, "medians": {k: {m: statistics.median(r[m] for r in rows) for m in rows[0]} for k, rows in runs.items()}}


# --- far link ---------------------------------------------------------------------------------


def _far_deltastore(server: Any, shaper: Any, states: list[dict[str, torch.Tensor]], part: int | None) -> list[dict[str, Any]]:
    url = server.url(f"scale-far-{uuid.uuid4().hex[:8]}")
    far = server.with_endpoint(shaper.endpoint_url).storage_options()
    store = _Counting(open_store(url, storage_options=far))
    rows: list[dict[str, Any]] = []
    with (Publisher(url, storage_options=server.storage_options()) as pub,
          Subscriber(url, store=store, range_part_bytes=part) as sub):
        pub.publish(states[0])
        held = sub.pull()
        for i, s in enumerate(states[1:], start=1):
            t0 = time.perf_counter()
            pub.publish(s)
            t1 = time.perf_counter()
            b, up, down = sub.bytes_fetched, shaper.bytes_up, shaper.bytes_down
            reqs, conns = store.requests, shaper.connections
            sub.pull_into(held)  # the worker's poll (one HEAD GET) and fast-forward
            t2 = time.perf_counter()
            assert _equal(held, s), "far worker not bit-exact"
            rows.append({"version": i + 1, "publish_s": t1 - t0, "pull_s": t2 - t1, "fresh_s": t2 - t0,
                         "segment_bytes": sub.bytes_fetched - b, "link_bytes_down": shaper.bytes_down - down,
                         "link_bytes_up": shaper.bytes_up - up, "requests": store.requests - reqs,
                         "new_connections": shaper.connections - conns,
                         "changed": _changed_fraction(states[i - 1], s)})
    return rows


def _far_full(server: Any, shaper: Any, states: list[dict[str, torch.Tensor]], part: int, threads: int) -> list[dict[str, Any]]:
    """Full-checkpoint sync: save, upload next to the bucket, download through the link, load."""
    from boto3.s3.transfer import TransferConfig
    from safetensors.torch import load, save

    near_c, far_c = server.boto3_client(), server.with_endpoint(shaper.endpoint_url).boto3_client()
    cfg = TransferConfig(multipart_chunksize=part, multipart_threshold=part, max_concurrency=threads)
    key = f"scale-full-{uuid.uuid4().hex[:8]}/model.safetensors"
    rows: list[dict[str, Any]] = []
    for i, s in enumerate(states[1:], start=1):
        t0 = time.perf_counter()
        blob = save(s)
        near_c.upload_fileobj(io.BytesIO(blob), server.bucket, key, Config=cfg)
        t1 = time.perf_counter()
        down = shaper.bytes_down
        buf = io.BytesIO()
        far_c.download_fileobj(server.bucket, key, buf, Config=cfg)
        got = load(buf.getvalue())
        t2 = time.perf_counter()
        assert _equal(got, s), "full-checkpoint worker not bit-exact"
        rows.append({"version": i + 1, "publish_s": t1 - t0, "pull_s": t2 - t1, "fresh_s": t2 - t0,
                     "file_bytes": len(blob), "link_bytes_down": shaper.bytes_down - down})
    return rows


#: The far worker's range parts in the second deltastore run: a sub-MB delta pack read as about
#: 16 parallel GETs (the subscriber's IO threads), since one connection on the far link carries
#: ~5.6 Mbit/s (MiniLM, one A/B run on the shared machine: pull_into 0.52 s median at 32 KiB,
#: 0.59 s at 64 KiB, 0.69 s at 16 KiB).
FAR_RANGE_PART_BYTES = 32 * 1024
#: The tuned full-checkpoint baseline: 1 MiB parts on 16 connections (fills the link).
TUNED_PART_BYTES, TUNED_CONCURRENCY = 1024 * 1024, 16


def bench_far(server: Any, states: list[dict[str, torch.Tensor]], part: int = FAR_RANGE_PART_BYTES) -> dict[str, Any]:
    from testkit.shaper import Link, LinkShaper

    link = Link(**FAR, seed=1)
    runs: dict[str, list[dict[str, Any]]] = {}
    with LinkShaper(server.endpoint_url, link) as shaper:
        runs["deltastore"] = _far_deltastore(server, shaper, states, None)
        runs[f"deltastore, {part // 1024} KiB ranges"] = _far_deltastore(server, shaper, states, part)
        runs["full checkpoint (aws s3 cp: 8 MiB parts, 10 connections)"] = _far_full(
            server, shaper, states, BASELINE_PART_BYTES, BASELINE_CONCURRENCY)
        runs["full checkpoint (1 MiB parts, 16 connections)"] = _far_full(
            server, shaper, states, TUNED_PART_BYTES, TUNED_CONCURRENCY)
        lost = shaper.lost_packets
    n_elem = sum(t.numel() for t in states[0].values())
    med = {k: statistics.median(r["fresh_s"] for r in rows) for k, rows in runs.items()}
    ds = runs["deltastore"]
    changed = statistics.median(r["changed"] for r in ds)
    return {
        "link": FAR, "per_connection_cap_bytes_per_s": link.per_connection_bytes_per_s, "lost_packets": lost,
        "runs": runs, "median_fresh_s": med,
        "speedups": {f"{d} vs {f}": med[f] / med[d] for d in med if d.startswith("deltastore")
                     for f in med if f.startswith("full")},
        "per_element": {
            "elements": n_elem, "changed_fraction": changed,
            "delta_bytes_per_changed_element": statistics.median(r["segment_bytes"] for r in ds) / (changed * n_elem),
            "publish_s_per_element": statistics.median(r["publish_s"] for r in ds) / n_elem,
        },
    }


# --- fan-out ----------------------------------------------------------------------------------


#: Fan-out workers poll HEAD this often: 32 workers at 5 polls/s is what a shared 2-core machine
#: running moto can answer without the polls themselves dominating the latency measured.
POLL_S = 0.2


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(state):
        h.update(n.encode())
        h.update(bits(state[n].contiguous()).tobytes())
    return h.hexdigest()


def _worker(url: str, opts: dict[str, Any], last: int, out: Any, ready: Any, wid: int) -> None:
    torch.set_num_threads(1)
    store = _Counting(open_store(url, storage_options=opts))
    recs = []
    with Subscriber(url, store=store, threads=1) as sub:
        weights = sub.allocate(1)
        before = (store.requests, store.bytes, store.idle_polls)
        cpu = time.process_time()
        for rec in sub.follow(weights, poll=PollPolicy(POLL_S, jitter=0.2), heartbeat=None):
            now = time.time()
            recs.append({"version": rec.info.version, "applied_at": now, "requests": store.requests - before[0],
                         "idle_polls": store.idle_polls - before[2], "bytes": store.bytes - before[1],
                         "full_load": rec.full_load, "cpu_s": time.process_time() - cpu})
            before = (store.requests, store.bytes, store.idle_polls)
            cpu = time.process_time()
            if len(recs) == 1:
                ready.put(wid)  # loaded: the publisher starts the deltas when every worker is
            if rec.info.version >= last:
                break
        digest = _digest(weights)
    out.put((wid, recs, digest, sub.version))


def bench_fanout(server: Any, states: list[dict[str, torch.Tensor]], m: int, gap_s: float) -> dict[str, Any]:
    url = server.url(f"scale-fan-{uuid.uuid4().hex[:8]}")
    opts = server.storage_options()
    ctx = mp.get_context("fork")
    q, ready = ctx.Queue(), ctx.Queue()
    committed: dict[int, float] = {}
    with Publisher(url, storage_options=opts) as pub:
        committed[pub.publish(states[0]).version] = time.time()
        procs = [ctx.Process(target=_worker, args=(url, opts, len(states), q, ready, i), daemon=True) for i in range(m)]
        for p in procs:
            p.start()
        for _ in procs:  # every worker holds version 1 before the first delta
            ready.get(timeout=600)
        time.sleep(gap_s)
        for s in states[1:]:
            committed[pub.publish(s).version] = time.time()
            time.sleep(gap_s)
        results = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    want = _digest(states[-1])
    lat, reqs, polls, byts, cpus, exact, at_head = [], [], [], [], [], 0, 0
    for _wid, recs, digest, version in results:
        exact += digest == want
        at_head += version == len(states)
        for r in recs:
            if r["full_load"]:
                continue
            lat.append(r["applied_at"] - committed[r["version"]])
            reqs.append(r["requests"] - r["idle_polls"])
            polls.append(r["idle_polls"])
            cpus.append(r["cpu_s"])
            byts.append(r["bytes"])
    q_ = lambda xs, p: float(np.percentile(xs, p)) if xs else None
    return {
        "workers": m, "versions": len(states), "gap_s": gap_s, "bit_exact_workers": exact, "at_head_workers": at_head,
        "poll_s": POLL_S,
        "per_worker_per_version": {"requests_median": q_(reqs, 50), "requests_max": max(reqs, default=None),
                                   "idle_polls_median": q_(polls, 50), "bytes_median": q_(byts, 50),
                                   "cpu_s_median": q_(cpus, 50)},
        "cores": os.cpu_count(),
        "head_to_applied_s": {"p50": q_(lat, 50), "p90": q_(lat, 90), "p99": q_(lat, 99), "max": max(lat, default=None)},
        "note": "requests: what a worker sent to apply a version (the HEAD GET that saw it, manifests, segment "
                "range GETs), idle polls (conditional GETs of HEAD answered 304) counted apart; bytes: bodies received",
    }


# --- driver -----------------------------------------------------------------------------------


def _md(res: dict[str, Any]) -> str:
    lines = ["# Scale out: partial pulls, a far link, fan-out (benchmarks/scale.py)", "",
             (f"Workload `{res['workload']}` (bf16, real AdamW steps), {res['steps']} versions after the first, "
              f"moto on 127.0.0.1; {res['machine']}."), ""]
    if "partial" in res:
        lines += ["## Partial pulls: bytes read by a worker holding 1/8", "",
                  ("Shares of a whole subscriber's bytes (same store, same versions). Spare: the bits of edge "
                   "chunks kept beside the user's tensors. Bit-exact: against torch's slice of the last state."), "",
                  "| chunking | selection | held / whole | spare / whole | first pull / whole | per version / whole | bit-exact |",
                  "|---|---|---|---|---|---|---|"]
        for row in res["partial"]:
            for label, r in row.items():
                if not isinstance(r, dict) or "held_ratio" not in r:
                    continue
                lines.append(f"| {row.get('chunking', str(row['chunk_bytes'] // 1024) + ' KiB')} | {label} | "
                             f"{r['held_ratio']:.1%} | {r.get('spare_ratio', 0):.1%} | "
                             f"{r['first_pull_ratio']:.1%} | {r['per_version_ratio']:.1%} | {r['bit_exact']} |")
        ranks = [row for row in res["partial"] if row.get("tp_ranks")]
        if ranks:
            lines += ["", "Every TP rank (first pull / per version / spare, shares of a whole subscriber's):", ""]
            for row in ranks:
                lines.append(f"- {row['chunking']}: " + "; ".join(
                    f"r{r['rank']} {r['first_pull_ratio']:.1%} / {r['per_version_ratio']:.1%} / {r['spare_ratio']:.1%}"
                    + ("" if r["bit_exact"] else " NOT EXACT") for r in row["tp_ranks"]))
        lines.append("")
    if "grid" in res:
        lines += grid_markdown(res["grid"])
    if "chunking" in res:
        c = res["chunking"]
        lines += ["## What slice-aligned chunking costs a whole worker", "",
                  f"Local store on tmpfs, the two rules interleaved {c['reps']} times, medians.", "",
                  "| chunking | chunks | delta bytes / version | manifest bytes / version | delta publish s | pull_into s |",
                  "|---|---|---|---|---|---|"]
        for k, m in c["medians"].items():
            lines.append(f"| {k} | {m['chunks']:.0f} | {m['delta_bytes']:.0f} | {m['manifest_bytes']:.0f} | "
                         f"{m['publish_s']:.3f} | {m['pull_into_s']:.3f} |")
        lines.append("")
    if "far" in res:
        f = res["far"]
        lines += ["## Far worker: time from publish to fresh weights", "",
                  (f"Server behind the link: {f.get('server', 'moto')}. "
                   f"Link: {f['link']['bytes_per_s'] * 8 / 1e6:.0f} Mbit/s, {f['link']['rtt_s'] * 1000:.0f} ms RTT, "
                   f"{f['link']['loss']:.1%} loss (one TCP connection capped at "
                   f"{f['per_connection_cap_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s)."), "",
                  "| sync | median publish→fresh (s) | per version: publish s + pull s, MB down |", "|---|---|---|"]
        for k, rows in f["runs"].items():
            per = "; ".join(f"{r['publish_s']:.2f} + {r['pull_s']:.2f}, {r['link_bytes_down'] / 1e6:.2f}" for r in rows)
            lines.append(f"| {k} | {f['median_fresh_s'][k]:.2f} | {per} |")
        trips = [(k, rows) for k, rows in f["runs"].items() if rows and "requests" in rows[0]]
        if trips:
            lines += ["", ("Far worker's requests and new connections per version (each new connection costs one "
                      "more RTT; the HEAD GET, the manifest and the segment GETs are three sequential round trips):"), ""]
            lines += [f"- {k}: requests {[r['requests'] for r in rows]}, new connections "
                      f"{[r['new_connections'] for r in rows]}" for k, rows in trips]
        lines += ["", "Speed-ups (median publish→fresh, goal ≥ 20×):", ""]
        lines += [f"- {k}: **{v:.1f}×**" for k, v in f["speedups"].items()]
        lines.append("")
    if "fanout" in res:
        fo = res["fanout"]
        lines += ["## Fan-out", "",
                  (f"{fo['workers']} worker processes, {fo['versions']} versions, one every {fo['gap_s']} s: "
                   f"{fo['at_head_workers']} at head, {fo['bit_exact_workers']} bit-exact."), "",
                  (f"Per worker per version: {fo['per_worker_per_version']['requests_median']:.0f} requests (median, "
                    f"max {fo['per_worker_per_version']['requests_max']}) plus "
                    f"{fo['per_worker_per_version']['idle_polls_median']:.0f} idle HEAD polls (every {fo['poll_s']} s), "
                    f"{fo['per_worker_per_version']['bytes_median'] / 1e6:.2f} MB and "
                    f"{fo['per_worker_per_version']['cpu_s_median']:.2f} s of CPU (polls included; medians). "
                    f"HEAD→applied: p50 {fo['head_to_applied_s']['p50']:.2f} s, p90 {fo['head_to_applied_s']['p90']:.2f} s, "
                    f"p99 {fo['head_to_applied_s']['p99']:.2f} s, max {fo['head_to_applied_s']['max']:.2f} s."), "",
                  (f"({fo['note']}.) {fo['workers']} workers × "
                    f"{fo['per_worker_per_version']['cpu_s_median']:.2f} s of CPU on {fo['cores']} cores is "
                    f"{fo['workers'] * fo['per_worker_per_version']['cpu_s_median'] / fo['cores']:.1f} s per version "
                    "with the cores to themselves; moto (Python, one process) serves every request on the same cores, "
                    "which other work shared: the latency here is CPU-bound, not a property of S3."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="versions after the first")
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between versions in the fan-out")
    ap.add_argument("--only", choices=("partial", "chunking", "far", "fanout", "grid"), action="append",
                    help="sections to run (default: every one but grid, the column grid's whole-worker A/B, "
                         "which needs a Llama-shaped --workload such as tf265m-rl-1e-6)")
    ap.add_argument("--reps", type=int, default=4, help="repetitions of each arm of the grid A/B")
    ap.add_argument("--rounds", type=int, default=3, help="store pairs of the grid A/B's paired times")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale")
    ap.add_argument("--workload", default=WORKLOAD, help="e.g. tf265m-rl-1e-6 (531 MB) for the far link")
    ap.add_argument("--far-range-kib", type=int, default=FAR_RANGE_PART_BYTES // 1024,
                    help="range_part_bytes of the second far run, in KiB (about a delta pack / 16 is best: "
                         "the subscriber reads 16 ranges at a time)")
    ap.add_argument("--far-server", choices=("seaweedfs", "moto"), default=None,
                    help="the server behind the far link (default: SeaweedFS where installed: it keeps connections "
                         "alive, as S3 does, where moto closes every one and each request pays a second RTT)")
    args = ap.parse_args(argv)
    from deltastore import devserver

    parts = args.only or ["partial", "chunking", "far", "fanout"]
    states = _states(args.steps, args.workload) if set(parts) - {"grid"} else []
    res: dict[str, Any] = {"workload": args.workload, "steps": args.steps,
                           "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                                      f"{os.getloadavg()[0]:.2f} at the start"}
    if "grid" in parts:  # first, on its own: no moto server running beside it
        res["grid"] = bench_grid_ab(args.workload, args.steps, args.reps, args.rounds)
    with devserver.moto() as server:
        if "partial" in parts:
            res["partial"] = bench_partial(server, states)
        if "chunking" in parts:
            res["chunking"] = bench_chunking(states)
        if "far" in parts:
            kind = args.far_server or ("seaweedfs" if devserver.find_weed() else "moto")
            part = args.far_range_kib * 1024
            if kind == "moto":
                res["far"] = bench_far(server, states, part)
            else:
                with devserver.seaweedfs() as weed:
                    res["far"] = bench_far(weed, states, part)
            res["far"]["server"] = kind
        if "fanout" in parts:
            res["fanout"] = bench_fanout(server, states, args.workers, args.gap)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.only and args.out.with_suffix(".json").exists():  # a partial run updates its sections only
        res = {**json.loads(args.out.with_suffix(".json").read_text()), **res}
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_md(res))
    print(_md(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
