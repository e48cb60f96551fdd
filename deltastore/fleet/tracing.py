"""OpenTelemetry spans for the phases of moving a version, where ``opentelemetry-api`` is installed.

Spans are named ``deltastore.<phase>``: ``poll`` (a look at HEAD and the manifest it names),
``stage`` (fetching, checking and decoding a version before the pause; its ``fetch_s`` and
``decode_s`` attributes split it, since the two overlap), ``apply`` (the pause) and ``commit``
(a publisher's version, from snapshot to HEAD). Without the package, or without an SDK
configured by the application, every span is a no-op: deltastore never configures exporters,
that is the application's choice (``opentelemetry-sdk``, an OTLP exporter).

Example::

    with span("poll", url=url) as s:
        ...
        set_attributes(s, version=7)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

#: The instrumentation scope of every span.
TRACER_NAME = "deltastore"


@functools.lru_cache(maxsize=1)
def _tracer() -> Any:
    """The OpenTelemetry tracer, or None when ``opentelemetry-api`` is not installed (looked up once)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer(TRACER_NAME)


def available() -> bool:
    """True when ``opentelemetry-api`` is installed (spans are then recorded if an SDK is set up)."""
    return _tracer() is not None


@contextlib.contextmanager
def span(phase: str, **attributes: Any) -> Iterator[Any]:
    """A span ``deltastore.<phase>`` around the ``with`` block (None where tracing is absent).

    Args:
        phase: the phase's name (``poll``, ``stage``, ``apply``, ``commit``).
        attributes: span attributes (str, bool, int or float; None values are left out).

    Returns:
        A context manager yielding the span, or None without ``opentelemetry-api``.
    """
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(f"deltastore.{phase}", attributes=_clean(attributes)) as s:
        yield s


def set_attributes(s: Any, **attributes: Any) -> None:
    """Set attributes on a span from :func:`span` (nothing when it is None)."""
    if s is not None:
        s.set_attributes(_clean(attributes))


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"deltastore.{k}": v for k, v in attributes.items() if v is not None}


__all__ = ["TRACER_NAME", "available", "set_attributes", "span"]
