"""A worker's local cache: the tensors of a version it held, to restart without refetching.

Layout of a cache directory::

    held.json                          {"format": "deltastore.worker-cache", "schema": 1, "url",
                                        "version", "manifest", "lineage", "file", "saved",
                                        "selection", "spare"}
    state-<version>-<random>.safetensors   the tensors of that version

A partial subscriber's cache (``selection``: its selection as a JSON object, else null) also
holds the bits of its edge chunks outside the selection: ``spare`` lists ``[unit, index, key]``,
``key`` naming that chunk's bytes (uint8) in the state file beside the tensors.

Writes are atomic: the tensors go to a new file (written, fsynced, renamed), then ``held.json``
is replaced to point at it, then older state files are removed. A worker killed at any point
leaves either the previous complete pair or the new one. A save that fails (a full disk) removes
what it wrote and raises :class:`~deltastore.errors.WorkerCacheError`: ``held.json`` still names
the previous complete state, which is adopted as the version it is, never as a newer one.

The cache is a hint, never trusted: :meth:`WorkerCache.load` only parses it. The subscriber
that adopts it re-reads the version's manifests from the store and checks every chunk of the
cached tensors against their digests; a cache from another store, of a version the store no
longer has, or with any damaged byte is discarded (with a log line) and rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltastore._util.files import fsync_path
from deltastore.errors import WorkerCacheError

logger = logging.getLogger(__name__)

CACHE_FORMAT = "deltastore.worker-cache"
CACHE_SCHEMA = 1
HELD_FILE = "held.json"
#: held.json is a few hundred bytes; anything much larger is not ours and is not parsed.
MAX_HELD_BYTES = 64 * 1024


@dataclass(frozen=True)
class CachedState:
    """What a cache directory says it holds (not yet verified against any store)."""

    url: str
    version: int
    manifest: str
    lineage: str | None
    tensors: dict[str, torch.Tensor]
    #: a partial subscriber's selection (JSON object), None for whole targets
    selection: dict[str, Any] | None = None
    #: a partial subscriber's edge chunks' bytes, by ``(unit, index)``
    spare: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)


class WorkerCache:
    """One worker's cache directory (created if missing).

    Example::

        cache = WorkerCache("/var/cache/deltastore/run42")
        cache.save(weights, url=url, version=7, manifest=key, lineage=None)
        held = cache.load()      # CachedState or None
    """

    def __init__(self, path: str | os.PathLike[str]):
        """Raises WorkerCacheError when ``path`` is not a directory and cannot be made one."""
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            what = "is not a directory" if self.path.exists() else f"cannot be created as a directory ({e.strerror or e})"
            raise WorkerCacheError(f"worker cache path {self.path} {what}; pass a directory for the cache") from e

    def save(self, tensors: Mapping[str, torch.Tensor], *, url: str, version: int, manifest: str,
             lineage: str | None, selection: dict[str, Any] | None = None,
             spare: Mapping[tuple[str, int], np.ndarray] | None = None) -> Path:
        """Write ``tensors`` as the cached state of ``version`` atomically; return the file.
        A partial subscriber's also passes its ``selection`` (a JSON object) and ``spare`` bits.

        Raises:
            WorkerCacheError: the state could not be written (a full disk, an I/O error); what
                this save wrote is removed and the previous cached state, if any, is kept.
        """
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        self._remove_partials()  # a killed save's leftovers would keep a full disk full
        name = f"state-{version:012d}-{uuid.uuid4().hex[:8]}.safetensors"
        final = self.path / name
        partial = self.path / f"{name}.partial"
        tmp = self.path / f"{HELD_FILE}.{uuid.uuid4().hex[:8]}.partial"
        cpu = {k: (v.detach().cpu() if v.device.type != "cpu" else v.detach()).contiguous() for k, v in tensors.items()}
        kept = []
        for n, (key, bits) in enumerate(sorted((spare or {}).items())):
            slot = f"#spare/{n}"
            while slot in cpu:  # never a user's tensor
                slot = "#" + slot
            cpu[slot] = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).copy())
            kept.append([key[0], key[1], slot])
        try:
            save_file(cpu, str(partial))
            with open(partial, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(partial, final)
            doc = {
                "format": CACHE_FORMAT, "schema": CACHE_SCHEMA, "url": url, "version": int(version),
                "manifest": manifest, "lineage": lineage, "file": name,
                "saved": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "selection": selection, "spare": kept,
            }
            with open(tmp, "w") as f:
                json.dump(doc, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path / HELD_FILE)
        except BaseException as e:
            for p in (partial, final, tmp):  # held.json still names the previous complete state
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
            if isinstance(e, (OSError, SafetensorError)):
                raise WorkerCacheError(
                    f"could not save version {version} of {url} in the worker cache {self.path}: {e}; "
                    "the previous cached version, if any, is kept (free space there, or pass another cache directory)"
                ) from e
            raise
        fsync_path(self.path, strict=False)
        self._remove_stale(keep=name)
        logger.info("cached version %d of %s in %s", version, url, self.path)
        return final

    def load(self) -> CachedState | None:
        """The cached state, or None (logged) when there is none or it does not parse."""
        held = self.path / HELD_FILE
        if not held.exists():
            return None
        try:
            if held.stat().st_size > MAX_HELD_BYTES:
                raise ValueError(f"{held} is too large to be a cache index")
            doc = json.loads(held.read_text())
            if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("schema") != CACHE_SCHEMA:
                raise ValueError(f"{held} is not a schema-{CACHE_SCHEMA} deltastore cache index")
            file = doc["file"]
            if not isinstance(file, str) or "/" in file or not file.startswith("state-"):
                raise ValueError(f"{held} names an odd state file {file!r}")
            version = doc["version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise ValueError(f"{held} has version {version!r}")
            from safetensors.torch import load_file

            tensors = load_file(str(self.path / file))
            selection = doc.get("selection")
            if selection is not None and not isinstance(selection, dict):
                raise ValueError(f"{held} has selection {selection!r}")
            spare: dict[tuple[str, int], np.ndarray] = {}
            for unit, index, key in doc.get("spare") or []:
                if not isinstance(unit, str) or isinstance(index, bool) or not isinstance(index, int):
                    raise ValueError(f"{held} lists an odd spare chunk {[unit, index]!r}")
                spare[(unit, index)] = tensors.pop(key).numpy()
            return CachedState(url=str(doc["url"]), version=version, manifest=str(doc["manifest"]),
                               lineage=doc.get("lineage"), tensors=tensors, selection=selection, spare=spare)
        except Exception as e:  # noqa: BLE001 - any damage means "no usable cache"
            logger.warning("ignoring the worker cache in %s: %s", self.path, e)
            return None

    def clear(self) -> None:
        """Forget the cached state (e.g. it failed verification)."""
        try:
            (self.path / HELD_FILE).unlink()
        except FileNotFoundError:
            pass
        self._remove_stale(keep=None)

    def _remove_stale(self, keep: str | None) -> None:
        for p in self.path.glob("state-*"):
            if p.name != keep:
                try:
                    p.unlink()
                except OSError:
                    pass
        self._remove_partials()

    def _remove_partials(self) -> None:
        for p in [*self.path.glob("state-*.partial"), *self.path.glob(f"{HELD_FILE}.*.partial")]:
            try:
                p.unlink()
            except OSError:
                pass
