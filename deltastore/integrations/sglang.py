"""SGLang: follow a deltastore and apply each version through SGLang's weight-update API,
changed tensors only, tagging the engine's ``weight_version`` with the version.

Two ways in, read from SGLang's source (docs/integrations.md names the files and commits):

- an in-process ``sglang.Engine``: ``Engine.update_weights_from_tensor(named_tensors,
  load_format=None, flush_cache=True)`` (:class:`EngineApplier`). The engine pickles the tensors
  for each tensor-parallel scheduler process (``MultiprocessingSerializer``: CPU tensors pass
  through shared memory, CUDA tensors as IPC handles), and every scheduler's
  ``model.load_weights`` cuts its own shard from the full tensors.
- ``sglang.launch_server`` over HTTP (:class:`ServerApplier`): ``POST
  /update_weights_from_disk`` with a directory holding the changed tensors as one safetensors
  file. ``POST /update_weights_from_tensor`` exists too, but its body is the same pickle,
  base64-encoded: shared-memory and CUDA IPC handles, not bytes, valid only on the engine's host
  while the sender keeps the memory alive. A safetensors file says what it holds; the directory
  must be readable by the server at the same path (same host or a shared filesystem).

Either way only the last call of a sync carries ``weight_version`` (so every response's
``meta_info["weight_version"]`` names the version whose weights produced it) and
``flush_cache=True`` (SGLang drops its radix prefix cache after the update). SGLang runs each
update call under its model-update writer lock: the call waits for the requests in flight,
which finish on the old weights, and requests arriving meanwhile run after it on the new ones.
A version applied in one call (``bucket_bytes=None``, or changes that fit one bucket) is
therefore atomic for requests; with several calls a request admitted between two calls sees a
mix (the bucket bounds the GPU memory each call takes: SGLang moves a call's tensors to the
device before loading them).

A failed call (an exception, ``success: false``, an HTTP error) is handled by
:meth:`~deltastore.integrations.hostcopy.HostCopy.sync`: every tensor of that sync is sent again
at the version served before, rebuilt from the store, and EngineUpdateError says so (or that the
engine's state is unknown, when that is impossible; the next sync then reloads every tensor).

Example::

    import sglang
    from deltastore.integrations.sglang import EngineApplier, SGLangSync

    engine = sglang.Engine(model_path="Qwen/Qwen3-0.6B")
    sync = SGLangSync(EngineApplier(engine), "s3://bucket/run-42")
    sync.start(wait_s=600)
    served = sync.sync()          # between generate() calls, or from a sidecar thread
"""

from __future__ import annotations

import inspect
import logging
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from deltastore.errors import EngineUpdateError
from deltastore.integrations.hostcopy import DEFAULT_INTERVAL_S, Applier, HostCopy, ServedVersion
from deltastore.integrations.jsonhttp import DEFAULT_TIMEOUT_S, JSONClient, Reply

logger = logging.getLogger(__name__)

#: The most tensor bytes one update call carries by default: SGLang moves all of a call's tensors
#: to the GPU before ``load_weights``, so a full first load in one call would need the model's
#: size in free GPU memory once more.
DEFAULT_BUCKET_BYTES = 512 << 20


def buckets(tensors: list[tuple[str, torch.Tensor]], limit: int | None) -> list[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in order, cut into runs of at most ``limit`` bytes (a larger tensor alone);
    one run when ``limit`` is None."""
    if limit is None:
        return [tensors] if tensors else []
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out


def _check_result(result: Any, what: str) -> None:
    """SGLang answers ``(success, message)`` (Engine) or ``{"success", "message"}`` (HTTP)."""
    if isinstance(result, tuple) and len(result) >= 2:
        ok, message = result[0], result[1]
    elif isinstance(result, Mapping):
        ok, message = result.get("success"), result.get("message")
    else:
        ok, message = result is None or result is True, result
    if ok is not True:
        raise EngineUpdateError(f"SGLang refused {what}: {message}")


class EngineApplier:
    """The in-process ``sglang.Engine`` path: ``update_weights_from_tensor``.

    Args:
        engine: an ``sglang.Engine`` (anything with ``update_weights_from_tensor``).
        bucket_bytes: the most tensor bytes per call (None: one call per sync).
        flush_cache: flush the prefix cache with the last call of each sync.

    ``weight_version`` is passed with the last call when the engine's method takes it; the
    ``Engine`` read for this integration does not (its HTTP server does), so an in-process
    engine's version is the one :class:`SGLangSync` reports.
    """

    def __init__(self, engine: Any, *, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, flush_cache: bool = True):
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.flush_cache = flush_cache
        self._tags = "weight_version" in inspect.signature(engine.update_weights_from_tensor).parameters

    @property
    def name(self) -> str:
        return f"SGLang engine {type(self.engine).__name__}"

    def apply(self, tensors: list[tuple[str, torch.Tensor]], version: ServedVersion) -> None:
        runs = buckets(tensors, self.bucket_bytes)
        if not runs and self._tags:
            runs = [[]]  # nothing changed: one empty call only moves the tag
        for i, run in enumerate(runs):
            last = i == len(runs) - 1
            # Copies: the engine moves CPU tensors into shared memory to pickle them, which
            # would move the host copy itself; a copy costs one bucket, transiently.
            kwargs: dict[str, Any] = {"named_tensors": [(n, t.clone()) for n, t in run], "load_format": None,
                                      "flush_cache": self.flush_cache and last}
            if last and self._tags:
                kwargs["weight_version"] = version.weight_version
            what = f"call {i + 1}/{len(runs)} of version {version.version} ({len(run)} tensors)"
            _check_result(self.engine.update_weights_from_tensor(**kwargs), what)


class ServerApplier:
    """The ``sglang.launch_server`` path: safetensors files and ``POST /update_weights_from_disk``.

    Args:
        engine_url: the server, ``http://host:30000``.
        work_dir: where the update files are written; the server must read it at the same path
            (default: a new temporary directory). The files of the last sync are kept (SGLang's
            ``model_path`` names them after an update), older ones deleted.
        bucket_bytes: the most tensor bytes per call (None: one call per sync).
        flush_cache: flush the prefix cache with the last call of each sync.
        load_format: SGLang's ``load_format`` (None: its default, which reads safetensors).
        timeout_s, api_key: per request; ``--api-key`` of the server.
    """

    def __init__(self, engine_url: str, work_dir: str | Path | None = None, *,
                 bucket_bytes: int | None = DEFAULT_BUCKET_BYTES, flush_cache: bool = True,
                 load_format: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, api_key: str | None = None):
        self.engine_url = engine_url
        self.client = JSONClient(engine_url, timeout_s=timeout_s, api_key=api_key)
        self._own_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="deltastore-sglang-")) if work_dir is None else Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.bucket_bytes = bucket_bytes
        self.flush_cache = flush_cache
        self.load_format = load_format
        self._seq = 0  # numbers the update directories: a retried version gets new ones
        self._kept: list[Path] = []  # the directories of the last sync that succeeded

    @property
    def name(self) -> str:
        return f"SGLang server {self.engine_url}"

    def apply(self, tensors: list[tuple[str, torch.Tensor]], version: ServedVersion) -> None:
        from safetensors.torch import save_file

        runs = buckets(tensors, self.bucket_bytes)
        if not runs:  # nothing changed: only the tag moves
            self._post("/update_weight_version", {"new_version": version.weight_version, "abort_all_requests": False},
                       f"the tag of version {version.version}")
            return
        written: list[Path] = []
        try:
            for i, run in enumerate(runs):
                last = i == len(runs) - 1
                self._seq += 1
                d = self.work_dir / f"v{version.version}-{self._seq:06d}"
                d.mkdir()
                written.append(d)
                # Copies: safetensors refuses tensors that share memory (a group's members are
                # views of one buffer), and each must be contiguous.
                save_file({n: t.detach().clone().contiguous() for n, t in run}, str(d / "model.safetensors"),
                          metadata={"format": "pt"})
                body: dict[str, Any] = {"model_path": str(d), "abort_all_requests": False,
                                        "flush_cache": self.flush_cache and last}
                if self.load_format is not None:
                    body["load_format"] = self.load_format
                if last:
                    body["weight_version"] = version.weight_version
                self._post("/update_weights_from_disk", body,
                           f"call {i + 1}/{len(runs)} of version {version.version} ({len(run)} tensors)")
        except BaseException:
            self._remove(written)
            raise
        self._remove(self._kept)
        self._kept = written

    def weight_version(self) -> str | None:
        """The server's weight version (``GET /get_weight_version``)."""
        reply = self._request("GET", "/get_weight_version", None)
        return reply.body.get("weight_version") if reply.ok and isinstance(reply.body, dict) else None

    def close(self) -> None:
        """Delete the update files (the whole directory when it was made here)."""
        self._remove(self._kept)
        self._kept = []
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def _request(self, method: str, path: str, body: Any) -> Reply:
        try:
            return self.client.request(method, path, body)
        except OSError as e:
            raise EngineUpdateError(f"{self.name} could not be reached ({method} {path}: {type(e).__name__}: {e})") from e

    def _post(self, path: str, body: dict[str, Any], what: str) -> None:
        reply = self._request("POST", path, body)
        if not reply.ok:
            raise EngineUpdateError(f"SGLang refused {what}: {path}: {reply.describe()}")
        _check_result(reply.body, what)

    @staticmethod
    def _remove(dirs: list[Path]) -> None:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


class SGLangSync:
    """Follows a store into a host copy and swaps each version into an SGLang engine.

    Args:
        applier: :class:`EngineApplier` (in-process) or :class:`ServerApplier` (HTTP).
        store_url, storage_options, interval, cache_dir, worker_id, trusted_keys, threads, format:
            as for :class:`~deltastore.integrations.hostcopy.HostCopy` (``format="fp8-block128"``
            for an engine serving block-scaled FP8 with ``weight_scale_inv``, SPEC §15).
        shared_host_copy: one host copy for every engine of the node that follows the same store
            and format (True: the default directory under ``/dev/shm``; or a directory):
            :class:`~deltastore.integrations.hostcopy.HostCopy` ``shared``.

    Memory: one host copy of the model per engine (SGLang's update API takes full checkpoint
    tensors and every tensor-parallel scheduler cuts its own shard), or per node with
    ``shared_host_copy``, plus one bucket of copies while a sync runs.

    Example::

        sync = SGLangSync(ServerApplier("http://127.0.0.1:30000", "/dev/shm/ds"), "s3://bucket/run-42")
        sync.start(wait_s=600)
        sync.sync()                       # ServedVersion; the server's weight_version is its tag
    """

    def __init__(self, applier: Applier, store_url: str, *, storage_options: Mapping[str, Any] | None = None,
                 interval: float = DEFAULT_INTERVAL_S, cache_dir: str | None = None, worker_id: str | None = None,
                 trusted_keys: Iterable[Any] | None = None, threads: int | None = None, format: str | None = None,
                 shared_host_copy: bool | str = False):
        self.applier = applier
        self.host = HostCopy(store_url, storage_options=storage_options, interval=interval, cache_dir=cache_dir,
                             worker_id=worker_id, trusted_keys=trusted_keys, threads=threads, format=format,
                             shared=shared_host_copy or None)

    @property
    def name(self) -> str:
        return str(getattr(self.applier, "name", type(self.applier).__name__))

    @property
    def served(self) -> ServedVersion | None:
        """The version the engine serves (None before the first sync, or when unknown)."""
        return self.host.served

    def start(self, wait_s: float | None = None) -> dict[str, Any]:
        """Start following; wait up to ``wait_s`` for the first version. Returns :meth:`status`."""
        self.host.start()
        if wait_s is not None:
            self.host.wait_ready(wait_s)
        return self.status()

    def sync(self, block: bool = False) -> ServedVersion | None:
        """Swap the tensors changed since the last sync into the engine (see the module docstring).

        Raises:
            EngineUpdateError: the engine failed; the message says what it serves now.
            RuntimeError: following failed (its error chained).
        """
        return self.host.sync(self.applier, block=block)

    def status(self) -> dict[str, Any]:
        """:meth:`HostCopy.status <deltastore.integrations.hostcopy.HostCopy.status>`."""
        return self.host.status()

    def close(self) -> None:
        """Stop following (the engine keeps what it serves) and release the applier's files."""
        self.host.close()
        close = getattr(self.applier, "close", None)
        if callable(close):
            close()
