"""The fleet ledger: tiny heartbeat objects that following workers write (SPEC §10).

Each worker that follows a store may write ``workers/<worker-id>.json`` saying which version it
holds. The ledger is advisory: it is never used for integrity (a reader assumes nothing of it
beyond "this worker said so at about this time"), a worker with read-only credentials simply
runs without it, and a malformed heartbeat is skipped with a log line. It is what lets
``deltastore status`` show the fleet's lag and lets a trainer (and, later, GC) see the oldest
version a live worker still holds.

Liveness is judged on the store's clock (the object's ``last_modified``), not the worker's, so
skewed worker clocks do not make a worker look dead or alive.
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
from deltastore.storage.base import Store

logger = logging.getLogger(__name__)

LEDGER_PREFIX = "workers/"
HEARTBEAT_FORMAT = "deltastore.heartbeat"
HEARTBEAT_SCHEMA = 1
#: A heartbeat is rewritten at least this often while the version does not change: slow enough
#: that 1,000 workers cost ~1,000 small PUTs a minute, fast enough for a "last seen" column.
HEARTBEAT_INTERVAL_S = 60.0
#: A worker not heard from for this long is not live (several missed heartbeats, not one).
LIVE_TTL_S = 5 * HEARTBEAT_INTERVAL_S
#: Heartbeats are tiny; anything larger is not one of ours and is not read.
MAX_HEARTBEAT_BYTES = 4096
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
class Heartbeat:
    """One worker's last word: the version it held, and when (store clock where known)."""

    worker: str
    version: int
    host: str
    time: datetime  # when the store received it (last_modified), else the worker's clock
    lineage: str | None = None

    def age_s(self, now: datetime | None = None) -> float:
        return ((now or _now()) - self.time).total_seconds()

    def live(self, now: datetime | None = None, ttl_s: float = LIVE_TTL_S) -> bool:
        return self.age_s(now) <= ttl_s


def encode_heartbeat(worker: str, version: int, *, host: str | None = None, lineage: str | None = None,
                     when: datetime | None = None) -> bytes:
    doc = {
        "format": HEARTBEAT_FORMAT,
        "schema": HEARTBEAT_SCHEMA,
        "worker": check_worker_id(worker),
        "version": int(version),
        "host": host or socket.gethostname(),
        "time": (when or _now()).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "lineage": lineage,
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
    when = last_modified
    if when is None:
        when = datetime.fromisoformat(str(doc.get("time")).replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return Heartbeat(worker=worker, version=version, host=str(host), time=when, lineage=lineage)


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


def oldest_live_version(beats: Iterable[Heartbeat], *, now: datetime | None = None,
                        ttl_s: float = LIVE_TTL_S) -> int | None:
    """The lowest version held by a live worker (None when no worker is live)."""
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
        live: heard from within the TTL.
    """

    worker: str
    host: str
    version: int
    lag_versions: int
    lag_s: float | None
    last_seen_s: float
    live: bool


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
        out.append(WorkerStatus(b.worker, b.host, b.version, lag, lag_s, b.age_s(now), b.live(now, ttl_s)))
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

    A store that refuses the write (read-only credentials) switches the writer off after one
    log line; any other storage error is logged and retried on the next beat. Never raises
    for a storage failure: the ledger must not stop a worker from serving.
    """

    def __init__(self, store: Store, worker_id: str | None = None, *, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.store = store
        self.worker_id = default_worker_id() if worker_id is None else check_worker_id(worker_id)
        self.interval_s = interval_s
        self.enabled = True
        self._last: tuple[int, float] | None = None  # (version, monotonic time) of the last write
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        return f"{LEDGER_PREFIX}{self.worker_id}.json"

    def beat(self, version: int, *, lineage: str | None = None, force: bool = False) -> bool:
        """Write the heartbeat if the version changed or the interval passed; True if written."""
        with self._lock:
            if not self.enabled:
                return False
            now = time.monotonic()
            if not force and self._last is not None and self._last[0] == version and now - self._last[1] < self.interval_s:
                return False
            try:
                self.store.put(self.key, encode_heartbeat(self.worker_id, version, lineage=lineage), mode="overwrite")
            except AccessDeniedError:
                self.enabled = False
                logger.info("not writing heartbeats to %s: the credentials are read-only (that is fine)", self.store.url)
                return False
            except (StorageError, DeltastoreError) as e:
                logger.warning("heartbeat to %s failed (will retry): %s", self.store.url, e)
                return False
            self._last = (version, now)
            return True


__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "LEDGER_PREFIX",
    "LIVE_TTL_S",
    "Heartbeat",
    "HeartbeatWriter",
    "WorkerStatus",
    "fleet_status",
    "default_worker_id",
    "oldest_live_version",
    "read_ledger",
]
