"""A deltastore worker: follow a store and keep a bf16 copy of the weights current.

A worker needs nothing but the store URL. :meth:`deltastore.Subscriber.follow` does the work:
it polls HEAD (a conditional GET that moves no body while nothing changed), loads the first
version it sees in full, then stages each new version (fetch, verify, decode only the chunks
that changed) and swaps it into the tensors in a short pause. This script only decides when to
stop: at a version the trainer marked ``{"final": true}`` in its metadata.

``demo.py`` starts two of these as processes (:func:`run_worker`). Run one by hand against a
store a trainer is publishing to, on this machine or any other that can reach the store::

    python examples/worker.py --store ./demo-store
    AWS_ENDPOINT_URL=http://127.0.0.1:9000 python examples/worker.py --store s3://weights/demo

Imports only deltastore and torch.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import multiprocessing
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from deltastore import CachePolicy, FollowRecord, PollPolicy, Subscriber, VersionInfo, VersionNotFoundError

logger = logging.getLogger("deltastore.examples.worker")

#: How often a worker asks for a new version: HEAD polls are conditional GETs, so frequent
#: polling costs requests, not bandwidth.
DEFAULT_POLL_S = 0.2
#: Format of the worker's log lines (the process name says which worker it is).
LOG_FORMAT = "%(asctime)s %(processName)s %(levelname)s %(message)s"


def tensor_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of every tensor's raw bytes: equal digests mean bit-identical tensors."""
    out = {}
    for name, t in state.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[name] = hashlib.sha256(raw).hexdigest()
    return out


def is_final(info: VersionInfo, run_id: str | None) -> bool:
    """True for the version the trainer marked as its last (of run ``run_id``, if given)."""
    meta = info.metadata
    return bool(meta.get("final")) and (run_id is None or meta.get("run") == run_id)


def follow(
    url: str,
    *,
    run_id: str | None = None,
    poll_s: float = DEFAULT_POLL_S,
    should_stop: Callable[[], bool] = lambda: False,
    on_version: Callable[[FollowRecord], None] | None = None,
    cache_dir: str | None = None,
) -> tuple[VersionInfo, dict[str, torch.Tensor]] | None:
    """Keep a bf16 copy of the weights at ``url`` current until the trainer's final version.

    Args:
        url: the store the trainer publishes to.
        run_id: stop only at a final version carrying this ``run`` in its metadata (so an old
            run's final version in a reused store does not end the worker at once).
        poll_s: seconds between HEAD polls.
        should_stop: checked every ``poll_s``; return True to give up early.
        on_version: called with each version's :class:`deltastore.FollowRecord`.
        cache_dir: a local cache directory, to restart without refetching the held version.

    Returns:
        ``(info, weights)`` at the final version, or None when stopped early.
    """
    stop = threading.Event()

    def watch() -> None:  # follow() takes an Event; turn the callable into one
        while not stop.wait(poll_s):
            if should_stop():
                stop.set()

    threading.Thread(target=watch, daemon=True, name="worker-stop").start()
    try:
        with Subscriber(url) as sub:
            while True:  # the layout to follow into comes with the first version
                try:
                    weights = sub.allocate()
                    break
                except VersionNotFoundError:
                    if stop.wait(poll_s):
                        return None
            cache = CachePolicy(cache_dir) if cache_dir is not None else None
            for rec in sub.follow(weights, poll=PollPolicy(poll_s), stop=stop, cache=cache):
                if on_version is not None:
                    on_version(rec)
                if is_final(rec.info, run_id):
                    return rec.info, weights
        return None
    finally:
        stop.set()


def _log_version(rec: FollowRecord) -> None:
    info = rec.info
    how = "loaded in full" if rec.full_load else f"fast-forwarded from version {rec.from_version}"
    logger.info(
        "version %d (step %s, %s) %s: fetched %s; fetch %.2f s, decode %.2f s, pause %.3f s",
        info.version, info.step, info.kind, how, human_bytes(rec.bytes_fetched), rec.fetch_s, rec.decode_s, rec.pause_s,
    )


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def setup_logging(verbose: bool) -> None:
    """INFO lines from the example scripts; deltastore's own only with ``verbose``; others' warnings."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("deltastore").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("deltastore.examples").setLevel(logging.INFO)


def run_worker(worker_id: int, url: str, run_id: str, events: Any, stop: Any, verbose: bool = False) -> None:
    """Entry point of a worker process started by demo.py.

    Reports to the ``events`` queue: ``{"event": "version", ...}`` per version reached, then
    ``{"event": "done", "version", "digests"}`` or ``{"event": "error", "error"}``. Returns
    early when ``stop`` (a multiprocessing Event) is set.
    """
    setup_logging(verbose)
    torch.set_num_threads(1)  # the trainer and the other worker share the cores

    def on_version(rec: FollowRecord) -> None:
        _log_version(rec)
        events.put({"event": "version", "worker": worker_id, "version": rec.info.version, "kind": rec.info.kind,
                    "fetched": rec.bytes_fetched, "seconds": rec.fetch_s + rec.decode_s + rec.pause_s,
                    "pause": rec.pause_s})

    try:
        result = follow(url, run_id=run_id, should_stop=stop.is_set, on_version=on_version)
        if result is not None:
            info, weights = result
            events.put({"event": "done", "worker": worker_id, "version": info.version,
                        "digests": tensor_digests(weights)})
    except KeyboardInterrupt:
        pass  # only when SIGINT reaches a worker that demo.py did not start (it ignores SIGINT)
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which decides the exit code
        logger.exception("worker %d failed", worker_id)
        events.put({"event": "error", "worker": worker_id, "error": f"{type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Follow a deltastore store and keep a bf16 copy of the weights current.")
    parser.add_argument("--store", default="./demo-store", help="store URL (a directory, s3://bucket/prefix, ...)")
    parser.add_argument("--run", default=None, help="stop only at the final version of this run id")
    parser.add_argument("--poll", type=float, default=DEFAULT_POLL_S, help="seconds between HEAD polls")
    parser.add_argument("--cache", default=None, help="cache directory: a restart resumes without refetching")
    parser.add_argument("-v", "--verbose", action="store_true", help="log deltastore's own messages too")
    args = parser.parse_args(argv)
    multiprocessing.current_process().name = "worker"
    setup_logging(args.verbose)
    try:
        result = follow(args.store, run_id=args.run, poll_s=args.poll, on_version=_log_version, cache_dir=args.cache)
    except KeyboardInterrupt:
        return 130
    assert result is not None
    info, weights = result
    combined = hashlib.sha256("".join(tensor_digests(weights).values()).encode()).hexdigest()
    print(f"final version {info.version}: {len(weights)} tensors, sha256 of tensor digests {combined[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
