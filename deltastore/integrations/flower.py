"""Flower (``flwr``) apps whose parameters travel through deltastore stores (design 009).

A Flower app keeps doing what it does (client selection, strategies, simulation, SuperLink and
SuperNodes), but its messages carry only *references* to versions, never weights:

- the server side, :class:`DeltastoreFedAvg` (a Flower ``FedAvg``), publishes the global model to
  the global store and sends each sampled node a :class:`VersionRef` of it (store URL, version,
  manifest key, manifest SHA-256, lineage);
- a node, through :class:`FlowerSite`, fast-forwards to that version (verified, bit-exact),
  trains, publishes its result as a *based version* into its own site store (only its change)
  and replies with a reference to it and its metrics;
- the strategy's ``aggregate_train`` reads every referenced site version (SPEC §14's checks,
  every segment and chunk verified), merges them with deltastore's federated merge (the
  :class:`~deltastore.federated.Aggregator`'s, so the global version is bit-exact to what it
  computed) and publishes the next global version. A reply whose reference names a version that
  does not exist, another lineage or another base is dropped from the round with a typed error
  (:attr:`DeltastoreFedAvg.rounds`, ``failures``); the round goes on without it.

:class:`InlineFedAvg` is the same strategy on Flower's own transport (full weights in
``ArrayRecord`` messages, merged by the same function, in the same site order): an app run with
either gives bit-identical global weights (same seeds), which is how the two are compared.

Requires the ``flower`` extra (``pip install deltastore-weights[flower]``).

Example (a ServerApp and a ClientApp)::

    from flwr.app import ArrayRecord, Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from deltastore.integrations.flower import DeltastoreFedAvg, FlowerSite

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = DeltastoreFedAvg("s3://b/run/global", {"a": "s3://b/run/sites/a", "b": "s3://b/run/sites/b"},
                                    dtype=torch.bfloat16)
        with strategy:
            strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=3)

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        site = FlowerSite.shared(context.node_config["site-url"], name=context.node_config["site"],
                                 dtype=torch.bfloat16)
        model.load_state_dict(site.pull(msg))        # verified, bit-exact
        fit(model)
        return site.reply(msg, model.state_dict(), num_examples=len(data), metrics={"loss": loss})
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("deltastore.integrations.flower needs Flower: pip install 'deltastore-weights[flower]' "
                      f"(flwr is not importable: {e})") from e

from deltastore.errors import (
    DeltastoreError,
    FormatError,
    HistoryReplacedError,
    InvalidStateDictError,
    NotFoundError,
    VersionNotFoundError,
    WrongBaseError,
)
from deltastore.federated.accept import ResultPolicy
from deltastore.federated.aggregator import Aggregator
from deltastore.federated.based import BasedResult, RoundBase, read_based
from deltastore.federated.merge import MergeFn, weighted_average
from deltastore.federated.compress import Compression, Compressor
from deltastore.federated.site import Site
from deltastore.format.history import History, VersionInfo
from deltastore.format.signing import TrustedKeys
from deltastore.read.engine import ReadEngine
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.policy import WriterPolicy

logger = logging.getLogger(__name__)

#: RecordDict key of the ConfigRecord holding a version reference (server → node and back).
REFERENCE_KEY = "deltastore"
#: RecordDict key of a reply's MetricRecord (Flower's convention: one MetricRecord per reply).
METRICS_KEY = "metrics"
#: ConfigRecord key naming the replying site (orders the merge; see :class:`InlineFedAvg`).
SITE_KEY = "site"
#: ``Array.stype`` of a tensor carried as its raw bytes: bf16 and the other dtypes NumPy lacks
#: travel bit for bit (Flower's own stype goes through NumPy).
RAW_STYPE = "torch.raw"

_REF_FIELDS = ("store", "version", "manifest", "sha256", "lineage")


@dataclass(frozen=True)
class VersionRef:
    """A version of a store, named precisely enough to be verified: what a Flower message
    carries instead of weights.

    Attributes:
        store: the store's URL. version: the version number. manifest: its manifest's key.
        sha256: that manifest's SHA-256 (the store's HEAD ``manifest_sha256`` when written).
        lineage: the store's lineage (a store deleted and recreated has another).
    """

    store: str
    version: int
    manifest: str
    sha256: str
    lineage: str

    def to_record(self) -> ConfigRecord:
        """The reference as a Flower ``ConfigRecord``."""
        return ConfigRecord({"store": self.store, "version": self.version, "manifest": self.manifest,
                             "sha256": self.sha256, "lineage": self.lineage})

    @classmethod
    def from_record(cls, record: Any, *, what: str = "message") -> VersionRef:
        """Parse a reference (every field present and of its type).

        Raises:
            FormatError: a field is missing or malformed (named).
        """
        if not isinstance(record, ConfigRecord):
            raise FormatError(f"{what}: no deltastore version reference (a ConfigRecord under {REFERENCE_KEY!r})")
        missing = [k for k in _REF_FIELDS if k not in record]
        if missing:
            raise FormatError(f"{what}: the version reference lacks {', '.join(missing)}")
        version = record["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise FormatError(f"{what}: the version reference's version is {version!r}, not a positive integer")
        texts = {k: record[k] for k in ("store", "manifest", "sha256", "lineage")}
        bad = [k for k, v in texts.items() if not isinstance(v, str) or not v]
        if bad:
            raise FormatError(f"{what}: the version reference's {bad[0]} is {texts[bad[0]]!r}, not a non-empty string")
        return cls(texts["store"], version, texts["manifest"], texts["sha256"], texts["lineage"])

    @classmethod
    def of_base(cls, store: str, base: RoundBase) -> VersionRef:
        """The reference of a round's base (a global version)."""
        return cls(store, base.version, base.manifest, base.sha256, base.lineage)


@dataclass(frozen=True)
class RoundFailure:
    """A node dropped from a round: why, typed.

    Attributes:
        node_id: the Flower node. site: the site its reference named (None when unknown).
        error_type: the error's class name (``VersionNotFoundError``, ``WrongBaseError``, ...;
            ``FlowerError`` for an error reply). error: the message.
    """

    node_id: int
    site: str | None
    error_type: str
    error: str


@dataclass(frozen=True)
class FlowerRound:
    """One training round of :class:`DeltastoreFedAvg`.

    Attributes:
        server_round: Flower's round number. base: the global version the round started from.
        published: the global version published (None when no reply was accepted).
        accepted: the sites merged, in merge order. failures: the nodes dropped.
        bytes_read: site-store segment bytes the server read.
        bytes_up: each accepted site's upload (its version's pack bytes), in ``accepted``'s order.
    """

    server_round: int
    base: int
    published: VersionInfo | None
    accepted: tuple[str, ...]
    failures: tuple[RoundFailure, ...]
    bytes_read: int
    bytes_up: tuple[int, ...] = ()


# --- tensors in Flower messages ----------------------------------------------------------------


def state_to_arrays(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """A state dict as an ``ArrayRecord`` whose arrays are the tensors' raw bytes (any dtype,
    bf16 included, bit for bit): Flower's own transport of the same weights."""
    arrays = {}
    for name, t in state.items():
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        arrays[name] = Array(dtype=str(t.dtype), shape=tuple(t.shape), stype=RAW_STYPE, data=data)
    return ArrayRecord(arrays)


def arrays_to_state(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of an ``ArrayRecord``: raw arrays (:func:`state_to_arrays`) bit for bit,
    Flower's NumPy arrays (``ArrayRecord(model.state_dict())``) through NumPy.

    Raises:
        FormatError: an array of an unknown dtype or stype, or whose size disagrees with its
            shape (named).
    """
    out: dict[str, torch.Tensor] = {}
    for name, a in record.items():
        if a.stype != RAW_STYPE:
            try:
                out[name] = torch.from_numpy(a.numpy().copy())
            except (TypeError, ValueError) as e:
                raise FormatError(f"array {name!r}: not readable ({a.stype}, {a.dtype}): {e}") from None
            continue
        dtype = getattr(torch, a.dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise FormatError(f"array {name!r}: unknown dtype {a.dtype!r}")
        shape = tuple(int(s) for s in a.shape)
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(a.data) != numel * itemsize:
            raise FormatError(f"array {name!r}: {len(a.data)} bytes for {a.dtype}{list(shape)} "
                              f"({numel * itemsize} expected)")
        raw = torch.frombuffer(bytearray(a.data), dtype=torch.uint8) if a.data else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(shape)
    return out


def reference_of(msg: Message, *, key: str = REFERENCE_KEY) -> VersionRef:
    """The version reference a message carries.

    Raises:
        FormatError: the message carries none, or a malformed one.
    """
    content = msg.content
    record = content.config_records.get(key) if content is not None else None
    return VersionRef.from_record(record, what=f"message from node {msg.metadata.src_node_id}")


def _weights(counts: Sequence[float]) -> list[float]:
    """Each site's example count normalised (as Flower's FedAvg weighs); equal when any is not
    positive."""
    if all(c > 0 for c in counts):
        total = float(sum(counts))
        return [float(c) / total for c in counts]
    return [1.0 / len(counts)] * len(counts)


def _count(content: RecordDict, key: str) -> float:
    """The reply's weight (``weighted_by_key`` of its MetricRecord), 0 when absent or invalid."""
    for rec in content.metric_records.values():
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return 0.0


# --- the server side ---------------------------------------------------------------------------


class _SiteStore:
    """One site store the strategy reads references from."""

    def __init__(self, name: str, store: Store, threads: int, keys: TrustedKeys | None = None):
        self.name = name
        self.store = store
        self.engine = ReadEngine(store, threads)
        self.keys = keys

    def close(self) -> None:
        self.engine.close()
        self.store.close()


class DeltastoreFedAvg(FedAvg):
    """Flower's ``FedAvg`` whose parameters travel through deltastore stores.

    ``configure_train`` / ``configure_evaluate`` send a :class:`VersionRef` of the global
    version instead of arrays; ``aggregate_train`` reads the sites' referenced based versions,
    verifies them (SPEC §14), merges them with ``merge`` (deltastore's weighted average of the
    changes in fp32 by default, weighted by Flower's ``weighted_by_key`` metric) and publishes
    the result as the next global version. It returns the merged weights as an
    ``ArrayRecord`` (server-local: what ``Strategy.start``'s result and ``evaluate_fn`` see).

    Only the site stores named in ``sites`` are read: a reference to any other store is
    refused.

    Args:
        global_url: the global store (written by this strategy only).
        sites: site name → site store URL.
        dtype: the served dtype of the global version (e.g. ``torch.bfloat16``).
        merge: the merge function (:func:`~deltastore.federated.weighted_average`).
        storage_options / site_storage_options: for the global store / the site stores.
        reference_key: the RecordDict key of references in messages.
        results: which site results a round accepts (:class:`~deltastore.federated.ResultPolicy`,
            as the aggregator's): with ``site_keys``, a reply naming an unsigned or wrongly
            signed version of such a site is dropped (SignatureError, in :attr:`rounds`);
            compressed results are merged only with ``accept_compressed`` (else dropped,
            CompressedVersionError).
        publisher_options: more :class:`~deltastore.federated.Aggregator` keyword arguments
            (``writer_policy``, ``signing_key``, ...).
        **fedavg: ``FedAvg``'s arguments (``fraction_train``, ``min_train_nodes``,
            ``weighted_by_key``, ...).

    Raises:
        ValueError: no site, a ``site_keys`` name that is no site, or a key that does not load.
        Everything :class:`~deltastore.federated.Aggregator` raises when it opens the stores.
    """

    def __init__(self, global_url: str, sites: Mapping[str, str], *, dtype: torch.dtype | None = None,
                 merge: MergeFn = weighted_average, storage_options: Mapping[str, Any] | None = None,
                 site_storage_options: Mapping[str, Any] | None = None, reference_key: str = REFERENCE_KEY,
                 results: ResultPolicy = ResultPolicy(), publisher_options: Mapping[str, Any] | None = None, **fedavg: Any):
        super().__init__(**fedavg)
        if not sites:
            raise ValueError("DeltastoreFedAvg needs at least one site store")
        if not isinstance(results, ResultPolicy):
            raise TypeError(f"results must be a ResultPolicy, not {type(results).__name__}")
        trusted = results.trusted(sites, what="this strategy")
        self.global_url = global_url
        self.reference_key = reference_key
        self.results = results
        opts = dict(site_storage_options or {})
        self._sites: dict[str, _SiteStore] = {}
        try:
            for name, url in sorted(sites.items()):
                self._sites[url] = _SiteStore(name, open_store(url, storage_options=opts), 1, trusted.get(name))
            self.aggregator = Aggregator(global_url, {},
                                         site_stores={s.name: s.store for s in self._sites.values()}, dtype=dtype,
                                         merge=merge, storage_options=storage_options, **dict(publisher_options or {}))
        except BaseException:
            for s in self._sites.values():
                s.close()
            raise
        self.merge_fn = merge
        self.rounds: list[FlowerRound] = []
        self._open: dict[int, RoundBase] = {}

    # --- what the strategy sends ---

    def current(self) -> VersionRef:
        """The reference of the global version the strategy holds.

        Raises:
            VersionNotFoundError: nothing published yet.
        """
        history = History(self.aggregator.publisher.store)
        top = history.read_head()
        if top is None or not top[0].manifest:
            raise VersionNotFoundError(f"{self.global_url} has no global version yet")
        head = top[0]
        assert head.manifest is not None and head.manifest_sha256 is not None and head.lineage is not None
        return VersionRef(self.global_url, head.version, head.manifest, head.manifest_sha256, head.lineage)

    def _referencing(self, messages: Iterable[Message], ref: VersionRef, config: ConfigRecord) -> list[Message]:
        out = []
        for m in messages:
            m.content = RecordDict({self.configrecord_key: config, self.reference_key: ref.to_record()})
            out.append(m)
        return out

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """Publish ``arrays`` as global version 1 when the global store is empty, pin the
        round's base and send each sampled node a reference to it."""
        if self.aggregator.version == 0:
            self.aggregator.start(arrays_to_state(arrays) if len(arrays) else None)
        base = self.aggregator.open_round()
        stale = self._open.pop(server_round, None)
        if stale is not None:
            self.aggregator.close_round(stale)
        self._open[server_round] = base
        messages = super().configure_train(server_round, ArrayRecord(), config, grid)
        return self._referencing(messages, VersionRef.of_base(self.global_url, base), config)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """Send each sampled node a reference to the current global version."""
        messages = super().configure_evaluate(server_round, ArrayRecord(), config, grid)
        return self._referencing(messages, self.current(), config) if messages else []

    # --- what the strategy reads ---

    def read_reference(self, ref: VersionRef, base: RoundBase) -> BasedResult:
        """Read and verify the site version ``ref`` names, as a result of the round on ``base``.

        Raises:
            VersionNotFoundError: the store is none of the site stores, or holds no such
                version (no manifest at that key, or one of another version).
            HistoryReplacedError: the store's (or the manifest's) lineage is not the
                reference's: another history.
            IntegrityError: the manifest's SHA-256 differs from the reference's, or a segment
                or chunk fails its digest.
            SignatureError: the site has trusted keys and the version is unsigned or not
                signed by one of them.
            CompressedVersionError: the version is compressed and the strategy does not accept
                compressed results.
            WrongBaseError, SiteLayoutError: the version is not based on ``base`` (SPEC §14).
        """
        site = self._sites.get(ref.store)
        if site is None:
            raise VersionNotFoundError(f"reference to {ref.store!r}: none of this run's site stores "
                                       f"({', '.join(sorted(self._sites))}); refused")
        history = History(site.store)  # fresh: the reference's digest is checked on this read
        top = history.read_head()
        if top is None or not top[0].manifest:
            raise VersionNotFoundError(f"site {site.name} ({ref.store}) has no version; the reply names version {ref.version}")
        head = top[0]
        if head.lineage != ref.lineage:
            raise HistoryReplacedError(f"site {site.name} ({ref.store}): the reply names lineage {ref.lineage}, the "
                                       f"store holds lineage {head.lineage} (recreated or another store): refused")
        if ref.version > head.version:
            raise VersionNotFoundError(f"site {site.name} ({ref.store}): version {ref.version} does not exist "
                                       f"(latest is {head.version})")
        try:
            m = history.manifest(ref.manifest, ref.sha256)
        except NotFoundError:
            raise VersionNotFoundError(f"site {site.name} ({ref.store}): version {ref.version} has no manifest at "
                                       f"{ref.manifest!r}") from None
        if m.version != ref.version:
            raise VersionNotFoundError(f"site {site.name} ({ref.store}): manifest {ref.manifest!r} is version "
                                       f"{m.version}, not {ref.version}")
        if m.lineage != ref.lineage:
            raise HistoryReplacedError(f"site {site.name} ({ref.store}): version {m.version} is of lineage {m.lineage}, "
                                       f"not {ref.lineage}")
        if site.keys is not None:
            site.keys.verify(ref.manifest, m)  # before anything of the version is used (SPEC §14)
        return read_based(site.name, history, site.engine, ref.manifest, m, base, self.aggregator.state(),
                          accept_compressed=self.results.accept_compressed)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Verify and merge the referenced site versions; publish the next global version.

        A reply that is an error, carries no valid reference, or whose version fails a check
        is dropped (logged, recorded in :attr:`rounds`); the others are merged, in site-name
        order. With none left, nothing is published and ``(None, None)`` is returned.
        """
        base = self._open.pop(server_round, None)
        if base is None:
            raise VersionNotFoundError(f"aggregate_train for round {server_round}, which configure_train never opened")
        try:
            return self._aggregate(server_round, base, list(replies))
        finally:
            self.aggregator.close_round(base)

    def _aggregate(self, server_round: int, base: RoundBase, replies: list[Message]
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        failures: list[RoundFailure] = []
        accepted: dict[str, tuple[BasedResult, Message]] = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                failures.append(RoundFailure(node, None, "FlowerError", str(msg.error.reason)))
                continue
            site: str | None = None
            try:
                ref = reference_of(msg, key=self.reference_key)
                site = self._sites[ref.store].name if ref.store in self._sites else None
                if site is not None and site in accepted:
                    raise WrongBaseError(f"site {site}: a second reply in round {server_round} (node {node})")
                result = self.read_reference(ref, base)
            except DeltastoreError as e:
                logger.warning("round %d: node %d (site %s) dropped: %s", server_round, node, site, e)
                failures.append(RoundFailure(node, site, type(e).__name__, str(e)))
                continue
            accepted[result.site] = (result, msg)
        if not accepted:
            self.rounds.append(FlowerRound(server_round, base.version, None, (), tuple(failures), 0))
            logger.warning("round %d: no site result accepted; nothing published", server_round)
            return None, None
        names = sorted(accepted)
        results = [accepted[n][0] for n in names]
        weights = _weights([_count(accepted[n][1].content, self.weighted_by_key) for n in names])
        merged = self.aggregator.merged(base, results, weights)
        info = self.aggregator.publish_merged(base, merged, results, metadata={"flower_round": server_round})
        self.rounds.append(FlowerRound(server_round, base.version, info, tuple(names), tuple(failures),
                                       sum(r.bytes_fetched for r in results),
                                       tuple(r.info.bytes_stored for r in results)))
        logger.info("round %d on global version %d: published version %d from %s (%d dropped)", server_round,
                    base.version, info.version, ", ".join(names), len(failures))
        contents = [accepted[n][1].content for n in names]
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key) if contents else None
        return state_to_arrays(merged), metrics

    def close(self) -> None:
        """Unpin open rounds; close the aggregator and the site stores."""
        for base in self._open.values():
            self.aggregator.close_round(base)
        self._open.clear()
        self.aggregator.close()
        for s in self._sites.values():
            s.close()

    def __enter__(self) -> DeltastoreFedAvg:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InlineFedAvg(FedAvg):
    """:class:`DeltastoreFedAvg`'s rounds on Flower's own transport: full weights in
    ``ArrayRecord`` messages (raw bytes, any dtype), merged by the same ``merge`` with the same
    weights in the same site order (replies name their site, :func:`inline_reply`). An app run
    with either strategy ends with bit-identical global weights.

    Args:
        dtype: the served dtype the global weights are held in.
        merge: the merge function (as :class:`DeltastoreFedAvg`'s).
        **fedavg: ``FedAvg``'s arguments.
    """

    def __init__(self, *, dtype: torch.dtype | None = None, merge: MergeFn = weighted_average, **fedavg: Any):
        super().__init__(**fedavg)
        self.dtype = dtype
        self.merge_fn = merge
        self.failures: dict[int, tuple[RoundFailure, ...]] = {}
        self._state: dict[str, torch.Tensor] | None = None

    def _served(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.dtype is None:
            return dict(state)
        return {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in state.items()}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """Send the global weights (served dtype, raw bytes) to each sampled node."""
        if self._state is None:
            self._state = self._served(arrays_to_state(arrays))
        return super().configure_train(server_round, state_to_arrays(self._state), config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Merge the replies' weights in site order with :attr:`merge_fn`."""
        assert self._state is not None, "configure_train runs first"
        failures: list[RoundFailure] = []
        accepted: dict[str, tuple[dict[str, torch.Tensor], Message]] = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                failures.append(RoundFailure(node, None, "FlowerError", str(msg.error.reason)))
                continue
            site_rec = msg.content.config_records.get(REFERENCE_KEY)
            site = str(site_rec.get(SITE_KEY, node)) if site_rec is not None else str(node)
            try:
                if len(msg.content.array_records) != 1:
                    raise FormatError(f"node {node}: {len(msg.content.array_records)} ArrayRecords, not one")
                state = self._served(arrays_to_state(next(iter(msg.content.array_records.values()))))
                _check_layout(self._state, state, site)
            except DeltastoreError as e:
                failures.append(RoundFailure(node, site, type(e).__name__, str(e)))
                continue
            accepted[site] = (state, msg)
        self.failures[server_round] = tuple(failures)
        if not accepted:
            return None, None
        names = sorted(accepted)
        weights = _weights([_count(accepted[n][1].content, self.weighted_by_key) for n in names])
        base = self._state
        self._state = {name: self.merge_fn(name, b, [accepted[n][0][name] for n in names], weights)
                       for name, b in base.items()}
        contents = [accepted[n][1].content for n in names]
        return state_to_arrays(self._state), self.train_metrics_aggr_fn(contents, self.weighted_by_key)


def _check_layout(base: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], site: str) -> None:
    if list(base) != list(state) or any(base[n].shape != state[n].shape or base[n].dtype != state[n].dtype
                                        for n in base):
        raise InvalidStateDictError(f"site {site}: its weights have another layout than the global weights")


def inline_reply(msg: Message, state: Mapping[str, torch.Tensor], *, site: str, num_examples: int,
                 metrics: Mapping[str, float] | None = None, weighted_by_key: str = "num-examples",
                 dtype: torch.dtype | None = None) -> Message:
    """A node's reply on Flower's own transport (for :class:`InlineFedAvg`): the full weights
    (cast to ``dtype``), its site name and metrics."""
    served = {n: t.detach().to("cpu") for n, t in state.items()}
    if dtype is not None:
        served = {n: t.to(dtype) if t.is_floating_point() else t for n, t in served.items()}
    content = RecordDict({"arrays": state_to_arrays(served), REFERENCE_KEY: ConfigRecord({SITE_KEY: site}),
                          METRICS_KEY: MetricRecord({**dict(metrics or {}), weighted_by_key: num_examples})})
    return Message(content, reply_to=msg)


# --- the node side -----------------------------------------------------------------------------


class FlowerSite:
    """A Flower node's side of :class:`DeltastoreFedAvg`: pulls the referenced global version,
    publishes the node's result into its own site store, replies with a reference.

    Keep one per node process (:meth:`shared`): it holds the global version it pulled, so the
    next round's pull is a verified fast-forward of the round's change, not the whole model.

    Args:
        site_url: this node's site store (written by it only).
        name: the site's name (as the server's ``sites`` mapping names it); default the URL.
        dtype: the served dtype results are cast to (the global store's).
        storage_options / site_storage_options: for the global store / the site store.
        writer_policy: for the site store (see :class:`~deltastore.federated.Site`).
        global_store / site_store: already opened stores to use (not closed by us); the global
            one must be the store the messages reference.
        reference_key / weighted_by_key: the RecordDict key of references; the metric the
            server weighs by (Flower's ``num-examples``).
        signing_key: this site's Ed25519 private key: every result is signed (for a server
            with ``site_keys``). None: unsigned.
        compression: publish compressed results (the opt-in compressed tier, SPEC §14.1; the
            server must accept them); the error feedback is kept by this object between
            rounds. None: lossless.
        residual_path: with ``compression``, a file that keeps the error feedback across
            processes (a SuperNode runs each message in a fresh ClientApp process): read when
            it exists, rewritten after every reply.
    """

    _shared: dict[tuple[str, str], FlowerSite] = {}
    _shared_lock = threading.Lock()

    def __init__(self, site_url: str, *, name: str | None = None, dtype: torch.dtype | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 site_storage_options: Mapping[str, Any] | None = None, writer_policy: WriterPolicy = WriterPolicy(),
                 global_store: Store | None = None, site_store: Store | None = None,
                 reference_key: str = REFERENCE_KEY, weighted_by_key: str = "num-examples",
                 signing_key: Any = None, compression: Compression | None = None,
                 residual_path: str | os.PathLike[str] | None = None):
        if residual_path is not None and compression is None:
            raise ValueError("residual_path keeps the compressed tier's error feedback: pass compression= too")
        self.site_url = site_url
        self.residual_path = residual_path
        self.signing_key = signing_key
        self.compression = compression
        self.name = name or site_url
        self.dtype = dtype
        self.storage_options = dict(storage_options or {})
        self.site_storage_options = dict(site_storage_options or {})
        self.writer_policy = writer_policy
        self.reference_key = reference_key
        self.weighted_by_key = weighted_by_key
        self.bytes_down = 0  #: pack bytes the last pull read from the global store
        self._given = (global_store, site_store)
        self._site: Site | None = None
        self._site_store: Store | None = None
        self._global_url: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, site_url: str, **kwargs: Any) -> FlowerSite:
        """The process's FlowerSite for ``site_url`` (created on first use with ``kwargs``)."""
        with cls._shared_lock:
            key = (site_url, str(kwargs.get("name")))
            site = cls._shared.get(key)
            if site is None:
                site = cls._shared[key] = cls(site_url, **kwargs)
            return site

    def _site_for(self, global_url: str) -> Site:
        if self._site is not None and self._global_url == global_url:
            return self._site
        self.close()
        given_global, given_site = self._given
        if given_global is not None and given_global.url.rstrip("/") != global_url.rstrip("/"):
            raise VersionNotFoundError(f"site {self.name}: the message references {global_url}, this site follows "
                                       f"{given_global.url}")
        self._site_store = given_site or open_store(self.site_url, storage_options=self.site_storage_options)
        try:
            self._site = Site(global_url, self.site_url, dtype=self.dtype, storage_options=self.storage_options,
                              global_store=given_global, site_store=self._site_store, writer_policy=self.writer_policy,
                              signing_key=self.signing_key, compression=self.compression,
                              residual_path=self.residual_path)
        except BaseException:
            if given_site is None:
                self._site_store.close()
            self._site_store = None
            raise
        self._global_url = global_url
        return self._site

    @property
    def compressor(self) -> Compressor | None:
        """The compressed tier's state (its error feedback), once a global version was pulled;
        None for lossless results."""
        return self._site.compressor if self._site is not None else None

    def pull(self, msg: Message) -> dict[str, torch.Tensor]:
        """The tensors of the global version ``msg`` references (a copy to train on),
        verified and bit-exact.

        Raises:
            FormatError: the message carries no valid reference.
            WrongBaseError: the global store's head is another version than the referenced
                one (the server moved on, or a stale message).
            HistoryReplacedError: the global store has another lineage than the reference's.
        """
        ref = reference_of(msg, key=self.reference_key)
        with self._lock:
            site = self._site_for(ref.store)
            base, self.bytes_down = site.pull()
            if base.lineage != ref.lineage:
                raise HistoryReplacedError(f"global store {ref.store}: the message names lineage {ref.lineage}, the store "
                                           f"holds {base.lineage}")
            if (base.version, base.manifest, base.sha256) != (ref.version, ref.manifest, ref.sha256):
                raise WrongBaseError(f"global store {ref.store}: the message names version {ref.version} "
                                     f"({ref.manifest!r}), the store's head is version {base.version} ({base.manifest!r})")
            return {n: t.clone() for n, t in site.weights.items()}

    def reply(self, msg: Message, state: Mapping[str, torch.Tensor], *, num_examples: int,
              metrics: Mapping[str, float] | None = None) -> Message:
        """Publish ``state`` as a based version on the version last pulled and reply to ``msg``
        with a reference to it, ``num_examples`` (the merge weight) and ``metrics``.

        Raises:
            VersionNotFoundError: nothing pulled yet.
            SiteLayoutError: ``state`` has another layout than the global version.
            ConflictError, FencedError, StorageError: from the commit.
        """
        with self._lock:
            if self._site is None or self._site_store is None:
                raise VersionNotFoundError(f"site {self.name}: pull(msg) the global version before replying")
            info = self._site.publish_result(state, num_examples=num_examples,
                                             metadata={"flower": {"site": self.name}})
            top = History(self._site_store).read_head()
            assert top is not None
            head = top[0]
            if head.version != info.version or head.manifest != info.manifest:
                raise VersionNotFoundError(f"site {self.name} ({self.site_url}): HEAD is version {head.version} right after "
                                           f"publishing version {info.version}: another writer on this site store")
            assert head.manifest_sha256 is not None and head.lineage is not None
            ref = VersionRef(self.site_url, info.version, info.manifest, head.manifest_sha256, head.lineage)
        record = ref.to_record()
        record[SITE_KEY] = self.name
        content = RecordDict({self.reference_key: record,
                              METRICS_KEY: MetricRecord({**dict(metrics or {}), self.weighted_by_key: num_examples})})
        return Message(content, reply_to=msg)

    def close(self) -> None:
        """Release the site's threads and stores."""
        if self._site is not None:
            self._site.close()
            self._site = None
        if self._site_store is not None:
            if self._given[1] is None:
                self._site_store.close()
            self._site_store = None
        self._global_url = None
