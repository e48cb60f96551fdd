"""The user's targets on the read path: the tensors a subscriber writes, checked against a layout.

A target is a dict of the version's tensors or an ``nn.Module``. A module's tied aliases (a name
the version leaves out because it shares memory with one it publishes, e.g. ``lm_head.weight``)
are set aside by :class:`~deltastore.layout.tied.ModuleTensors`; a dict is taken as it is, and a
tied alias that keeps it from fitting is named in the error. What an update wrote is reported in
the tensors users see (:func:`plan_spans`), never in group rows.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltastore.errors import FormatError, InvalidStateDictError, LayoutMismatchError
from deltastore.layout.groups import member_overlaps
from deltastore.layout.tensors import TensorDict, TensorScan, TensorSpec, check_layout, member_specs, torch_dtype
from deltastore.layout.tied import ModuleTensors, alias_hint
from deltastore.read.changes import merge_spans
from deltastore.read.plan import ChunkPlan

#: A target as the user passes it.
Target = Mapping[str, torch.Tensor] | torch.nn.Module


def stored_dtype(name: str) -> torch.dtype:
    """The torch dtype of a (validated) manifest's dtype name."""
    try:
        return torch_dtype(name)
    except InvalidStateDictError as e:  # a name deltastore stores, but this torch is too old
        raise FormatError(f"{e}: upgrade torch to read this store") from None


def target_tensors(target: Target) -> dict[str, torch.Tensor]:
    """The target's tensors, checked to be tensors and contiguous (a :class:`TensorDict`:
    plain tensors are checked all at once and the scan is kept for this call's other checks)."""
    if isinstance(target, torch.nn.Module):
        target = target.state_dict(keep_vars=True)
    if not isinstance(target, Mapping):
        raise InvalidStateDictError(f"pull_into needs a state dict or nn.Module, got {type(target).__name__}")
    values = list(target.values())
    if set(map(type, values)) <= {torch.Tensor}:  # no Parameter to unwrap, no stranger
        sc = TensorScan(values)
        if sc.contiguous.all():
            names = list(target)
            return TensorDict(target if type(target) is dict else zip(names, values), (names, sc))
    out = {}
    for n, t in target.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidStateDictError(f"target {n!r} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_contiguous():
            raise InvalidStateDictError(f"target tensor {n!r} is not contiguous; it cannot be updated in place")
        # type() first: Parameter's isinstance check is the slow one, at every tensor of a large model
        out[n] = t if type(t) is torch.Tensor else t.data if isinstance(t, torch.nn.Parameter) else t
    return TensorDict(out)


def module_targets(target: Target) -> dict[str, torch.Tensor]:
    """The target's tensors (:func:`target_tensors`); a module's as :class:`~deltastore.layout.tied.ModuleTensors`,
    which fit a version that publishes each tied memory once (kept as they are when passed again)."""
    if isinstance(target, ModuleTensors):
        return target
    tensors = target_tensors(target)
    return ModuleTensors(tensors) if isinstance(target, torch.nn.Module) else tensors


def owners(target: Target) -> dict[str, torch.Tensor]:
    """The tensor objects to repoint in a swap by rebinding: a module's own Parameters and
    buffers, or the tensors of a mapping as they are."""
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=True))
    return dict(target)


def check_tensors(specs: dict[str, TensorSpec], tensors: dict[str, torch.Tensor], *, against: str,
                  tied: Mapping[str, str] | None = None) -> None:
    """``tensors`` (a whole target) against the layout ``specs``. A module target first sets
    aside the tied aliases the version leaves out; a dict target is checked as it is, and a
    tied alias that keeps it from fitting is named in the error (``tied``: the aliases the
    version records).

    Raises:
        LayoutMismatchError: naming the first tensor that differs.
    """
    try:
        check_layout(specs, tensors, against=against)
        return
    except LayoutMismatchError as e:
        error = e
    names = member_specs(specs).keys()
    if isinstance(tensors, ModuleTensors) and tensors.fit(names):
        try:
            check_layout(specs, tensors, against=against)
            return
        except LayoutMismatchError as e:
            error = e
    hint = alias_hint(tensors, names, tied or {}, module=isinstance(tensors, ModuleTensors))
    if not hint:
        raise error
    raise LayoutMismatchError(f"{error}{hint}") from None


def whole(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
    """Every tensor as changed whole (a full load)."""
    return {n: [(0, t.numel())] for n, t in tensors.items()}


def plan_spans(plans: list[ChunkPlan], specs: Mapping[str, TensorSpec]) -> dict[str, list[tuple[int, int]]]:
    """Tensor name → the merged spans of the chunks ``plans`` write (what changed). A group
    row's span (design 007) is reported as the spans of the member tensors it overlaps, in
    each member's own element coordinates: users see tensors, never group rows. A column-grid
    chunk (design 011 D4) is reported as its whole row band ``[r0·row, r1·row)``: a superset
    in natural order, one span per chunk (merged with its neighbours)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in plans:
        spec = specs.get(p.name)
        if spec is not None and spec.members:
            for member, lo, hi in member_overlaps(spec, *p.span):
                spans.setdefault(member.name, []).append((lo - member.offset, hi - member.offset))
        elif spec is not None and spec.chunk_cols:
            r0, r1, _, _ = spec.chunk_block(p.index)
            spans.setdefault(p.name, []).append((r0 * spec.row_elems, r1 * spec.row_elems))
        else:
            spans.setdefault(p.name, []).append(p.span)
    return {n: merge_spans(s) for n, s in spans.items()}
