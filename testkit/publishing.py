"""Publishing helpers for tests of serving streams (SPEC §15)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def publish_in_turn(url: str, *runs: tuple[Sequence[Any], Sequence[Mapping[str, torch.Tensor]]], **options: Any) -> None:
    """Publish each run's states to ``url`` in turn, each run by a Publisher declaring that run's
    formats (empty: none) and taking ``options``: a trainer that changes the formats it serves."""
    from deltastore import Publisher

    for formats, states in runs:
        with Publisher(url, formats=formats, **options) as pub:
            for s in states:
                pub.publish(s)
