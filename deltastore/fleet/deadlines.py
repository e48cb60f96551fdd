"""Deadlines of the phases of moving a version: a HEAD poll, a fetch, a decode, an apply, a
commit, a federated round.

A stalled socket read cannot be interrupted from another thread, and an S3 client's own
``read_timeout`` bounds only the wait between two bytes (a server trickling one byte a minute
never trips it). So a network phase is bounded from outside: :class:`DeadlineStore` runs each
request on a daemon thread and waits for it at most the request's deadline; past it, the
request is abandoned (its thread ends when the client's socket timeout fires; its answer is
dropped) and :class:`~deltastore.errors.DeadlineExceededError` is raised, naming the phase
and the key. The CPU phases (decode, apply) cannot be abandoned without leaving a target half
written: :class:`Watchdog` reports them (a log line and a callback, e.g. a metric) when they
overrun, and lets them finish.

Example::

    store = DeadlineStore(open_store(url), Deadlines(poll=10))
    store.get_if_changed("HEAD", etag)    # DeadlineExceededError(phase="poll") after 10 s
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from deltastore.errors import DeadlineExceededError
from deltastore.format.keys import is_content_key
from deltastore.storage.base import GetResult, ObjectMeta, PutMode, Store, StreamedPut

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

MIB = 1024 * 1024
#: An unranged GET's size is unknown to the store wrapper: it is given the time of an object
#: this large (packs are cut at about 64 MiB; a manifest is far smaller).
UNKNOWN_SIZE_BYTES = 256 * MIB
#: Seconds a deadline thread waits for its next call before it ends.
IDLE_S = 30.0
#: The phases a deadline can be given for (the ``phase`` of DeadlineExceededError).
PHASES = ("poll", "fetch", "decode", "apply", "commit", "round")


@dataclass(frozen=True)
class Deadlines:
    """How long each phase of moving a version may take before it counts as stalled.

    The defaults are generous: a stall is a phase that makes no progress, not a slow link. A
    fetch's deadline grows with its bytes (``fetch + bytes / min_bytes_per_s``), a decode's and
    an apply's with the model's (``decode + model bytes / min_cpu_bytes_per_s``), so a
    multi-GB model on a slow link is never cut off by the defaults.

    Attributes:
        poll: seconds for one look at HEAD (a conditional GET of a small object).
        fetch: the floor of one read's deadline (a manifest, a pack or a range of one).
        decode: the floor of staging one version (fetching, checking and decoding it).
        apply: the floor of writing one version into the target (the pause).
        commit: the floor of one write (a heartbeat, a manifest, HEAD).
        round: a federated round's collection (design 009), for callers that wait on one.
        min_bytes_per_s: the slowest transfer still called working (fetch and commit).
        min_cpu_bytes_per_s: the slowest decode or apply still called working, per model byte.

    Raises:
        ValueError: a value that is not a finite positive number.

    Example::

        Subscriber(url, deadlines=Deadlines(poll=5, fetch=30))
    """

    poll: float = 30.0
    fetch: float = 60.0
    decode: float = 300.0
    apply: float = 300.0
    commit: float = 60.0
    round: float = 3600.0
    min_bytes_per_s: float = 1.0 * MIB
    min_cpu_bytes_per_s: float = 16.0 * MIB

    def __post_init__(self) -> None:
        for name in ("poll", "fetch", "decode", "apply", "commit", "round", "min_bytes_per_s", "min_cpu_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Deadlines.{name} must be a finite number above 0, got {value!r}")

    def fetch_s(self, nbytes: int | None) -> float:
        """The deadline of a read of ``nbytes`` (None: unknown, :data:`UNKNOWN_SIZE_BYTES`)."""
        return self.fetch + (UNKNOWN_SIZE_BYTES if nbytes is None else nbytes) / self.min_bytes_per_s

    def commit_s(self, nbytes: int) -> float:
        """The deadline of a write of ``nbytes``."""
        return self.commit + nbytes / self.min_bytes_per_s

    def decode_s(self, model_bytes: int) -> float:
        """The deadline of staging a version of a model of ``model_bytes`` (its fetches included)."""
        return self.decode + model_bytes / self.min_cpu_bytes_per_s + self.fetch_s(model_bytes)

    def apply_s(self, model_bytes: int) -> float:
        """The deadline of writing a version of a model of ``model_bytes`` into its target."""
        return self.apply + model_bytes / self.min_cpu_bytes_per_s


def exceeded(phase: str, obj: str, seconds: float, what_to_do: str) -> DeadlineExceededError:
    """The typed error of ``phase`` on ``obj`` past its deadline of ``seconds``."""
    return DeadlineExceededError(
        f"{phase} of {obj} passed its deadline of {seconds:.1f} s and was abandoned; {what_to_do}",
        phase=phase, object=obj, deadline_s=seconds,
    )


class _Workers:
    """Daemon threads that run one call at a time each, kept while busy or recently idle.

    Not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so one stalled
    read would hold up the exit; and its pool is bounded, so stalled reads could take every
    thread. Here a call that finds no idle thread starts one (a stalled call keeps its thread,
    the others go on), and a thread idle for :data:`IDLE_S` ends. A hand-off to an idle thread
    costs tens of microseconds; starting a thread, hundreds on a busy host.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []  # inboxes of idle threads, last idle last

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put(job)
            return
        inbox = queue.SimpleQueue()
        inbox.put(job)
        threading.Thread(target=self._work, args=(inbox,), name="deltastore-deadline", daemon=True).start()

    def _work(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            try:
                job = inbox.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    if any(q is inbox for q in self._idle):
                        self._idle = [q for q in self._idle if q is not inbox]
                        return
                job = inbox.get()  # a caller took this thread off the idle list: its call is on the way
            job()
            with self._lock:
                self._idle.append(inbox)


_WORKERS = _Workers()


def within(seconds: float, phase: str, obj: str, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
    """``fn(*args, **kwargs)`` on a daemon thread, waited for at most ``seconds``.

    Past the deadline the call is abandoned (its thread runs on until ``fn`` returns, and its
    result or error is dropped) and DeadlineExceededError is raised.

    Raises:
        DeadlineExceededError: ``fn`` did not return within ``seconds``.
        Whatever ``fn`` raised.
    """
    done: Future[_R] = Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            done.set_exception(e)

    _WORKERS.submit(run)
    try:
        return done.result(timeout=seconds)
    except FutureTimeout:
        raise exceeded(phase, obj, seconds, "the endpoint or the network stalled: check them, or raise "
                       f"Deadlines.{phase} if the link is that slow") from None


class DeadlineStore(Store):
    """``inner`` with a deadline on every request (see the module docstring).

    A read of an immutable object (a manifest, a pack, a layout: at the root or inside a serving
    stream's tree, :func:`~deltastore.format.keys.is_content_key`) is a ``fetch`` (its deadline
    grows with the range's bytes); any other read (HEAD, a fleet target, a heartbeat: small mutable
    objects) a ``poll``; a write or delete a ``commit``. Listings and streamed writes pass through
    unbounded (a follower does neither). A write abandoned at its deadline may still land
    later: like a lost response, its caller reads back what it needs (the commit protocol
    does). It shares ``inner``'s capability flags and does not own it: :meth:`close` leaves
    ``inner`` open.

    Args:
        inner: the store.
        deadlines: the deadlines.
    """

    def __init__(self, inner: Store, deadlines: Deadlines):
        if not isinstance(deadlines, Deadlines):
            raise TypeError(f"deadlines must be a Deadlines, not {type(deadlines).__name__}")
        self.inner = inner
        self.deadlines = deadlines
        self.url = inner.url
        self.atomic_conditional_writes = inner.atomic_conditional_writes
        self.conditional_writes_need_probe = inner.conditional_writes_need_probe

    def _read(self, key: str, nbytes: int | None, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        if not is_content_key(key):  # HEAD and the other small mutable objects (a fleet target, heartbeats)
            return within(self.deadlines.poll, "poll", f"{self.url}/{key}", fn, *args, **kwargs)
        return within(self.deadlines.fetch_s(nbytes), "fetch", f"{self.url}/{key}", fn, *args, **kwargs)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        nbytes = None if byte_range is None else max(0, byte_range[1] - byte_range[0])
        return self._read(key, nbytes, self.inner.get, key, byte_range=byte_range)

    def get_with_meta(self, key: str) -> GetResult:
        return self._read(key, None, self.inner.get_with_meta, key)

    def get_if_changed(self, key: str, etag: str | None) -> GetResult | None:
        return self._read(key, None, self.inner.get_if_changed, key, etag)

    def head(self, key: str) -> ObjectMeta:
        return self._read(key, 0, self.inner.head, key)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite") -> ObjectMeta:
        seconds = self.deadlines.commit_s(len(data))
        return within(seconds, "commit", f"{self.url}/{key}", self.inner.put, key, data, mode=mode)

    def delete(self, key: str) -> None:
        within(self.deadlines.commit, "commit", f"{self.url}/{key}", self.inner.delete, key)

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return self.inner.list(prefix)

    def begin_put(self, directory: str) -> StreamedPut | None:
        return self.inner.begin_put(directory)

    def close(self) -> None:
        """Nothing to release: ``inner`` belongs to whoever opened it."""

    def __repr__(self) -> str:
        return f"DeadlineStore({self.inner!r})"


@dataclass
class _Watched:
    phase: str
    obj: str
    seconds: float
    until: float
    reported: bool = False


class Watchdog:
    """Reports a CPU phase (decode, apply) that runs past its deadline, without stopping it.

    One daemon thread per watchdog, started with the first phase; entering and leaving a phase
    costs a lock and a notify. An overrun is logged at ERROR once per phase and handed to
    ``on_late`` (a DeadlineExceededError, not raised).

    Args:
        on_late: called with the error of each phase that overran (on the watchdog's thread).
    """

    def __init__(self, on_late: Callable[[DeadlineExceededError], None] | None = None):
        self._on_late = on_late
        self._cond = threading.Condition()
        self._current: _Watched | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def phase(self, phase: str, obj: str, seconds: float) -> Iterator[None]:
        """Watch the ``with`` block as ``phase`` of ``obj``, due within ``seconds``."""
        with self._cond:
            self._current = _Watched(phase, obj, seconds, time.monotonic() + seconds)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="deltastore-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._current = None
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                cur = self._current
                if cur is None or cur.reported:
                    self._cond.wait()
                    continue
                left = cur.until - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                cur.reported = True
                e = exceeded(cur.phase, cur.obj, cur.seconds, "it is still running (it cannot be abandoned without "
                             "leaving its target half written): look for a starved or swapping host")
                logger.error("%s", e)
                if self._on_late is not None:
                    self._cond.release()  # the callback never runs under the lock
                    try:
                        self._on_late(e)
                    except Exception:  # noqa: BLE001 - a failing reporter must not kill the watchdog
                        logger.exception("reporting an overrun phase failed")
                    finally:
                        self._cond.acquire()

    def close(self) -> None:
        """Stop the watchdog thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify()


__all__ = ["MIB", "PHASES", "UNKNOWN_SIZE_BYTES", "DeadlineStore", "Deadlines", "Watchdog", "exceeded", "within"]
