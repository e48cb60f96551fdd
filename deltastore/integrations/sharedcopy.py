"""One host copy per node: the followed weights in shared memory, for every engine process on it.

Each process of an engine that follows a store holds the model once more in host memory (vLLM:
every tensor-parallel worker; SGLang: every engine's sidecar). Eight ranks or eight engines on
one node hold eight copies. With a shared directory (``HostCopy(shared=...)``) they hold one:
one process, the *leader*, follows the store into tensors mapped from a file in the directory;
the others, *readers*, map the same file and feed their engine from it. On a tmpfs
(``/dev/shm``) the file is the copy, in memory once however many processes map it, and one
process fetches and decodes each version (with a node cache, ``Subscriber(node_cache=)``, the
readers' restores read its packs too).

Layout of a shared directory::

    weights.<g>.bin   the tensors of layout generation g, back to back (Subscriber.allocate(into=))
    index.<g>.json    their names, dtypes, shapes and byte offsets
    state.json        the identity (store, format, selection), the generation, the version in
                      the weights (or ``kept``: left by killed processes, not yet checked),
                      whether the leader is writing them, its error, and the tensors each recent
                      version changed
    leader.lock       held (flock, exclusive) by the leader for as long as it leads
    weights.lock      held exclusive by the leader while it writes the weights and the state,
                      shared by a reader while it reads them into its engine
    users.lock        held shared by every process that has the directory open
    init.lock         held while a process opens or leaves the directory

Guarantees:

- *A reader never feeds its engine a torn version.* The leader writes the weights only inside
  its swap, under ``weights.lock`` held exclusive, and marks the state ``writing`` before its
  first byte; a reader reads under the lock held shared, and a state marked ``writing`` (a
  leader that died in its swap) is a version nobody serves until a leader has written one whole.
- *A leader that dies is replaced.* ``flock`` is released by the kernel when its holder dies;
  every reader tries to lead at each poll, and the one that wins goes on from the version the
  copy holds once every chunk matches its digest (hashed, nothing fetched); a copy left
  ``writing``, or one that fails a digest, is loaded whole (fetched and verified) into the same
  mapping.
- *What changed is known across processes.* The state lists, for the last
  :data:`LOG_VERSIONS` versions, the tensors each changed; a reader swaps in the union since the
  version its engine serves, or every tensor when that version is not in the list.
- *The memory goes with the last process.* The last process to close removes the directory.
  What processes that were killed left is cleared by the next process to open it alone, but for
  a whole version of the same store, format and selection: that is kept, served by nobody until
  the next leader has checked every chunk against the version's digests and goes on from it (an
  engine that crashed with all its ranks restarts without fetching the model again).
- *No room is an error, not a crash.* The weights file is allocated whole
  (``posix_fallocate``) before it is mapped: a tmpfs too small raises SharedCopyError instead
  of a SIGBUS in the middle of a write.

Locks are ``fcntl.flock`` (Linux, macOS), as for the node cache (deltastore.fleet.nodecache):
keep the directory on the node (a tmpfs such as ``/dev/shm``, sized for the model: containers
often mount a small one, e.g. Docker's 64 MB default ``--shm-size``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import mmap
import os
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from deltastore.errors import SharedCopyError

try:
    import fcntl
except ImportError:  # no flock(2) (Windows): SharedCopy refuses to open
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Version of the directory's files (state.json ``format``); another one is refused.
SHARED_FORMAT = 1
#: How many versions' changed tensors the state lists.
LOG_VERSIONS = 32
#: The default parent of shared directories: the node's tmpfs.
DEFAULT_PARENT = "/dev/shm"

_LOCKS = ("leader.lock", "weights.lock", "users.lock", "init.lock")


def default_shared_dir(identity: Mapping[str, Any]) -> str:
    """The directory shared by every process that follows the same store, format and selection
    as this user: ``/dev/shm/deltastore-copy-<uid>-<hash>`` (the system's temporary directory
    where there is no ``/dev/shm``)."""
    parent = DEFAULT_PARENT if os.path.isdir(DEFAULT_PARENT) else tempfile.gettempdir()
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(parent, f"deltastore-copy-{os.getuid()}-{digest}")


def _index_bytes(index: list[list[Any]]) -> int:
    """The bytes a weights file of ``index`` (name, dtype, shape, offset, bytes per tensor) holds."""
    return max((off + nbytes for *_, off, nbytes in index), default=0)


def _logged(state: Mapping[str, Any], manifest: str, changed: list[int]) -> list[Any]:
    """The state's log with ``manifest`` appended, changing the tensors ``changed`` (indices in
    the index), cut to the last :data:`LOG_VERSIONS`."""
    return [*(state.get("log") or []), [manifest, changed]][-LOG_VERSIONS:]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise SharedCopyError(f"unknown dtype {name!r} in a shared host copy's index")
    return dt


class SharedCopy:
    """The files of one shared host copy, opened by one process (see the module docstring).

    Args:
        path: the directory (created if missing).
        identity: what the copy follows (store URL, format, selection); a directory opened with
            another identity is refused.

    Raises:
        SharedCopyError: the directory cannot be used (not creatable, no flock, another
            identity, another format).
    """

    def __init__(self, path: str | os.PathLike[str], identity: Mapping[str, Any]):
        self.path = Path(path)
        self.identity = dict(identity)
        self.generation: int | None = None  # of the weights this process maps
        self._lead_fd: int | None = None
        self._write_fd: int | None = None
        self._read_fd: int | None = None
        self._users_fd: int | None = None
        if fcntl is None:
            raise SharedCopyError(f"shared host copy {self.path}: this platform has no flock(2)")
        self._open()

    # --- the directory ----------------------------------------------------------------------

    def _lock_fd(self, name: str) -> int:
        return os.open(self.path / name, os.O_RDWR | os.O_CREAT, 0o600)

    def _open(self) -> None:
        for _ in range(100):  # another process removing the directory meanwhile: open it again
            try:
                self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
                init = self._lock_fd("init.lock")
            except OSError as e:
                raise SharedCopyError(f"shared host copy {self.path} cannot be used: {e}") from e
            try:
                fcntl.flock(init, fcntl.LOCK_EX)
                if not self._same_file(init, "init.lock"):
                    continue  # removed by the last process out while this one waited
                users = self._lock_fd("users.lock")
                try:
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._clear_left_overs()  # nobody else has it open: what is here was left by the dead
                    fcntl.flock(users, fcntl.LOCK_SH)
                except BlockingIOError:
                    fcntl.flock(users, fcntl.LOCK_SH)
                self._users_fd = users
                state = self.state()
                if state is None:
                    self._write_state({"format": SHARED_FORMAT, "identity": self.identity, "generation": None,
                                       "version": None, "writing": False, "error": None, "log": []})
                elif state.get("format") != SHARED_FORMAT or state.get("identity") != self.identity:
                    self._release_users(remove=True)  # init.lock is held here
                    raise SharedCopyError(
                        f"shared host copy {self.path} holds {state.get('identity')!r} (format "
                        f"{state.get('format')!r}), not {self.identity!r}: give each store, format and "
                        "selection a directory of its own")
                return
            except SharedCopyError:
                raise
            except OSError as e:
                raise SharedCopyError(f"shared host copy {self.path} cannot be used: {e}") from e
            finally:
                os.close(init)
        raise SharedCopyError(f"shared host copy {self.path} kept being removed while it was opened")

    def _same_file(self, fd: int, name: str) -> bool:
        try:
            st = os.stat(self.path / name)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def _clear(self, keep: frozenset[str] = frozenset()) -> None:
        for p in self.path.iterdir():
            if p.name not in _LOCKS and p.name not in keep:
                p.unlink(missing_ok=True)

    def _clear_left_overs(self) -> None:
        """What processes killed without closing left: a whole version of this copy's identity
        (not marked ``writing``) is kept, its weights, index and state, as ``kept`` until a
        leader has checked it against the version's digests (:meth:`checked`); the rest goes."""
        try:
            state = self.state()
        except SharedCopyError:
            state = None
        if state is None:
            self._clear()
            return
        gen, version = state.get("generation"), state.get("version") or state.get("kept")
        whole = (state.get("format") == SHARED_FORMAT and state.get("identity") == self.identity
                 and isinstance(gen, int) and isinstance(version, dict) and not state.get("writing"))
        index = self._index(gen) if whole else None
        try:
            whole = index is not None and os.stat(self.path / f"weights.{gen}.bin").st_size >= _index_bytes(index)
        except (OSError, TypeError, ValueError):  # no weights file, or an index not of this format
            whole = False
        if not whole:
            self._clear()
            return
        self._clear(frozenset({f"weights.{gen}.bin", f"index.{gen}.json", "state.json"}))
        self._write_state({**state, "version": None, "kept": version, "error": None, "log": []})
        logger.info("shared host copy %s: keeping version %s, left by processes that were killed, until a leader "
                    "has checked it", self.path, version.get("version"))

    def _leave(self) -> None:
        """Release this process's hold; the last one out removes the directory."""
        if self._users_fd is None:
            return
        try:
            init = self._lock_fd("init.lock")
        except OSError:
            self._release_users(remove=False)
            return
        try:
            fcntl.flock(init, fcntl.LOCK_EX)
            self._release_users(remove=True)
        finally:
            os.close(init)

    def _release_users(self, *, remove: bool) -> None:
        """Drop this process's hold on ``users.lock`` (with ``init.lock`` held when ``remove``);
        when nobody else holds it, remove the directory."""
        users, self._users_fd = self._users_fd, None
        if users is None:
            return
        try:
            if not remove:
                return
            fcntl.flock(users, fcntl.LOCK_UN)
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # others still use it
            self._clear()
            for name in _LOCKS:
                (self.path / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.path.rmdir()
        except OSError as e:
            logger.warning("leaving shared host copy %s: %s", self.path, e)
        finally:
            os.close(users)

    def close(self) -> None:
        """Stop leading and leave (the mapping goes with the last tensor of it). Idempotent."""
        for attr in ("_write_fd", "_read_fd", "_lead_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                setattr(self, attr, None)
                os.close(fd)
        self._leave()

    # --- state -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any] | None:
        """The state file (replaced whole on every write, so read whole), None before the first."""
        try:
            raw = (self.path / "state.json").read_bytes()
        except FileNotFoundError:
            return None
        try:
            state = json.loads(raw)
            if not isinstance(state, dict):
                raise ValueError("not an object")
            return state
        except ValueError as e:
            raise SharedCopyError(f"shared host copy {self.path}: state.json is unreadable ({e})") from e

    def _write_state(self, state: Mapping[str, Any]) -> None:
        tmp = self.path / f"state.json.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.path / "state.json")

    def _update(self, state: Mapping[str, Any] | None = None, **fields: Any) -> None:
        """Write the state with ``fields`` changed: of ``state`` when the caller has just read
        it, else of the file's."""
        self._write_state({**(self.state() or {} if state is None else state), **fields})

    # --- leading ---------------------------------------------------------------------------

    def try_lead(self) -> bool:
        """Become the leader if nobody leads (never waits)."""
        if self._lead_fd is not None:
            return True
        fd = self._lock_fd("leader.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lead_fd = fd
        return True

    @property
    def leads(self) -> bool:
        return self._lead_fd is not None

    def create(self, layout: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The leader's tensors, mapped: ``layout`` is :meth:`Subscriber.allocate`'s tensors on a
        ``meta`` buffer (names, dtypes, shapes, byte offsets). The generation the readers map is
        kept when its index is the same (a new leader continues in the same memory), else a new
        one is allocated, its state marked ``writing`` until the leader's first version lands.

        Raises:
            SharedCopyError: no room for the weights (the directory's filesystem is full).
        """
        index = [[n, str(t.dtype), list(t.shape), t.storage_offset() * t.element_size(),
                  t.numel() * t.element_size()] for n, t in layout.items()]
        with self._exclusive():
            return self._create(index)

    def _create(self, index: list[list[Any]]) -> dict[str, torch.Tensor]:
        size = _index_bytes(index)
        state = self.state() or {}
        gen = state.get("generation")
        if gen is not None and self._index(gen) == index:
            return self.attach(gen)
        gen = 0 if gen is None else int(gen) + 1
        weights = self.path / f"weights.{gen}.bin"
        try:
            fd = os.open(weights, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)  # every page now, or ENOSPC now: never a SIGBUS later
            finally:
                os.close(fd)
            (self.path / f"index.{gen}.json").write_text(json.dumps(index))
        except OSError as e:
            weights.unlink(missing_ok=True)
            room = (" (no room: size the tmpfs for the model, or pass another directory)"
                    if e.errno == errno.ENOSPC else "")
            raise SharedCopyError(
                f"shared host copy {self.path}: cannot allocate {size} bytes of weights{room}: {e}") from e
        self._update(state, generation=gen, version=None, kept=None, writing=True, log=[])
        # readers that still map an older generation keep its pages until they map this one
        for old in self.path.glob("weights.*.bin"):
            if old.name != weights.name:
                old.unlink(missing_ok=True)
        return self.attach(gen)

    def _index(self, gen: int) -> list[list[Any]] | None:
        try:
            index = json.loads((self.path / f"index.{gen}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return index if isinstance(index, list) else None

    def attach(self, gen: int | None = None) -> dict[str, torch.Tensor] | None:
        """Map generation ``gen`` (default: the state's) and return its tensors; None while the
        leader has not created one."""
        if gen is None:
            state = self.state() or {}
            gen = state.get("generation")
            if gen is None:
                return None
        index = self._index(gen)
        if index is None:
            return None
        size = _index_bytes(index)
        try:
            with open(self.path / f"weights.{gen}.bin", "r+b") as f:
                if os.fstat(f.fileno()).st_size < size:
                    raise SharedCopyError(f"shared host copy {self.path}: weights.{gen}.bin is shorter than its index")
                mm = mmap.mmap(f.fileno(), size) if size else None
        except FileNotFoundError:
            return None  # replaced by a newer generation meanwhile
        except SharedCopyError:
            raise
        except OSError as e:
            raise SharedCopyError(f"shared host copy {self.path}: cannot map weights.{gen}.bin: {e}") from e
        buf = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
        out = {}
        for name, dtype, shape, off, nbytes in index:
            out[name] = buf[off:off + nbytes].view(_dtype(dtype)).view(shape)
        self.generation = gen  # (each tensor keeps the mapping alive, torch.frombuffer)
        return out

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        fd = self._lock_fd("weights.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def begin_write(self) -> Iterator[None]:
        """The leader's swap: the weights locked exclusive and the state marked ``writing``.
        Stays held when the block ends normally, until :meth:`landed`; a block that raises
        restores the mark (the swap put everything back) and releases the lock."""
        fd = self._lock_fd("weights.lock")
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._write_fd = fd
        try:
            state = self.state() or {}
            writing_before = bool(state.get("writing"))
            self._update(state, writing=True)
            yield
        except BaseException:
            with contextlib.suppress(OSError, SharedCopyError):
                self._update(writing=writing_before)
            self._end_write()
            raise

    def landed(self, version: Mapping[str, Any], changed: list[str], names: Mapping[str, int]) -> None:
        """Record the version the weights now hold and the tensors it changed, then release the
        write lock (after a :meth:`begin_write` block that ended normally)."""
        state = self.state() or {}
        log = _logged(state, version["manifest"], sorted(names[n] for n in changed if n in names))
        self._update(state, version=dict(version), kept=None, writing=False, error=None, log=log)
        self._end_write()

    def checked(self, version: Mapping[str, Any]) -> None:
        """The leader found the weights to be ``version`` (every chunk against its digest): the
        readers may serve it (a version kept from processes that were killed), and an engine
        that serves it swaps only what later versions change."""
        state = self.state() or {}
        self._update(state, version=dict(version), kept=None, log=_logged(state, version["manifest"], []))

    def failed(self, error: str) -> None:
        """Record the leader's follow error (readers report it), releasing a write it held."""
        with contextlib.suppress(OSError, SharedCopyError):
            self._update(error=error)
        self._end_write()

    def _end_write(self) -> None:
        fd, self._write_fd = self._write_fd, None
        if fd is not None:
            os.close(fd)  # releases the flock

    # --- reading ---------------------------------------------------------------------------

    def read_lock(self, block: bool) -> bool:
        """Lock the weights shared (readers of the engine's side); False when the leader writes
        and ``block`` is False."""
        fd = self._lock_fd("weights.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self._read_fd = fd
        return True

    def read_unlock(self) -> None:
        fd, self._read_fd = self._read_fd, None
        if fd is not None:
            os.close(fd)


def changed_since(state: Mapping[str, Any], manifest: str | None, names: list[str]) -> list[str] | None:
    """The tensors changed since the version ``manifest`` (the union over the logged versions
    after its last entry), in ``names`` order; None when it is not in the log (every tensor)."""
    log = state.get("log") or []
    for i in range(len(log) - 1, -1, -1):
        if manifest is not None and log[i][0] == manifest:
            idx = {j for _, changed in log[i + 1:] for j in changed}
            return [n for j, n in enumerate(names) if j in idx]
    return None
