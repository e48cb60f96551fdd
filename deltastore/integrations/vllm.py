"""vLLM: a worker extension that follows a deltastore and reloads only the tensors that changed,
and the client that drives it on a ``vllm serve`` engine.

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
``VLLM_SERVER_DEV_MODE=1``), e.g. ``{"method": "deltastore_sync"}``; :class:`VLLMServerSync`
makes those calls (and tags the engine's weight version), and
:mod:`deltastore.integrations.rollout` runs it in a loop. See docs/integrations.md.

How it works, per worker process (:class:`~deltastore.integrations.hostcopy.HostCopy`):

- ``deltastore_start`` opens a :class:`~deltastore.Subscriber` and a thread that follows the
  store into a host copy of the weights in the store's layout (checkpoint names and dtypes,
  which is what ``model.load_weights`` takes; the engine's own parameters are fused and
  sharded, so they cannot be followed directly). Each new version is fetched, verified and
  decoded while the engine keeps generating, then swapped into the host copy under a lock.
- ``deltastore_sync`` is the pause: vLLM runs a ``collective_rpc`` between engine steps, so no
  forward pass runs while it feeds ``model.load_weights`` the tensors changed since the last
  sync (the union over every version applied meanwhile), and records the version now served.
  The ranks of a tensor- or pipeline-parallel engine vote first over vLLM's CPU process groups:
  they swap only when every rank has staged the same version, and keep it only when every rank
  loaded it, so the ranks never serve different versions. A failed load puts the version
  served before back (EngineUpdateError says which, or that the state is unknown).
- ``deltastore_version`` reports the version served (its number, ``step`` and the trainer's
  ``model_version`` from its metadata), so rollouts are tagged with the weights actually used.

The weight version vLLM's engine reports (``AsyncLLM.update_weight_version`` /
``get_weight_version``) lives in the engine core, which a worker cannot reach: the client sets
it over HTTP after each swap (``POST /update_weight_version``).

Cost: each worker process holds the model once more in host memory (the followed copy, whole:
``load_weights`` takes full checkpoint tensors and cuts each rank's shard itself; a
pipeline-parallel rank started with ``pipeline_stage=True`` holds only its stage's tensors;
with ``shared_host_copy=True`` the ranks of a node hold one copy between them), and reloads
whole tensors (``load_weights`` takes tensors, not rows).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import torch

from deltastore.errors import EngineUpdateError
from deltastore.integrations.hostcopy import DEFAULT_INTERVAL_S, HostCopy, ServedVersion, agree_over, stage_selection
from deltastore.integrations.jsonhttp import DEFAULT_TIMEOUT_S, JSONClient, Reply
from deltastore.layout.select import Selection

logger = logging.getLogger(__name__)

#: The extension's class path, for ``--worker-extension-cls``.
EXTENSION_CLS = "deltastore.integrations.vllm.DeltastoreWorkerExtension"
#: ``vllm.distributed.parallel_state`` getters of the process groups the ranks vote over, in
#: order: together they connect every rank of one engine (a data-parallel engine is another).
GROUP_GETTERS = ("get_tp_group", "get_pp_group")


class DeltastoreWorkerExtension:
    """Methods added to every vLLM worker (``--worker-extension-cls``); see the module docstring.

    The extension reaches the engine's model through ``self.model_runner`` (vLLM's GPU worker:
    ``get_model()`` or ``.model``); that and ``model.load_weights(iterable of (name, tensor))``
    are all it needs, plus vLLM's tensor- and pipeline-parallel groups to vote when there are
    several ranks.
    """

    _deltastore: HostCopy | None = None

    # --- RPCs -----------------------------------------------------------------------------

    def deltastore_start(self, url: str, storage_options: Mapping[str, Any] | None = None, *,
                         interval: float = DEFAULT_INTERVAL_S, cache_dir: str | None = None,
                         worker_id: str | None = None, trusted_keys: Iterable[Any] | None = None,
                         threads: int | None = None, wait_s: float | None = None,
                         format: str | None = None, pipeline_stage: bool = False,
                         shared_host_copy: bool | str = False) -> dict[str, Any]:
        """Start following ``url`` in a background thread (idempotent for the same URL).

        Args:
            url, storage_options, trusted_keys: as for :class:`deltastore.Subscriber`.
            interval: seconds between polls of HEAD.
            cache_dir, worker_id: a local cache to resume from and the id in the store's
                ledger (:class:`deltastore.CachePolicy` ``path``, :class:`deltastore.HeartbeatPolicy`
                ``worker_id``).
            threads: decode threads (default: all cores).
            wait_s: wait up to this long for the first version to be staged.
            format: the serving format to follow, e.g. ``"fp8-block128"`` for an engine started
                with block-FP8 weights (the store's publisher declared it, SPEC §15); None: the
                versions as published.
            pipeline_stage: hold only this rank's pipeline stage: every tensor but those under
                the layers vLLM left out of this rank's model (its
                ``get_pp_missing_layer_names``; :func:`~deltastore.integrations.hostcopy.stage_selection`).
                The host copy then holds and fetches the stage's tensors only (and its
                ``cache_dir`` caches them). A rank without missing layers holds every tensor.
            shared_host_copy: one host copy per node instead of one per rank: True for the
                default directory under ``/dev/shm``, or a directory (on the node's tmpfs). The
                ranks (and other engines on the node) that follow the same store, format and
                selection map one copy, which one of them follows
                (:mod:`deltastore.integrations.sharedcopy`).

        Returns:
            :meth:`deltastore_status`.

        Raises:
            ValueError: this worker already follows another URL.
        """
        f = self._deltastore
        if f is not None:
            if f.url != url:
                raise ValueError(f"this worker already follows {f.url}; call deltastore_stop first")
            return self.deltastore_status()
        select = self._deltastore_stage() if pipeline_stage else None
        f = HostCopy(url, storage_options=storage_options, interval=interval, cache_dir=cache_dir,
                     worker_id=worker_id, trusted_keys=trusted_keys, threads=threads, format=format, select=select,
                     shared=shared_host_copy or None)
        self._deltastore = f
        f.start()
        if wait_s is not None:
            f.wait_ready(wait_s)
        return self.deltastore_status()

    def deltastore_sync(self, block: bool = False) -> dict[str, Any] | None:
        """Load the tensors changed since the last sync into the engine's model (the pause).

        Args:
            block: wait while the follow thread writes the host copy (a swap, or the first
                version's full load). Default False: the engine does not wait for the host side;
                the version served stays as it is, and the next sync picks the update up.

        Returns:
            :meth:`deltastore_version` after the sync (None while nothing was served yet).

        Raises:
            EngineUpdateError: ``load_weights`` failed (here or on another rank); the message
                says whether the version served before was put back or the state is unknown.
            RuntimeError: not started, or the follow thread died (its error chained).
        """
        agree = self._deltastore_agreement()
        f = self._deltastore
        if f is None:
            if agree is not None:
                agree(("unstarted",))  # the other ranks are in the vote: never leave them waiting
            raise RuntimeError("deltastore_start(url) was not called on this worker")
        served = f.sync(_LoadWeights(self), block=block, agree=agree)
        return None if served is None else served.to_dict()

    def deltastore_version(self) -> dict[str, Any] | None:
        """The version the engine serves: ``{"version", "step", "model_version", "manifest"}``
        (None before the first sync, or while a failed swap left the state unknown)."""
        served = self._follower().served
        return None if served is None else served.to_dict()

    def deltastore_status(self) -> dict[str, Any]:
        """Served and staged versions, the tensors waiting for a sync, whether the engine's state
        is unknown, and the follow error if any (never waits for the follow thread)."""
        return self._follower().status()

    def deltastore_stop(self) -> None:
        """Stop following and release the store (the engine keeps the weights it serves)."""
        f, self._deltastore = self._deltastore, None
        if f is not None:
            f.close()

    # --- helpers --------------------------------------------------------------------------

    def _follower(self) -> HostCopy:
        f = self._deltastore
        if f is None:
            raise RuntimeError("deltastore_start(url) was not called on this worker")
        return f

    def _deltastore_model(self) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise RuntimeError("no model_runner on this worker: is this a vLLM worker?")
        get = getattr(runner, "get_model", None)
        return get() if callable(get) else runner.model

    def _deltastore_stage(self) -> Selection | None:
        """This rank's pipeline stage (None: its model lacks no layer)."""
        try:
            from vllm.model_executor.models.utils import get_pp_missing_layer_names
        except ImportError as e:
            raise RuntimeError("pipeline_stage=True needs vLLM's get_pp_missing_layer_names "
                               f"(vllm.model_executor.models.utils): {e}") from e
        return stage_selection(get_pp_missing_layer_names(self._deltastore_model()))

    def _deltastore_agreement(self) -> Callable[[Hashable], bool] | None:
        """The vote over this engine's ranks (None for a single rank): all-gathers over vLLM's
        tensor-parallel group, then its pipeline-parallel group, on their CPU (gloo) groups."""
        gathers = _vllm_gathers()
        return None if not gathers else functools.partial(agree_over, gathers=gathers)


class _LoadWeights:
    """The vLLM :class:`~deltastore.integrations.hostcopy.Applier`: ``model.load_weights``."""

    def __init__(self, worker: DeltastoreWorkerExtension):
        self.worker = worker

    def apply(self, tensors: list[tuple[str, torch.Tensor]], version: ServedVersion) -> None:
        if tensors:  # (a version that changed nothing only moves the version served)
            self.worker._deltastore_model().load_weights(tensors)


def _vllm_gathers() -> list[Callable[[Hashable], list[Hashable]]]:
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return []
    gathers = []
    for name in GROUP_GETTERS:
        get = getattr(parallel_state, name, None)
        try:
            group = get() if get is not None else None
        except AssertionError:  # not initialized: a single-process engine
            group = None
        if group is not None and getattr(group, "world_size", 1) > 1:
            gathers.append(functools.partial(_all_gather, group.cpu_group, group.world_size))
    return gathers


def _all_gather(cpu_group: Any, world: int, value: Hashable) -> list[Hashable]:
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, value, group=cpu_group)
    return out


class VLLMServerSync:
    """Drives a ``vllm serve`` engine running :class:`DeltastoreWorkerExtension` over HTTP.

    The server needs ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``, ``/reset_prefix_cache``,
    ``/pause``, ``/resume``) and ``--worker-extension-cls`` set to :data:`EXTENSION_CLS`.

    Args:
        engine_url: the server, ``http://host:8000``.
        store_url: the store every worker follows.
        storage_options, interval, cache_dir, worker_id, trusted_keys, threads, format,
            pipeline_stage, shared_host_copy: passed to ``deltastore_start`` on every worker
            (JSON: ``trusted_keys`` as PEM file paths on the engine's host; ``format`` a serving
            format such as ``"fp8-block128"``; ``pipeline_stage`` True: each rank holds its stage
            only; ``shared_host_copy`` True or a directory: one host copy per node).
        drain: swap at an exact boundary: ``POST /pause?mode=wait`` (vLLM finishes the requests
            it runs and holds new ones), the swap, then ``POST /resume``. Default False: the swap
            runs between two engine steps and sequences in flight continue on the new weights.
        reset_prefix_cache: ``POST /reset_prefix_cache`` after each swap, so that no new request
            reuses KV blocks computed with the old weights (vLLM does not reset its prefix cache
            when weights are loaded).
        tag_weight_version: ``POST /update_weight_version`` with the version's tag
            (:attr:`ServedVersion.weight_version`) after each swap, on servers that have it
            (``GET /weight_info`` then names the weights).
        timeout_s, api_key: per request; ``--api-key`` of the server.

    Example::

        engine = VLLMServerSync("http://127.0.0.1:8000", "s3://bucket/run-42")
        engine.start()
        served = engine.sync()     # ServedVersion, or None before the first version
    """

    def __init__(self, engine_url: str, store_url: str, *, storage_options: Mapping[str, Any] | None = None,
                 interval: float = DEFAULT_INTERVAL_S, cache_dir: str | None = None, worker_id: str | None = None,
                 trusted_keys: list[str] | None = None, threads: int | None = None, drain: bool = False,
                 reset_prefix_cache: bool = True, tag_weight_version: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S, api_key: str | None = None, format: str | None = None,
                 pipeline_stage: bool = False, shared_host_copy: bool | str = False):
        self.engine_url = engine_url
        self.store_url = store_url
        self.client = JSONClient(engine_url, timeout_s=timeout_s, api_key=api_key)
        opts = {"storage_options": dict(storage_options or {}) or None, "interval": interval, "cache_dir": cache_dir,
                "worker_id": worker_id, "trusted_keys": trusted_keys, "threads": threads, "format": format,
                "pipeline_stage": pipeline_stage or None, "shared_host_copy": shared_host_copy or None}
        self._start_kwargs = {k: v for k, v in opts.items() if v is not None}
        self.drain = drain
        self._reset, self._tag = reset_prefix_cache, tag_weight_version
        self._served: ServedVersion | None = None

    @property
    def name(self) -> str:
        return f"vLLM {self.engine_url}"

    @property
    def served(self) -> ServedVersion | None:
        """The version the engine served at the last :meth:`sync` (the lowest of its ranks)."""
        return self._served

    def start(self, wait_s: float | None = None) -> list[dict[str, Any]]:
        """``deltastore_start`` on every worker; returns their statuses.

        Raises:
            EngineUpdateError: the server refused (no dev mode, no extension, another URL).
        """
        kwargs = dict(self._start_kwargs)
        if wait_s is not None:
            kwargs["wait_s"] = wait_s
        return self._rpc("deltastore_start", [self.store_url], kwargs)

    def sync(self) -> ServedVersion | None:
        """Swap the latest staged version in on every worker, then reset the prefix cache and tag
        the weight version if the version served changed.

        Returns:
            The version served (the lowest over the engine's workers), None before the first.

        Raises:
            EngineUpdateError: a worker failed the swap (its message says what it serves now),
                or the server could not be reached (what it serves is then known at the next sync).
        """
        if self.drain:
            self._control("/pause", query={"mode": "wait"}, required=True)
        try:
            served = self._lowest(self._rpc("deltastore_sync", [], {"block": self.drain}))
            if served is not None and served != self._served:
                if self._reset:
                    self._reset = self._control("/reset_prefix_cache")
                if self._tag:
                    self._tag = self._control("/update_weight_version", {"new_version": served.weight_version})
        finally:
            if self.drain:
                self._control("/resume", required=True)
        if served != self._served:
            logger.info("%s serves version %s", self.name, None if served is None else served.version)
        self._served = served
        return served

    def status(self) -> list[dict[str, Any]]:
        """``deltastore_status`` of every worker."""
        return self._rpc("deltastore_status", [], {})

    def weight_version(self) -> str | None:
        """The engine's own weight version (``GET /weight_info``), None where the server lacks it."""
        reply = self._call("GET", "/weight_info")
        return reply.body.get("weight_version") if reply.ok and isinstance(reply.body, dict) else None

    def close(self) -> None:
        """``deltastore_stop`` on every worker (the engine keeps serving its weights)."""
        self._rpc("deltastore_stop", [], {})

    # --- helpers --------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None) -> Reply:
        try:
            return self.client.request(method, path, body, query=query)
        except OSError as e:
            raise EngineUpdateError(
                f"{self.name} could not be reached ({method} {path}: {type(e).__name__}: {e}); what it serves is "
                "known again at its next sync"
            ) from e

    def _rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        reply = self._call("POST", "/collective_rpc", {"method": method, "args": args, "kwargs": kwargs})
        if not reply.ok:
            hint = ("; start the server with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls " + EXTENSION_CLS
                    if reply.status == 404 else "")
            raise EngineUpdateError(f"{self.name}: collective_rpc {method} failed: {reply.describe()}{hint}")
        results = reply.body.get("results") if isinstance(reply.body, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineUpdateError(f"{self.name}: collective_rpc {method} returned {reply.describe()}, not the "
                                    "workers' results")
        return results

    def _lowest(self, results: list[Any]) -> ServedVersion | None:
        try:
            versions = [None if r is None else ServedVersion.from_dict(r) for r in results]
        except (ValueError, TypeError) as e:
            raise EngineUpdateError(f"{self.name}: deltastore_sync returned {results!r}: {e}") from None
        if any(v is None for v in versions):
            return None  # a worker serves nothing it knows of (before its first sync, or unknown)
        lowest = min(versions, key=lambda v: v.version)  # type: ignore[union-attr]
        if any(v != lowest for v in versions):
            # Ranks of one engine agree; this is several engines (data parallel) at different versions.
            logger.info("%s: its engines serve versions %s; reporting %d", self.name,
                        sorted({v.version for v in versions}), lowest.version)  # type: ignore[union-attr]
        return lowest

    def _control(self, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                 required: bool = False) -> bool:
        """POST a control endpoint; False (and one warning) when the server lacks it, so the
        caller stops asking. A refusal is raised when ``required``, else logged."""
        reply = self._call("POST", path, body, query)
        if reply.ok:
            return True
        if reply.status == 404 and not required:
            logger.warning("%s has no %s (%s); not calling it again", self.name, path, reply.describe())
            return False
        if required:
            raise EngineUpdateError(f"{self.name}: {path} failed: {reply.describe()}")
        logger.error("%s: %s failed: %s", self.name, path, reply.describe())
        return True
