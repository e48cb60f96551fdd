"""A fleet target: how fast a fleet of followers converges when the target moves it back, and forward again.

    python -m benchmarks.fleet_target [--workload tf125m-rl-1e-6] [--versions 7] [--workers 8]
        [--interval 5] [--back 5] [--json benchmarks/results/fleet_target.json]

Publishes the workload's real fine-tuning checkpoints (:mod:`benchmarks.workload`; version 1
is the anchor, the others deltas) to a local directory store, then starts ``--workers``
followers in this process (a thread and a ``Subscriber(threads=1)`` each, following into their
own tensors with heartbeats, polling every ``--interval`` seconds with the default jitter), and
waits until all hold HEAD. Then:

1. ``write_target(store, head - back)`` (what ``deltastore target URL VERSION`` does): the
   time until every follower has swapped that version in, from the write, in seconds and in
   poll intervals; each follower's tensors then checked bit for bit (SHA-256) against the
   published state of that version. Goal: within 2 poll intervals.
2. ``write_target(store, None)`` (``--latest``): the same, back to HEAD.

Also reported per move: the bytes each follower fetched, and its time to notice (the wait
before its move started: at most one poll interval plus jitter) and to move (fetch, decode and
swap). The followers share this host's cores, so a move's time grows with ``--workers``.
"""

from __future__ import annotations

import argparse
import json
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
#: The goal: every follower holds the target's version within this many poll intervals.
GOAL_INTERVALS = 2.0
#: Followers of one fleet (the issue's figure).
DEFAULT_WORKERS = 8
#: A fleet poll interval (seconds): 1,000 workers polling every 5 s cost a few dollars a day.
DEFAULT_INTERVAL_S = 5.0
#: Seconds to wait for the whole fleet before the run is called hung.
CONVERGE_TIMEOUT_S = 900.0


class Follower:
    """One follower: a thread running ``Subscriber.follow``, its records timed."""

    def __init__(self, url: str, index: int, interval: float):
        from deltastore import HeartbeatPolicy, PollPolicy, Subscriber

        self.worker = f"worker-{index}"
        self.sub = Subscriber(url, threads=1)
        self.target = self.sub.allocate()
        self.stop = threading.Event()
        self.records: list[tuple[float, Any]] = []  # (time.monotonic() at the yield, FollowRecord)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self._follow = self.sub.follow(self.target, poll=PollPolicy(interval), stop=self.stop,
                                       heartbeat=HeartbeatPolicy(self.worker))
        self.thread = threading.Thread(target=self._run, name=self.worker, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for rec in self._follow:
                with self.cond:
                    self.records.append((time.monotonic(), rec))
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def wait_for(self, version: int, since: float, deadline: float) -> tuple[float, Any]:
        """The first record of ``version`` after ``since`` (monotonic)."""
        with self.cond:
            while True:
                for t, rec in self.records:
                    if t >= since and rec.info.version == version:
                        return t, rec
                if self.error is not None:
                    raise RuntimeError(f"{self.worker} failed") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.worker} did not reach version {version}")
                self.cond.wait(left)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        self.sub.close()


def _publish(url: str, workload: str, versions: int) -> dict[int, str]:
    """Publish steps 0..versions-1 as versions 1..versions; each version's SHA-256."""
    from benchmarks.workload import load_workload
    from deltastore import Publisher

    out = {}
    with Publisher(url) as pub:
        for step, state in enumerate(load_workload(workload, versions - 1)):
            out[pub.publish(state, step=step).version] = state_sha256(state)
    return out


def _move(fleet: list[Follower], version: int, t0: float, interval: float, want: str) -> dict[str, Any]:
    """Wait for every follower to hold ``version`` (records after ``t0``) and check its bits."""
    deadline = t0 + CONVERGE_TIMEOUT_S
    got = [f.wait_for(version, t0, deadline) for f in fleet]
    done = [t - t0 for t, _ in got]
    moving = [rec.fetch_s + rec.decode_s + rec.pause_s for _, rec in got]
    bad = [f.worker for f in fleet if state_sha256(f.target) != want]
    if bad:
        raise AssertionError(f"{bad} do not hold version {version} bit for bit")
    worst = max(done)
    return {
        "version": version, "converged_s": worst, "converged_intervals": worst / interval,
        "goal_met": worst <= GOAL_INTERVALS * interval, "bit_exact_workers": len(fleet),
        "per_worker_s": [round(d, 3) for d in done],
        "notice_s_max": max(d - m for d, m in zip(done, moving)),
        "move_s_median": statistics.median(moving), "move_s_max": max(moving),
        "bytes_fetched_median": statistics.median(rec.bytes_fetched for _, rec in got),
        "from_versions": sorted({rec.from_version for _, rec in got}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tf125m-rl-1e-6")
    parser.add_argument("--versions", type=int, default=7, help="versions published (1 anchor + deltas)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="the followers' poll interval (s)")
    parser.add_argument("--back", type=int, default=5, help="the target is head - BACK")
    parser.add_argument("--json", type=Path, default=RESULTS / "fleet_target.json")
    args = parser.parse_args(argv)
    if not 1 <= args.back < args.versions:
        parser.error("--back must be at least 1 and below --versions")
    from deltastore.fleet.target import write_target
    from deltastore.storage import open_store

    with tempfile.TemporaryDirectory(prefix="fleet-target-") as tmp:
        url = str(Path(tmp) / "store")
        t_pub = time.perf_counter()
        shas = _publish(url, args.workload, args.versions)
        publish_s = time.perf_counter() - t_pub
        head = max(shas)
        t0 = time.monotonic()
        fleet = [Follower(url, i, args.interval) for i in range(args.workers)]
        try:
            first = _move(fleet, head, t0, args.interval, shas[head])
            with open_store(url) as store:
                t1 = time.monotonic()
                write_target(store, head - args.back, note="benchmark: back")
                back = _move(fleet, head - args.back, t1, args.interval, shas[head - args.back])
                t2 = time.monotonic()
                write_target(store, None)
                latest = _move(fleet, head, t2, args.interval, shas[head])
        finally:
            for f in fleet:
                f.close()
    doc = {
        "benchmark": "fleet_target", "workload": args.workload, "versions": args.versions, "workers": args.workers,
        "poll_interval_s": args.interval, "target": f"head - {args.back}", "goal_intervals": GOAL_INTERVALS,
        "store": "local directory; followers are threads of one process, Subscriber(threads=1) each",
        "publish_s": publish_s, "first_load": first, "back_to_target": back, "latest": latest,
        "goal_met": back["goal_met"] and latest["goal_met"],
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "python -m benchmarks.fleet_target " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    for name, m in (("first load", first), (f"target head-{args.back}", back), ("--latest", latest)):
        print(f"{name:>14}: all {args.workers} at v{m['version']} bit-exact in {m['converged_s']:.2f} s "
              f"({m['converged_intervals']:.2f} poll intervals of {args.interval:g} s); move median "
              f"{m['move_s_median']:.2f} s, max {m['move_s_max']:.2f} s; {m['bytes_fetched_median'] / 1e6:.1f} MB each")
    print(f"goal: within {GOAL_INTERVALS:g} poll intervals -> {'met' if doc['goal_met'] else 'NOT met'}; {args.json}")
    return 0 if doc["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
