"""Find out whether a store's endpoint really honours conditional writes, and remember it.

Every ``s3://`` endpoint claims S3's API, but not all of them implement its conditional writes:
rclone's ``serve s3`` and s3rver silently ignore ``If-None-Match``/``If-Match``, older MinIO
accepted ``If-Match`` on a missing key, SeaweedFS is broken on versioned buckets. Two publishers on
such an endpoint can both "win" a compare-and-swap of HEAD and fork the history.
:func:`require_atomic_writes` probes the endpoint with a few conditional writes and small races
under ``_deltastore/probe/``, caches the verdict in ``_deltastore/probe.json`` (docs/SPEC.md §1.1),
and refuses an endpoint that failed unless the caller opts in as a single writer.

The verdict is bound to what it measured (:class:`ProbeBinding`: the endpoint URL the requests
went to, the store URL, the endpoint's ``Server`` header). A publisher reuses a cached verdict
only when it passed, the binding the publisher computes itself from its own configuration and
responses is the same, it is younger than PROBE_MAX_AGE_S, and the endpoint still refuses a
create-only PUT of ``probe.json`` itself; else it probes again. A store copied object by object
to another server (``aws s3 sync``, rclone) carries a verdict that names the old server; an
endpoint that ignores ``If-None-Match`` fails the create-only check whatever its file says.

Cost, which decides what is cached: a probe is about 20 small requests (13 PUTs, 4 DELETEs, 2
GETs, a HEAD), a dozen of them in sequence and two rounds of PROBE_RACERS at once; servers that
make the losers of a race wait (SeaweedFS holds them about a second) take longer. Reusing a
verdict costs 2 requests (the GET of ``probe.json`` and the refused create-only PUT), so every
publisher re-checks what a copied verdict cannot vouch for, and the full probe runs only for a
new binding, a stale or failed verdict, or an endpoint that takes the create-only PUT.

Example::

    store = open_store("s3://weights/run1")
    require_atomic_writes(store)                          # raises UnsafeStoreError on rclone
    require_atomic_writes(store, allow_unsafe_store=True)  # one publisher only: no check
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timedelta, timezone

from deltastore.errors import (
    AlreadyExistsError,
    DeltastoreError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    UnsafeStoreError,
)
from deltastore.storage.base import IfMatch, Store

logger = logging.getLogger(__name__)

#: Everything deltastore writes about the store itself (not versions) lives under this prefix;
#: readers and garbage collection ignore it.
META_PREFIX = "_deltastore/"
#: Where the probe's short-lived keys go (one fresh sub-prefix per probe run).
PROBE_PREFIX = META_PREFIX + "probe/"
#: The cached verdict, so that later publishers skip the probe.
PROBE_RESULT_KEY = META_PREFIX + "probe.json"
#: Format tag and version of PROBE_RESULT_KEY; an unknown one is ignored and the store re-probed.
#: Schema 2 added the binding (schema 1 named no endpoint).
PROBE_FORMAT = "deltastore.probe"
PROBE_SCHEMA = 2
#: A cached verdict older than this is earned again: a backend swapped behind an unchanged URL
#: and Server header (an upgrade, a failover) is noticed within a day, for one probe a day.
PROBE_MAX_AGE_S = 24 * 3600
#: How far a verdict's ``probed_at`` may lie in the future (the probing host's clock ran ahead);
#: beyond it the verdict is treated as stale rather than fresh for longer.
PROBE_CLOCK_SKEW_S = 300
#: Threads released together in each race: enough to collide on any server that serialises
#: nothing, few enough that the whole probe stays at about 20 small requests.
PROBE_RACERS = 4
#: Runs of a race (each on a fresh key) before the probe gives up on it. A race with no winner
#: (the winner's response was lost and its SDK retry refused) or with a racer that failed
#: otherwise (it may have won unseen) says nothing about the endpoint, and is run again.
PROBE_RACE_ATTEMPTS = 3
#: How a refusal names the conditions a backend's endpoint ignored, and which endpoints honour them.
_S3_CONDITIONS = (
    "S3 conditional writes",
    "an endpoint that implements If-None-Match/If-Match on PutObject (AWS S3, MinIO, SeaweedFS on an "
    "unversioned bucket; not rclone serve s3 or s3rver)",
)
_CONDITIONS = {
    "GCSStore": (
        "GCS generation preconditions (ifGenerationMatch)",
        "Google Cloud Storage or an emulator that honours them (fake-gcs-server; not gcp-storage-emulator)",
    ),
    "AzureBlobStore": (
        "Azure Blob conditional headers (If-None-Match/If-Match)",
        "Azure Blob Storage or Azurite, without a proxy that drops those headers",
    ),
}
#: An ETag no object has (conditional writes against it must be refused).
_NO_SUCH_ETAG = "0" * 32


@dataclass(frozen=True)
class ProbeBinding:
    """What a verdict was measured on, as the publisher itself observes it (:func:`observe_binding`).

    A cached verdict is trusted only when the binding it records equals the one the reading
    publisher computes from its own configuration and responses; the recorded one alone proves
    nothing (a copied or written-over ``probe.json`` says whatever it says).

    Attributes:
        endpoint: the URL the store's requests go to ("" for a store without a remote endpoint).
        store: the store URL (``s3://bucket/prefix``): the bucket and prefix.
        server: the endpoint's ``Server`` response header ("" when it sends none).
    """

    endpoint: str
    store: str
    server: str


@dataclass(frozen=True)
class ProbeResult:
    """What a store's endpoint did with conditional writes.

    Attributes:
        create_only_ok: a second create-only (``If-None-Match: *``) put of a key was refused.
        if_match_ok: an ``If-Match`` put with a wrong ETag was refused.
        if_match_missing_ok: an ``If-Match`` put on a missing key was refused (and created nothing).
        create_race_ok: of PROBE_RACERS concurrent create-only puts of one key, exactly one won.
        if_match_race_ok: of PROBE_RACERS concurrent ``If-Match`` puts from one ETag, exactly one won.
        detail: what the endpoint did, one clause per check, for messages and logs.
        deltastore_version: the version that ran the probe.
        probed_at: when (ISO 8601, UTC).
        binding: the endpoint, store and server the checks ran against.
    """

    create_only_ok: bool
    if_match_ok: bool
    if_match_missing_ok: bool
    create_race_ok: bool
    if_match_race_ok: bool
    detail: str
    deltastore_version: str
    probed_at: str
    binding: ProbeBinding

    @property
    def ok(self) -> bool:
        """True when every check passed: the endpoint is safe for concurrent publishers."""
        return (
            self.create_only_ok
            and self.if_match_ok
            and self.if_match_missing_ok
            and self.create_race_ok
            and self.if_match_race_ok
        )

    def to_json(self) -> bytes:
        """The cached form (PROBE_RESULT_KEY)."""
        body = {"format": PROBE_FORMAT, "schema": PROBE_SCHEMA, **asdict(self)}
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ProbeResult | None:
        """Parse the cached form; None when it is not one this version wrote (then re-probe)."""
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            return None
        if not isinstance(body, dict) or body.get("format") != PROBE_FORMAT or body.get("schema") != PROBE_SCHEMA:
            return None
        binding = body.get("binding")
        if not isinstance(binding, dict) or not all(isinstance(binding.get(f.name), str) for f in fields(ProbeBinding)):
            return None
        values: dict[str, object] = {"binding": ProbeBinding(**{f.name: binding[f.name] for f in fields(ProbeBinding)})}
        for f in fields(cls):
            if f.name == "binding":
                continue
            value = body.get(f.name)
            if not isinstance(value, bool if f.type in (bool, "bool") else str):
                return None
            values[f.name] = value
        return cls(**values)  # type: ignore[arg-type]

    def age_s(self, now: datetime) -> float | None:
        """Seconds from ``probed_at`` to ``now``; None when ``probed_at`` is not a UTC timestamp."""
        try:
            probed = datetime.fromisoformat(self.probed_at)
        except ValueError:
            return None
        if probed.utcoffset() is None:
            return None
        return (now - probed).total_seconds()


def _race(n: int, fn: Callable[[int], object]) -> list[object]:
    """fn(i) for i in range(n) on n threads released together; results or the errors raised."""
    barrier = threading.Barrier(n)

    def run(i: int) -> object:
        barrier.wait()
        try:
            return fn(i)
        except DeltastoreError as e:
            return e

    with ThreadPoolExecutor(n, thread_name_prefix="deltastore-probe") as pool:
        return list(pool.map(run, range(n)))


def _race_verdict(what: str, outcomes: list[object], refusal: type[Exception]) -> tuple[bool, str]:
    winners = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, refusal)]
    other = [o for o in outcomes if isinstance(o, Exception) and not isinstance(o, refusal)]
    extra = f", {len(other)} failed otherwise ({type(other[0]).__name__})" if other else ""
    text = f"{len(outcomes)} concurrent {what}: {len(winners)} won, {len(refused)} refused{extra}"
    return len(winners) == 1, text


def _settled_race(store: Store, what: str, race: Callable[[int], list[object]],
                  refusal: type[Exception]) -> tuple[bool, str]:
    """``race(attempt)`` run until its outcome is an answer of the endpoint's: one winner and the
    others refused, or two winners or more (the endpoint let both write); at most
    :data:`PROBE_RACE_ATTEMPTS` runs, each on a fresh key.

    Raises:
        StorageError: no run gave an answer (a lost response or a failed request in each); the
            endpoint was not shown to be unsafe, so this is not an UnsafeStoreError.
    """
    seen = []
    for attempt in range(PROBE_RACE_ATTEMPTS):
        outcomes = race(attempt)
        ok, text = _race_verdict(what, outcomes, refusal)
        winners = sum(1 for o in outcomes if not isinstance(o, Exception))
        failed = any(isinstance(o, Exception) and not isinstance(o, refusal) for o in outcomes)
        if winners >= 2 or (winners == 1 and not failed):
            return ok, text
        logger.info("probe of %s: %s; running the race again", store.url, text)
        seen.append(text)
    raise StorageError(
        f"{store.url}: the conditional-write probe could not tell whether the endpoint lets only one writer win: "
        f"{'; '.join(seen)} (each run lost a response or met a failed request); try again"
    )


def probe_conditional_writes(store: Store) -> ProbeResult:
    """Run the conditional-write checks against ``store`` and return what its endpoint did.

    Writes a handful of tiny objects under ``_deltastore/probe/<uuid>/`` and deletes them
    afterwards. Does not read or write the cached verdict (see :func:`require_atomic_writes`).

    A lost response is resolved by reading the store: a create-only PUT of the first key whose
    retry was refused stands when the key holds its bytes, and a race with no clear answer is run
    again (:func:`_settled_race`).

    Raises:
        StorageError: the store failed in a way that is not a conditional-write answer
            (unreachable, access denied, a race never answered); nothing can be concluded.
    """
    from deltastore import __version__

    base = f"{PROBE_PREFIX}{uuid.uuid4().hex}/"
    clauses: list[str] = []
    written: list[str] = []

    def put(key: str, data: bytes, mode):
        written.append(key)
        return store.put(key, data, mode=mode)

    try:
        # 1. create-only twice: the second must be refused and change nothing.
        key = base + "create"
        try:
            put(key, b"first", "create")
        except AlreadyExistsError:
            if store.get(key) != b"first":  # a fresh key: only our own write, its response lost, holds these bytes
                raise
        try:
            put(key, b"second", "create")
            create_only_ok = False
            clauses.append("a second create-only PUT (If-None-Match: *) of an existing key succeeded")
        except AlreadyExistsError:
            create_only_ok = store.get(key) == b"first"
            clauses.append(
                "create-only PUT of an existing key: refused"
                if create_only_ok
                else "a refused create-only PUT still replaced the object"
            )

        # 2. If-Match with a wrong ETag: refused, object unchanged.
        try:
            put(key, b"third", IfMatch(_NO_SUCH_ETAG))
            if_match_ok = False
            clauses.append("an If-Match PUT with a wrong ETag succeeded")
        except PreconditionFailedError:
            if_match_ok = store.get(key) == b"first"
            clauses.append("If-Match PUT with a wrong ETag: refused")

        # 3. If-Match on a missing key: refused, nothing created (older MinIO created it).
        missing = base + "missing"
        try:
            put(missing, b"x", IfMatch(_NO_SUCH_ETAG))
            if_match_missing_ok = False
            clauses.append("an If-Match PUT on a missing key succeeded (created it)")
        except PreconditionFailedError:
            if_match_missing_ok = not store.exists(missing)
            clauses.append(
                "If-Match PUT on a missing key: refused"
                if if_match_missing_ok
                else "a refused If-Match PUT on a missing key still created it"
            )

        # 4. create-only race: exactly one winner.
        def create_race(attempt: int) -> list[object]:
            race_key = base + f"create-race-{attempt}"
            written.append(race_key)
            return _race(PROBE_RACERS, lambda i: store.put(race_key, b"racer-%d" % i, mode="create"))

        create_race_ok, text = _settled_race(store, "create-only PUTs of one key", create_race, AlreadyExistsError)
        clauses.append(text)

        # 5. If-Match race from one ETag: exactly one winner.
        def cas_race(attempt: int) -> list[object]:
            cas_key = base + f"cas-race-{attempt}"
            etag = put(cas_key, b"base", "overwrite").etag
            return _race(PROBE_RACERS, lambda i: store.put(cas_key, b"racer-%d" % i, mode=IfMatch(etag)))

        if_match_race_ok, text = _settled_race(store, "If-Match PUTs from one ETag", cas_race, PreconditionFailedError)
        clauses.append(text)
    finally:
        for key in dict.fromkeys(written):
            try:
                store.delete(key)
            except StorageError as e:
                logger.warning("could not delete probe key %s/%s: %s", store.url, key, e)

    result = ProbeResult(
        create_only_ok=create_only_ok,
        if_match_ok=if_match_ok,
        if_match_missing_ok=if_match_missing_ok,
        create_race_ok=create_race_ok,
        if_match_race_ok=if_match_race_ok,
        detail="; ".join(clauses),
        deltastore_version=__version__,
        probed_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        binding=observe_binding(store),  # after the checks: the server that answered them
    )
    logger.info("probed conditional writes of %s: %s (%s)", store.url, "ok" if result.ok else "UNSAFE", result.detail)
    return result


def observe_binding(store: Store) -> ProbeBinding:
    """The binding of ``store`` as this process observes it: its own endpoint URL, store URL and
    the ``Server`` header of the endpoint's latest successful response (so call it after a
    request). Nothing in it is read from the store's contents."""
    identify = getattr(store, "endpoint_identity", None)
    if identify is None:
        return ProbeBinding(endpoint="", store=store.url, server="")
    identity = identify()
    return ProbeBinding(endpoint=identity.endpoint, store=store.url, server=identity.server)


def check_endpoint(store: Store) -> None:
    """Make sure a store's endpoint is what its URL says (an ``s3://`` URL: an S3 endpoint).

    Without it a web server or a SeaweedFS filer port looks like an empty store (every key
    "missing") and a follower waits forever. Costs one small request; a no-op for stores that
    have no remote endpoint.

    Raises:
        StorageError: the endpoint does not speak the store's protocol, or could not be reached.
    """
    check = getattr(store, "check_endpoint", None)
    if check is not None:
        check()


def cached_probe(store: Store) -> ProbeResult | None:
    """The verdict cached in the store, or None when there is none this version can read.

    It is only what the file says: :func:`require_atomic_writes` decides whether to trust it.
    """
    try:
        data = store.get(PROBE_RESULT_KEY)
    except NotFoundError:
        return None
    result = ProbeResult.from_json(data)
    if result is None:
        try:
            body = json.loads(data)
            older = isinstance(body, dict) and body.get("format") == PROBE_FORMAT and body.get("schema") != PROBE_SCHEMA
        except (ValueError, RecursionError):
            older = False
        if older:  # another release's format: expected after an upgrade, not worth a warning
            logger.info("%s/%s has probe schema %r, not %d; probing again", store.url, PROBE_RESULT_KEY,
                        body.get("schema"), PROBE_SCHEMA)
        else:
            logger.warning("ignoring unreadable %s/%s; probing again", store.url, PROBE_RESULT_KEY)
    return result


def _why_not_reusable(result: ProbeResult, binding: ProbeBinding, now: datetime) -> str | None:
    """Why a cached verdict must be earned again by a publisher that observes ``binding`` at
    ``now``, or None when it may be reused (it still needs the create-only check, see
    :func:`require_atomic_writes`)."""
    if not result.ok:
        return "the cached verdict failed (the endpoint may have been fixed)"
    for name in ("endpoint", "store", "server"):
        cached, seen = getattr(result.binding, name), getattr(binding, name)
        if cached != seen:
            return f"the cached verdict was measured with {name} {cached!r}, this publisher sees {seen!r}"
    age = result.age_s(now)
    if age is None:
        return f"the cached verdict's probed_at {result.probed_at!r} is not a UTC timestamp"
    if age > PROBE_MAX_AGE_S:
        return f"the cached verdict is {timedelta(seconds=round(age))} old (at most {timedelta(seconds=PROBE_MAX_AGE_S)})"
    if age < -PROBE_CLOCK_SKEW_S:
        return f"the cached verdict is dated {result.probed_at}, in the future"
    return None


def _still_refuses_create(store: Store, result: ProbeResult) -> bool:
    """True when a create-only PUT of PROBE_RESULT_KEY (which exists: it was just read) is
    refused, as every endpoint that passed the probe must. An endpoint that ignores
    ``If-None-Match`` (whatever its verdict file says) takes it, rewriting the same verdict."""
    try:
        store.put(PROBE_RESULT_KEY, result.to_json(), mode="create")
    except AlreadyExistsError:
        return True
    except StorageError as e:  # nothing concluded (denied, 5xx): the probe will say
        logger.info("create-only check of %s/%s failed (%s); probing again", store.url, PROBE_RESULT_KEY, e)
        return False
    logger.warning("%s accepted a create-only PUT of the existing %s: its cached verdict no longer holds",
                   store.url, PROBE_RESULT_KEY)
    return False


def require_atomic_writes(store: Store, *, allow_unsafe_store: bool = False) -> ProbeResult | None:
    """Make sure concurrent publishers cannot fork history on ``store``; raise if they could.

    Local and in-memory stores are atomic by construction and are not probed. A store that
    declares no atomic conditional writes (fsspec URLs) is refused outright. Any other store
    (``s3://``) is probed, and the verdict cached in ``_deltastore/probe.json``. A later call
    reuses a cached verdict only when it passed, its binding equals the one this call observes
    (:func:`observe_binding`: endpoint URL, store URL, ``Server`` header), it is at most
    PROBE_MAX_AGE_S old, and a create-only PUT of ``probe.json`` itself is refused; otherwise it
    probes again. Delete that object to force a new probe.

    Args:
        store: the store a publisher is about to write to.
        allow_unsafe_store: the caller is the only writer this store will ever have; skip every
            check (nothing is probed or cached).

    Returns:
        The probe verdict used (cached or fresh), or None when no probe was needed.

    Raises:
        UnsafeStoreError: the endpoint does not honour conditional writes; the message says what
            it did and what to do.
        StorageError: the probe itself could not run (unreachable, access denied).

    Example::

        with open_store("s3://weights/run1") as store:
            require_atomic_writes(store)
    """
    if allow_unsafe_store:
        return None
    if not store.atomic_conditional_writes:
        raise UnsafeStoreError(
            f"{store.url} cannot do atomic conditional writes ({type(store).__name__} checks, then "
            f"writes), so two publishers could fork its history; pass allow_unsafe_store=True if "
            f"only one publisher ever writes there, or use an s3://, gs:// or az:// URL (with the gcs or "
            f"azure extra installed for the latter two)"
        )
    if not store.conditional_writes_need_probe:
        return None
    result = cached_probe(store)
    if result is not None:
        why = _why_not_reusable(result, observe_binding(store), datetime.now(timezone.utc))
        if why is None and _still_refuses_create(store, result):
            return result
        if why is not None:
            logger.info("probing %s again: %s", store.url, why)
    result = probe_conditional_writes(store)
    try:
        store.put(PROBE_RESULT_KEY, result.to_json(), mode="overwrite")
    except StorageError as e:  # a read-only cache is no reason to fail: probe next time
        logger.warning("could not cache the probe verdict in %s/%s: %s", store.url, PROBE_RESULT_KEY, e)
    if not result.ok:
        conditions, use = _CONDITIONS.get(type(store).__name__, _S3_CONDITIONS)
        raise UnsafeStoreError(
            f"{store.url}: the endpoint does not honour {conditions} ({result.detail}), so two publishers could "
            f"both commit and fork the history. Use {use}, or pass allow_unsafe_store=True if only one publisher "
            f"ever writes to this store"
        )
    return result


__all__ = [
    "META_PREFIX",
    "PROBE_MAX_AGE_S",
    "PROBE_RESULT_KEY",
    "ProbeBinding",
    "ProbeResult",
    "cached_probe",
    "check_endpoint",
    "observe_binding",
    "probe_conditional_writes",
    "require_atomic_writes",
]
