"""Hypothesis budgets for tests whose examples are dear: a fraction of the loaded profile's.

The profiles themselves (``default``, ``ci``, ``nightly``) are registered in tests/conftest.py,
which loads one before any test module is imported.
"""

from __future__ import annotations

from hypothesis import settings


def examples(fraction: float) -> int:
    """``fraction`` of the loaded profile's ``max_examples``, at least 1."""
    return max(1, round(settings().max_examples * fraction))
