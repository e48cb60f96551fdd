"""Mirrors: what the origin bucket serves per version, and how long a worker waits, when a fleet
of 2 regions × 16 workers reads through one mirror per region (SPEC §16).

    python -m benchmarks.fleet_mirrors [--workload tf125m-rl-1e-6] [--versions 12]
        [--workers-per-region 16] [--poll 0.05 1.0] [--json benchmarks/results/fleet_mirrors.json]

Real fine-tuning states (benchmarks.workload; bf16 exports of consecutive optimizer steps) are
published to an origin store, forwards through the cached steps and back again as often as
``--versions`` asks (each step's delta, or its inverse). Each region is a store of its own kept current by a
``Mirror.follow`` loop reading the origin; its workers are ``Subscriber(origin, mirrors=[region])``
threads that poll and ``pull_into`` their own copy of the model. Regions are local directories
standing for buckets: the origin's egress is counted at the store interface (the bytes of every
GET body the origin answers, mirrors' copies and workers' HEAD polls alike), which is what a
provider bills, and is independent of the link between them.

Per version the benchmark reports:

- **origin egress / one delta**: bytes the origin served between the publish and the moment
  every worker held the version, over the version's pack bytes (``bytes_stored``). The goal is
  ≤ 2.1 (one copy per mirror plus slack); without mirrors every worker reads the packs from
  the origin (32 × one delta, measured here with one worker reading the origin directly and
  multiplied by the fleet size).
- **head-to-applied**: seconds from the publish returning (HEAD written) to each worker's
  ``pull_into`` returning with the version, against one worker that reads the origin directly
  (a local bucket) with the same poll interval, and one worker reading through a mirror alone
  (the mirror's own cost, without 32 workers sharing this machine's cores), and against the
  same fleet reading the origin directly (the same contention for this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.workload import load_workload

RESULTS = Path(__file__).resolve().parent / "results" / "fleet_mirrors.json"
#: Seconds between a worker's polls of HEAD (the same for the fleet and the single workers):
#: a short one shows what a mirror adds, a longer one what it adds to a usual follower.
POLLS_S = (0.05, 1.0)
#: Seconds between a mirror's polls of the origin's HEAD: one process per region, whose idle
#: polls are conditional GETs without a body, so it can poll more often than each worker does.
MIRROR_POLL_S = 0.01
#: Seconds to wait for the fleet to hold a version before the run is declared failed.
VERSION_TIMEOUT_S = 600.0

logger = logging.getLogger("benchmarks.fleet_mirrors")


class CountingStore:
    """Builds a store that delegates to ``inner`` and counts the bytes of every body it serves."""

    def __new__(cls, inner: Any) -> Any:
        from deltastore.storage.base import Store

        class Counting(Store):
            def __init__(self) -> None:
                self.url = inner.url
                self.atomic_conditional_writes = inner.atomic_conditional_writes
                self.served = 0
                self.requests = 0
                self._lock = threading.Lock()

            def _add(self, n: int) -> None:
                with self._lock:
                    self.served += n
                    self.requests += 1

            def get(self, key: str, *, byte_range: Any = None) -> bytes:
                data = inner.get(key, byte_range=byte_range)
                self._add(len(data))
                return data

            def get_with_meta(self, key: str) -> Any:
                got = inner.get_with_meta(key)
                self._add(len(got.data))
                return got

            def get_if_changed(self, key: str, etag: str | None) -> Any:
                got = inner.get_if_changed(key, etag)
                self._add(0 if got is None else len(got.data))
                return got

            def put(self, key: str, data: bytes, *, mode: Any = "overwrite") -> Any:
                return inner.put(key, data, mode=mode)

            def head(self, key: str) -> Any:
                return inner.head(key)

            def list(self, prefix: str = "") -> Any:
                return inner.list(prefix)

            def delete(self, key: str) -> None:
                inner.delete(key)

            def begin_put(self, directory: str) -> Any:
                return inner.begin_put(directory)

        return Counting()


class Worker:
    """One worker thread: polls, applies each new version, records when it held it."""

    def __init__(self, name: str, sub: Any, state: dict[str, Any], stop: threading.Event, poll_s: float):
        self.name, self.sub, self.state, self.stop, self.poll_s = name, sub, state, stop, poll_s
        self.applied: dict[int, float] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                info = self.sub.pull_into(self.state)
                if info is not None:
                    self.applied[info.version] = time.perf_counter()
                self.stop.wait(self.poll_s)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e


def _wait_all(workers: list[Worker], version: int) -> None:
    deadline = time.perf_counter() + VERSION_TIMEOUT_S
    while any(version not in w.applied for w in workers):
        for w in workers:
            if w.error is not None:
                raise RuntimeError(f"worker {w.name} failed: {w.error!r}") from w.error
        if time.perf_counter() > deadline:
            raise TimeoutError(f"version {version} not held by every worker within {VERSION_TIMEOUT_S}s")
        time.sleep(0.01)


def _fleet(root: Path, sds: list[dict[str, Any]], regions: int, per_region: int, poll_s: float,
           mirrored: bool = True) -> dict[str, Any]:
    """The fleet's workers, each region's reading through its mirror (or, ``mirrored=False``,
    every worker reading the origin: the fleet without mirrors, on the same cores)."""
    from deltastore import Publisher, Subscriber
    from deltastore.fleet.mirror import Mirror
    from deltastore.format.history import History
    from deltastore.storage import open_store
    from deltastore.write.policy import WriterPolicy

    origin_url = str(root / "origin")
    region_urls = [str(root / f"region-{chr(ord('a') + r)}") for r in range(regions)]
    pub = Publisher(origin_url, writer_policy=WriterPolicy(threads=2))
    pub.publish(sds[0], step=0)
    origin = CountingStore(open_store(origin_url))
    mirrors = [Mirror(origin, url) for url in region_urls] if mirrored else []
    for m in mirrors:
        m.sync()
    stop = threading.Event()
    syncs: list[list[Any]] = [[] for _ in mirrors]
    followers = [threading.Thread(target=m.follow, kwargs=dict(interval=MIRROR_POLL_S, stop=stop, on_sync=syncs[i].append),
                                  daemon=True) for i, m in enumerate(mirrors)]
    workers: list[Worker] = []
    subs = []
    for r, url in enumerate(region_urls):
        for i in range(per_region):
            sub = Subscriber(origin_url, store=origin, mirrors=[url] if mirrored else None, threads=1)
            subs.append(sub)
            workers.append(Worker(f"region-{r}-worker-{i}", sub, sub.pull(), stop, poll_s))
    for t in followers:
        t.start()
    for w in workers:
        w.thread.start()
    history = History(open_store(origin_url))
    per_version = []
    try:
        for step in range(1, len(sds)):
            before, requests = origin.served, origin.requests
            info = pub.publish(sds[step], step=step)
            t_head = time.perf_counter()
            _wait_all(workers, info.version)
            egress = origin.served - before
            delta = history.latest().bytes_stored  # type: ignore[union-attr]
            waits = sorted(w.applied[info.version] - t_head for w in workers)
            per_version.append({
                "version": info.version, "kind": info.kind, "delta_bytes": delta, "origin_egress_bytes": egress,
                "origin_requests": origin.requests - requests, "egress_over_delta": egress / delta,
                "head_to_applied_s": {"p50": statistics.median(waits), "max": waits[-1], "min": waits[0]},
            })
            logger.info("version %d: delta %d B, origin egress %d B (%.2f×), head-to-applied p50 %.2f s max %.2f s",
                        info.version, delta, egress, egress / delta, statistics.median(waits), waits[-1])
    finally:
        stop.set()
        for w in workers:
            w.thread.join(30)
        for t in followers:
            t.join(30)
        for s in subs:
            s.close()
        pub.close()
    return {"per_version": per_version}


def _single(root: Path, sds: list[dict[str, Any]], through_mirror: bool, poll_s: float) -> dict[str, Any]:
    """One worker, alone: reading the origin directly (a local bucket), or through one mirror."""
    from deltastore import Publisher, Subscriber
    from deltastore.fleet.mirror import Mirror
    from deltastore.storage import open_store
    from deltastore.write.policy import WriterPolicy

    origin_url = str(root / "origin")
    pub = Publisher(origin_url, writer_policy=WriterPolicy(threads=2))
    pub.publish(sds[0], step=0)
    origin = CountingStore(open_store(origin_url))
    stop = threading.Event()
    follower = None
    mirrors: list[str] = []
    if through_mirror:
        m = Mirror(origin, str(root / "region"))
        m.sync()
        mirrors = [str(root / "region")]
        follower = threading.Thread(target=m.follow, kwargs=dict(interval=MIRROR_POLL_S, stop=stop), daemon=True)
        follower.start()
    sub = Subscriber(origin_url, store=origin, mirrors=mirrors or None, threads=1)
    w = Worker("single", sub, sub.pull(), stop, poll_s)
    w.thread.start()
    waits, egress = [], []
    try:
        for step in range(1, len(sds)):
            before = origin.served
            info = pub.publish(sds[step], step=step)
            t_head = time.perf_counter()
            _wait_all([w], info.version)
            waits.append(w.applied[info.version] - t_head)
            egress.append(origin.served - before)
    finally:
        stop.set()
        w.thread.join(30)
        if follower is not None:
            follower.join(30)
        sub.close()
        pub.close()
    return {"head_to_applied_s": waits, "origin_egress_bytes": egress}


def _states(cached: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n + 1`` states: forwards through the cached steps, back, forwards again (no state twice
    in a row, so every version is a real step's delta or its inverse)."""
    cycle = list(range(len(cached))) + list(range(len(cached) - 2, 0, -1))
    return [cached[cycle[i % len(cycle)]] for i in range(n + 1)]


def _run(root: Path, sds: list[dict[str, Any]], regions: int, per_region: int, poll_s: float) -> dict[str, Any]:
    for name in ("fleet", "direct", "local", "mirror"):
        (root / name).mkdir(parents=True)
    fleet = _fleet(root / "fleet", sds, regions, per_region, poll_s)["per_version"]
    direct = _fleet(root / "direct", sds, regions, per_region, poll_s, mirrored=False)["per_version"]
    local = _single(root / "local", sds, through_mirror=False, poll_s=poll_s)
    alone = _single(root / "mirror", sds, through_mirror=True, poll_s=poll_s)
    local_mean = statistics.mean(local["head_to_applied_s"])
    p50 = statistics.mean(v["head_to_applied_s"]["p50"] for v in fleet)
    p50_direct = statistics.mean(v["head_to_applied_s"]["p50"] for v in direct)
    summary = {
        "poll_s": poll_s,
        "egress_over_delta_max": max(v["egress_over_delta"] for v in fleet),
        "egress_over_delta_mean": statistics.mean(v["egress_over_delta"] for v in fleet),
        "without_mirrors_egress_over_delta_mean": statistics.mean(v["egress_over_delta"] for v in direct),
        "fleet_head_to_applied_p50_s": p50,
        "fleet_head_to_applied_max_s": max(v["head_to_applied_s"]["max"] for v in fleet),
        "fleet_without_mirrors_head_to_applied_p50_s": p50_direct,
        "fleet_p50_over_fleet_without_mirrors": p50 / p50_direct,
        "single_worker_local_bucket_s": local_mean,
        "single_worker_through_mirror_s": statistics.mean(alone["head_to_applied_s"]),
        "through_mirror_over_local": statistics.mean(alone["head_to_applied_s"]) / local_mean,
        "fleet_p50_over_single_local": p50 / local_mean,
    }
    logger.info("poll %gs: %s", poll_s, json.dumps(summary))
    return {"summary": summary, "fleet": fleet, "fleet_without_mirrors": direct, "single_local": local,
            "single_through_mirror": alone}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="tf125m-rl-1e-6")
    p.add_argument("--versions", type=int, default=12, help="delta versions published after the first (default 12)")
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--workers-per-region", type=int, default=16)
    p.add_argument("--poll", type=float, nargs="+", default=list(POLLS_S),
                   help="workers' poll intervals, seconds: one run each (default 0.05 1.0)")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("deltastore").setLevel(logging.WARNING)
    sds = _states(load_workload(args.workload), args.versions)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fleet-mirrors-") as d:
        for i, poll_s in enumerate(args.poll):
            runs.append(_run(Path(d) / f"run-{i}", sds, args.regions, args.workers_per_region, poll_s))
    out = {
        "benchmark": "fleet_mirrors", "workload": args.workload, "versions": args.versions,
        "regions": args.regions, "workers_per_region": args.workers_per_region, "mirror_poll_s": MIRROR_POLL_S,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "command": "python -m benchmarks.fleet_mirrors " + " ".join(sys.argv[1:] if argv is None else argv),
        "summaries": [r["summary"] for r in runs], "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summaries"], indent=2))


if __name__ == "__main__":
    main()
