"""A host copy that follows a store, and the all-or-restored swap of its versions into an engine.

Inference engines take weight updates as whole tensors under checkpoint names: vLLM's
``model.load_weights``, SGLang's ``update_weights_from_tensor`` and ``update_weights_from_disk``.
Their parameters are fused and sharded, so they cannot be followed directly: each integration
follows the store into a host copy in the store's layout (a :class:`HostCopy`) and hands the
engine the tensors that changed since its last sync, through an :class:`Applier` (one per engine
API). This module is the part they share:

- the follow thread: each version is fetched, verified and decoded while the engine serves, then
  swapped into the host copy under :attr:`HostCopy.lock`; the names it changed accumulate until
  the next sync (the union over every version staged meanwhile);
- :meth:`HostCopy.sync`, the swap into the engine, with its guarantee: the engine ends serving
  either the new version, whole, or the version it served before. When the engine fails partway
  (an exception, a refusal, a transport error), every tensor of that sync is sent again at the
  version served before, rebuilt from the store (a partial pull of exactly those tensors,
  verified against their digests), and :class:`~deltastore.errors.EngineUpdateError` says so.
  When that is impossible (nothing was served before: a first load; the old version was
  collected; the restore failed too) the error says the engine's state is unknown, and the next
  sync reloads every tensor;
- agreement between ranks: an engine whose ranks each follow the store (vLLM's tensor- and
  pipeline-parallel workers) must swap all ranks to the same version or none. ``sync(agree=)``
  takes a collective vote (:func:`agree_over`): ranks apply only when every rank has staged the
  same version, and keep it only when every rank applied it. (A rank whose restore failed, its
  state unknown, is brought back by the next version every rank stages: until then it votes to
  apply a version its peers already serve, and nobody moves.)
- one copy per node (``shared=``): the processes that follow the same store, format and
  selection on a node map one copy in shared memory, which one of them follows
  (:mod:`deltastore.integrations.sharedcopy`); each still swaps into its own engine as above.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deltastore.errors import EngineUpdateError, SelectionError
from deltastore.integrations.sharedcopy import SharedCopy, changed_since, default_shared_dir
from deltastore.layout.select import Selection

logger = logging.getLogger(__name__)

#: How often the follow thread polls HEAD by default (one conditional GET each).
DEFAULT_INTERVAL_S = 2.0
#: How long :meth:`HostCopy.close` waits for the follow thread to notice the stop.
STOP_JOIN_S = 30.0

#: A rank's vote when its votes differ from another rank's (never a vote itself).
_DISAGREE = ("disagree",)


@dataclass(frozen=True)
class ServedVersion:
    """The version an engine serves, as every integration reports it.

    Attributes:
        version: the store's version number.
        step: the version's step (the TRL backend writes TRL's ``model_version`` there too).
        model_version: ``metadata["model_version"]`` (TRL's policy version), None when absent.
        manifest: the version's manifest key (unique in the store, across replaced histories).
    """

    version: int
    step: int | None
    model_version: int | None
    manifest: str

    @classmethod
    def of(cls, info: Any) -> ServedVersion:
        """From a :class:`deltastore.VersionInfo`."""
        mv = info.metadata.get("model_version")
        return cls(version=int(info.version), step=info.step, model_version=None if mv is None else int(mv),
                   manifest=str(info.manifest))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServedVersion:
        """From :meth:`to_dict`'s JSON form (what the vLLM RPCs return).

        Raises:
            ValueError: a field is missing or of the wrong type.
        """
        try:
            version, manifest = d["version"], d["manifest"]
            step, mv = d.get("step"), d.get("model_version")
            if not isinstance(version, int) or isinstance(version, bool) or not isinstance(manifest, str):
                raise TypeError
            return cls(version=version, step=None if step is None else int(step),
                       model_version=None if mv is None else int(mv), manifest=manifest)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"not a served version: {dict(d)!r} (needs an int 'version' and a str 'manifest')") from None

    def to_dict(self) -> dict[str, Any]:
        """``{"version", "step", "model_version", "manifest"}``."""
        return {"version": self.version, "step": self.step, "model_version": self.model_version,
                "manifest": self.manifest}

    @property
    def weight_version(self) -> str:
        """The tag set as the engine's ``weight_version`` (SGLang, vLLM): the version number as a
        string, so a response's ``meta_info["weight_version"]`` names the store version."""
        return str(self.version)

    @property
    def policy_version(self) -> int:
        """The trainer's count for these weights: ``model_version``, else ``step``, else ``version``
        (what TRL's staleness accounting compares)."""
        if self.model_version is not None:
            return self.model_version
        return self.step if self.step is not None else self.version


class Applier(Protocol):
    """One engine API that takes whole tensors under checkpoint names."""

    def apply(self, tensors: list[tuple[str, torch.Tensor]], version: ServedVersion) -> None:
        """Make the engine serve ``tensors`` (possibly none: then only the version's tag moves)
        and name ``version`` as its weights. Raise on any failure; the tensors are the host
        copy's own, valid only during the call."""
        ...


def agree_over(vote: Hashable, gathers: Sequence[Callable[[Hashable], list[Hashable]]]) -> bool:
    """Whether every rank cast ``vote``: the same answer on every rank.

    ``gathers`` are all-gathers over process groups that together connect every rank of the
    engine (vLLM: its tensor-parallel group, then its pipeline-parallel group). Each round
    replaces a rank's value by its group's common value (or a disagreement marker), so after
    the rounds every rank holds the same value, equal to its own vote only if all votes were.
    Every rank must call it with the same ``gathers``, in the same order.
    """
    value: Hashable = vote
    for gather in gathers:
        votes = gather(value)
        value = votes[0] if all(v == votes[0] for v in votes) else _DISAGREE
    return value == vote


class HostCopy:
    """Follows ``url`` into host tensors in a thread; :meth:`sync` swaps them into an engine.

    Args:
        url, storage_options, trusted_keys: as for :class:`deltastore.Subscriber`.
        format: the serving format to follow (``"fp8-block128"``, ``"mxfp8"``: the weights and
            scales the engine loads, SPEC §15), or None for the versions as published.
        interval: seconds between polls of HEAD.
        cache_dir, worker_id: a local cache to resume from and the id in the store's ledger
            (:class:`deltastore.CachePolicy` ``path``, :class:`deltastore.HeartbeatPolicy`
            ``worker_id``).
        threads: decode threads (default: all cores).
        select: hold only these tensors, whole (:class:`deltastore.layout.select.Selection`
            without ``shard``; e.g. :func:`stage_selection` for a pipeline stage); None: every
            tensor.
        shared: one copy for every process of the node that follows the same store, format and
            selection (:mod:`deltastore.integrations.sharedcopy`): a directory on the node's
            tmpfs, or True for the default one (:func:`~deltastore.integrations.sharedcopy.default_shared_dir`,
            under ``/dev/shm``). One of the processes follows the store into it, the others
            read it; ``cache_dir`` and ``worker_id`` are the follower's. None: this process's own.

    Memory: the model once in host memory, in the store's dtypes (the selection's tensors only,
    with ``select``); with ``shared``, once per node.

    Example::

        host = HostCopy("s3://bucket/run-42")
        host.start()
        host.wait_ready(600)
        served = host.sync(my_applier)     # the changed tensors, all or restored
    """

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None,
                 interval: float = DEFAULT_INTERVAL_S, cache_dir: str | None = None, worker_id: str | None = None,
                 trusted_keys: Iterable[Any] | None = None, threads: int | None = None, format: str | None = None,
                 select: Selection | None = None, shared: str | os.PathLike[str] | bool | None = None):
        from deltastore.read.partial import selection_doc
        from deltastore.read.subscriber import Subscriber

        if select is not None and select.shard is not None:
            raise SelectionError("an engine's host copy holds whole tensors (its loader cuts each rank's shard): "
                                 "select tensors by name, without shard")
        self.url = url  # as given (the subscriber's URL may be normalized)
        self.format = format
        self._trusted_keys = None if trusted_keys is None else list(trusted_keys)  # reused by rebuild
        self._threads = threads
        self.sub = Subscriber(url, storage_options=storage_options, trusted_keys=self._trusted_keys, threads=threads,
                              format=format, select=select)
        self.weights: dict[str, torch.Tensor] = {}
        #: Held by the follow thread while it writes the host copy, and by a sync while it reads it.
        self.lock = threading.Lock()
        self.pending: dict[str, None] = {}  # tensor names changed since the last sync (ordered)
        self._staged: ServedVersion | None = None  # the version in the host copy
        self._served: ServedVersion | None = None  # the version the engine serves
        self.shared: SharedCopy | None = None
        if shared is not None and shared is not False:
            identity = {"url": self.sub.url, "format": format,
                        "select": None if select is None else selection_doc(select)}
            path = default_shared_dir(identity) if shared is True else shared
            try:
                self.shared = SharedCopy(path, identity)
            except BaseException:
                self.sub.close()
                raise
        self._state_unknown = False  # a failed swap could not be undone
        # The host copy was written but its record is not in yet: a sync now would read bits of
        # a version whose changed names it does not know.
        self._ahead = False
        self.error: BaseException | None = None
        self._interval = interval
        self._cache_dir, self._worker_id = cache_dir, worker_id
        self._stop = threading.Event()
        self._started = False
        self.ready = threading.Event()  # set once the first version is in the host copy (or following failed)
        self._thread = threading.Thread(target=self._run, name="deltastore-follow", daemon=True)

    # --- following ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the follow thread (once; not after :meth:`close`)."""
        if not self._started and not self._stop.is_set():
            self._started = True
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first version is staged (or following failed); False on timeout."""
        return self.ready.wait(timeout)

    @contextlib.contextmanager
    def _swap(self) -> Iterator[None]:
        """The follow loop's pause: the host copy is written under the lock, and stays marked
        ahead of its record until the loop body has booked the record."""
        with self.lock:
            self._ahead = True
            try:
                yield
            except BaseException:
                self._ahead = False  # a failed swap restores the host copy: nothing is ahead
                raise

    def _run(self) -> None:
        try:
            if self.shared is None:
                self._follow()
                return
            while not self._stop.is_set():  # read the shared copy until this process leads it
                if self.shared.try_lead():
                    logger.info("following %s into the shared host copy %s", self.sub.url, self.shared.path)
                    self._follow()
                    return
                self._read_shared()
                self._stop.wait(self._interval)
        except BaseException as e:  # noqa: BLE001 - reported by the next sync or status
            logger.exception("following %s stopped", self.sub.url)
            self.error = e
            if self.shared is not None and self.shared.leads:
                self.shared.failed(f"{type(e).__name__}: {e}")
            self.ready.set()

    def _allocate(self) -> dict[str, torch.Tensor]:
        if self.shared is None:
            return self.sub.allocate()
        # the layout's names, dtypes, shapes and offsets without memory; then the shared tensors
        return self.shared.create(self.sub.allocate(into=lambda n: torch.empty(n, dtype=torch.uint8, device="meta")))

    def _follow(self) -> None:
        from deltastore.errors import StorageError, VersionNotFoundError
        from deltastore.read.follow import CachePolicy, HeartbeatPolicy, PollPolicy

        while not self._stop.is_set():  # an empty store (the trainer not started yet): wait
            try:
                self.weights = self._allocate()
                break
            except (VersionNotFoundError, StorageError) as e:
                logger.info("waiting for a first version of %s (%s)", self.sub.url, e)
                self._stop.wait(self._interval)
        if self._stop.is_set():
            return
        if self.shared is not None:
            self._adopt_shared()
        cache = CachePolicy(self._cache_dir) if self._cache_dir is not None else None
        pause = self._swap if self.shared is None else self._shared_swap
        order = {n: i for i, n in enumerate(self.weights)}
        for rec in self.sub.follow(self.weights, poll=PollPolicy(self._interval), pause=pause,
                                   stop=self._stop, cache=cache, heartbeat=HeartbeatPolicy(self._worker_id)):
            staged = ServedVersion.of(rec.info)
            with self.lock:
                self._staged = staged
                self._ahead = False
                if self.shared is None:
                    self.pending.update(dict.fromkeys(rec.changed))
                else:  # what changed is the shared state's, for every process
                    self.shared.landed(staged.to_dict(), list(rec.changed), order)
            self.ready.set()
            logger.info("staged version %d of %s (%d tensors changed, host copy paused %.3f s)",
                        rec.info.version, self.sub.url, len(rec.changed), rec.pause_s)

    def _adopt_shared(self) -> None:
        """A new leader goes on from the version the shared copy holds, or was kept from
        processes that were killed, when every chunk of it matches its digest (hashed here,
        nothing fetched; the engines serving that version swap nothing again). A copy a leader
        left in the middle of a write, in another layout, of a selection that takes part of a
        chunk (small tensors grouped with ones it leaves out: their bits are in no copy) or that
        fails a digest is loaded whole by the follow loop, as a first version is."""
        from deltastore.errors import DeltastoreError

        assert self.shared is not None
        state = self.shared.state() or {}
        version = state.get("version") or state.get("kept")
        if version is None or state.get("writing") or state.get("generation") != self.shared.generation:
            return
        try:
            info = self.sub.adopt(self.weights, ServedVersion.from_dict(version).version)
        except (DeltastoreError, ValueError) as e:
            logger.warning("the shared host copy %s does not hold the version it names (%s): loading %s whole",
                           self.shared.path, e, self.sub.url)
            return
        if state.get("version") is None:
            self.shared.checked(version)
        self.ready.set()
        logger.info("went on from version %d of %s in the shared host copy %s", info.version, self.sub.url,
                    self.shared.path)

    @contextlib.contextmanager
    def _shared_swap(self) -> Iterator[None]:
        """:meth:`_swap` over the shared copy: its write lock is taken too, and stays held until
        the loop body has recorded the version and what it changed for the readers."""
        assert self.shared is not None
        with self._swap(), self.shared.begin_write():
            yield

    def _read_shared(self) -> None:
        """A reader's poll: map the leader's tensors once they exist; ready once they hold a
        version; the leader's error is this reader's."""
        assert self.shared is not None
        state = self.shared.state() or {}
        if self.shared.generation != state.get("generation"):
            weights = self.shared.attach()
            if weights is not None:
                with self.lock:
                    self.weights = weights
        if state.get("version") is not None and not state.get("writing") and self.weights:
            self.ready.set()

    # --- state ----------------------------------------------------------------------------

    @property
    def served(self) -> ServedVersion | None:
        """The version the engine serves (None before the first sync, or when unknown)."""
        return self._served

    @property
    def staged(self) -> ServedVersion | None:
        """The version in the host copy (None before the first is loaded)."""
        return self._staged if self.shared is None else _shared_version(self.shared.state() or {})

    def check(self) -> None:
        """Raise RuntimeError (the follow thread's error chained) if following failed: this
        process's, or with ``shared`` the leader's."""
        if self.error is not None:
            raise RuntimeError(f"following {self.sub.url} failed: {type(self.error).__name__}: {self.error}") from self.error
        error = self._leader_error()
        if error is not None and self.shared is not None:
            raise RuntimeError(f"following {self.sub.url} into the shared host copy {self.shared.path} failed "
                               f"(in the process that follows it): {error}")

    def _leader_error(self) -> str | None:
        return None if self.shared is None else (self.shared.state() or {}).get("error")

    def status(self) -> dict[str, Any]:
        """Served and staged versions, tensors waiting for a sync, whether the engine's state is
        unknown, and the follow error if any. Read without the lock (which the follow thread
        holds through a whole first load): each field is read once."""
        served, error = self.served, self.error
        if self.shared is None:
            staged, leader_error, pending, shared = self._staged, None, len(self.pending), None
        else:  # the shared state, read once
            state = self.shared.state() or {}
            staged, leader_error = _shared_version(state), state.get("error")
            pending = len(self._changed_since_served(state))
            shared = {"path": str(self.shared.path), "leader": self.shared.leads}
        text = f"{type(error).__name__}: {error}" if error is not None else leader_error
        return {"url": self.sub.url, "served": None if served is None else served.to_dict(),
                "staged": None if staged is None else staged.to_dict(), "pending_tensors": pending,
                "engine_state_unknown": self._state_unknown, "error": text, "shared": shared}

    # --- the swap into the engine ---------------------------------------------------------

    def sync(self, applier: Applier, *, block: bool = False,
             agree: Callable[[Hashable], bool] | None = None) -> ServedVersion | None:
        """Swap the tensors changed since the last sync into the engine through ``applier``.

        Args:
            applier: the engine API (:class:`Applier`).
            block: wait while the follow thread writes the host copy. Default False: the
                engine does not wait for the host side; the version served stays as it is.
            agree: a collective vote over the engine's ranks (:func:`agree_over`), called once
                before applying and, when every rank applies, once after; every rank must call
                ``sync`` together. None: a single rank.

        Returns:
            The version served after the sync (None while nothing was ever served).

        Raises:
            EngineUpdateError: the engine failed the swap; the message says whether the version
                served before was restored or the engine's state is unknown.
            RuntimeError: following failed (the follow thread's error chained).
        """
        acquired = self.lock.acquire(blocking=block) if self.shared is None else self.shared.read_lock(block)
        try:
            vote, staged, names = self._vote(acquired)
            agreed = agree(vote) if agree is not None else True
            if vote[0] == "error":
                self.check()
            if vote[0] != "apply" or not agreed or staged is None:
                return self.served
            target = staged
            t0 = time.perf_counter()
            failure: BaseException | None = None
            try:
                applier.apply(self._tensors(names), target)
            except Exception as e:  # noqa: BLE001 - every failure gets the same recovery
                failure = e
            everyone = agree(("ok",) if failure is None else ("failed",)) if agree is not None else True
            if failure is not None or not everyone:
                cause = failure or EngineUpdateError(f"another rank of the engine failed to apply version {target.version}")
                self._recover(applier, names, target, cause)
            self.pending.clear()
            self._served, self._state_unknown = staged, False
            dt = time.perf_counter() - t0
        finally:
            if acquired:
                self.lock.release() if self.shared is None else self.shared.read_unlock()
        logger.info("serving version %d of %s (model_version %s): %d tensors swapped in %.3f s",
                    target.version, self.sub.url, target.model_version, len(names), dt)
        return target

    def _vote(self, acquired: bool) -> tuple[tuple[Any, ...], ServedVersion | None, list[str]]:
        """This rank's vote, the version it would apply and the tensors that changed since the
        version served (the held lock makes them one version's)."""
        if self.error is not None:
            return ("error",), None, []
        if self.shared is None:
            if not acquired or self._ahead:
                return ("busy",), None, []
            staged, names = self._staged, list(self.pending)
        else:
            state = self.shared.state() or {}
            if state.get("error") is not None:
                return ("error",), None, []
            if not acquired or state.get("writing"):
                return ("busy",), None, []
            version = state.get("version")
            if version is not None and self.shared.generation != state.get("generation"):
                weights = self.shared.attach()  # a new leader's layout: map it (no writer now)
                if weights is None:
                    return ("busy",), None, []
                self.weights = weights
            staged = _shared_version(state)
            names = self._changed_since_served(state)
        if staged is None or staged == self._served:
            return ("current", None if staged is None else staged.manifest), None, []
        return ("apply", staged.manifest), staged, names

    def _changed_since_served(self, state: Mapping[str, Any]) -> list[str]:
        """The tensors of the shared copy changed since the version the engine serves (every
        tensor when the state does not list that version)."""
        names = list(self.weights)
        since = changed_since(state, None if self._served is None else self._served.manifest, names)
        return names if since is None else since

    def _tensors(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        from deltastore.read.changes import changed_tensors

        return list(changed_tensors(self.weights, {n: [] for n in names}))

    def _recover(self, applier: Applier, names: list[str], target: ServedVersion, cause: BaseException) -> None:
        """Put back the version served before (see the module docstring); always raises."""
        prev = self._served
        what = f"version {target.version} of {self.sub.url} ({len(names)} tensors)"
        if prev is not None:
            try:
                applier.apply(self.rebuild(names, prev), prev)
            except Exception as e:  # noqa: BLE001 - reported in the error below
                logger.exception("restoring version %d after a failed swap", prev.version)
                why = f"restoring version {prev.version} failed too ({type(e).__name__}: {e})"
            else:
                raise EngineUpdateError(
                    f"the engine did not take {what}: {type(cause).__name__}: {cause}. The tensors it was sent "
                    f"were put back at version {prev.version}, which it serves; the next sync tries again"
                ) from cause
        else:
            why = "nothing was served before it, so there is no version to put back"
        self._served, self._state_unknown = None, True
        self.pending.update(dict.fromkeys(self.weights))
        raise EngineUpdateError(
            f"the engine did not take {what}: {type(cause).__name__}: {cause}; {why}. The engine's state is "
            "unknown (it may hold some tensors of each version): the next sync reloads every tensor"
        ) from cause

    def rebuild(self, names: list[str], version: ServedVersion) -> list[tuple[str, torch.Tensor]]:
        """The tensors ``names`` as they are at ``version``, pulled from the store and verified
        (a partial pull of exactly those tensors: the host copy holds only the newest bits).

        Raises:
            VersionNotFoundError: ``version`` is gone (VersionCollectedError below the floor), or
                its number now names another manifest (the store's history was replaced).
        """
        from deltastore.errors import VersionNotFoundError
        from deltastore.read.subscriber import Subscriber

        if not names:
            return []
        # Every tensor held: the host copy's selection. Otherwise one literal pattern per name.
        if set(names) >= set(self.weights):
            select = self.sub.select or Selection()
        else:
            select = Selection(names=tuple(_literal(n) for n in names))
        with Subscriber(self.sub.url, store=self.sub.store, select=select,
                        trusted_keys=self._trusted_keys, threads=self._threads, format=self.format) as sub:
            # Versions are read by number through HEAD's history: after a replaced history the
            # number names other weights, which must not be passed off as the ones served.
            def same_history() -> None:
                manifest = sub.info(version.version).manifest
                if manifest != version.manifest:
                    raise VersionNotFoundError(
                        f"version {version.version} of {self.sub.url} is now {manifest!r}, not the "
                        f"{version.manifest!r} the engine served: the store's history was replaced"
                    )

            same_history()
            got = sub.pull(version.version)
            same_history()
        return [(n, got[n]) for n in names]

    def close(self) -> None:
        """Stop following and release the store (the engine keeps what it serves) and the shared
        copy (the last process out removes it). Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_JOIN_S)
        self.sub.close()
        if self.shared is not None:
            self.shared.close()


def _shared_version(state: Mapping[str, Any]) -> ServedVersion | None:
    """The version a shared copy's state says its weights hold (None: none yet, or unchecked)."""
    version = state.get("version")
    return None if version is None else ServedVersion.from_dict(version)


def _literal(name: str) -> str:
    """An fnmatch pattern matching exactly ``name``."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def stage_selection(missing: Iterable[str]) -> Selection | None:
    """The selection of a pipeline-parallel stage whose model lacks the modules ``missing``
    (their names with a trailing dot, as vLLM's ``get_pp_missing_layer_names`` gives them):
    every tensor but those whose name starts with one of them; None when none is missing.

    The store's names are the checkpoint's, which the engine's loader skips by the same
    prefixes; a tensor it would map to another name is held (more memory, never a tensor less).
    """
    prefixes = sorted(set(missing))
    if not prefixes:
        return None
    return Selection(exclude=tuple(_literal(p) + "*" for p in prefixes))
