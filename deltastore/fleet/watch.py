"""What a follow loop tells its operator: phase spans, CPU-phase deadlines and metrics, in one object.

:func:`deltastore.read.follow.follow` holds one :class:`FollowWatch` and calls it a few times
per poll: :meth:`FollowWatch.phase` around a phase (an OpenTelemetry span where
``opentelemetry-api`` is installed; for ``stage`` and ``apply``, a
:class:`~deltastore.fleet.deadlines.Watchdog` that reports an overrun), :meth:`FollowWatch.seen`
after each poll, :meth:`FollowWatch.failed` for each error it retries. The network phases'
deadlines are the store's (:class:`~deltastore.fleet.deadlines.DeadlineStore`); their errors
reach :meth:`FollowWatch.failed` like any storage error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from deltastore.errors import DeadlineExceededError
from deltastore.fleet import tracing
from deltastore.fleet.deadlines import Deadlines, Watchdog


class FollowWatch:
    """Spans, CPU-phase deadlines and (optionally) metrics of one follow loop.

    Build one with :meth:`start`; :meth:`close` it when the loop ends.

    Args:
        deadlines: the deadlines (None: CPU phases are not watched).
        model_bytes: the target's bytes (decode and apply deadlines grow with them).
        metrics: a :class:`~deltastore.fleet.metrics.FollowerMetrics` (None: no metrics).
        exporter: the :class:`~deltastore.fleet.metrics.Exporter` serving them (closed by :meth:`close`).
    """

    def __init__(self, deadlines: Deadlines | None = None, model_bytes: int = 0, metrics: Any = None,
                 exporter: Any = None):
        self.deadlines = deadlines
        self.model_bytes = model_bytes
        self.metrics = metrics
        self.exporter = exporter
        self._dog = Watchdog(self._late) if deadlines is not None else None

    @classmethod
    def start(cls, url: str, tensors: Mapping[str, torch.Tensor], *, metrics_port: int | None,
              deadlines: Deadlines | None) -> FollowWatch:
        """A watch for a loop following ``url`` into ``tensors``; with ``metrics_port``, its
        metrics served there (before anything is fetched).

        Raises:
            MetricsUnavailableError: ``metrics_port`` without ``prometheus-client``.
            MetricsPortInUseError: ``metrics_port`` cannot be listened on.
        """
        metrics = exporter = None
        if metrics_port is not None:
            from deltastore.fleet.metrics import Exporter, FollowerMetrics

            metrics = FollowerMetrics(url)
            exporter = Exporter(metrics.registry, metrics_port)
        model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return cls(deadlines, model_bytes, metrics, exporter)

    @property
    def port(self) -> int | None:
        """The port metrics are served on (None: no metrics)."""
        return None if self.exporter is None else self.exporter.port

    @contextlib.contextmanager
    def phase(self, name: str, version: int | None = None) -> Iterator[None]:
        """The ``with`` block as phase ``name`` (``poll``, ``stage``, ``apply``) of ``version``:
        a span, and for ``stage``/``apply`` a watchdog at their deadline."""
        with tracing.span(name, version=version):
            if self._dog is None or name not in ("stage", "apply"):
                yield
                return
            assert self.deadlines is not None
            d = self.deadlines
            # a stage waits on its fetches: their stall is raised by the store, its own reported here
            seconds = d.decode_s(self.model_bytes) if name == "stage" else d.apply_s(self.model_bytes)
            with self._dog.phase("decode" if name == "stage" else "apply", f"version {version}", seconds):
                yield

    def seen(self, reader: Any, rec: Any) -> None:
        """After a poll that went through: HEAD's and the held version, and the record of a
        version applied (None: none)."""
        if self.metrics is None:
            return
        head = reader.head
        self.metrics.polled(None if head is None else head.version, reader.version)
        if rec is not None:
            self.metrics.applied(rec)

    def failed(self, e: BaseException) -> None:
        """An error the loop retries."""
        if self.metrics is not None:
            self.metrics.failed(e)

    def _late(self, e: DeadlineExceededError) -> None:
        if self.metrics is not None:
            self.metrics.late(e)

    def close(self) -> None:
        """Stop the watchdog and the exporter (idempotent)."""
        if self._dog is not None:
            self._dog.close()
        if self.exporter is not None:
            self.exporter.close()


#: A watch that records spans only: for a single step outside a follow loop.
IDLE = FollowWatch()

__all__ = ["IDLE", "FollowWatch"]
