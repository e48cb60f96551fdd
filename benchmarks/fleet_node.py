"""One fetch per node: bytes the bucket serves per version to the worker processes of one host.

    python -m benchmarks.fleet_node [--workload tf125m-rl-1e-6] [--versions 7] [--workers 8]
        [--json benchmarks/results/fleet_node.json]

Publishes the workload's real fine-tuning checkpoints (:mod:`benchmarks.workload`; version 1
is the anchor, the others deltas) to a local directory store, then starts ``--workers``
processes on this host, as the ranks of a tensor-parallel engine would be, twice: each with a
``Subscriber`` of its own reading the bucket (*direct*), and each with the same node cache
directory (``Subscriber(node_cache=DIR)``, *node cache*). All workers take each version
together (a barrier per version, the way a new HEAD reaches every rank within a poll): the
first ``pull(1)``, then ``pull_into(target, v)``. Every GET is counted at the store interface
of each process (the bucket's side of the node cache), split into packs, other immutable
objects (manifests, layouts) and HEAD.

Per version it reports the bytes the bucket served to the whole node, as a multiple of one
delta (the version's pack bytes, ``VersionInfo.bytes_stored``). Goal: at most 1.05x with the
node cache (against about ``--workers``x without). Every worker's final tensors are checked bit
for bit (SHA-256) against the published state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from testkit.tensors import state_sha256

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The goal: bytes from the bucket per version and node, as a multiple of one delta.
GOAL_RATIO = 1.05
#: Worker processes of one host: the ranks of an 8-GPU tensor-parallel engine.
DEFAULT_WORKERS = 8
#: Seconds a worker may take for one version before the run is called hung.
STEP_TIMEOUT_S = 600


def _kind(key: str) -> str:
    from deltastore.fleet.nodecache import cache_name

    if cache_name(key) is None:
        return "head"  # HEAD (and any other mutable key): never cached
    return "packs" if key.endswith(".pack") else "other"


def _counting(store: Any, counts: dict[str, int], lock: threading.Lock) -> Any:
    """``store`` with the body bytes of every GET added to ``counts`` by kind of key."""
    from deltastore.storage.base import Store

    class Counting(Store):
        def __init__(self) -> None:
            self.url = store.url

        def _add(self, key: str, n: int) -> None:
            with lock:
                counts[_kind(key)] += n
                counts["requests"] += 1

        def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
            data = store.get(key, byte_range=byte_range)
            self._add(key, len(data))
            return data

        def get_with_meta(self, key: str) -> Any:
            res = store.get_with_meta(key)
            self._add(key, len(res.data))
            return res

        def get_if_changed(self, key: str, etag: str | None) -> Any:
            res = store.get_if_changed(key, etag)
            self._add(key, 0 if res is None else len(res.data))
            return res

        def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> Any:
            return store.put(key, data, mode=mode)

        def head(self, key: str) -> Any:
            with lock:
                counts["requests"] += 1
            return store.head(key)

        def list(self, prefix: str = "") -> Any:
            return store.list(prefix)

        def delete(self, key: str) -> None:
            store.delete(key)

    return Counting()


def _worker(url: str, node_cache: str | None, versions: int, barrier: Any, out: Any) -> None:
    from deltastore import Subscriber
    from deltastore.fleet.nodecache import NodeCacheStore
    from deltastore.storage import open_store

    counts = dict.fromkeys(("packs", "other", "head", "requests"), 0)
    lock = threading.Lock()
    rows = []
    with open_store(url) as store:
        # Subscriber(node_cache=DIR) wraps the store the same way; built here to read its stats.
        read = _counting(store, counts, lock)
        cached = None if node_cache is None else NodeCacheStore(read, node_cache)
        sub = Subscriber(url, store=cached or read, threads=1)
        target = None
        for v in range(1, versions + 1):
            barrier.wait(STEP_TIMEOUT_S)
            before = dict(counts)
            t0 = time.perf_counter()
            if target is None:
                target = sub.pull(v)
            else:
                sub.pull_into(target, v)
            seconds = time.perf_counter() - t0
            rows.append({"version": v, "seconds": seconds, **{k: counts[k] - before[k] for k in counts}})
        sub.close()
        stats = None if cached is None else dataclasses.asdict(cached.stats())
        out.put({"rows": rows, "sha256": state_sha256(target), "cache": stats})


def _run(url: str, node_cache: str | None, workers: int, versions: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "deltastore", "deltastore.read.subscriber"])
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, node_cache, versions, barrier, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=STEP_TIMEOUT_S * versions) for _ in procs]
    for p in procs:
        p.join(STEP_TIMEOUT_S)
        if p.exitcode != 0:
            raise RuntimeError(f"a worker exited with {p.exitcode}")
    return results


def _publish(url: str, workload: str, versions: int) -> tuple[list[dict[str, Any]], str]:
    """Publish steps 0..versions-1; the versions' infos and the last state's SHA-256."""
    from deltastore import Publisher, Subscriber
    from benchmarks.workload import load_step

    with Publisher(url) as pub:
        for step in range(versions):
            state = load_step(workload, step)
            pub.publish(state, step=step)
    with Subscriber(url) as sub:
        infos = [sub.info(v) for v in range(1, versions + 1)]
    return [{"version": i.version, "kind": i.kind, "bytes_stored": i.bytes_stored} for i in infos], state_sha256(state)


def _summarise(mode: str, results: list[dict[str, Any]], infos: list[dict[str, Any]], want: str) -> dict[str, Any]:
    bad = sum(r["sha256"] != want for r in results)
    if bad:
        raise AssertionError(f"{mode}: {bad} workers do not hold the published state bit for bit")
    rows = []
    for i, info in enumerate(infos):
        per = [r["rows"][i] for r in results]
        node = {k: sum(p[k] for p in per) for k in ("packs", "other", "head", "requests")}
        total = node["packs"] + node["other"] + node["head"]
        rows.append({
            "version": info["version"], "kind": info["kind"], "one_delta_bytes": info["bytes_stored"],
            "node_bucket_bytes": total, **{f"node_{k}": v for k, v in node.items()},
            "ratio": total / info["bytes_stored"], "ratio_packs": node["packs"] / info["bytes_stored"],
            "seconds_median": statistics.median(p["seconds"] for p in per),
            "seconds_max": max(p["seconds"] for p in per),
        })
    deltas = [r for r in rows if r["kind"] == "delta"]
    caches = [r["cache"] for r in results if r["cache"] is not None]
    cache = {k: sum(c[k] for c in caches) for k in caches[0]} if caches else None
    return {"rows": rows, "node_cache_stats": cache, "delta_ratio_max": max(r["ratio"] for r in deltas),
            "delta_ratio_median": statistics.median(r["ratio"] for r in deltas), "bit_exact_workers": len(results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tf125m-rl-1e-6")
    parser.add_argument("--versions", type=int, default=7, help="versions published and pulled (1 anchor + deltas)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--json", type=Path, default=RESULTS / "fleet_node.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleet-node-") as tmp:
        url = str(Path(tmp) / "store")
        infos, want = _publish(url, args.workload, args.versions)
        modes = {}
        for mode, cache in (("direct", None), ("node_cache", str(Path(tmp) / "node"))):
            t0 = time.perf_counter()
            modes[mode] = _summarise(mode, _run(url, cache, args.workers, args.versions), infos, want)
            modes[mode]["wall_s"] = time.perf_counter() - t0
    doc = {
        "benchmark": "fleet_node", "workload": args.workload, "workers": args.workers, "versions": args.versions,
        "store": "local directory, GETs counted at each worker's store interface", "goal_ratio": GOAL_RATIO,
        "goal_met": modes["node_cache"]["delta_ratio_max"] <= GOAL_RATIO, "modes": modes,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "command": "python -m benchmarks.fleet_node " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'version':>7} {'kind':>6} {'one delta':>12} {'direct':>8} {'node cache':>10}")
    for d, c in zip(modes["direct"]["rows"], modes["node_cache"]["rows"]):
        print(f"{d['version']:>7} {d['kind']:>6} {d['one_delta_bytes']:>12,} {d['ratio']:>7.2f}x {c['ratio']:>9.3f}x")
    print(f"deltas, node cache: max {modes['node_cache']['delta_ratio_max']:.3f}x of one delta "
          f"(goal <= {GOAL_RATIO}x; direct: {modes['direct']['delta_ratio_max']:.2f}x) -> {args.json}")
    return 0 if doc["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
