"""The rollout sidecar: keeps inference engines at the store's latest version and tells the
rollout worker which version they serve.

With TRL's ``AsyncGRPOTrainer`` and :class:`~deltastore.integrations.trl.DeltastoreWeightTransfer`,
the trainer publishes every sync to a store and bumps its ``model_version`` right away, while the
engine only swaps weights when someone asks it to. This module closes the loop:

- :class:`RolloutSidecar` runs a thread that asks every engine to sync (vLLM:
  :class:`~deltastore.integrations.vllm.VLLMServerSync`, ``deltastore_sync`` through
  ``POST /collective_rpc``; SGLang: :class:`~deltastore.integrations.sglang.SGLangSync`, its
  weight-update API) every ``interval`` seconds, or at once when kicked, and reports the version
  the engines serve (the lowest, with several engines) to its listeners.
- :class:`ServedVersionWorker` wraps a TRL rollout worker (``RolloutWorkerProtocol``, e.g. TRL's
  own ``AsyncRolloutWorker``): the trainer's ``update_model_version`` only kicks the sidecar,
  and the worker is told the ``model_version`` the engines actually serve, after they serve it.
  TRL's worker stamps each group with the version it holds when the group starts, and the
  trainer computes ``staleness = trainer.model_version - sample.model_version`` and drops
  samples past ``max_staleness``: with the served version, that staleness is never less than
  the true one (a group started just after a swap, before the worker heard of it, carries the
  older version; tokens generated after a swap mid-sequence come from newer weights).

Run standalone next to a server (the rollout worker then reads the version from the engine:
SGLang responses' ``meta_info["weight_version"]``, vLLM's ``GET /weight_info`` or
``deltastore_version``)::

    python -m deltastore.integrations.rollout --engine http://127.0.0.1:8000 --store s3://bucket/run-42
    python -m deltastore.integrations.rollout --kind sglang --engine http://127.0.0.1:30000 \\
        --store s3://bucket/run-42 --work-dir /dev/shm/deltastore

In the trainer's process (TRL)::

    sidecar = RolloutSidecar([VLLMServerSync("http://127.0.0.1:8000", url)])
    worker = ServedVersionWorker(AsyncRolloutWorker(...), sidecar)
    trainer = AsyncGRPOTrainer(..., rollout_worker=worker, weight_transfer=DeltastoreWeightTransfer(url))
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from deltastore.errors import EngineUpdateError, WaitTimeoutError
from deltastore.integrations.hostcopy import ServedVersion
from deltastore.storage import parse_storage_option

logger = logging.getLogger(__name__)

#: Seconds between two syncs of every engine when nobody kicks the sidecar. A sync that finds
#: nothing new is one RPC (vLLM) or nothing at all (SGLang): the store is polled by the
#: followers, on their own interval.
DEFAULT_SYNC_INTERVAL_S = 1.0
#: How long :meth:`RolloutSidecar.stop` waits for the sync thread to finish its round.
STOP_JOIN_S = 60.0


class EngineSync(Protocol):
    """One engine the sidecar keeps in sync (:class:`~deltastore.integrations.vllm.VLLMServerSync`,
    :class:`~deltastore.integrations.sglang.SGLangSync`)."""

    @property
    def name(self) -> str: ...

    @property
    def served(self) -> ServedVersion | None: ...

    def start(self, wait_s: float | None = None) -> Any: ...

    def sync(self) -> ServedVersion | None: ...

    def close(self) -> None: ...


class RolloutSidecar:
    """A thread that syncs engines and reports the version they serve.

    Args:
        engines: the engines to keep in sync (each started by :meth:`start`).
        interval: seconds between rounds when not kicked.
        start_wait_s: passed to each engine's ``start`` (wait for a first version).

    A sync that fails (:class:`~deltastore.errors.EngineUpdateError`: the engine refused, or was
    unreachable) is logged and retried at the next round; its engine keeps what it served. Any
    other error stops the thread and is raised by :meth:`check`.

    Example::

        with RolloutSidecar([SGLangSync(ServerApplier(url_engine), url_store)]) as sidecar:
            sidecar.wait_for(policy_version=3, timeout=600)
    """

    def __init__(self, engines: Sequence[EngineSync], *, interval: float = DEFAULT_SYNC_INTERVAL_S,
                 start_wait_s: float | None = None):
        if not engines:
            raise ValueError("a rollout sidecar needs at least one engine")
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval!r}")
        self.engines = list(engines)
        self.interval = interval
        self.start_wait_s = start_wait_s
        self.failures: dict[str, EngineUpdateError] = {}  # engine name → its last failed sync
        self.error: BaseException | None = None
        self._listeners: list[Callable[[ServedVersion], None]] = []
        self._reported: ServedVersion | None = None
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[ServedVersion], None]) -> None:
        """Call ``fn(served)`` (in the sidecar's thread) each time the version served changes."""
        self._listeners.append(fn)

    def start(self) -> None:
        """Start every engine, then the sync thread (idempotent)."""
        if self._thread is not None:
            return
        for engine in self.engines:
            engine.start(self.start_wait_s)
        self._thread = threading.Thread(target=self._run, name="deltastore-rollout-sidecar", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """Sync now rather than at the next interval (e.g. the trainer just published)."""
        self._wake.set()

    def stop(self, *, close_engines: bool = True) -> None:
        """Stop the thread, then close the engines (they keep serving what they serve). Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(STOP_JOIN_S)
        if close_engines and not self._closed:
            self._closed = True
            for engine in self.engines:
                try:
                    engine.close()
                except Exception:  # noqa: BLE001 - one engine's close must not skip the others
                    logger.exception("closing %s", engine.name)
        with self._changed:
            self._changed.notify_all()

    def __enter__(self) -> RolloutSidecar:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- state ----------------------------------------------------------------------------

    @property
    def served(self) -> ServedVersion | None:
        """The lowest version the engines serve (None while one of them serves none it knows)."""
        versions = [e.served for e in self.engines]
        if any(v is None for v in versions):
            return None
        return min(versions, key=lambda v: v.version)  # type: ignore[union-attr]

    def check(self) -> None:
        """Raise RuntimeError (chained) if the sync thread stopped on an error."""
        if self.error is not None:
            raise RuntimeError(f"the rollout sidecar stopped: {type(self.error).__name__}: {self.error}") from self.error

    def wait_for(self, version: int | None = None, *, policy_version: int | None = None,
                 timeout: float | None = None) -> ServedVersion:
        """Wait until every engine serves at least ``version`` (store numbering) or
        ``policy_version`` (the trainer's ``model_version``).

        Raises:
            WaitTimeoutError: ``timeout`` passed first.
            RuntimeError: the sidecar stopped on an error.
        """
        deadline = None if timeout is None else time.monotonic() + timeout

        def reached() -> ServedVersion | None:
            s = self.served
            if s is None:
                return None
            if (version is None or s.version >= version) and (policy_version is None or s.policy_version >= policy_version):
                return s
            return None

        with self._changed:
            while (got := reached()) is None:
                self.check()
                left = None if deadline is None else deadline - time.monotonic()
                if self._stop.is_set() or (left is not None and left <= 0):
                    raise WaitTimeoutError(
                        f"the engines serve {self.served}, not version {version} / policy_version {policy_version}"
                        f"{'' if timeout is None else f' after {timeout:.1f} s'}: is the trainer publishing, and "
                        "are the engines following the same store?"
                    )
                self._changed.wait(left if left is not None else self.interval)
        return got

    # --- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self.sync_once()
                self._wake.wait(self.interval)
        except BaseException as e:  # noqa: BLE001 - raised by check()
            logger.exception("the rollout sidecar stopped")
            self.error = e
            with self._changed:
                self._changed.notify_all()

    def sync_once(self) -> ServedVersion | None:
        """One round: sync every engine, report the version served if it changed; returns it."""
        for engine in self.engines:
            try:
                engine.sync()
                self.failures.pop(engine.name, None)
            except EngineUpdateError as e:
                logger.warning("sync of %s failed: %s", engine.name, e)
                self.failures[engine.name] = e
        served = self.served
        if served is not None and served != self._reported:
            for fn in self._listeners:
                fn(served)
            self._reported = served
            with self._changed:
                self._changed.notify_all()
        return served


class ServedVersionWorker:
    """A TRL ``RolloutWorkerProtocol`` around another one, told the version the engines serve.

    Args:
        worker: the rollout worker (TRL's ``AsyncRolloutWorker``, or any worker with
            ``rollout_buffer``, ``metrics_queue``, ``start``, ``stop``, ``update_model_version``
            and ``check_health``).
        sidecar: the sidecar syncing the engines ``worker`` generates with; started and
            stopped with the worker unless ``own_sidecar=False``.

    The trainer's ``update_model_version(v)`` (called right after it published version ``v``)
    kicks the sidecar and is not passed on; ``worker.update_model_version`` receives the served
    version's :attr:`~deltastore.integrations.hostcopy.ServedVersion.policy_version` when it
    changes. The worker's metrics queue also gets ``deltastore/serving_lag`` (the trainer's
    version minus the served one) at each change.

    Example::

        sidecar = RolloutSidecar([VLLMServerSync("http://127.0.0.1:8000", url)])
        trainer = AsyncGRPOTrainer(..., rollout_worker=ServedVersionWorker(AsyncRolloutWorker(...), sidecar),
                                   weight_transfer=DeltastoreWeightTransfer(url))
    """

    def __init__(self, worker: Any, sidecar: RolloutSidecar, *, own_sidecar: bool = True):
        self.worker = worker
        self.sidecar = sidecar
        self.own_sidecar = own_sidecar
        self.rollout_buffer = worker.rollout_buffer
        self.metrics_queue = worker.metrics_queue
        self.trainer_version = 0  # what the trainer last announced
        sidecar.add_listener(self._served)

    def start(self) -> None:
        if self.own_sidecar:
            self.sidecar.start()
        self.worker.start()

    def update_model_version(self, model_version: int) -> None:
        """The trainer published ``model_version``: sync the engines now (not passed on)."""
        self.trainer_version = int(model_version)
        self.sidecar.kick()

    def check_health(self, stale_after_s: float) -> None:
        self.sidecar.check()
        self.worker.check_health(stale_after_s)

    def stop(self) -> None:
        try:
            self.worker.stop()
        finally:
            if self.own_sidecar:
                self.sidecar.stop()

    def _served(self, served: ServedVersion) -> None:
        self.worker.update_model_version(served.policy_version)
        try:
            self.metrics_queue.put_nowait({"deltastore/serving_lag": float(self.trainer_version - served.policy_version)})
        except queue.Full:  # the trainer drains it at its own pace; a gauge may be dropped
            pass
        except Exception:  # noqa: BLE001 - e.g. a closed multiprocessing queue at shutdown
            logger.debug("could not report the serving lag", exc_info=True)


# --- command line ---------------------------------------------------------------------------


def build_engine(kind: str, engine_url: str, store_url: str, *, storage_options: dict[str, Any] | None = None,
                 interval: float, work_dir: str | None = None, bucket_bytes: int | None = None,
                 drain: bool = False, api_key: str | None = None, format: str | None = None,
                 pipeline_stage: bool = False, shared_host_copy: bool | str = False) -> EngineSync:
    """The :class:`EngineSync` for a server: ``kind`` is ``"vllm"`` or ``"sglang"``; ``format``
    the serving format the engine loads (SPEC §15), None for the versions as published;
    ``pipeline_stage`` (vLLM): each rank holds only its pipeline stage's tensors;
    ``shared_host_copy`` (True, or a directory): one host copy per node (HostCopy ``shared``)."""
    if kind == "vllm":
        from deltastore.integrations.vllm import VLLMServerSync

        return VLLMServerSync(engine_url, store_url, storage_options=storage_options, interval=interval, drain=drain,
                              api_key=api_key, format=format, pipeline_stage=pipeline_stage,
                              shared_host_copy=shared_host_copy)
    if pipeline_stage:
        raise ValueError("pipeline_stage is vLLM's: an SGLang engine's host copy is the sidecar's, one per engine")
    if kind == "sglang":
        from deltastore.integrations.sglang import DEFAULT_BUCKET_BYTES, ServerApplier, SGLangSync

        applier = ServerApplier(engine_url, work_dir, api_key=api_key,
                                bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
        return SGLangSync(applier, store_url, storage_options=storage_options, interval=interval, format=format,
                          shared_host_copy=shared_host_copy)
    raise ValueError(f"unknown engine kind {kind!r}: vllm or sglang")


def main(argv: list[str] | None = None) -> int:
    """``python -m deltastore.integrations.rollout``: sync one engine until interrupted."""
    p = argparse.ArgumentParser(prog="python -m deltastore.integrations.rollout",
                                description="Keep an inference engine at a deltastore's latest version.")
    p.add_argument("--engine", required=True, help="the engine's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--store", required=True, help="the store URL, e.g. s3://bucket/run-42")
    p.add_argument("--kind", choices=("vllm", "sglang"), default="vllm",
                   help="vllm: a vllm serve with the deltastore worker extension (VLLM_SERVER_DEV_MODE=1); "
                        "sglang: sglang.launch_server, updated from files in --work-dir")
    p.add_argument("--interval", type=float, default=DEFAULT_SYNC_INTERVAL_S, help="seconds between syncs")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between polls of the store's HEAD")
    p.add_argument("--work-dir", help="sglang: where update files are written (the server reads them there)")
    p.add_argument("--bucket-mb", type=int, help="sglang: the most MiB of tensors per update call")
    p.add_argument("--drain", action="store_true", help="vllm: finish the requests in flight before each swap")
    p.add_argument("--pipeline-stage", action="store_true",
                   help="vllm: each pipeline-parallel rank holds only its stage's tensors in host memory")
    p.add_argument("--shared-host-copy", nargs="?", const=True, default=False, metavar="DIR",
                   help="one host copy per node for every rank and engine that follows the same store and format "
                        "(default directory under /dev/shm, or DIR on the node's tmpfs)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", type=parse_storage_option,
                   help="a storage option (endpoint_url=..., retries=2, ...), as the deltastore command takes it; "
                        "repeatable")
    p.add_argument("--api-key", help="the engine's --api-key")
    p.add_argument("--format", help="the serving format the engine loads, e.g. fp8-block128 (the trainer published it "
                                    "with formats=...); default: the versions as published")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(a.kind, a.engine, a.store, storage_options=dict(a.storage_option) or None, interval=a.poll,
                          work_dir=a.work_dir, bucket_bytes=None if a.bucket_mb is None else a.bucket_mb << 20,
                          drain=a.drain, api_key=a.api_key, format=a.format, pipeline_stage=a.pipeline_stage,
                          shared_host_copy=a.shared_host_copy)
    sidecar = RolloutSidecar([engine], interval=a.interval)
    sidecar.add_listener(lambda s: logger.info("serving version %d (model_version %s)", s.version, s.model_version))
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    sidecar.start()
    try:
        while not done.wait(1.0):
            sidecar.check()
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
