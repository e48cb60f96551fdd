"""Which tensors (and rows) a fast-forward changed, for engines that reload only those.

A fast-forward knows what it writes from its plan: the chunks it patches or replaces, as
element spans ``[start, stop)`` of each flattened tensor. That is all an engine needs to reload
only what changed (``model.load_weights`` of the changed tensors, or of their rows), so nothing
here reads or compares tensor contents: it is pure bookkeeping over the spans, no second pass.

Spans are chunk-granular (a chunk is rewritten whole or patched; see docs/SPEC.md §4), so a
listed tensor may have unchanged elements inside its spans, but an element outside every span
did not change.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

#: Tensor name → element spans ``[start, stop)`` of the flattened tensor, in ascending order.
Spans = Mapping[str, list[tuple[int, int]]]


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, with overlapping or touching spans merged into one."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def row_ranges(shape: torch.Size | tuple[int, ...], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The rows ``[start, stop)`` along dim 0 that element ``spans`` touch, merged.

    A 0-d or 1-d tensor has one element per row. Example: a (4, 8) tensor with span (10, 20)
    touches rows 1 and 2: ``[(1, 3)]``.
    """
    row = 1
    for d in tuple(shape)[1:]:
        row *= int(d)
    if row == 0:
        return []
    return merge_spans([(a // row, -(-b // row)) for a, b in spans if b > a])


def changed_tensors(target: Mapping[str, torch.Tensor] | torch.nn.Module, changed: Spans) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from ``target`` for every tensor named in ``changed``, whole.

    The tensors are ``target``'s own (no copy), in ``changed``'s order: what an engine's
    ``load_weights`` takes. A name ``target`` lacks raises KeyError naming it.
    """
    tensors = target.state_dict(keep_vars=True) if isinstance(target, torch.nn.Module) else target
    for name in changed:
        if name not in tensors:
            raise KeyError(f"changed tensor {name!r} is not in the target")
        t = tensors[name]
        yield name, (t.data if isinstance(t, torch.nn.Parameter) else t)


def changed_rows(
    target: Mapping[str, torch.Tensor] | torch.nn.Module, changed: Spans
) -> Iterator[tuple[str, list[tuple[int, int]], torch.Tensor]]:
    """Yield ``(name, rows, tensor)``: each changed tensor, the row ranges along dim 0 that
    changed (see :func:`row_ranges`), and the tensor itself (slice it with ``tensor[a:b]``)."""
    for name, t in changed_tensors(target, changed):
        yield name, row_ranges(t.shape, changed[name]), t
