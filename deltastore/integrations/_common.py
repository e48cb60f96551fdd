"""Pieces the trainer-side integrations share: rank detection, name cleanup, tied weights."""

from __future__ import annotations

import os

import torch

from deltastore.layout.tied import tied_aliases

#: Prefixes that wrappers add to parameter names and that a served checkpoint does not have:
#: DDP/FSDP1 (``module.``), torch.compile (``_orig_mod.``), FSDP1 and activation checkpointing
#: wrappers. TRL strips the first and the last already; a name that arrives clean is kept.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """``name`` without the wrapper prefixes and infixes of :data:`WRAPPER_PREFIXES`."""
    for infix in WRAPPER_INFIXES:
        name = name.replace(infix, "")
    for prefix in WRAPPER_PREFIXES:  # once each, in order: a model's own "module" stays
        name = name.removeprefix(prefix)
    return name


def global_rank() -> int:
    """This process's rank: torch.distributed's when initialized, else ``RANK`` (0 by default)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def tied_weights_of(model: torch.nn.Module) -> dict[str, str]:
    """Names in ``model.state_dict()`` that alias another entry's memory (tied weights such as
    ``lm_head.weight`` → ``model.embed_tokens.weight``), mapped to the name that
    ``named_parameters()`` keeps, both without wrapper prefixes: the rule of
    :func:`deltastore.layout.tied.tied_aliases`, which ``Publisher.publish(model)`` applies too.
    Published once under that name; the mapping is recorded in the version's metadata."""
    return {clean_name(a): clean_name(s) for a, s in tied_aliases(model).items()}


def served_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` (floating tensors cast to ``dtype``) that shares no memory
    with it: the trainer keeps updating its parameters while the copy is published. A device
    tensor is cast on the device first, so fewer bytes cross the bus."""
    t = t.detach()
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    if t.device.type != "cpu" and t.dtype != target:
        t = t.to(dtype=target)
    return t.to(device="cpu", dtype=target, copy=True).contiguous()
