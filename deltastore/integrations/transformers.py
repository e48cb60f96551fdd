"""A ``transformers.Trainer`` callback that publishes the model to a deltastore as it trains.

``DeltastoreCallback`` publishes on ``on_step_end``: the trainer calls it once per optimizer
step, after ``optimizer.step()``, the scheduler step and ``zero_grad``, and only for steps that
happened. (``on_optimizer_step`` fires before the scheduler step and also for steps a
gradient-scaler skips, so it is not used.) Only the main process (``state.is_world_process_zero``)
publishes; the others do nothing.

Publishing is asynchronous (``Publisher.publish_async``): the step waits only for a host copy
of the weights in the served dtype; upload and commit run in the background, and a background
failure is raised by the next publish or at train end, once.

The weights published are ``model.state_dict()`` of the model the trainer passes (unwrapped),
with tied weights once: an alias such as ``lm_head.weight`` (tied to the input embeddings) is
left out and recorded in the version's metadata as ``tied_weights`` (alias → published name),
the layout ``Publisher.publish(model)`` and the TRL backend write for the same model. A worker
follows it into its own model (``Subscriber.pull_into(model)``, ``follow(model)``: the alias
shares memory with the tensor it is tied to, so it is updated through it), or loads it with
``model.load_state_dict(weights, strict=False)``, which keeps the tie. Under
FSDP or DeepSpeed ZeRO-3 the main process does not hold the full weights: use the TRL backend
(which drains TRL's gathered stream) or gather them first.

Example::

    from transformers import Trainer
    from deltastore.integrations.transformers import DeltastoreCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[DeltastoreCallback("s3://bucket/run-42", every_n_steps=1)])
    trainer.train()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from deltastore.integrations._common import clean_name, tied_weights_of
from deltastore.layout.tied import TIED_WEIGHTS_KEY

logger = logging.getLogger(__name__)


def _callback_base() -> type:
    """transformers' TrainerCallback (imported here, when this module is used)."""
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise ImportError(
            f"deltastore.integrations.transformers needs transformers ({e}): pip install 'deltastore-weights[transformers]'"
        ) from e
    return TrainerCallback


class DeltastoreCallback(_callback_base()):  # type: ignore[misc]
    """Publish the model every ``every_n_steps`` optimizer steps (``on_step_end``), rank 0 only.

    Args:
        url: the store (see :class:`deltastore.Publisher`).
        every_n_steps: publish when ``state.global_step`` is a multiple of this (≥ 1).
        dtype: the served dtype of floating tensors (default bfloat16; None keeps the model's).
        storage_options: passed to the storage backend.
        metadata: JSON-serializable metadata added to every version; ``global_step`` and
            ``epoch`` are added, and ``tied_weights`` when the model has any.
        publish_on_train_end: also publish the final weights at train end when the last step
            was not published (default True).
        publisher_kwargs: further :class:`deltastore.Publisher` arguments.

    Attributes:
        futures: one Future of :class:`deltastore.VersionInfo` per version queued, in order.
    """

    def __init__(
        self,
        url: str,
        every_n_steps: int = 1,
        dtype: torch.dtype | None = torch.bfloat16,
        *,
        storage_options: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        publish_on_train_end: bool = True,
        **publisher_kwargs: Any,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.url = url
        self.every_n_steps = every_n_steps
        self.dtype = dtype
        self.storage_options = dict(storage_options or {})
        self.metadata = dict(metadata or {})
        self.publish_on_train_end = publish_on_train_end
        self.publisher_kwargs = publisher_kwargs
        self.publisher: Any = None
        self.futures: list[Future[Any]] = []
        self._last_published: int | None = None
        self._tied: dict[str, str] | None = None

    def _open(self) -> Any:
        if self.publisher is None:
            from deltastore.write.publisher import Publisher  # the write path, loaded when first used

            self.publisher = Publisher(self.url, storage_options=self.storage_options, dtype=self.dtype, **self.publisher_kwargs)
        return self.publisher

    def _publish(self, state: Any, model: torch.nn.Module | None) -> None:
        if model is None:
            raise ValueError("DeltastoreCallback needs the model: the Trainer passes it to callbacks as model=")
        if self._tied is None:
            self._tied = tied_weights_of(model)
        weights = {clean_name(n): t for n, t in model.state_dict().items()}
        weights = {n: t for n, t in weights.items() if n not in self._tied}
        meta = {**self.metadata, "global_step": int(state.global_step), "epoch": state.epoch}
        if self._tied:
            meta[TIED_WEIGHTS_KEY] = self._tied
        future = self._open().publish_async(weights, step=int(state.global_step), metadata=meta)
        self.futures.append(future)
        self._last_published = int(state.global_step)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self._open()

    def on_step_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and state.global_step % self.every_n_steps == 0:
            self._publish(state, model)

    def on_train_end(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        """Publish the last step if it was not, then wait for every version and close
        (raises a background failure not yet reported)."""
        if not state.is_world_process_zero:
            return
        try:
            if self.publish_on_train_end and model is not None and state.global_step != self._last_published:
                self._publish(state, model)
        finally:
            pub, self.publisher = self.publisher, None
            if pub is not None:
                pub.close()
