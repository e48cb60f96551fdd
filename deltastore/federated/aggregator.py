"""The aggregator of federated rounds (design 009 D4–D8).

It owns the global store (one :class:`~deltastore.Publisher`, so a second aggregator fences the
first), follows N site stores, and runs rounds: pin the round's base, wait for the quorum,
verify every site's based version (SPEC §14), merge, publish the next global version as a
delta, unpin.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from deltastore._util.jobs import default_threads
from deltastore.errors import (
    DeltastoreError,
    FormatError,
    IntegrityError,
    InvalidStateDictError,
    QuorumError,
    StorageError,
    VersionNotFoundError,
)
from deltastore.federated.accept import ResultPolicy
from deltastore.federated.based import BasedResult, RoundBase, read_based, same_layout, specs_of
from deltastore.federated.late import LatePolicy, carried_tensor
from deltastore.federated.merge import MergeFn, StateMerge, weighted_average
from deltastore.fleet.deadlines import Deadlines
from deltastore.format.history import History, VersionInfo
from deltastore.format.models import Head, Manifest
from deltastore.format.signing import TrustedKeys
from deltastore.layout.tensors import TensorSpec, bits
from deltastore.lifecycle.index import pin, unpin
from deltastore.read.engine import ReadEngine
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.policy import LayoutPolicy, WriterPolicy, check_policy
from deltastore.write.publisher import Publisher

logger = logging.getLogger(__name__)

#: Seconds between two polls of a site's HEAD while a round waits: a conditional GET each, so
#: a round of minutes costs a few hundred small requests per site.
POLL_INTERVAL_S = 0.5
#: Metadata key a site's weight is read from (design 009 D6): its number of training examples.
WEIGHT_KEY = "num_examples"

Status = Literal["accepted", "refused", "missing", "carried", "dropped"]


@dataclass(frozen=True)
class SiteOutcome:
    """What one site contributed to a round.

    Attributes:
        site: its name. status: ``accepted`` (merged), ``refused`` (failed a check, a
            signature check included: ``error`` says which, named, ``error_type`` its class),
            ``missing`` (no result against this round's base by the end); for a late result
            (:attr:`RoundReport.late`): ``carried`` (merged with a staleness weight) or
            ``dropped`` (design 009 D5).
        version: the site version read (None when missing).
        base: the global version the result is based on (late results: the previous round's).
        weight: its weight in the merge (accepted and carried only).
        bytes_up: bytes of packs the site wrote for this result (its version's ``bytes_stored``).
        bytes_read: segment bytes the aggregator read from the site store.
        compressed: the result is compressed (SPEC §14.1; accepted with ``accept_compressed``).
    """

    site: str
    status: Status
    version: int | None = None
    weight: float | None = None
    error: str | None = None
    error_type: str | None = None
    bytes_up: int = 0
    bytes_read: int = 0
    base: int | None = None
    compressed: bool = False


@dataclass(frozen=True)
class RoundReport:
    """One round: its base, what each site did, the version published.

    Attributes:
        base: the round's global version. published: the version it published.
        sites: one outcome per site (accepted, refused or missing) for this round's base.
        elapsed_s: from opening the round to its publish.
        late: late results seen in the round (design 009 D5): ``carried`` or ``dropped``.
        late_policy: the aggregator's :class:`~deltastore.federated.LatePolicy` mode.
        collect_s: how long the round waited for results (at most its deadline plus one
            poll interval).
    """

    base: int
    published: VersionInfo
    sites: tuple[SiteOutcome, ...]
    elapsed_s: float
    late: tuple[SiteOutcome, ...] = ()
    late_policy: str = "drop"
    collect_s: float = 0.0

    @property
    def accepted(self) -> list[str]:
        return [s.site for s in self.sites if s.status == "accepted"]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the CLI's ``--json``)."""
        return {
            "base": self.base,
            "version": self.published.version,
            "kind": self.published.kind,
            "bytes_published": self.published.bytes_stored,
            "elements_changed": self.published.elements_changed,
            "accepted": self.accepted,
            "sites": [asdict(s) for s in self.sites],
            "late": [asdict(s) for s in self.late],
            "late_policy": self.late_policy,
            "elapsed_s": round(self.elapsed_s, 3),
            "collect_s": round(self.collect_s, 3),
        }


@dataclass(frozen=True)
class Gathered:
    """What :meth:`Aggregator.gather` collected for one round.

    Attributes:
        results, weights: the accepted results (by site name) and their merge weights.
        outcomes: one per site (accepted, refused, missing).
        carried, carried_weights: late results carried into the round, and their weights.
        late: every late result seen (carried or dropped), as outcomes.
        collect_s: how long the wait took.
    """

    results: tuple[BasedResult, ...]
    weights: tuple[float, ...]
    outcomes: tuple[SiteOutcome, ...]
    carried: tuple[BasedResult, ...]
    carried_weights: tuple[float, ...]
    late: tuple[SiteOutcome, ...]
    collect_s: float


class _SiteReader:
    """One followed site store: its history (HEAD polled conditionally), read engine, trusted
    keys, and the poll in flight (one at a time: History and the engine are not shared)."""

    def __init__(self, name: str, store: Store, owned: bool, threads: int, keys: TrustedKeys | None):
        self.name = name
        self.store = store
        self.owned = owned
        self.history = History(store)
        self.engine = ReadEngine(store, threads)
        self.keys = keys
        self.inflight: Future[_Seen] | None = None
        self.inflight_base = 0  # the round base the poll in flight looks for

    def close(self) -> None:
        self.engine.close()
        if self.owned:
            self.store.close()


@dataclass(frozen=True)
class _Seen:
    """What one poll of a site found: its result for the open round (or None: not yet), and
    a late result (or the error that refused one)."""

    result: BasedResult | None = None
    late: BasedResult | None = None
    late_version: int | None = None
    late_error: DeltastoreError | None = None


@dataclass(frozen=True)
class _LastRound:
    """The previous round, held to recognise (and carry) its late results."""

    base: RoundBase
    state: Mapping[str, torch.Tensor]
    merged: Mapping[str, int]  # site → the version the round merged


class Aggregator:
    """Runs federated rounds over one global store and N site stores (design 009).

    Args:
        global_url: the global store (written by this aggregator only).
        sites: site name → site store URL (or a list of URLs, named ``site-0``, ``site-1``, …).
        dtype: the served dtype (as :class:`~deltastore.Publisher`'s ``dtype``).
        merge: the merge function, per tensor (default
            :func:`~deltastore.federated.merge.weighted_average`), or a
            :class:`~deltastore.federated.merge.StateMerge` of the whole state, called once per
            round (for merges that read several tensors at once, e.g.
            :class:`~deltastore.federated.lora.LoraMerge`'s stacking).
        storage_options / site_storage_options: for the global store / every site store.
        global_store / site_stores: already opened stores to use (not closed by us).
        poll_interval_s: seconds between polls of the site stores while a round waits.
        publisher_options: more :class:`~deltastore.Publisher` keyword arguments
            (``writer_policy``, ``anchor_policy``, ``layout_policy``, ``signing_key``, ...).
            ``writer_policy.threads`` are also the read threads. Every round commits a new
            global version (``skip_unchanged`` is always False here) and the global store
            stays ungrouped (``group_small_tensors`` False; True is refused): the merge works
            per tensor (design 009).
        results: which site results a round accepts
            (:class:`~deltastore.federated.ResultPolicy`): the sites' trusted keys (``site_keys``:
            a site named there whose version is unsigned or wrongly signed is refused,
            SignatureError, named in the report, and the round goes on) and whether compressed
            results are merged (``accept_compressed``; default: refused, CompressedVersionError).
        late: what to do with late results (:class:`~deltastore.federated.LatePolicy`;
            default: drop them, reported).

    Raises:
        ValueError: no site, ``group_small_tensors=True``, a ``site_keys`` name that is no
            site, or a key that does not load.
        Everything :class:`~deltastore.Publisher` raises when it opens the global store.

    Example::

        with Aggregator("s3://b/run/global", {"a": "s3://b/run/sites/a", "b": "s3://b/run/sites/b"},
                        dtype=torch.bfloat16) as agg:
            agg.start(model.state_dict())          # version 1, unless the store has versions
            for r in range(rounds):
                report = agg.run_round(quorum=2, deadline_s=600)
                print(report.to_json())
    """

    def __init__(self, global_url: str, sites: Mapping[str, str] | Sequence[str], *, dtype: torch.dtype | None = None,
                 merge: MergeFn | StateMerge = weighted_average, storage_options: Mapping[str, Any] | None = None,
                 site_storage_options: Mapping[str, Any] | None = None, global_store: Store | None = None,
                 site_stores: Mapping[str, Store] | None = None, poll_interval_s: float = POLL_INTERVAL_S,
                 results: ResultPolicy = ResultPolicy(), late: LatePolicy = LatePolicy(), **publisher_options: Any):
        named = dict(sites) if isinstance(sites, Mapping) else {f"site-{i}": u for i, u in enumerate(sites)}
        given = dict(site_stores or {})
        if not named and not given:
            raise ValueError("an aggregator needs at least one site")
        if not isinstance(late, LatePolicy):
            raise TypeError(f"late must be a LatePolicy, not {type(late).__name__}")
        if not isinstance(results, ResultPolicy):
            raise TypeError(f"results must be a ResultPolicy, not {type(results).__name__}")
        trusted = results.trusted(set(named) | set(given))
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be above 0, got {poll_interval_s!r}")
        writer = publisher_options.pop("writer_policy", WriterPolicy())
        layout = publisher_options.pop("layout_policy", LayoutPolicy())
        check_policy(writer, WriterPolicy, "writer_policy")
        check_policy(layout, LayoutPolicy, "layout_policy")
        if layout.group_small_tensors is True:
            raise ValueError("an aggregator's global store is not grouped (the merge works per tensor, design 009): "
                             "pass LayoutPolicy(group_small_tensors=False)")
        self.threads = writer.threads or default_threads()
        self.merge_fn = merge
        self.results = results
        self.poll_interval_s = poll_interval_s
        self.late = late
        # Every round must make a new global version (even one where no element moved): the
        # round's identity is its base version, and a repeated base would accept last round's
        # results again. The global store stays ungrouped, whatever its tensor count.
        writer = dataclasses.replace(writer, threads=self.threads, skip_unchanged=False)
        layout = dataclasses.replace(layout, group_small_tensors=False)
        self.publisher = Publisher(global_url, storage_options=storage_options, dtype=dtype, store=global_store,
                                   writer_policy=writer, layout_policy=layout, **publisher_options)
        self.writer_id = self.publisher.writer_id
        self._global = History(self.publisher.store)
        self._sites: dict[str, _SiteReader] = {}
        try:
            for name in sorted(set(named) | set(given)):
                if name in given:
                    self._sites[name] = _SiteReader(name, given[name], False, self.threads, trusted.get(name))
                else:
                    store = open_store(named[name], storage_options=dict(site_storage_options or {}))
                    self._sites[name] = _SiteReader(name, store, True, self.threads, trusted.get(name))
        except BaseException:
            self.close()
            raise
        self._state: dict[str, torch.Tensor] | None = None  # the global version we hold
        self._state_version = 0
        self._last: _LastRound | None = None  # the previous round (late results are based on it)
        self._last_late: tuple[SiteOutcome, ...] = ()
        self._late_results: list[tuple[BasedResult, float]] = []

    @property
    def sites(self) -> list[str]:
        return list(self._sites)

    @property
    def version(self) -> int:
        """The global version this aggregator holds (0 before :meth:`start`)."""
        return self._state_version

    def state(self) -> dict[str, torch.Tensor]:
        """The global version's tensors as this aggregator holds them (do not modify)."""
        if self._state is None:
            raise VersionNotFoundError("the aggregator holds no global version yet: call start()")
        return self._state

    def start(self, initial_state: Mapping[str, torch.Tensor] | None = None) -> int:
        """Publish ``initial_state`` as version 1 when the global store is empty, else read its
        head version (verified), and, when a round published it, that round (so that a
        restarted aggregator still knows the previous round's late results). Returns the
        global version held."""
        top = self._global.read_head()
        if top is None or not top[0].manifest:
            if initial_state is None:
                raise VersionNotFoundError(f"{self.publisher.url} has no version yet: pass the initial state")
            info = self.publisher.publish(initial_state, metadata={"federated": {"round": 0}})
            self._load(info.version)
        else:
            self._load(top[0].version)
            self._last = self._round_before(top[0])
        return self._state_version

    def _load(self, version: int) -> None:
        from deltastore.read.subscriber import Subscriber

        with Subscriber(self.publisher.url, store=self.publisher.store, threads=self.threads) as sub:
            self._state = sub.pull(version)
        self._state_version = version

    def open_round(self) -> RoundBase:
        """The round's base (the global HEAD's version), pinned in the global store's index
        (design 009 D8). Call :meth:`close_round` after it."""
        top = self._global.read_head()
        if top is None or not top[0].manifest:
            raise VersionNotFoundError(f"{self.publisher.url} has no version: call start() first")
        head = top[0]
        if head.version != self._state_version:
            self._load(head.version)  # someone else published (or we restarted): serve what HEAD says
            self._last = self._round_before(head)
        _, m = self._global.head_manifest(head)  # type: ignore[misc]
        assert m.layout is not None
        base = RoundBase.of(head, self._global.layout(m.layout))
        pin(self.publisher.store, base.version, note="federated round base", writer=self.writer_id)
        return base

    def _round_before(self, head: Head) -> _LastRound | None:
        """The round that published HEAD's version, read back from the store: its base and the
        site versions it merged (``metadata.federated``, SPEC §14), and, to carry late results,
        the base's tensors. None when HEAD's version is no round's (the initial version, or
        another writer's) or its base cannot be read (logged: late results are then not
        recognised, as before any round)."""
        got = self._global.head_manifest(head)
        if got is None:
            return None
        fed = got[1].metadata.get("federated")
        if not isinstance(fed, dict) or not isinstance(fed.get("base"), int) or not isinstance(fed.get("site_versions"), dict):
            return None
        merged = {str(k): v for k, v in fed["site_versions"].items() if isinstance(v, int) and not isinstance(v, bool)}
        try:
            key, m = self._global.find(fed["base"], head)
            assert m.layout is not None and head.lineage is not None
            sha = key.rsplit("-", 1)[1].split(".", 1)[0]
            base = RoundBase(m.version, key, sha, head.lineage, specs_of(self._global.layout(m.layout), what=key))
            state: Mapping[str, torch.Tensor] = {}
            if self.late.mode == "carry":
                from deltastore.read.subscriber import Subscriber

                with Subscriber(self.publisher.url, store=self.publisher.store, threads=self.threads) as sub:
                    state = sub.pull(base.version)
        except (DeltastoreError, StorageError) as e:
            logger.warning("%s: the round that published version %d cannot be read back (%s): its late results "
                           "will not be recognised", self.publisher.url, head.version, e)
            return None
        return _LastRound(base, state, merged)

    def close_round(self, base: RoundBase) -> None:
        """Unpin the round's base (logged, never raised: a leftover pin only keeps objects)."""
        try:
            unpin(self.publisher.store, base.version, writer=self.writer_id)
        except DeltastoreError as e:
            logger.warning("could not unpin global version %d of %s: %s", base.version, self.publisher.url, e)

    def gather(self, base: RoundBase, *, quorum: int | None = None, deadline_s: float | None = None) -> Gathered:
        """Wait for the round's results (design 009 D5) and verify each as it appears.

        Without a deadline: until ``quorum`` sites (default all) are accepted, for at most
        ``Deadlines().round`` (an hour: a round never waits forever on an unreachable site). With
        one: until every site answered or the deadline passed; then at least ``quorum`` must be
        accepted. Sites are polled each on its own thread, ``poll_interval_s`` apart, so a site
        whose store stalls holds up neither the others nor the round: the wait ends at the
        deadline plus at most one poll interval, whatever the sites do.

        A refused site is not waited for. A result against an older base is a site still in an
        earlier round: not yet. A *late* result (based on the previous round's base, not merged
        by it) is dropped or carried, as :class:`~deltastore.federated.LatePolicy` says, and
        reported; the site is still waited for.

        Raises:
            QuorumError: the quorum cannot be or was not reached; nothing is published.
        """
        n = len(self._sites)
        k = n if quorum is None else quorum
        if not 1 <= k <= n:
            raise ValueError(f"quorum must be in [1, {n}], got {quorum}")
        limit_s = Deadlines().round if deadline_s is None else deadline_s
        t0 = time.monotonic()
        end = t0 + limit_s
        pending = set(self._sites)
        accepted: dict[str, BasedResult] = {}
        outcomes: dict[str, SiteOutcome] = {}
        late: dict[str, tuple[SiteOutcome, BasedResult | None]] = {}
        next_poll = dict.fromkeys(pending, t0)
        while True:
            now = time.monotonic()
            for name in sorted(pending):
                site = self._sites[name]
                if site.inflight is None and next_poll[name] <= now:
                    site.inflight = _spawn(self._poll, name, base, name not in late)
                    site.inflight_base = base.version
                    next_poll[name] = now + self.poll_interval_s
            busy = [self._sites[name].inflight for name in pending if self._sites[name].inflight is not None]
            idle = [next_poll[name] for name in pending if self._sites[name].inflight is None]
            wake = min([end, *idle]) if idle else end
            if busy:
                wait(busy, timeout=max(0.0, wake - time.monotonic()), return_when=FIRST_COMPLETED)  # type: ignore[arg-type]
            else:
                time.sleep(max(0.0, wake - time.monotonic()))
            for name in sorted(pending):
                site = self._sites[name]
                fut = site.inflight
                if fut is None or not fut.done():
                    continue
                site.inflight = None
                if site.inflight_base != base.version:
                    continue  # a poll of an earlier round that stalled past it: its answer is not this round's
                try:
                    seen = fut.result()
                except (IntegrityError, FormatError, InvalidStateDictError) as e:  # refused: named, round goes on
                    logger.warning("round on global version %d: site %s refused: %s", base.version, name, e)
                    outcomes[name] = SiteOutcome(name, "refused", error=str(e), error_type=type(e).__name__)
                    pending.discard(name)
                    continue
                except StorageError as e:  # transient (or the site is down): try again next poll
                    logger.info("site %s unreadable for now: %s", name, e)
                    continue
                if name not in late and (seen.late is not None or seen.late_version is not None):
                    late[name] = self._late_outcome(name, seen)
                if seen.result is not None:
                    accepted[name] = seen.result
                    pending.discard(name)
            if len(accepted) + len(pending) < k:
                raise QuorumError(f"round on global version {base.version}: {len(accepted)} accepted, "
                                  f"{n - len(accepted) - len(pending)} refused of {n} sites; quorum {k} is out of reach")
            if not pending or (deadline_s is None and len(accepted) >= k) or time.monotonic() >= end:
                break
        waited = time.monotonic() - t0
        if len(accepted) < k:
            raise QuorumError(f"round on global version {base.version}: {len(accepted)} of {n} sites accepted by the "
                              f"deadline ({limit_s:g} s), quorum {k}: nothing published")
        for name in pending:  # a poll still in flight stays with its site; its answer is dropped
            outcomes[name] = SiteOutcome(name, "missing")
        results = [accepted[name] for name in sorted(accepted)]
        carried = [(name, r) for name, (_, r) in sorted(late.items()) if r is not None]
        weights = _weights([*results, *(r for _, r in carried)], [1.0] * len(results) + [self.late.weight] * len(carried))
        for r, w in zip(results, weights):
            outcomes[r.site] = SiteOutcome(r.site, "accepted", r.info.version, w, base=base.version,
                                           bytes_up=r.info.bytes_stored, bytes_read=r.bytes_fetched,
                                           compressed=r.compression is not None)
        late_outcomes = {name: o for name, (o, _) in late.items()}
        for (name, r), w in zip(carried, weights[len(results):]):
            late_outcomes[name] = dataclasses.replace(late_outcomes[name], weight=w)
        return Gathered(tuple(results), tuple(weights[:len(results)]), tuple(outcomes[name] for name in sorted(outcomes)),
                        tuple(r for _, r in carried), tuple(weights[len(results):]),
                        tuple(late_outcomes[name] for name in sorted(late_outcomes)), waited)

    def collect(self, base: RoundBase, *, quorum: int | None = None, deadline_s: float | None = None
                ) -> tuple[list[BasedResult], list[SiteOutcome]]:
        """:meth:`gather`'s fresh results and the sites' outcomes (late results left out).

        Raises:
            QuorumError: the quorum cannot be or was not reached; nothing is published.
        """
        got = self.gather(base, quorum=quorum, deadline_s=deadline_s)
        return list(got.results), list(got.outcomes)

    def _late_outcome(self, name: str, seen: _Seen) -> tuple[SiteOutcome, BasedResult | None]:
        last = self._last
        old = last.base.version if last is not None else None
        if seen.late_error is not None:
            e = seen.late_error
            logger.warning("site %s: late version %s refused: %s", name, seen.late_version, e)
            return SiteOutcome(name, "dropped", seen.late_version, base=old, error=str(e), error_type=type(e).__name__), None
        r = seen.late
        if r is None or self.late.mode == "drop":
            logger.info("site %s: late version %s (based on global version %s) dropped", name, seen.late_version, old)
            return SiteOutcome(name, "dropped", seen.late_version, base=old), None
        logger.info("site %s: late version %d (based on global version %s) carried", name, r.info.version, old)
        return SiteOutcome(name, "carried", r.info.version, base=old, bytes_up=r.info.bytes_stored,
                           bytes_read=r.bytes_fetched, compressed=r.compression is not None), r

    def _poll(self, name: str, base: RoundBase, want_late: bool = True) -> _Seen:
        """One look at a site: its result for ``base`` (verified), and when ``want_late`` a late
        result before it (or as its HEAD). Runs on a poll thread, one per site at a time."""
        site = self._sites[name]
        head = site.history.poll_head()
        if head is None or not head.manifest:
            return _Seen()
        top = site.history.head_manifest(head)
        assert top is not None
        key, m = top
        if m.base is not None and m.base.lineage == base.lineage and m.base.version < base.version:
            # this round's result is not there yet; a late one may be
            return self._look_late(site, key, m, base) if want_late else _Seen()
        if site.keys is not None:
            site.keys.verify(key, m)  # SignatureError (an IntegrityError): refused, named
        result = read_based(name, site.history, site.engine, key, m, base, self.state(),
                            accept_compressed=self.results.accept_compressed)
        seen = _Seen(result)
        if want_late and self._last is not None and m.parent_manifest is not None:
            # a late result the site published just before this one
            try:
                pkey, p = site.history.parent(key, m)
            except (DeltastoreError, StorageError) as e:
                logger.info("site %s: the version before %d is unreadable (%s): no late result looked for", name, m.version, e)
                return seen
            seen = dataclasses.replace(self._look_late(site, pkey, p, base), result=result)
        return seen

    def _look_late(self, site: _SiteReader, key: str, m: Manifest, base: RoundBase) -> _Seen:
        """``m`` as a late result: None unless it is based on the previous round's base and
        that round did not merge it; read and verified only when it is to be carried."""
        last = self._last
        if last is None or m.base is None or m.base.version != last.base.version or m.base.lineage != last.base.lineage:
            return _Seen()
        if last.merged.get(site.name) == m.version:
            return _Seen()  # merged by its round: the site simply has not answered this one yet
        if self.late.mode == "drop" or same_layout(last.base.specs, base.specs) is not None:
            return _Seen(late_version=m.version)  # dropped (a layout change between rounds: nothing to carry it onto)
        try:
            if site.keys is not None:
                site.keys.verify(key, m)
            r = read_based(site.name, site.history, site.engine, key, m, last.base, last.state,
                           accept_compressed=self.results.accept_compressed)
        except (IntegrityError, FormatError, InvalidStateDictError) as e:
            return _Seen(late_version=m.version, late_error=e)
        return _Seen(late=r, late_version=m.version)

    def merged(self, base: RoundBase, results: Sequence[BasedResult], weights: Sequence[float], *,
               carried: Sequence[BasedResult] = (), carried_weights: Sequence[float] = ()) -> dict[str, torch.Tensor]:
        """The merge of ``results`` (and ``carried`` late results, moved onto ``base`` by
        :func:`~deltastore.federated.late.carried_tensor`) on the global state; only tensors a
        site changed are merged."""
        state = self.state()
        last = self._last
        if carried and last is None:
            raise VersionNotFoundError("late results are carried from the previous round, which this aggregator did not run")
        changed = {name for r in (*results, *carried) for (name, _) in r.chunks}
        weights_all = [*weights, *carried_weights]
        touched = [{n for (n, _) in r.chunks} for r in (*results, *carried)]

        def site_tensors(name: str) -> list[torch.Tensor | None]:
            """Each site's tensor ``name`` (None where it changed nothing), carried ones moved onto ``base``."""
            b = state[name]
            out: list[torch.Tensor | None] = [_site_tensor(r, base.specs[name], b) if name in touched[i] else None
                                              for i, r in enumerate(results)]
            for j, r in enumerate(carried):
                assert last is not None
                old = last.state[name]
                i = len(results) + j
                out.append(carried_tensor(_site_tensor(r, last.base.specs[name], old), old, b) if name in touched[i] else None)
            return out

        got: dict[str, torch.Tensor] = {}
        if isinstance(self.merge_fn, StateMerge):  # every site's changed tensors at once
            sites: list[dict[str, torch.Tensor]] = [{} for _ in touched]
            for name in base.specs:
                if name in changed:
                    for i, t in enumerate(site_tensors(name)):
                        if t is not None:
                            sites[i][name] = t
            got = dict(self.merge_fn(state, sites, weights_all))
            unknown = sorted(set(got) - set(base.specs))
            if unknown:
                raise InvalidStateDictError(f"the merge returned tensors the global version does not have: {unknown[:5]}")
        else:  # one tensor at a time: at most one tensor per site in memory
            for name in base.specs:
                if name in changed:
                    b = state[name]
                    got[name] = self.merge_fn(name, b, [b if t is None else t for t in site_tensors(name)], weights_all)
        out: dict[str, torch.Tensor] = {}
        for name in base.specs:
            b = state[name]
            t = got.get(name, b)
            if t.dtype != b.dtype or t.shape != b.shape:
                raise InvalidStateDictError(f"merge of tensor {name!r} returned {t.dtype}{list(t.shape)}, "
                                            f"not {b.dtype}{list(b.shape)}")
            out[name] = t
        return out

    def publish_merged(self, base: RoundBase, merged: Mapping[str, torch.Tensor], results: Sequence[BasedResult], *,
                       carried: Sequence[BasedResult] = (), step: int | None = None,
                       metadata: Mapping[str, Any] | None = None) -> VersionInfo:
        """Publish ``merged`` (the :meth:`merged` state of ``results`` on ``base``) as the next
        global version, recording the round in its ``metadata.federated`` (the base, the merged
        and carried site versions, the merge, the compressed results, and ``metadata``'s
        entries), and hold it as this aggregator's state: the next round starts from it without
        reading it back, and knows this round's late results.

        Raises:
            FencedError, ConflictError: another aggregator took the global store over.
        """
        fed: dict[str, Any] = {"base": base.version, "sites": [r.site for r in results],
                               "site_versions": {r.site: r.info.version for r in results},
                               "merge": merge_name(self.merge_fn), **dict(metadata or {})}
        if carried:
            fed["carried"] = {r.site: r.info.version for r in carried}
        compressed = {r.site: r.compression.model_dump(mode="json") for r in (*results, *carried)
                      if r.compression is not None}
        if compressed:
            fed["compressed"] = compressed
        info = self.publisher.publish(dict(merged), step=step, metadata={"federated": fed})
        # the base's tensors are kept only to carry late results (the tensors this round
        # changed: one model copy at most); dropping needs only which versions were merged
        kept = self.state() if self.late.mode == "carry" else {}
        self._last = _LastRound(base, kept, {r.site: r.info.version for r in results})
        self._state, self._state_version = dict(merged), info.version
        return info

    def run_round(self, *, quorum: int | None = None, deadline_s: float | None = None, step: int | None = None
                  ) -> RoundReport:
        """One round: pin the base, gather, merge, publish the next global version, unpin.

        Raises:
            QuorumError: not enough results (nothing published; the base is unpinned).
            FencedError, ConflictError: another aggregator took the global store over.
        """
        t0 = time.monotonic()
        base = self.open_round()
        try:
            got = self.gather(base, quorum=quorum, deadline_s=deadline_s)
            merged = self.merged(base, got.results, got.weights, carried=got.carried, carried_weights=got.carried_weights)
            info = self.publish_merged(base, merged, got.results, carried=got.carried, step=step)
        finally:
            self.close_round(base)
        report = RoundReport(base.version, info, got.outcomes, time.monotonic() - t0, got.late, self.late.mode, got.collect_s)
        logger.info("round on global version %d: published version %d (%d bytes) from %s", base.version,
                    info.version, info.bytes_stored, ", ".join(report.accepted))
        return report

    def close(self) -> None:
        """Close the publisher and the site stores this aggregator opened."""
        for s in self._sites.values():
            s.close()
        self.publisher.close()

    def __enter__(self) -> Aggregator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_name(fn: Any) -> str:
    """How a global version's metadata names the merge that made it: a function's name, or an
    object's ``repr`` (e.g. ``LoraMerge(mode='stack', ...)``, which tells a reader whether the
    global adapter or the whole model changed)."""
    return fn.__name__ if hasattr(fn, "__name__") else repr(fn)


def _weights(results: Sequence[BasedResult], discounts: Sequence[float]) -> list[float]:
    """Each result's ``num_examples`` (or 1 for all, unless every result gave a positive one)
    times its discount (1 for a fresh result, the staleness weight for a carried one),
    normalised to sum to 1."""
    if not results:
        return []
    counts = [r.metadata.get(WEIGHT_KEY) for r in results]
    if all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in counts):
        raw = [float(c) * d for c, d in zip(counts, discounts)]  # type: ignore[arg-type]
    else:
        raw = [1.0 * d for d in discounts]
    total = sum(raw)
    return [x / total for x in raw]


def _spawn(fn: Any, *args: Any) -> Future[Any]:
    """``fn(*args)`` on a daemon thread, as a Future: a poll stalled on a site's store keeps only
    its own thread (a daemon, so it never holds up the interpreter's exit)."""
    fut: Future[Any] = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the round that waits on it
            fut.set_exception(e)

    threading.Thread(target=run, name="deltastore-round-poll", daemon=True).start()
    return fut


def _site_tensor(r: BasedResult, spec: TensorSpec, base: torch.Tensor) -> torch.Tensor:
    """The site's tensor: the base with the site's changed chunks written in."""
    mine = [(i, raw) for (n, i), raw in r.chunks.items() if n == spec.name]
    if not mine:
        return base
    t = base.clone()
    flat = bits(t)  # a view of t's bits
    for i, raw in mine:
        a, b = spec.chunk_span(i)
        flat[a:b] = raw
    return t
