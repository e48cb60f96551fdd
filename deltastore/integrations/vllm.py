"""A vLLM worker extension: follow a deltastore and reload only the tensors that changed.

Launch (every vLLM worker process gets these methods; call them through ``collective_rpc``)::

    vllm serve Qwen/Qwen3-0.6B \\
        --worker-extension-cls deltastore.integrations.vllm.DeltastoreWorkerExtension

    # offline engine
    llm = LLM(model=..., worker_extension_cls="deltastore.integrations.vllm.DeltastoreWorkerExtension")
    llm.collective_rpc("deltastore_start", args=("s3://bucket/run-42",))
    while True:
        served = llm.collective_rpc("deltastore_sync")[0]   # between generate() calls
        outputs = llm.generate(prompts, params)             # tag them with served["model_version"]

With ``vllm serve``, the same calls go through ``POST /collective_rpc`` (enabled by
``VLLM_SERVER_DEV_MODE=1``), e.g. ``{"method": "deltastore_sync"}``; see docs/integrations.md.

How it works, per worker process:

- ``deltastore_start`` opens a :class:`~deltastore.Subscriber` and a thread that follows the
  store into a host copy of the weights in the store's layout (checkpoint names and dtypes,
  which is what ``model.load_weights`` takes; the engine's own parameters are fused and
  sharded, so they cannot be followed directly). Each new version is fetched, verified and
  decoded while the engine keeps generating, then swapped into the host copy under a lock.
- ``deltastore_sync`` is the pause: vLLM runs a ``collective_rpc`` between engine steps, so no
  forward pass runs while it feeds ``model.load_weights`` the tensors changed since the last
  sync (the union over every version applied meanwhile; :meth:`FollowRecord.updates`), and
  records the version now served. Without a new version it returns at once.
- ``deltastore_version`` reports the version served (its number, ``step`` and the trainer's
  ``model_version`` from its metadata), so rollouts are tagged with the weights actually used.

Cost: each worker process holds the model once more in host memory (the followed copy), and
reloads whole tensors (``load_weights`` takes tensors, not rows).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: How often the follow thread polls HEAD by default (one conditional GET each).
DEFAULT_INTERVAL_S = 2.0
#: How long deltastore_stop waits for the follow thread to notice the stop.
STOP_JOIN_S = 30.0


class _Follower:
    """The per-process state of the extension: a Subscriber, the host copy, what is pending."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None, interval: float,
                 cache_dir: str | None, worker_id: str | None, trusted_keys: Iterable[Any] | None, threads: int | None):
        from deltastore.read.subscriber import Subscriber

        self.url = url  # as passed to deltastore_start
        self.sub = Subscriber(url, storage_options=storage_options, trusted_keys=trusted_keys, threads=threads)
        self.weights: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()  # held for a host swap and while load_weights reads the host copy
        self.pending: dict[str, None] = {}  # tensor names changed since the last sync (ordered)
        self.staged: Any = None  # VersionInfo of the version in the host copy
        self.served: Any = None  # VersionInfo of the version the engine serves
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.ready = threading.Event()  # set once the first version is in the host copy
        self.thread = threading.Thread(
            target=self._run, args=(interval, cache_dir, worker_id), name="deltastore-follow", daemon=True,
        )

    def _run(self, interval: float, cache_dir: str | None, worker_id: str | None) -> None:
        from deltastore.errors import StorageError, VersionNotFoundError
        from deltastore.read.follow import CachePolicy, HeartbeatPolicy, PollPolicy

        try:
            while not self.stop.is_set():  # an empty store (the trainer not started yet): wait
                try:
                    self.weights = self.sub.allocate()
                    break
                except (VersionNotFoundError, StorageError) as e:
                    logger.info("waiting for a first version of %s (%s)", self.sub.url, e)
                    self.stop.wait(interval)
            if self.stop.is_set():
                return
            cache = CachePolicy(cache_dir) if cache_dir is not None else None
            for rec in self.sub.follow(self.weights, poll=PollPolicy(interval), pause=self.lock, stop=self.stop,
                                       cache=cache, heartbeat=HeartbeatPolicy(worker_id)):
                with self.lock:
                    self.pending.update(dict.fromkeys(rec.changed))
                    self.staged = rec.info
                self.ready.set()
                logger.info("staged version %d (%d tensors changed, paused %.3f s on the host copy)",
                            rec.info.version, len(rec.changed), rec.pause_s)
        except BaseException as e:  # noqa: BLE001 - reported by the next RPC
            logger.exception("following %s stopped", self.sub.url)
            self.error = e
            self.ready.set()


def _describe(info: Any) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"version": info.version, "step": info.step, "model_version": info.metadata.get("model_version"),
            "manifest": info.manifest}


class DeltastoreWorkerExtension:
    """Methods added to every vLLM worker (``--worker-extension-cls``); see the module docstring.

    The extension reaches the engine's model through ``self.model_runner.model`` (vLLM's GPU
    worker); that and ``model.load_weights(iterable of (name, tensor))`` are all it needs.
    """

    _deltastore: _Follower | None = None

    # --- RPCs -----------------------------------------------------------------------------

    def deltastore_start(self, url: str, storage_options: Mapping[str, Any] | None = None, *,
                         interval: float = DEFAULT_INTERVAL_S, cache_dir: str | None = None,
                         worker_id: str | None = None, trusted_keys: Iterable[Any] | None = None,
                         threads: int | None = None, wait_s: float | None = None) -> dict[str, Any] | None:
        """Start following ``url`` in a background thread (idempotent for the same URL).

        Args:
            url, storage_options, trusted_keys: as for :class:`deltastore.Subscriber`.
            interval: seconds between polls of HEAD.
            cache_dir, worker_id: a local cache to resume from and the id in the store's
                ledger (:class:`deltastore.CachePolicy` ``path``, :class:`deltastore.HeartbeatPolicy`
                ``worker_id``).
            threads: decode threads (default: all cores).
            wait_s: wait up to this long for the first version to be staged.

        Returns:
            :meth:`deltastore_status`.
        """
        f = self._deltastore
        if f is not None:
            if f.url != url:
                raise ValueError(f"this worker already follows {f.url}; call deltastore_stop first")
            return self.deltastore_status()
        f = _Follower(url, storage_options=storage_options, interval=interval, cache_dir=cache_dir,
                      worker_id=worker_id, trusted_keys=trusted_keys, threads=threads)
        self._deltastore = f
        f.thread.start()
        if wait_s is not None:
            f.ready.wait(wait_s)
        return self.deltastore_status()

    def deltastore_sync(self, block: bool = False) -> dict[str, Any] | None:
        """Load the tensors changed since the last sync into the engine's model (the pause).

        Args:
            block: wait while the follow thread writes the host copy (a swap, or the first
                version's full load). Default False: the engine does not wait for the host side;
                the version served stays as it is, and the next sync picks the update up.

        Returns:
            :meth:`deltastore_version` after the sync (None while nothing was staged yet).

        Raises:
            RuntimeError: not started, or the follow thread died (its error chained).
        """
        f = self._follower()
        if not f.lock.acquire(blocking=block):
            return _describe(f.served)
        try:
            if f.staged is None or f.staged is f.served:
                return _describe(f.served)
            names = list(f.pending)
            t0 = time.perf_counter()
            if names:  # (a version that changed nothing only moves the version served)
                self._deltastore_model().load_weights(_updates(f.weights, names))
            f.pending.clear()
            f.served = f.staged
            dt = time.perf_counter() - t0
        finally:
            f.lock.release()
        logger.info("serving version %d (model_version %s): %d tensors reloaded in %.3f s",
                    f.served.version, f.served.metadata.get("model_version"), len(names), dt)
        return _describe(f.served)

    def deltastore_version(self) -> dict[str, Any] | None:
        """The version the engine serves: ``{"version", "step", "model_version", "manifest"}``
        (None before the first sync)."""
        return _describe(self._follower(check=False).served)

    def deltastore_status(self) -> dict[str, Any]:
        """Served and staged versions, the tensors waiting for a sync, and the follow error if any."""
        f = self._follower(check=False)
        # Without the lock, which the follow thread holds through a whole first load: a status
        # RPC must not stall the engine. Each field is read once (a consistent enough snapshot).
        served, staged, error = f.served, f.staged, f.error
        return {"url": f.sub.url, "served": _describe(served), "staged": _describe(staged),
                "pending_tensors": len(f.pending),
                "error": None if error is None else f"{type(error).__name__}: {error}"}

    def deltastore_stop(self) -> None:
        """Stop following and release the store (the engine keeps the weights it serves)."""
        f, self._deltastore = self._deltastore, None
        if f is None:
            return
        f.stop.set()
        f.thread.join(STOP_JOIN_S)
        f.sub.close()

    # --- helpers --------------------------------------------------------------------------

    def _follower(self, check: bool = True) -> _Follower:
        f = self._deltastore
        if f is None:
            raise RuntimeError("deltastore_start(url) was not called on this worker")
        if check and f.error is not None:
            raise RuntimeError(f"following {f.sub.url} failed: {type(f.error).__name__}: {f.error}") from f.error
        return f

    def _deltastore_model(self) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise RuntimeError("no model_runner on this worker: is this a vLLM worker?")
        get = getattr(runner, "get_model", None)
        return get() if callable(get) else runner.model


def _updates(weights: Mapping[str, torch.Tensor], names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs for ``load_weights``: the host copy's own tensors (the engine
    copies them to the device), read under the follower's lock."""
    from deltastore.read.changes import changed_tensors

    return list(changed_tensors(weights, {n: [] for n in names}))
