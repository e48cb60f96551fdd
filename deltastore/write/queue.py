"""Asynchronous publishing: snapshot now, encode/upload/commit in the background, in order.

A trainer calls :meth:`Publisher.publish_async`, which takes a host snapshot of the state
(in the served dtype) before returning, so the caller may modify its tensors right away. One
background thread hands the snapshots to the synchronous commit path one after another; the
caller gets a :class:`~concurrent.futures.Future` per snapshot.

When the store is slower than training, a policy applies:

- ``"block"``: at most ``max_pending`` snapshots wait; the next call blocks until one starts
  (before it takes its own snapshot, so at most ``max_pending + 1`` snapshots are alive).
- ``"latest"``: a newer snapshot replaces the newest *waiting* one (never the one being
  published). The replaced snapshot is never published and its Future raises
  :class:`~deltastore.errors.VersionSkippedError`.

A failure in the background (conflict, fencing, storage error) resolves that snapshot's
Future with the error, and the next :meth:`PublishQueue.submit`, :meth:`PublishQueue.flush`
or :meth:`PublishQueue.close` raises it once: a failure is never silent.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from deltastore.errors import DeltastoreError, StorageError, VersionSkippedError
from deltastore.write.policy import AsyncPolicy

logger = logging.getLogger(__name__)


def snapshot(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A host copy of ``state`` that the caller's later writes cannot reach.

    Floating tensors are cast to ``dtype`` when one is given (e.g. bf16 served from fp32
    masters); other tensors keep theirs. Device tensors are copied into pinned host memory
    with non-blocking copies and one synchronization at the end, so the copy overlaps itself.

    Args:
        state: name → tensor, already validated (dense, contiguous).
        dtype: the served dtype of floating tensors, or None to keep each tensor's dtype.

    Returns:
        A new dict of contiguous CPU tensors sharing no memory with ``state``.
    """
    out: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, t in state.items():
        t = t.detach()
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.device.type == "cpu":
            out[name] = t.to(dtype=target, copy=True).contiguous()
            continue
        src = t if t.dtype == target else t.to(dtype=target)  # cast on the device: fewer bytes to move
        host = torch.empty(src.shape, dtype=target, pin_memory=torch.cuda.is_available())
        host.copy_(src, non_blocking=True)
        devices.add(t.device)
        out[name] = host
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return out


@dataclass
class _Item:
    state: dict[str, torch.Tensor]
    kwargs: dict[str, Any]
    future: Future = field(default_factory=Future)


class PublishQueue:
    """Runs ``publish_fn`` on snapshots in submission order on one background thread.

    Args:
        publish_fn: the synchronous commit, called as ``publish_fn(state, **kwargs)``; returns
            the committed version's info.
        policy: the :class:`~deltastore.write.policy.AsyncPolicy`: ``"block"`` or ``"latest"``
            (see the module docstring) and ``max_pending``, the snapshots that may wait behind
            the one being published.
        name: used in the thread's name and in messages (e.g. the store URL).
        sticky: keyword arguments that a snapshot inherits from the waiting one it replaces
            under ``"latest"`` when that one's value is true (the Publisher passes
            ``("anchor",)``, so a requested anchor or layout change survives coalescing).
    """

    def __init__(self, publish_fn: Callable[..., Any], policy: AsyncPolicy = AsyncPolicy(), *,
                 name: str = "deltastore", sticky: tuple[str, ...] = ()):
        self._publish = publish_fn
        self.policy = policy.mode
        self.max_pending = policy.max_pending
        self.name = name
        self.sticky = sticky
        self._reserved = 0  # places taken by callers still copying their snapshot
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"deltastore-publish[{name}]", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Snapshots submitted and not yet finished (being taken, waiting, being published)."""
        with self._cond:
            return self._reserved + len(self._queue) + int(self._busy)

    def submit(self, state: dict[str, torch.Tensor], **kwargs: Any) -> Future:
        """Queue one snapshot (the queue takes ownership of ``state``).

        Raises:
            DeltastoreError (or the builtin it was): an earlier background publish failed;
                raised once, here or in flush()/close(), whichever comes first.
            StorageError: the queue is closed.
        """
        return self.submit_snapshot(lambda: state, **kwargs)

    def submit_snapshot(self, take: Callable[[], dict[str, torch.Tensor]], **kwargs: Any) -> Future:
        """Make room by the policy, *then* call ``take()`` for the snapshot, and queue it.

        Taking the snapshot only once it has a place keeps at most ``max_pending + 1``
        snapshots alive (the one being published and those waiting), counting the one being
        taken: under ``"block"`` the call waits before copying anything, under ``"latest"``
        the replaced snapshot is freed before the new one is taken. ``take`` runs in the
        caller's thread without the queue's lock; if it raises, nothing is queued.

        Raises:
            as :meth:`submit`, and whatever ``take`` raises.
        """
        skipped: list[_Item] = []
        with self._cond:
            self._check_open()
            if self.policy == "block":
                while len(self._queue) + self._reserved >= self.max_pending and not self._closed:
                    self._cond.wait()
                self._check_open()
            else:
                while len(self._queue) + self._reserved >= self.max_pending:
                    if self._queue:
                        skipped.append(self._queue.pop())  # the newest waiting one: older than ours
                    else:
                        self._cond.wait()  # other callers are taking snapshots into every place
                        self._check_open()
            for old in skipped:
                for key in self.sticky:
                    if old.kwargs.get(key):
                        kwargs[key] = old.kwargs[key]  # e.g. a requested anchor is not lost by coalescing
            self._reserved += 1
        for old in skipped:
            old.state.clear()  # freed before the new snapshot is taken
        try:
            state = take()
        except BaseException as e:
            with self._cond:
                self._reserved -= 1
                self._cond.notify_all()
            for old in skipped:
                self._skip(old, f"a newer snapshot was to replace it, but taking that one failed ({e!r})")
            raise
        for old in skipped:
            self._skip(old, "a newer one replaced it while the store was busy")
        item = _Item(state, kwargs)
        with self._cond:
            self._reserved -= 1
            self._queue.append(item)
            self._cond.notify_all()
        return item.future

    def _check_open(self) -> None:
        """Raise an unreported failure, or StorageError if closed. Call with the lock held."""
        self._raise_error()
        if self._closed:
            raise StorageError(f"the publish queue of {self.name} is closed")

    def _skip(self, item: _Item, why: str) -> None:
        step = item.kwargs.get("step")
        logger.info("publish of step %s to %s skipped (policy 'latest'): %s", step, self.name, why)
        item.state.clear()
        item.future.set_exception(VersionSkippedError(
            f"the snapshot of step {step} was not published to {self.name}: {why} (policy 'latest')"
        ))

    def flush(self) -> None:
        """Wait until every submitted snapshot is published (or failed); raise a failure."""
        with self._cond:
            while self._queue or self._busy or self._reserved:
                self._cond.wait()
            self._raise_error()

    def close(self, *, raise_errors: bool = True) -> None:
        """Publish what is queued, stop the thread, then raise an unreported failure. Idempotent."""
        with self._cond:
            already = self._closed
            self._closed = True
            self._cond.notify_all()
        if not already:
            self._thread.join()
        if raise_errors:
            with self._cond:
                self._raise_error()

    # --- background ---------------------------------------------------------------------

    def _raise_error(self) -> None:
        """Raise (once) the first unreported background failure. Call with the lock held."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and (not self._closed or self._reserved):
                    self._cond.wait()  # after close, a snapshot still being taken is published too
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy = True
                self._cond.notify_all()
            try:
                result = self._publish(item.state, **item.kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the Future
                if not isinstance(e, DeltastoreError):
                    logger.exception("background publish to %s failed", self.name)
                else:
                    logger.error("background publish to %s failed: %s", self.name, e)
                item.future.set_exception(e)
                with self._cond:
                    if self._error is None:
                        self._error = e
            else:
                item.future.set_result(result)
            finally:
                item.state.clear()  # the snapshot's memory goes now, not when the Future does
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
