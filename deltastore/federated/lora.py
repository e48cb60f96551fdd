"""Federated rounds of a LoRA adapter: the merges FedIT and FLoRA use, as state merges.

The global store's state is a ``peft.PeftModel``'s own ``state_dict()``: every base tensor
(``...query.base_layer.weight``, ``...key.weight``, ...) and, for every adapted module ``X``,
``X.lora_A.<adapter>.weight`` (r × in) and ``X.lora_B.<adapter>.weight`` (out × r). A site's
training function is then ``model.load_state_dict(weights); train(); return model.state_dict()``.
The first global version holds the base (a full version, published once); sites train only the
adapter, so their results hold only its change. The effective weight of a module is
``W + s · B A`` with ``s`` PEFT's scaling (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` for
rsLoRA).

:class:`LoraMerge` is passed to the aggregator as ``Aggregator(..., merge=LoraMerge(...))``
(see :mod:`deltastore.federated.merge` for the state-merge contract):

- ``fedavg`` (the default; FedIT): every tensor some site changed is averaged on its own with
  :func:`~deltastore.federated.merge.weighted_average`, ``A`` and ``B`` alike, exactly as the
  aggregator's default merge. The global adapter keeps its rank and layout, so a round's
  download is at most an adapter and engines serve it on an unchanged base. Its cost:
  ``avg(B) · avg(A) ≠ avg(B · A)``, the aggregation noise FLoRA points out.
- ``stack`` (FLoRA): the exact merge. For each module some site changed,
  ``ΔW = s · [w_1 B_1 … w_N B_N] · [A_1; …; A_N] = s · Σ w_i B_i A_i`` (in fp32; a site's
  ``B_i``/``A_i`` are the base's where it changed them not) is folded into the base weight,
  ``W' = (W + ΔW)`` cast to W's dtype, and the global ``B`` is set to zero (``A`` stays the
  base's), so ``W' + s · B' A'`` is the weighted average of the site models ``W + s B_i A_i``
  up to that one cast. Its cost: each round changes the adapted base matrices (dense, much
  bigger than an adapter), and folding into a bf16 base loses increments below bf16's
  resolution.

Module discovery (:func:`lora_modules`) reads only names and shapes: a module is a pair
``X.lora_A.<adapter>.weight`` / ``X.lora_B.<adapter>.weight`` with the base weight
``X.base_layer.weight`` (PEFT's model names), or ``X.lora_A.weight`` / ``X.lora_B.weight`` (PEFT's
saved names) with ``X.base_layer.weight`` or ``X.weight``. Embedding LoRA
(``lora_embedding_A``/``_B``), DoRA magnitudes and LoRA biases are averaged per tensor by
``fedavg`` and refused by ``stack``, whose fold would not be exact for them.

Example::

    merge = LoraMerge.from_peft_config(peft_model.peft_config["default"], "stack")
    with Aggregator(global_url, site_urls, dtype=torch.float32, merge=merge) as agg:
        agg.start(peft_model.state_dict())
        agg.run_round(quorum=len(site_urls))
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from deltastore.errors import InvalidStateDictError
from deltastore.federated.merge import StateMerge, bit_pattern, weighted_average

logger = logging.getLogger(__name__)

Mode = Literal["fedavg", "stack"]
MODES: tuple[str, ...] = ("fedavg", "stack")

#: A LoRA factor under PEFT's model names (``X.lora_A.<adapter>.weight``) or saved names
#: (``X.lora_A.weight``). The adapter group is absent in saved names.
_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")
#: LoRA tensors that ``stack`` cannot fold exactly (embedding factors, DoRA magnitudes, LoRA
#: biases): refused by ``stack``, averaged per tensor by ``fedavg``.
_UNFOLDABLE = re.compile(r"\.(lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.|$)|\.lora_B\.(?:[^.]+\.)?bias$")
#: Tensors :func:`adapter_state` keeps: every LoRA tensor of one adapter, named as PEFT saves it.
_ADAPTER_TENSOR = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B"
                             r"|lora_magnitude_vector)\.(?P<adapter>[^.]+)(?P<rest>\.weight|\.bias)?$")


@dataclass(frozen=True)
class LoraModule:
    """One adapted module of a state, found by :func:`lora_modules`.

    Attributes:
        module: the module's name (``...attention.self.query``).
        adapter: the adapter's name (None under PEFT's saved names).
        a / b: the names of its ``lora_A`` (r × in) and ``lora_B`` (out × r) weights.
        weight: the name of the base weight the update folds into (out × in, or in × out when
            stored transposed: ``fan_in_fan_out``).
        rank: r.
    """

    module: str
    adapter: str | None
    a: str
    b: str
    weight: str
    rank: int


def lora_modules(state: Mapping[str, Any], *, fan_in_fan_out: bool = False) -> tuple[LoraModule, ...]:
    """The LoRA modules of ``state`` (a PeftModel's ``state_dict()``, or PEFT's saved names with
    the base weights beside them), checked by shape, sorted by module name.

    Args:
        state: tensor name → tensor (or anything with a ``shape``).
        fan_in_fan_out: the base weights are stored transposed (in × out, e.g. GPT-2's Conv1D).

    Returns:
        One :class:`LoraModule` per (module, adapter).

    Raises:
        InvalidStateDictError: a ``lora_A`` without its ``lora_B`` (or the reverse), a module
            without its base weight, or shapes that do not multiply (``B A`` is not the base
            weight's shape): each names the tensors and says what to check.

    Example::

        for m in lora_modules(peft_model.state_dict()):
            print(m.module, m.rank)
    """
    pairs: dict[tuple[str, str | None], dict[str, str]] = {}
    for name in state:
        got = _FACTOR.match(name)
        if got is not None:
            pairs.setdefault((got["module"], got["adapter"]), {})[got["part"]] = name
    out = []
    for (module, adapter), parts in sorted(pairs.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if "lora_A" not in parts or "lora_B" not in parts:
            have, lack = ("lora_A", "lora_B") if "lora_A" in parts else ("lora_B", "lora_A")
            raise InvalidStateDictError(f"LoRA module {module!r}: {parts[have]!r} has no {lack} beside it; "
                                        f"pass the whole state (every {lack} of the adapter)")
        weight = next((w for w in (f"{module}.base_layer.weight", f"{module}.weight") if w in state), None)
        if weight is None:
            raise InvalidStateDictError(f"LoRA module {module!r} has no base weight ({module}.base_layer.weight or "
                                        f"{module}.weight): the global state must hold the base model as well as the adapter")
        a, b, w = (tuple(state[n].shape) for n in (parts["lora_A"], parts["lora_B"], weight))
        want = (b[0], a[1]) if len(a) == 2 and len(b) == 2 else None
        if fan_in_fan_out and want is not None:
            want = (want[1], want[0])
        if want is None or a[0] != b[1] or w != want:
            raise InvalidStateDictError(
                f"LoRA module {module!r}: lora_B {list(b)} · lora_A {list(a)} does not give base weight {weight!r} "
                f"{list(w)}" + ("" if fan_in_fan_out else " (a base weight stored transposed needs fan_in_fan_out=True)"))
        out.append(LoraModule(module, adapter, parts["lora_A"], parts["lora_B"], weight, a[0]))
    return tuple(out)


def adapter_state(state: Mapping[str, torch.Tensor], adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter ``adapter_name`` of a PeftModel's state (e.g. a global version), under the
    names PEFT saves (``get_peft_model_state_dict``: ``X.lora_A.weight``, adapter name removed).

    What :meth:`deltastore.integrations.peft.AdapterPublisher.publish_state` takes with the
    adapter's config, to publish the global adapter of ``fedavg`` rounds for engines. (After
    ``stack`` rounds the adapter is zero and the update is in the base: serve the whole state.)

    Args:
        state: tensor name → tensor, PEFT's model names.
        adapter_name: which adapter.

    Returns:
        Saved name → tensor (the same tensors, not copies).

    Raises:
        InvalidStateDictError: ``state`` has no tensor of that adapter.

    Example::

        pub.publish_state(adapter_state(agg.state()), adapter_config(peft_model))
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        got = _ADAPTER_TENSOR.match(name)
        if got is not None and got["adapter"] == adapter_name:
            out[f"{got['module']}.{got['part']}{got['rest'] or ''}"] = t
    if not out:
        raise InvalidStateDictError(f"the state has no tensor of LoRA adapter {adapter_name!r} "
                                    f"(names like X.lora_A.{adapter_name}.weight): is it a PeftModel's state_dict()?")
    return out


class LoraMerge(StateMerge):
    """A round's merge of LoRA site results: ``fedavg`` (FedIT) or ``stack`` (FLoRA).

    A state merge (:class:`~deltastore.federated.merge.StateMerge`): pass it as
    ``Aggregator(..., merge=LoraMerge(...))``.

    Args:
        mode: ``fedavg`` (default): every changed tensor averaged on its own, the global adapter
            keeps its rank and layout. ``stack``: the sites' updates ``s · Σ w_i B_i A_i`` folded
            exactly into the base weights, the global ``lora_B`` zeroed.
        scaling: PEFT's ``s`` (``lora_alpha / r``; ``lora_alpha / sqrt(r)`` with rsLoRA); needed
            by ``stack``, unused by ``fedavg``.
        fan_in_fan_out: base weights stored transposed (in × out), as PEFT's config says.

    Raises:
        ValueError: an unknown mode, or ``stack`` without a positive finite ``scaling``.

    Example::

        agg = Aggregator(global_url, sites, merge=LoraMerge("stack", scaling=16 / 8))
    """

    def __init__(self, mode: Mode = "fedavg", *, scaling: float | None = None, fan_in_fan_out: bool = False):
        if mode not in MODES:
            raise ValueError(f"LoraMerge mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "stack" and (scaling is None or not math.isfinite(scaling) or scaling <= 0):
            raise ValueError(f"LoraMerge('stack') needs the adapter's scaling (lora_alpha / r, or lora_alpha / sqrt(r) "
                             f"with rsLoRA), a positive number; got {scaling!r}: pass scaling= or use from_peft_config")
        self.mode: Mode = mode
        self.scaling = None if scaling is None else float(scaling)
        self.fan_in_fan_out = bool(fan_in_fan_out)

    def __repr__(self) -> str:
        return f"LoraMerge({self.mode!r}, scaling={self.scaling!r}, fan_in_fan_out={self.fan_in_fan_out!r})"

    @classmethod
    def from_peft_config(cls, config: Any, mode: Mode = "fedavg") -> LoraMerge:
        """A merge for the adapter described by ``config`` (a ``peft.LoraConfig`` or the dict of
        its ``adapter_config.json``): scaling from ``lora_alpha``, ``r`` and ``use_rslora``,
        ``fan_in_fan_out`` as it says.

        Raises:
            ValueError: not a LoRA config; for ``stack``: ``rank_pattern`` or ``alpha_pattern``
                (one scaling per module, which this merge does not take), DoRA or LoRA biases
                (no exact fold), or no usable ``r`` / ``lora_alpha``.
        """
        def get(key: str, default: Any = None) -> Any:
            return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)

        peft_type = get("peft_type")
        peft_type = getattr(peft_type, "value", peft_type)
        if peft_type is not None and str(peft_type).upper() != "LORA":
            raise ValueError(f"LoraMerge needs a LoRA config, not peft_type {peft_type!r}")
        fan = bool(get("fan_in_fan_out", False))
        if mode != "stack":
            return cls(mode, fan_in_fan_out=fan)
        for key in ("rank_pattern", "alpha_pattern"):
            if get(key):
                raise ValueError(f"LoraMerge('stack') takes one scaling for every module, and the config has a {key} "
                                 f"({dict(get(key))}): use mode 'fedavg', or an adapter without per-module ranks")
        if get("use_dora", False):
            raise ValueError("LoraMerge('stack') cannot fold a DoRA adapter exactly (its magnitude normalises the "
                             "merged weight): use mode 'fedavg'")
        if get("lora_bias", False):
            raise ValueError("LoraMerge('stack') does not fold LoRA biases (lora_bias=True): use mode 'fedavg'")
        r, alpha = get("r"), get("lora_alpha")
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)):
            raise ValueError(f"LoraMerge('stack') needs the config's r and lora_alpha, got r={r!r}, lora_alpha={alpha!r}")
        scaling = alpha / math.sqrt(r) if get("use_rslora", False) else alpha / r
        return cls(mode, scaling=scaling, fan_in_fan_out=fan)

    def __call__(self, base: Mapping[str, torch.Tensor], sites: Sequence[Mapping[str, torch.Tensor]],
                 weights: Sequence[float]) -> dict[str, torch.Tensor]:
        """Merge one round (the state-merge contract of :mod:`deltastore.federated.merge`).

        Args:
            base: the round's global state. sites: per accepted site, the tensors it changed
            (whole, in the base's dtype). weights: the sites' weights (summing to 1).

        Returns:
            The tensors of the next global version that differ from ``base``.

        Raises:
            InvalidStateDictError: the state's LoRA modules do not check (:func:`lora_modules`),
                a site result names a tensor the base does not have or has another shape, or
                ``stack`` meets a tensor it cannot fold.
        """
        if len(sites) != len(weights):
            raise ValueError(f"{len(sites)} site results but {len(weights)} weights")
        modules = lora_modules(base, fan_in_fan_out=self.fan_in_fan_out)
        changed = sorted({n for s in sites for n in s})
        for i, s in enumerate(sites):
            for n, t in s.items():
                if n not in base or tuple(t.shape) != tuple(base[n].shape) or t.dtype != base[n].dtype:
                    got = f"{t.dtype}{list(t.shape)}"
                    want = f"{base[n].dtype}{list(base[n].shape)}" if n in base else "no such tensor"
                    raise InvalidStateDictError(f"site result {i}: tensor {n!r} is {got}, the round's base has {want}")
        out: dict[str, torch.Tensor] = {}
        folded: set[str] = set()
        if self.mode == "stack":
            bad = [n for n in changed if _UNFOLDABLE.search(n)]
            if bad:
                raise InvalidStateDictError(f"LoraMerge('stack') cannot fold {bad[0]!r} exactly (embedding LoRA, DoRA "
                                            f"and LoRA biases are not folded): use mode 'fedavg'")
            touched = set(changed)
            adapters: dict[str, set[str | None]] = {}
            for m in modules:
                adapters.setdefault(m.weight, set()).add(m.adapter)
            for m in modules:
                if not {m.a, m.b, m.weight} & touched:
                    continue  # no site moved this module: its effective weight stays as it is
                if len(adapters[m.weight]) > 1:
                    names = sorted(map(str, adapters[m.weight]))
                    raise InvalidStateDictError(f"LoRA module {m.module!r} has several adapters ({names}): LoraMerge('stack') "
                                                f"folds one adapter into the base; keep one in the state")
                out.update(self._fold(m, base, sites, weights))
                folded |= {m.a, m.b, m.weight}
        for n in changed:
            if n in folded:
                continue
            b = base[n]
            t = weighted_average(n, b, [s.get(n, b) for s in sites], weights)
            if not torch.equal(bit_pattern(t), bit_pattern(b)):
                out[n] = t
        logger.debug("LoraMerge(%s): %d of %d tensors changed, %d modules", self.mode, len(out), len(base), len(modules))
        return out

    def _fold(self, m: LoraModule, base: Mapping[str, torch.Tensor], sites: Sequence[Mapping[str, torch.Tensor]],
              weights: Sequence[float]) -> dict[str, torch.Tensor]:
        """``stack`` of one module: W' = W + Σ w_i (W_i − W) + s · [w_i B_i] [A_i] (fp32, one cast), B' = 0."""
        assert self.scaling is not None
        w, a, b = base[m.weight], base[m.a], base[m.b]
        w32 = w.to(torch.float32)
        acc = w32.clone()
        for s, wt in zip(sites, weights):  # a site that also moved the base weight (an unfrozen base)
            if m.weight in s:
                acc += float(wt) * (s[m.weight].to(torch.float32) - w32)
        # FLoRA's stacking: the product of the stacked, weighted B's and the stacked A's is Σ w_i B_i A_i
        b_stack = torch.cat([float(wt) * s.get(m.b, b).to(torch.float32) for s, wt in zip(sites, weights)], dim=1)
        a_stack = torch.cat([s.get(m.a, a).to(torch.float32) for s in sites], dim=0)
        delta = self.scaling * (b_stack @ a_stack)
        acc += delta.T if self.fan_in_fan_out else delta
        out = {m.weight: acc.to(w.dtype)}
        zero = torch.zeros_like(b)
        if not torch.equal(bit_pattern(zero), bit_pattern(b)):
            out[m.b] = zero
        return out
