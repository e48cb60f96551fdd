"""A federated site (design 009): one round = fast-forward to the global version, train (user
code), publish the local result as a based version into the site's own store."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deltastore.errors import VersionNotFoundError
from deltastore.federated.based import BasedWriter, RoundBase, specs_of
from deltastore.federated.compress import Compression, Compressor
from deltastore.format.history import History, VersionInfo
from deltastore.format.models import Head
from deltastore.read.subscriber import Subscriber
from deltastore.storage import open_store
from deltastore.storage.base import Store
from deltastore.write.policy import WriterPolicy, check_policy

logger = logging.getLogger(__name__)

#: What a site's training callback gets and returns: the global version's tensors (a copy the
#: callback may modify or load into its model) in, the trained state dict out.
TrainFn = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class SiteRound:
    """One round of one site.

    Attributes:
        base: the global version trained on. published: the site version written.
        bytes_down: pack bytes read from the global store by this round's pull.
        bytes_up: pack bytes written to the site store (the version's ``bytes_stored``).
    """

    base: int
    published: VersionInfo
    bytes_down: int
    bytes_up: int


class Site:
    """One site of a federated run: follows the global store, writes its own site store.

    The site keeps the global version it pulled (in the served dtype) as its own copy, so the
    next round's pull is a verified fast-forward of a few deltas; training works on a copy.

    Args:
        global_url: the global store (read only).
        site_url: this site's store (written only by this site).
        dtype: the served dtype results are cast to (the global store's; default: as trained).
        storage_options / site_storage_options: for each store.
        global_store / site_store: already opened stores to use (not closed by us).
        writer_policy: for the site store (see :class:`~deltastore.federated.BasedWriter`:
            ``writer_id``, ``takeover``, ``allow_unsafe_store``, ``max_attempt_s``); its
            ``threads`` are the read and encode threads.
        signing_key: this site's Ed25519 private key (key object, PEM bytes or path): every
            result is signed, for an aggregator configured with the site's public keys
            (``ResultPolicy(site_keys=...)``, design 009 D9). None: unsigned results.
        compression: publish compressed results (the opt-in compressed tier, SPEC §14.1): the
            top-k of each tensor's change, quantized, with error feedback kept by this site
            (:attr:`compressor`) between rounds. The aggregator must accept compressed results.
            None (the default): lossless results.
        residual_path: with ``compression``, a file that keeps the error feedback across
            restarts: read on open when it exists, rewritten (atomically) after every result
            published.

    Example (a transformers Trainer)::

        site = Site("s3://b/run/global", "s3://b/run/sites/3", dtype=torch.bfloat16)
        def train(weights):
            model.load_state_dict(weights)      # fp32 masters from the bf16 global version
            trainer.train()
            return model.state_dict()
        rnd = site.run_round(train, num_examples=len(dataset))
    """

    def __init__(self, global_url: str, site_url: str, *, dtype: torch.dtype | None = None,
                 storage_options: Mapping[str, Any] | None = None, site_storage_options: Mapping[str, Any] | None = None,
                 global_store: Store | None = None, site_store: Store | None = None,
                 writer_policy: WriterPolicy = WriterPolicy(), signing_key: Any = None,
                 compression: Compression | None = None, residual_path: str | os.PathLike[str] | None = None):
        check_policy(writer_policy, WriterPolicy, "writer_policy")
        if residual_path is not None and compression is None:
            raise ValueError("residual_path keeps the compressed tier's error feedback: pass compression= too")
        #: the compressed tier's state (its residual), None for lossless results
        self.compressor = Compressor(compression) if compression is not None else None
        self.residual_path = residual_path
        if self.compressor is not None and residual_path is not None and os.path.exists(residual_path):
            self.compressor.load(residual_path)
        self.dtype = dtype
        self._sub = Subscriber(global_url, storage_options=storage_options, store=global_store, threads=writer_policy.threads)
        self._site_store = site_store if site_store is not None else open_store(site_url, storage_options=dict(site_storage_options or {}))
        self._owns_site_store = site_store is None
        try:
            self._writer = BasedWriter(self._site_store, writer_policy=writer_policy, signing_key=signing_key)
        except BaseException:
            self._sub.close()
            if self._owns_site_store:
                self._site_store.close()
            raise
        self._history = History(self._sub.store)
        self._weights: dict[str, torch.Tensor] | None = None
        self._base: RoundBase | None = None

    @property
    def base(self) -> RoundBase | None:
        """The global version this site holds (after :meth:`pull`)."""
        return self._base

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The global version's tensors as pulled (verified; do not modify)."""
        if self._weights is None:
            raise VersionNotFoundError("the site has pulled no global version yet")
        return self._weights

    def pull(self, version: int | None = None) -> tuple[RoundBase, int]:
        """Fast-forward to the global HEAD's version (or to ``version``, e.g. the base a
        training run started from). Returns the base and the pack bytes read.

        Raises:
            VersionNotFoundError: the global store is empty, or has no such version on HEAD's chain.
            VersionCollectedError, IntegrityError, StorageError: from the pull.
        """
        before = self._sub.bytes_fetched
        top = self._history.read_head()
        if top is None or not top[0].manifest:
            raise VersionNotFoundError(f"{self._sub.url} has no global version yet")
        head = top[0]
        if version is None or version == head.version:
            if self._weights is None or (self._base is not None and self._base.version > head.version):
                self._weights = self._sub.pull(head.version)
            else:
                self._sub.pull_into(self._weights, head.version)
            _, m = self._history.head_manifest(head)  # type: ignore[misc]
            assert m.layout is not None
            self._base = RoundBase.of(head, self._history.layout(m.layout))
        else:
            if not 1 <= version <= head.version:
                raise VersionNotFoundError(f"{self._sub.url} has versions 1..{head.version}, not {version}")
            self._weights = self._sub.pull(version)  # verified; an older version is a fresh pull
            self._base = self._base_at(head, version)
        return self._base, self._sub.bytes_fetched - before

    def _base_at(self, head: Head, version: int) -> RoundBase:
        """The RoundBase of ``version`` on HEAD's chain (its manifest key names its SHA-256)."""
        top = self._history.head_manifest(head)
        assert top is not None
        key, m = top
        while m.version > version:
            key, m = self._history.parent(key, m)
        assert m.layout is not None and head.lineage is not None
        sha = key.rsplit("-", 1)[1].split(".", 1)[0]
        return RoundBase(m.version, key, sha, head.lineage, specs_of(self._history.layout(m.layout), what=key))

    def global_version(self) -> int:
        """The global HEAD's version (0 while the global store is empty): one small read."""
        top = self._history.read_head()
        return 0 if top is None or not top[0].manifest else top[0].version

    def last_base(self) -> int:
        """The global version this site's latest result is based on (0 before its first):
        what a restarted site has already answered."""
        history = History(self._site_store)
        top = history.read_head()
        if top is None or not top[0].manifest:
            return 0
        got = history.head_manifest(top[0])
        return 0 if got is None or got[1].base is None else got[1].base.version

    def publish_result(self, state: Mapping[str, torch.Tensor], *, num_examples: int | None = None,
                       step: int | None = None, metadata: Mapping[str, Any] | None = None) -> VersionInfo:
        """Publish ``state`` (cast to the served dtype) as a based version on the version last
        pulled. ``num_examples`` is the site's weight in the default merge. With
        ``compression``, what is published is the compressed change of ``state`` (as trained,
        before any cast) on the base, and the site keeps the error."""
        if self._base is None or self._weights is None:
            raise VersionNotFoundError("pull() the global version before publishing a result on it")
        served = {n: t.detach().to("cpu") for n, t in state.items()}
        c = self.compressor
        kept = dict(c.residual) if c is not None else {}  # its tensors are replaced, never changed in place
        if c is not None:
            served = c.compress(served, self._weights)
        elif self.dtype is not None:
            served = {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in served.items()}
        meta = dict(metadata or {})
        if num_examples is not None:
            meta["num_examples"] = int(num_examples)
        try:
            info = self._writer.publish(served, self._base, self._weights, step=step, metadata=meta,
                                        compression=c.compression.ref() if c is not None else None)
        except BaseException:
            if c is not None:
                c.residual = kept  # nothing was sent: the next result sends it all again
            raise
        if c is not None and self.residual_path is not None:
            c.save(self.residual_path)
        return info

    def run_round(self, train: TrainFn, *, num_examples: int | None = None, step: int | None = None,
                  metadata: Mapping[str, Any] | None = None) -> SiteRound:
        """Pull the global version, ``train`` on a copy of it, publish the result (based)."""
        base, down = self.pull()
        result = train({n: t.clone() for n, t in self.weights.items()})
        info = self.publish_result(result, num_examples=num_examples, step=step, metadata=metadata)
        return SiteRound(base.version, info, down, info.bytes_stored)

    def close(self) -> None:
        """Release threads and the stores this site opened."""
        self._writer.close()
        self._sub.close()
        if self._owns_site_store:
            self._site_store.close()

    def __enter__(self) -> Site:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
