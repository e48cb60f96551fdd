"""The aggregator of federated rounds (design 009 D4–D8).

It owns the global store (one :class:`~deltastore.Publisher`, so a second aggregator fences the
first), follows N site stores, and runs rounds: pin the round's base, wait for the quorum,
verify every site's based version (SPEC §14), merge, publish the next global version as a
delta, unpin.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from deltastore._util.deadline import Deadlines
from deltastore.read.engine import ReadEngine
from deltastore.errors import (
    DeltastoreError,
    FormatError,
    IntegrityError,
    InvalidStateDictError,
    QuorumError,
    StorageError,
    VersionNotFoundError,
)
from deltastore.federated.based import BasedResult, RoundBase, read_based
from deltastore.federated.merge import MergeFn, weighted_average
from deltastore.format.history import History, VersionInfo
from deltastore.lifecycle.index import pin, unpin
from deltastore._util.jobs import default_threads
from deltastore.write.policy import LayoutPolicy, WriterPolicy, check_policy
from deltastore.write.publisher import Publisher
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.layout.tensors import TensorSpec, bits

logger = logging.getLogger(__name__)

#: Seconds between two polls of a site's HEAD while a round waits: a conditional GET each, so
#: a round of minutes costs a few hundred small requests per site.
POLL_INTERVAL_S = 0.5
#: Metadata key a site's weight is read from (design 009 D6): its number of training examples.
WEIGHT_KEY = "num_examples"

Status = Literal["accepted", "refused", "missing"]


@dataclass(frozen=True)
class SiteOutcome:
    """What one site contributed to a round.

    Attributes:
        site: its name. status: ``accepted`` (merged), ``refused`` (failed a check: ``error``
            says which, named), ``missing`` (no result against this round's base by the end).
        version: the site version read (None when missing).
        weight: its weight in the merge (accepted only).
        bytes_up: bytes of packs the site wrote for this result (its version's ``bytes_stored``).
        bytes_read: segment bytes the aggregator read from the site store.
    """

    site: str
    status: Status
    version: int | None = None
    weight: float | None = None
    error: str | None = None
    error_type: str | None = None
    bytes_up: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class RoundReport:
    """One round: its base, what each site did, the version published."""

    base: int
    published: VersionInfo
    sites: tuple[SiteOutcome, ...]
    elapsed_s: float

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
            "elapsed_s": round(self.elapsed_s, 3),
        }


class _SiteReader:
    """One followed site store: its history (HEAD polled conditionally) and read engine."""

    def __init__(self, name: str, store: Store, owned: bool, threads: int):
        self.name = name
        self.store = store
        self.owned = owned
        self.history = History(store)
        self.engine = ReadEngine(store, threads)

    def close(self) -> None:
        self.engine.close()
        if self.owned:
            self.store.close()


class Aggregator:
    """Runs federated rounds over one global store and N site stores (design 009).

    Args:
        global_url: the global store (written by this aggregator only).
        sites: site name → site store URL (or a list of URLs, named ``site-0``, ``site-1``, …).
        dtype: the served dtype (as :class:`~deltastore.Publisher`'s ``dtype``).
        merge: the merge function (default :func:`~deltastore.federated.merge.weighted_average`).
        storage_options / site_storage_options: for the global store / every site store.
        global_store / site_stores: already opened stores to use (not closed by us).
        poll_interval_s: seconds between polls of the site stores while a round waits.
        publisher_options: more :class:`~deltastore.Publisher` keyword arguments
            (``writer_policy``, ``anchor_policy``, ``layout_policy``, ``signing_key``, ...).
            ``writer_policy.threads`` are also the read threads. Every round commits a new
            global version (``skip_unchanged`` is always False here) and the global store
            stays ungrouped (``group_small_tensors`` False; True is refused): the merge works
            per tensor (design 009).

    Raises:
        ValueError: no site, or ``group_small_tensors=True``.
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
                 merge: MergeFn = weighted_average, storage_options: Mapping[str, Any] | None = None,
                 site_storage_options: Mapping[str, Any] | None = None, global_store: Store | None = None,
                 site_stores: Mapping[str, Store] | None = None, poll_interval_s: float = POLL_INTERVAL_S,
                 **publisher_options: Any):
        named = dict(sites) if isinstance(sites, Mapping) else {f"site-{i}": u for i, u in enumerate(sites)}
        given = dict(site_stores or {})
        if not named and not given:
            raise ValueError("an aggregator needs at least one site")
        writer = publisher_options.pop("writer_policy", WriterPolicy())
        layout = publisher_options.pop("layout_policy", LayoutPolicy())
        check_policy(writer, WriterPolicy, "writer_policy")
        check_policy(layout, LayoutPolicy, "layout_policy")
        if layout.group_small_tensors is True:
            raise ValueError("an aggregator's global store is not grouped (the merge works per tensor, design 009): "
                             "pass LayoutPolicy(group_small_tensors=False)")
        self.threads = writer.threads or default_threads()
        self.merge_fn = merge
        self.poll_interval_s = poll_interval_s
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
                    self._sites[name] = _SiteReader(name, given[name], False, self.threads)
                else:
                    store = open_store(named[name], storage_options=dict(site_storage_options or {}))
                    self._sites[name] = _SiteReader(name, store, True, self.threads)
        except BaseException:
            self.close()
            raise
        self._state: dict[str, torch.Tensor] | None = None  # the global version we hold
        self._state_version = 0

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
        head version (verified). Returns the global version held."""
        top = self._global.read_head()
        if top is None or not top[0].manifest:
            if initial_state is None:
                raise VersionNotFoundError(f"{self.publisher.url} has no version yet: pass the initial state")
            info = self.publisher.publish(initial_state, metadata={"federated": {"round": 0}})
            self._load(info.version)
        else:
            self._load(top[0].version)
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
        _, m = self._global.head_manifest(head)  # type: ignore[misc]
        assert m.layout is not None
        base = RoundBase.of(head, self._global.layout(m.layout))
        pin(self.publisher.store, base.version, note="federated round base", writer=self.writer_id)
        return base

    def close_round(self, base: RoundBase) -> None:
        """Unpin the round's base (logged, never raised: a leftover pin only keeps objects)."""
        try:
            unpin(self.publisher.store, base.version, writer=self.writer_id)
        except DeltastoreError as e:
            logger.warning("could not unpin global version %d of %s: %s", base.version, self.publisher.url, e)

    def collect(self, base: RoundBase, *, quorum: int | None = None, deadline_s: float | None = None
                ) -> tuple[list[BasedResult], list[SiteOutcome]]:
        """Wait for the round's results (design 009 D5) and verify each as it appears.

        Without a deadline: until ``quorum`` sites (default all) are accepted, for at most
        ``Deadlines().round`` (an hour: a round never waits forever on an unreachable site). With
        one: until every site answered or the deadline passed; then at least ``quorum`` must be
        accepted.
        A refused site is not waited for. A result against an older base is a site still in an
        earlier round (or late): not yet. A late result is dropped.

        Raises:
            QuorumError: the quorum cannot be or was not reached; nothing is published.
        """
        n = len(self._sites)
        k = n if quorum is None else quorum
        if not 1 <= k <= n:
            raise ValueError(f"quorum must be in [1, {n}], got {quorum}")
        limit_s = Deadlines().round if deadline_s is None else deadline_s
        end = time.monotonic() + limit_s
        pending = set(self._sites)
        accepted: dict[str, BasedResult] = {}
        outcomes: dict[str, SiteOutcome] = {}
        while True:
            for name in sorted(pending):
                try:
                    r = self._poll(name, base)
                except (IntegrityError, FormatError, InvalidStateDictError) as e:  # refused: named, round goes on
                    logger.warning("round on global version %d: site %s refused: %s", base.version, name, e)
                    outcomes[name] = SiteOutcome(name, "refused", error=str(e), error_type=type(e).__name__)
                    pending.discard(name)
                    continue
                except StorageError as e:  # transient (or the site is down): try again next poll
                    logger.info("site %s unreadable for now: %s", name, e)
                    continue
                if r is not None:
                    accepted[name] = r
                    pending.discard(name)
            if len(accepted) + len(pending) < k:
                raise QuorumError(f"round on global version {base.version}: {len(accepted)} accepted, "
                                  f"{n - len(accepted) - len(pending)} refused of {n} sites; quorum {k} is out of reach")
            expired = time.monotonic() >= end
            if not pending or (deadline_s is None and len(accepted) >= k) or expired:
                break
            time.sleep(self.poll_interval_s)
        if len(accepted) < k:
            raise QuorumError(f"round on global version {base.version}: {len(accepted)} of {n} sites accepted by the "
                              f"deadline ({limit_s:g} s), quorum {k}: nothing published")
        for name in pending:
            outcomes[name] = SiteOutcome(name, "missing")
        results = [accepted[name] for name in sorted(accepted)]
        weights = _weights(results)
        for r, w in zip(results, weights):
            outcomes[r.site] = SiteOutcome(r.site, "accepted", r.info.version, w, bytes_up=r.info.bytes_stored,
                                           bytes_read=r.bytes_fetched)
        return results, [outcomes[name] for name in sorted(outcomes)]

    def _poll(self, name: str, base: RoundBase) -> BasedResult | None:
        site = self._sites[name]
        head = site.history.poll_head()
        if head is None or not head.manifest:
            return None
        top = site.history.head_manifest(head)
        assert top is not None
        key, m = top
        if m.base is not None and m.base.lineage == base.lineage and m.base.version < base.version:
            return None  # the site's result of an earlier round: this round's is not there yet
        return read_based(name, site.history, site.engine, key, m, base, self.state())

    def merged(self, base: RoundBase, results: Sequence[BasedResult], weights: Sequence[float]) -> dict[str, torch.Tensor]:
        """The merge of ``results`` on the global state (only tensors a site changed are merged)."""
        state = self.state()
        changed = {name for r in results for (name, _) in r.chunks}
        out: dict[str, torch.Tensor] = {}
        for name in base.specs:
            b = state[name]
            if name not in changed:
                out[name] = b
                continue
            sites = [_site_tensor(r, base.specs[name], b) for r in results]
            t = self.merge_fn(name, b, sites, list(weights))
            if t.dtype != b.dtype or t.shape != b.shape:
                raise InvalidStateDictError(f"merge of tensor {name!r} returned {t.dtype}{list(t.shape)}, "
                                            f"not {b.dtype}{list(b.shape)}")
            out[name] = t
        return out

    def run_round(self, *, quorum: int | None = None, deadline_s: float | None = None, step: int | None = None
                  ) -> RoundReport:
        """One round: pin the base, collect, merge, publish the next global version, unpin.

        Raises:
            QuorumError: not enough results (nothing published; the base is unpinned).
            FencedError, ConflictError: another aggregator took the global store over.
        """
        t0 = time.monotonic()
        base = self.open_round()
        try:
            results, outcomes = self.collect(base, quorum=quorum, deadline_s=deadline_s)
            weights = [o.weight for o in outcomes if o.status == "accepted"]
            merged = self.merged(base, results, [w for w in weights if w is not None])
            meta = {"federated": {"base": base.version, "sites": [r.site for r in results],
                                  "site_versions": {r.site: r.info.version for r in results}}}
            info = self.publisher.publish(merged, step=step, metadata=meta)
            self._state, self._state_version = merged, info.version
        finally:
            self.close_round(base)
        report = RoundReport(base.version, info, tuple(outcomes), time.monotonic() - t0)
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


def _weights(results: Sequence[BasedResult]) -> list[float]:
    """Each site's ``num_examples`` normalised, when every site gave a positive one; else equal."""
    counts = [r.metadata.get(WEIGHT_KEY) for r in results]
    if all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in counts):
        total = float(sum(counts))  # type: ignore[arg-type]
        return [float(c) / total for c in counts]  # type: ignore[arg-type]
    return [1.0 / len(results)] * len(results)


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
