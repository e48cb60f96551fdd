"""A TRL weight-transfer backend: ``AsyncGRPOTrainer`` publishes its policy through deltastore.

TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``, trl ≥ 1.16) hands weights to
any object implementing its ``WeightTransferProtocol``. What TRL does, read from its source
(``AsyncGRPOTrainer._sync_weight_merged``), and what this backend does about it:

- Only the main process (rank 0) calls the backend; every rank builds it, so the constructor
  opens nothing (the store is opened by ``init_weight_transfer`` on rank 0).
- ``send_weights`` receives a generator of ``(name, tensor)`` in the training dtype (fp32 by
  default), one parameter at a time. Under FSDP2 each item is an all-gather (``full_tensor()``)
  that the other ranks run in lockstep, draining the same generator: rank 0 must drain it to
  the end even when something fails, or every other rank hangs in a collective. Each tensor is
  cast to the served ``dtype`` and copied to the host as it arrives, so the trainer never holds
  the model in the training dtype a second time; the copies are handed to
  ``Publisher.publish_async(copy=False)`` without a further copy (memory: the publisher's
  reference, plus one copy per version queued or being published).
- Names come from ``named_parameters()``: tied weights appear once (``lm_head.weight`` tied to
  the embeddings is absent) and wrapper prefixes are stripped. The backend strips the wrapper
  prefixes TRL leaves (torch.compile's ``_orig_mod.``), and records ``tied_weights`` (alias →
  published name) in each version's metadata when told (``tied_weights=`` or ``model=``). That
  is the layout ``Publisher.publish(model)`` and ``DeltastoreCallback`` write for the same
  model; a worker follows it into its own model (``Subscriber.follow(model)``), whose tied
  alias is updated through the tensor it shares memory with, recorded or not.
- TRL counts ``model_version`` itself (0 before the cold sync at train begin, +1 after each
  sync) and does not pass it: the backend counts sends the same way (or asks
  ``model_version_fn``) and records ``model_version`` in the metadata and as the step, so
  rollouts can be tagged with the version a worker serves.
- The upload runs in the background (``publish_async``): the trainer waits only for the host
  copy. A background failure (a conflict, a fenced publisher, a storage error) is raised by the
  next ``send_weights`` (after draining) or by ``destroy``, once.
- ``pause``/``resume`` do nothing: workers stage each version while serving and pause only for
  their own swap (``Subscriber.follow(pause=...)``).

Example::

    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from deltastore.integrations.trl import DeltastoreWeightTransfer

    trainer = AsyncGRPOTrainer(model=path, args=config, train_dataset=ds, reward_funcs=reward,
                               weight_transfer=DeltastoreWeightTransfer("s3://bucket/run-42"))
    trainer.train()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from deltastore.errors import DeltastoreError
from deltastore.integrations._common import clean_name, global_rank, served_copy, tied_weights_of
from deltastore.layout.tied import TIED_WEIGHTS_KEY

logger = logging.getLogger(__name__)


class DeltastoreWeightTransfer:
    """A ``trl.experimental.async_grpo.WeightTransferProtocol`` that publishes to a deltastore.

    Args:
        url: the store (``s3://bucket/prefix``, a local path, ...; see :class:`deltastore.Publisher`).
        dtype: the served dtype of floating tensors (default bfloat16; None keeps the training dtype).
            At RL learning rates most fp32 updates round away in bf16, so a bf16 delta is ~20×
            smaller than an fp32 one.
        storage_options: passed to the storage backend (endpoint, credentials, ...).
        metadata: JSON-serializable metadata added to every version (e.g. the run's config).
        model: the trained model, to find tied weights (:func:`tied_weights_of`); or pass
            ``tied_weights`` (alias → published name) directly.
        tied_weights: recorded as ``metadata["tied_weights"]`` in every version.
        model_version_fn: returns TRL's ``trainer.model_version`` before a sync (e.g.
            ``lambda: trainer.model_version``), for a trainer resumed from a checkpoint;
            default: count the syncs of this backend from ``start_version``.
        start_version: TRL's ``model_version`` before the first sync (default 0).
        publisher_kwargs: further :class:`deltastore.Publisher` arguments (``async_policy``,
            ``anchor_policy``, ``writer_policy``, ``signing_key``, ``compact``, ...).

    Attributes:
        futures: one Future of :class:`deltastore.VersionInfo` per version sent, in order.
    """

    def __init__(
        self,
        url: str,
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        storage_options: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        model: torch.nn.Module | None = None,
        tied_weights: Mapping[str, str] | None = None,
        model_version_fn: Callable[[], int] | None = None,
        start_version: int = 0,
        **publisher_kwargs: Any,
    ):
        self.url = url
        self.dtype = dtype
        self.storage_options = dict(storage_options or {})
        self.metadata = dict(metadata or {})
        tied = dict(tied_weights or {})
        if model is not None:
            tied = {**tied_weights_of(model), **tied}
        if tied:
            self.metadata[TIED_WEIGHTS_KEY] = tied
        self.model_version_fn = model_version_fn
        self.model_version = start_version  # TRL's count after the last sync we saw
        self.publisher_kwargs = publisher_kwargs
        self.publisher: Any = None  # a deltastore.Publisher, opened on rank 0 by init_weight_transfer
        self.futures: list[Future[Any]] = []

    # --- WeightTransferProtocol -----------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Open the store and claim it as its writer (rank 0 only; other ranks hold nothing)."""
        if self.publisher is not None or global_rank() != 0:
            return
        from deltastore.write.publisher import Publisher  # the write path, loaded only on the trainer

        self.publisher = Publisher(self.url, storage_options=self.storage_options, dtype=self.dtype, **self.publisher_kwargs)
        logger.info("publishing TRL weight syncs to %s (served dtype %s)", self.url, self.dtype)

    def pause(self) -> None:
        """Nothing to pause: workers stage a version while serving and pause only for their swap."""

    def resume(self) -> None:
        """Nothing to resume (see :meth:`pause`)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Drain ``iterator`` to the end, then queue the weights it gave as the next version.

        Each tensor is copied to the host in the served dtype as it arrives. If anything fails
        (a bad tensor, a closed publisher, an earlier background failure), the rest of the
        iterator is still drained (the other ranks are in lockstep with it), nothing is
        published, and the error is raised afterwards.

        Raises:
            DeltastoreError: an earlier version failed in the background (raised once), or this
                one could not be queued (InvalidStateDictError, LayoutMismatchError, ...).
        """
        version = (self.model_version_fn() if self.model_version_fn is not None else self.model_version) + 1
        state: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        for name, tensor in iterator:
            if error is not None:
                continue  # keep draining: the other ranks gather in lockstep with this generator
            try:
                name = clean_name(name)
                if name in state:
                    raise DeltastoreError(f"TRL sent tensor {name!r} twice in sync {version} (after removing wrapper prefixes)")
                state[name] = served_copy(tensor, self.dtype)
            except Exception as e:  # noqa: BLE001 - raised after draining
                error = e
                state.clear()
        if error is not None:
            raise error
        if global_rank() != 0:
            self.model_version = version
            return  # not the backend's rank: drained only
        if self.publisher is None:
            self.init_weight_transfer()
        meta = {**self.metadata, "model_version": version}
        future = self.publisher.publish_async(state, step=version, metadata=meta, copy=False)
        del state  # the publisher owns the copies now
        future.add_done_callback(_log_result)
        self.futures.append(future)
        self.model_version = version

    def destroy(self) -> None:
        """Wait for every queued version and close the publisher (idempotent).

        Raises:
            DeltastoreError: a version failed in the background and was not yet reported.
        """
        pub, self.publisher = self.publisher, None
        if pub is not None:
            pub.close()

    # --- beyond the protocol --------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every version sent so far is committed (raises a background failure once)."""
        if self.publisher is not None:
            self.publisher.flush()


def _log_result(future: Future[Any]) -> None:
    e = future.exception()
    if e is not None:
        logger.error("a TRL weight sync failed to publish: %s: %s (raised by the next send_weights)", type(e).__name__, e)
    else:
        info = future.result()
        logger.info("published model_version %s as version %d (%s, %d bytes)",
                    info.metadata.get("model_version"), info.version, info.kind, info.bytes_stored)
