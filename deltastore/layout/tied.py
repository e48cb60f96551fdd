"""Tied weights: one memory under two names of a module (``lm_head.weight`` → ``model.embed_tokens.weight``).

The rule every writer and reader follows (SPEC §6, *Tied weights*):

- A writer given a module (``Publisher.publish(model)``, ``DeltastoreCallback``, and the TRL
  backend, which receives ``named_parameters()``) publishes each memory once, under the name
  ``named_parameters()`` keeps, and records the aliases it left out as the version's
  ``metadata["tied_weights"]`` (alias → published name) when it knows them (:func:`tied_aliases`).
- A reader given a module target (``pull_into``, ``stage``/``swap``, ``follow``) satisfies a
  name the version leaves out through the tensor of the version it shares memory with in that
  module: updating the published tensor updates the alias (:class:`ModuleTensors`).
- A dict target is checked strictly; when a tied alias is the reason it does not fit, the
  error says so (:func:`alias_hint`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from deltastore.layout.tensors import TensorDict

#: The metadata key under which writers record tied aliases (alias → published name).
TIED_WEIGHTS_KEY = "tied_weights"


def _memory(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors one memory: device, first element's address, dtype and shape."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape))


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """The names of ``module.state_dict()`` that alias another entry's memory, each mapped to
    the entry a writer publishes instead: the one ``named_parameters()`` keeps (else the first
    in state-dict order). Empty tensors and meta tensors are never tied."""
    kept = {n for n, _ in module.named_parameters()}
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t.is_meta or t.numel() == 0:
            continue
        owner = first.setdefault(_memory(t), name)
        if owner == name:
            continue
        if name in kept and owner not in kept:  # named_parameters keeps this one: it owns the memory
            first[_memory(t)] = name
            out = {a: (name if s == owner else s) for a, s in out.items()}
            out[owner] = name
        else:
            out[name] = owner
    return out


def recorded_aliases(metadata: Mapping[str, object] | None) -> dict[str, str]:
    """The tied aliases a version's metadata records (``{}`` when none)."""
    tied = (metadata or {}).get(TIED_WEIGHTS_KEY)
    return {str(a): str(s) for a, s in tied.items()} if isinstance(tied, Mapping) else {}


def module_state(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``module.state_dict()`` without its tied aliases, and the aliases (alias → published name)."""
    tied = tied_aliases(module)
    return {n: t for n, t in module.state_dict().items() if n not in tied}, tied


class ModuleTensors(TensorDict):
    """The tensors of a module target (its ``state_dict(keep_vars=True)``, unwrapped) that can
    :meth:`fit` a version which publishes each tied memory once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        super().__init__(tensors, getattr(tensors, "_scan", None))
        #: aliases left out of the dict, each → the name of the tensor it shares memory with
        self.aside: dict[str, str] = {}

    def update(self, *args: Any, **kwargs: Any) -> None:
        """As dict's, except that an alias set aside stays aside (it still follows its source)."""
        new = dict(*args, **kwargs)
        for n in self.aside.keys() & new.keys():
            del new[n]
        super().update(new)

    def fit(self, names: Collection[str]) -> bool:
        """Set aside each name not in ``names`` (a version's tensors) that shares memory with a
        tensor that is, and put back each alias set aside that ``names`` holds. Returns whether
        anything moved (the caller then checks the layout again)."""
        moved = False
        for alias, source in list(self.aside.items()):
            if alias in names:  # the version publishes it again: a target of its own
                self[alias] = self[source]
                del self.aside[alias]
                moved = True
        extra = [n for n in self if n not in names]
        if not extra:
            return moved
        owners: dict[tuple[Any, ...], str] = {}
        for n, t in self.items():
            if n in names and t.numel():
                owners.setdefault(_memory(t), n)
        for n in extra:
            t = self[n]
            source = owners.get(_memory(t)) if t.numel() else None
            if source is not None:
                self.aside[n] = source
                del self[n]
                moved = True
        return moved


def alias_hint(tensors: Mapping[str, torch.Tensor], names: Collection[str], recorded: Mapping[str, str],
               *, module: bool) -> str:
    """Why ``tensors`` holds names the version does not, when tied aliases are the reason
    ("" otherwise): the words appended to a LayoutMismatchError."""
    extra = [n for n in tensors if n not in names]
    if not extra:
        return ""
    owners: dict[tuple[Any, ...], str] = {}
    for n, t in tensors.items():
        if n in names and t.numel():
            owners.setdefault(_memory(t), n)
    for n in extra:
        t = tensors[n]
        shared = owners.get(_memory(t)) if t.numel() else None
        source = shared or (recorded.get(n) if recorded.get(n) in names else None)
        if source is None:
            continue
        if module:  # recorded as tied by the writer, but not tied in this module
            return (f"; the version records {n!r} as a tied alias of {source!r}, published once, but in this "
                    f"module it does not share memory with it: tie them (e.g. tie_word_embeddings) or pull()")
        return (f"; {n!r} is a tied alias of {source!r}, published once: pass the nn.Module (a tied alias "
                f"follows the tensor it shares memory with) or leave {n!r} out of the dict")
    return ""
