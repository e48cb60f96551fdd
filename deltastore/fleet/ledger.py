"""The fleet ledger: tiny heartbeat objects that following workers write (SPEC §10).

Each worker that follows a store may write ``workers/<worker-id>.json`` saying which version it
holds. The ledger is advisory: it is never used for integrity (a reader assumes nothing of it
beyond "this worker said so at about this time"), a worker with read-only credentials simply
runs without it, and a malformed heartbeat is skipped with a log line. It is what lets
``deltastore status`` show the fleet's lag and lets a trainer, the compactor and GC see the
oldest version a live worker still holds.

Liveness is judged on the store's clock (the object's ``last_modified``), not the worker's, so
skewed worker clocks do not make a worker look dead or alive. A worker that stops cleanly writes
a last heartbeat marked ``"state": "stopped"`` (with the version it held): it is never live,
whatever its age; one that dies without a word stops being live once its heartbeat is older than
:data:`LIVE_TTL_S`.

Example (a worker that updates with ``stage``/``swap`` rather than ``follow``)::

    with sub.heartbeat("serve-1"):          # a HeartbeatWriter beating from a thread
        while serving:
            staged = sub.stage(model)       # each version swapped in is announced
            ...
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from deltastore.errors import AccessDeniedError, DeltastoreError, NotFoundError, StorageError
from deltastore.format.models import FORMAT_NAME_PATTERN
from deltastore.storage.base import Store

logger = logging.getLogger(__name__)

LEDGER_PREFIX = "workers/"
HEARTBEAT_FORMAT = "deltastore.heartbeat"
HEARTBEAT_SCHEMA = 1
#: A heartbeat is rewritten at least this often while the version does not change: slow enough
#: that 1,000 workers cost ~1,000 small PUTs a minute, fast enough for a "last seen" column.
HEARTBEAT_INTERVAL_S = 60.0
#: A worker not heard from for this long is not live: two missed heartbeats, not one (they are
#: written from a thread of their own, so a long update does not delay them).
LIVE_TTL_S = 3 * HEARTBEAT_INTERVAL_S
#: What a heartbeat says the worker is doing; an absent or unknown state reads as following.
STATE_FOLLOWING = "following"
STATE_STOPPED = "stopped"
#: How long closing a writer waits for its thread's heartbeat in flight before marking it stopped.
CLOSE_WAIT_S = 10.0
#: Heartbeats are tiny; anything larger is not one of ours and is not read.
MAX_HEARTBEAT_BYTES = 4096
#: Where a following worker is with the version it moves to (``stage``): fetching its
#: segments, holding it staged, or swapped in (held). Absent in older writers' heartbeats.
STAGE_FETCHING = "fetching"
STAGE_STAGED = "staged"
STAGE_SWAPPED = "swapped"
STAGES = (STAGE_FETCHING, STAGE_STAGED, STAGE_SWAPPED)
#: The longest last-error text a heartbeat carries: it must keep the heartbeat far below
#: MAX_HEARTBEAT_BYTES, and one line is what ``deltastore status`` shows anyway.
MAX_ERROR_CHARS = 512
_WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def default_worker_id() -> str:
    """``host-pid-random``: unique per process, readable in ``deltastore status``."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def check_worker_id(worker_id: str) -> str:
    """A worker id is one key segment: letters, digits, ``.``, ``_``, ``-`` (≤ 128)."""
    if not isinstance(worker_id, str) or not _WORKER_ID.match(worker_id):
        raise ValueError(
            f"worker id {worker_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return worker_id


def _now() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class Progress:
    """What a following worker reports beside the version it holds (SPEC §10); every field is
    optional, and None in a heartbeat of a writer that does not report it.

    Attributes:
        stage: ``"fetching"``, ``"staged"`` or ``"swapped"`` (:data:`STAGES`): where it is with
            the version it moves to (``"swapped"``: it holds it).
        goal: the version it converges to (the fleet target's, else HEAD's), as it last saw it.
        lag: versions between the one it holds and ``goal``.
        error: its last error, one line (None once a move succeeded since).
    """

    stage: str | None = None
    goal: int | None = None
    lag: int | None = None
    error: str | None = None

    def fields(self) -> dict[str, object]:
        """The heartbeat fields this progress adds (only those known)."""
        out: dict[str, object] = {}
        if self.stage is not None:
            out["stage"] = self.stage
        if self.goal is not None:
            out["goal"] = int(self.goal)
        if self.lag is not None:
            out["lag"] = int(self.lag)
        if self.error is not None:
            out["error"] = " ".join(self.error.split())[:MAX_ERROR_CHARS]
        return out


@dataclass(frozen=True)
class Heartbeat:
    """One worker's last word: the version it held, and when (store clock where known)."""

    worker: str
    version: int
    host: str
    time: datetime  # when the store received it (last_modified), else the worker's clock
    lineage: str | None = None
    state: str = STATE_FOLLOWING
    progress: Progress = Progress()
    #: the serving format it reads (SPEC §15; None: the versions as published)
    serving_format: str | None = None

    @property
    def stopped(self) -> bool:
        """The worker said it stopped following (a clean exit)."""
        return self.state == STATE_STOPPED

    def age_s(self, now: datetime | None = None) -> float:
        return ((now or _now()) - self.time).total_seconds()

    def live(self, now: datetime | None = None, ttl_s: float = LIVE_TTL_S) -> bool:
        """Following, and heard from within ``ttl_s`` (store clock)."""
        return not self.stopped and self.age_s(now) <= ttl_s


def encode_heartbeat(worker: str, version: int, *, host: str | None = None, lineage: str | None = None,
                     when: datetime | None = None, state: str = STATE_FOLLOWING,
                     progress: Progress | None = None, serving_format: str | None = None) -> bytes:
    if state not in (STATE_FOLLOWING, STATE_STOPPED):
        raise ValueError(f"heartbeat state must be {STATE_FOLLOWING!r} or {STATE_STOPPED!r}, not {state!r}")
    if serving_format is not None and not re.fullmatch(FORMAT_NAME_PATTERN, serving_format):
        raise ValueError(f"serving_format must be a serving format's name, not {serving_format!r}")
    doc = {
        "format": HEARTBEAT_FORMAT,
        "schema": HEARTBEAT_SCHEMA,
        "worker": check_worker_id(worker),
        "version": int(version),
        "host": host or socket.gethostname(),
        "time": (when or _now()).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "lineage": lineage,
        "state": state,
        **(progress.fields() if progress is not None else {}),
        **({"serving_format": serving_format} if serving_format is not None else {}),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def parse_heartbeat(data: bytes, key: str, last_modified: datetime | None = None) -> Heartbeat:
    """Parse one heartbeat; raises ValueError for anything that is not one."""
    if len(data) > MAX_HEARTBEAT_BYTES:
        raise ValueError(f"{key} is {len(data)} bytes, more than a heartbeat")
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != HEARTBEAT_FORMAT or doc.get("schema") != HEARTBEAT_SCHEMA:
        raise ValueError(f"{key} is not a schema-{HEARTBEAT_SCHEMA} heartbeat")
    worker, version, host = doc.get("worker"), doc.get("version"), doc.get("host")
    if not isinstance(worker, str) or key != f"{LEDGER_PREFIX}{worker}.json":
        raise ValueError(f"{key} names worker {worker!r}, not its own key")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
        raise ValueError(f"{key} has version {version!r}")
    lineage = doc.get("lineage")
    if lineage is not None and not isinstance(lineage, str):
        raise ValueError(f"{key} has lineage {lineage!r}")
    state = doc.get("state", STATE_FOLLOWING)
    if not isinstance(state, str):
        raise ValueError(f"{key} has state {state!r}")
    # A state this release does not know reads as following: counted as live, so a collector
    # keeps what that worker holds (the safe side).
    state = STATE_STOPPED if state == STATE_STOPPED else STATE_FOLLOWING
    when = last_modified
    if when is None:
        when = datetime.fromisoformat(str(doc.get("time")).replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    fmt = doc.get("serving_format")  # a wrong type, or no format's name, reads as absent (advisory)
    fmt = fmt if isinstance(fmt, str) and re.fullmatch(FORMAT_NAME_PATTERN, fmt) else None
    return Heartbeat(worker=worker, version=version, host=str(host), time=when, lineage=lineage, state=state,
                     progress=_progress(doc), serving_format=fmt)


def _progress(doc: dict) -> Progress:
    """The optional progress fields; one of a wrong type reads as absent (the heartbeat is
    advisory, and its version still counts for GC)."""
    def count(name: str) -> int | None:
        v = doc.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 else None

    stage, error = doc.get("stage"), doc.get("error")
    return Progress(stage=stage if stage in STAGES else None, goal=count("goal"), lag=count("lag"),
                    error=error[:MAX_ERROR_CHARS] if isinstance(error, str) else None)


def read_ledger(store: Store) -> list[Heartbeat]:
    """Every readable heartbeat in ``store``, by worker id. Malformed ones are skipped (logged)."""
    beats = []
    for meta in store.list(LEDGER_PREFIX):
        if not meta.key.endswith(".json") or "/" in meta.key[len(LEDGER_PREFIX):]:
            continue
        if meta.size > MAX_HEARTBEAT_BYTES:
            logger.warning("skipping %s: %d bytes is not a heartbeat", meta.key, meta.size)
            continue
        try:
            data = store.get(meta.key)
            beats.append(parse_heartbeat(data, meta.key, meta.last_modified))
        except NotFoundError:
            continue  # the worker's entry was removed since the listing
        except (ValueError, TypeError) as e:
            logger.warning("skipping malformed heartbeat %s: %s", meta.key, e)
    return sorted(beats, key=lambda b: b.worker)


def read_heartbeat(store: Store, worker: str) -> Heartbeat | None:
    """One worker's heartbeat (None when it has none, or it is not a heartbeat: logged): one
    GET, so that a readiness probe per worker does not read the whole ledger."""
    key = f"{LEDGER_PREFIX}{check_worker_id(worker)}.json"
    try:
        got = store.get_with_meta(key)
        when = got.meta.last_modified
        if when is None:
            when = store.head(key).last_modified
        return parse_heartbeat(got.data, key, when)
    except NotFoundError:
        return None
    except (ValueError, TypeError) as e:
        logger.warning("skipping malformed heartbeat %s: %s", key, e)
        return None


def oldest_live_version(beats: Iterable[Heartbeat], *, now: datetime | None = None,
                        ttl_s: float = LIVE_TTL_S) -> int | None:
    """The lowest version held by a live worker (None when no worker is live; a stopped one never is)."""
    live = [b.version for b in beats if b.live(now, ttl_s)]
    return min(live) if live else None


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as ``deltastore status`` shows it.

    Attributes:
        worker, host: from its heartbeat.
        version: the version it said it held.
        lag_versions: head version minus its version (0 when current).
        lag_s: how long the oldest version it lacks has existed (0 when current; None when
            that version's time is unknown).
        last_seen_s: seconds since its heartbeat reached the store.
        live: following, and heard from within the TTL.
        state: ``"live"``, ``"stopped"`` (it said so when it exited) or ``"gone"`` (not heard
            from within the TTL).
        progress: its stage, goal, lag and last error, as its heartbeat reports them.
        serving_format: the serving format it reads (None: the versions as published).
    """

    worker: str
    host: str
    version: int
    lag_versions: int
    lag_s: float | None
    last_seen_s: float
    live: bool
    state: str = "live"
    progress: Progress = Progress()
    serving_format: str | None = None


def fleet_status(beats: Iterable[Heartbeat], head_version: int, created: Callable[[int], datetime | None], *,
                 now: datetime | None = None, ttl_s: float = LIVE_TTL_S) -> list[WorkerStatus]:
    """Each worker's lag behind ``head_version``; ``created(v)`` is version v's commit time."""
    now = now or _now()
    out = []
    for b in beats:
        lag = max(0, head_version - b.version)
        lag_s: float | None = 0.0
        if lag:
            first_missing = created(b.version + 1)
            lag_s = None if first_missing is None else max(0.0, (now - first_missing).total_seconds())
        live = b.live(now, ttl_s)
        state = "live" if live else STATE_STOPPED if b.stopped else "gone"
        out.append(WorkerStatus(b.worker, b.host, b.version, lag, lag_s, b.age_s(now), live, state, b.progress,
                                b.serving_format))
    return out


def parse_time(text: str) -> datetime | None:
    """An RFC 3339 time as recorded in HEAD and manifests (None if it does not parse)."""
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


class HeartbeatWriter:
    """Writes one worker's heartbeat: on each new version, and otherwise every ``interval_s``.

    Call :meth:`beat` from the worker's own loop, or :meth:`start` a thread that beats for
    whatever version a callable says is held (what :meth:`deltastore.Subscriber.heartbeat`
    does). :meth:`close` writes a last heartbeat marked stopped, so that ``deltastore status``
    shows a worker that exited as stopped rather than live; it is a context manager.

    A store that refuses the write (read-only credentials) switches the writer off after one
    log line; any other storage error is logged and retried on the next beat. Never raises
    for a storage failure: the ledger must not stop a worker from serving.
    """

    def __init__(self, store: Store, worker_id: str | None = None, *, interval_s: float = HEARTBEAT_INTERVAL_S,
                 serving_format: str | None = None):
        self.store = store
        self.serving_format = serving_format
        self.worker_id = default_worker_id() if worker_id is None else check_worker_id(worker_id)
        self.interval_s = interval_s
        self.enabled = True
        self._last: tuple[int, str | None, float] | None = None  # (version, lineage, monotonic time) written last
        self._progress = Progress()  # what report() last said
        self._written: Progress | None = None  # the progress of the heartbeat written last
        self._tried = 0.0  # monotonic time of the last write attempted, written or not
        self._lock = threading.Lock()
        self._closed = False
        self._held: Callable[[], tuple[int, str | None] | None] | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return f"{LEDGER_PREFIX}{self.worker_id}.json"

    @property
    def closed(self) -> bool:
        return self._closed

    def beat(self, version: int, *, lineage: str | None = None, force: bool = False) -> bool:
        """Write the heartbeat if the version changed or the interval passed; True if written."""
        with self._lock:
            if not self.enabled or self._closed:
                return False
            now = time.monotonic()
            if not force and self._last is not None and self._last[:2] == (version, lineage) \
                    and self._written == self._progress and now - self._last[2] < self.interval_s:
                return False
            if self._put(version, lineage, STATE_FOLLOWING):
                self._last = (version, lineage, now)
                return True
            return False

    def start(self, held: Callable[[], tuple[int, str | None] | None]) -> HeartbeatWriter:
        """Beat from a daemon thread for ``held()`` (``(version, lineage)``, or None while nothing
        is held): at once, after each :meth:`notify`, and every ``interval_s``. Returns self."""
        with self._lock:
            if self._thread is not None or self._closed:
                raise ValueError(f"heartbeat writer {self.worker_id!r} was already started or closed")
            self._held = held
            self._thread = threading.Thread(target=self._run, name=f"deltastore-heartbeat-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def notify(self) -> None:
        """The held version changed: the thread writes it now (without blocking the caller)."""
        self._wake.set()

    def report(self, progress: Progress) -> None:
        """Say where the worker is (stage, goal, lag, last error) in its next heartbeats; a
        change is written by the thread at once (without blocking the caller)."""
        with self._lock:
            changed = progress != self._progress
            self._progress = progress
        if changed:
            self._wake.set()

    @property
    def progress(self) -> Progress:
        """What :meth:`report` last said."""
        return self._progress

    def close(self) -> None:
        """Stop the thread and write a last heartbeat marked stopped (the version last held).
        Nothing is written for a worker that never held a version. Idempotent."""
        if self._closed:
            return
        self._closed = True  # the thread's next beat is refused; one in flight finishes first
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)
        with self._lock:
            current = self._current()
            if current is None and self._last is not None:
                current = self._last[:2]
            if current is not None and self.enabled:
                self._put(*current, STATE_STOPPED)

    def __enter__(self) -> HeartbeatWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _current(self) -> tuple[int, str | None] | None:
        if self._held is None:
            return None
        try:
            return self._held()
        except Exception:  # noqa: BLE001 - a heartbeat must never take the worker down
            logger.debug("heartbeat source of %s failed", self.worker_id, exc_info=True)
            return None

    def _put(self, version: int, lineage: str | None, state: str) -> bool:
        """One write (under ``_lock``); False when it failed (logged)."""
        self._tried = time.monotonic()
        progress = self._progress
        try:
            self.store.put(self.key, encode_heartbeat(self.worker_id, version, lineage=lineage, state=state,
                                                      progress=progress, serving_format=self.serving_format),
                           mode="overwrite")
        except AccessDeniedError:
            self.enabled = False
            logger.info("not writing heartbeats to %s: the credentials are read-only (that is fine)", self.store.url)
            return False
        except (StorageError, DeltastoreError) as e:
            logger.warning("heartbeat to %s failed (will retry): %s", self.store.url, e)
            return False
        self._written = progress
        return True

    def _run(self) -> None:
        while not self._closed and self.enabled:
            self._wake.clear()
            current = self._current()
            if current is not None:
                self.beat(current[0], lineage=current[1])
            # The next beat is due an interval after the last write attempted (a failed one too:
            # no tight loop against a failing store).
            self._wake.wait(max(0.0, self.interval_s - (time.monotonic() - self._tried)) if self._tried else self.interval_s)


__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "LEDGER_PREFIX",
    "LIVE_TTL_S",
    "STATE_FOLLOWING",
    "STATE_STOPPED",
    "Heartbeat",
    "HeartbeatWriter",
    "Progress",
    "WorkerStatus",
    "fleet_status",
    "default_worker_id",
    "oldest_live_version",
    "read_heartbeat",
    "read_ledger",
]
