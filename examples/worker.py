"""A deltastore worker: follow a store and keep a bf16 copy of the weights current.

A worker needs nothing but the store URL. It polls HEAD (a conditional GET that moves no
body while nothing changed), pulls the first version it sees in full, then fast-forwards its
tensors in place with ``pull_into``, fetching only the chunks that changed. It stops when it
reaches a version the trainer marked ``{"final": true}`` in its metadata.

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
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deltastore import Subscriber, VersionInfo
from deltastore.storage import GetResult, ObjectMeta, PutMode, Store, open_store

logger = logging.getLogger("deltastore.examples.worker")

#: How often a worker asks for a new version: HEAD polls are conditional GETs, so frequent
#: polling costs requests, not bandwidth.
DEFAULT_POLL_S = 0.2
#: Format of the worker's log lines (the process name says which worker it is).
LOG_FORMAT = "%(asctime)s %(processName)s %(levelname)s %(message)s"


class CountingStore(Store):
    """Wraps a store and counts the bytes read from it, so a worker can report what it fetched.

    Every read (HEAD polls, manifests, segment ranges) goes through :meth:`get`,
    :meth:`get_with_meta` or :meth:`get_if_changed`. Reads may come from several threads;
    the counter is guarded by a lock.
    """

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        data = self.inner.get(key, byte_range=byte_range)
        self._count(len(data))
        return data

    def get_with_meta(self, key: str) -> GetResult:
        res = self.inner.get_with_meta(key)
        self._count(len(res.data))
        return res

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        res = self.inner.get_if_changed(key, etag)
        if res is not None:
            self._count(len(res.data))
        return res

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        return self.inner.put(key, data, mode=mode)

    def head(self, key: str) -> ObjectMeta:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def close(self) -> None:
        self.inner.close()


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
    on_version: Callable[[VersionInfo, int | None, int, float], None] | None = None,
) -> tuple[VersionInfo, dict[str, torch.Tensor]] | None:
    """Keep a bf16 copy of the weights at ``url`` current until the trainer's final version.

    Args:
        url: the store the trainer publishes to.
        run_id: stop only at a final version carrying this ``run`` in its metadata (so an old
            run's final version in a reused store does not end the worker at once).
        poll_s: seconds between HEAD polls.
        should_stop: polled between versions; return True to give up early.
        on_version: called after each version reached with its info, the version it came
            from (None for the first, full pull), the bytes fetched since the previous one
            (HEAD polls and manifests included) and the seconds the pull took.

    Returns:
        ``(info, weights)`` at the final version, or None when stopped early.
    """
    store = CountingStore(open_store(url))
    with Subscriber(url, store=store) as sub:
        weights: dict[str, torch.Tensor] | None = None
        fetched_before = 0
        while not should_stop():
            info = sub.latest()
            if info is None or (sub.version is not None and info.version <= sub.version):
                time.sleep(poll_s)
                continue
            # Pin the version latest() saw, so what is logged is exactly what was applied.
            previous = sub.version
            t0 = time.perf_counter()
            if weights is None:
                weights = sub.pull(info.version)  # first sync: the whole version, verified
            else:
                reached = sub.pull_into(weights, info.version)  # only the changed chunks
                if reached is None or reached.version != info.version:
                    raise RuntimeError(f"pull_into({info.version}) from version {previous} returned {reached}")
            seconds = time.perf_counter() - t0
            fetched, fetched_before = store.bytes_read - fetched_before, store.bytes_read
            if on_version is not None:
                on_version(info, previous, fetched, seconds)
            if is_final(info, run_id):
                return info, weights
    return None


def _log_version(info: VersionInfo, previous: int | None, fetched: int, seconds: float) -> None:
    how = "pulled in full" if previous is None else f"fast-forwarded from version {previous}"
    logger.info(
        "version %d (step %s, %s) %s: fetched %s in %.2f s",
        info.version, info.step, info.kind, how, human_bytes(fetched), seconds,
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

    def on_version(info: VersionInfo, previous: int | None, fetched: int, seconds: float) -> None:
        _log_version(info, previous, fetched, seconds)
        events.put({"event": "version", "worker": worker_id, "version": info.version, "kind": info.kind,
                    "fetched": fetched, "seconds": seconds})

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
    parser.add_argument("-v", "--verbose", action="store_true", help="log deltastore's own messages too")
    args = parser.parse_args(argv)
    multiprocessing.current_process().name = "worker"
    setup_logging(args.verbose)
    try:
        result = follow(args.store, run_id=args.run, poll_s=args.poll, on_version=_log_version)
    except KeyboardInterrupt:
        return 130
    assert result is not None
    info, weights = result
    combined = hashlib.sha256("".join(tensor_digests(weights).values()).encode()).hexdigest()
    print(f"final version {info.version}: {len(weights)} tensors, sha256 of tensor digests {combined[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
