"""Serving formats (docs/SPEC.md "Serving formats: quantizers"): what a format quantizes, and
the serving state dict :func:`derive` makes of one version's state.

A publisher that serves several formats derives each one's state dict from the same state and
publishes it as a chain of its own; a worker pulls the one its engine loads. Three formats:

- ``bf16``: floating tensors cast to bfloat16 (a no-op for bfloat16), the others as they are.
- ``fp8-block128``: 2-D linear weights quantized by
  :func:`~deltastore.serving.quantize.quantize_fp8_block128` (``X.weight`` float8_e4m3fn plus
  ``X.weight_scale_inv`` float32, the DeepSeek-V3 / vLLM block-FP8 layout); every other tensor as
  in ``bf16``.
- ``mxfp8``: 2-D linear weights whose last dimension is a multiple of 32 quantized by
  :func:`~deltastore.serving.quantize.quantize_mxfp8` (``X.weight`` float8_e4m3fn plus
  ``X.weight_scale`` uint8 E8M0, the layout vLLM and SGLang load); every other tensor as in
  ``bf16``.

Which weights are linear weights is decided by name, with the engines' convention as the
default: ``*.weight`` of 2 dimensions, except embeddings, the output head, norms and MoE
routers (:data:`DEFAULT_EXCLUDE`). Both lists are fnmatch patterns (case-sensitive, as
:class:`~deltastore.layout.select.Selection`'s) and can be replaced per format.

Example::

    fmt = serving_format("fp8-block128")
    serving = derive(model.state_dict(), fmt)
    serving["model.layers.0.mlp.down_proj.weight_scale_inv"].shape   # [ceil(M/128), ceil(N/128)]
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import math
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from deltastore._util import kernels
from deltastore.errors import FormatError, InvalidStateDictError, UnknownFormatError
from deltastore.serving.quantize import MX_BLOCK, quantize_fp8_block128, quantize_mxfp8, scale_shape

logger = logging.getLogger(__name__)

#: The serving formats deltastore defines, in the order they are documented.
KNOWN_FORMATS: tuple[str, ...] = ("bf16", "fp8-block128", "mxfp8")

#: Tensors a quantizing format quantizes by default (with 2 dimensions only).
DEFAULT_INCLUDE: tuple[str, ...] = ("*.weight",)

#: Tensors a quantizing format keeps in bfloat16 by default, as the engines' FP8 checkpoints do:
#: embeddings (``embed_tokens``, GPT-2's ``wte``/``wpe``), the output head, norms, and the MoE
#: router (``mlp.gate``, ``block_sparse_moe.gate``, ``router``, Qwen's ``shared_expert_gate``),
#: which the engines run in high precision. Biases and other 1-D tensors are never quantized.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    "*embed*",
    "*wte.weight",
    "*wpe.weight",
    "*lm_head*",
    "*norm*",
    "*.gate.weight",
    "*router*",
    "*shared_expert_gate*",
)

#: The bfloat16 every NaN of a cast to bfloat16 is written as (the canonical quiet NaN).
BF16_NAN_BITS = 0x7FC0

#: The suffix of the scale tensor a format adds after each quantized tensor's name.
SCALE_SUFFIX: dict[str, str] = {"fp8-block128": "_scale_inv", "mxfp8": "_scale"}


@dataclass(frozen=True)
class ServingFormat:
    """A serving format and the tensors it quantizes.

    Args:
        name: one of :data:`KNOWN_FORMATS`.
        include: fnmatch patterns of the tensors to quantize (default :data:`DEFAULT_INCLUDE`;
            must be empty for ``bf16``, which quantizes nothing). Only 2-D tensors are ever
            quantized, and for ``mxfp8`` only those whose last dimension is a multiple of 32
            (the others stay bfloat16: the engines refuse MXFP8 there).
        exclude: fnmatch patterns of tensors never to quantize, even when ``include`` matches
            them (default :data:`DEFAULT_EXCLUDE`).

    Raises:
        UnknownFormatError: ``name`` is not a known format (``available`` lists them).
        FormatError: patterns that are not non-empty strings, or patterns for ``bf16``.

    Example::

        ServingFormat("fp8-block128", exclude=(*DEFAULT_EXCLUDE, "*.self_attn.*"))
    """

    name: str
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.name not in KNOWN_FORMATS:
            raise UnknownFormatError(
                f"unknown serving format {self.name!r}; the formats are {', '.join(KNOWN_FORMATS)}",
                available=KNOWN_FORMATS,
            )
        quantizes = self.name in SCALE_SUFFIX
        for field, default in (("include", DEFAULT_INCLUDE), ("exclude", DEFAULT_EXCLUDE)):
            value = getattr(self, field)
            value = (default if quantizes else ()) if value is None else value
            if isinstance(value, str) or not all(isinstance(p, str) and p for p in value):
                raise FormatError(f"serving format {self.name!r}: {field} must be a sequence of non-empty fnmatch "
                                  f"patterns, got {value!r}")
            object.__setattr__(self, field, tuple(value))
        if not quantizes and (self.include or self.exclude):
            raise FormatError(f"serving format {self.name!r} quantizes nothing; drop include/exclude")

    @property
    def scale_suffix(self) -> str | None:
        """The suffix of the scale tensor after a quantized tensor's name, or None (``bf16``)."""
        return SCALE_SUFFIX.get(self.name)

    def selects(self, name: str, shape: tuple[int, ...] | torch.Size) -> bool:
        """Whether this format quantizes the tensor ``name`` of ``shape`` (else it is kept, as in
        ``bf16``)."""
        if self.name not in SCALE_SUFFIX or len(shape) != 2:
            return False
        if self.name == "mxfp8" and shape[-1] % MX_BLOCK:
            return False
        return _selected(self.include, self.exclude, name)


def serving_format(spec: str | ServingFormat) -> ServingFormat:
    """The :class:`ServingFormat` a name stands for (default patterns), or ``spec`` itself.

    Raises:
        UnknownFormatError: an unknown name; ``available`` lists :data:`KNOWN_FORMATS`.

    Example::

        serving_format("mxfp8").scale_suffix   # '_scale'
    """
    if isinstance(spec, ServingFormat):
        return spec
    if not isinstance(spec, str):
        raise UnknownFormatError(
            f"a serving format is a name ({', '.join(KNOWN_FORMATS)}) or a ServingFormat, got {type(spec).__name__}",
            available=KNOWN_FORMATS,
        )
    return ServingFormat(spec)


def derive(state: Mapping[str, torch.Tensor], fmt: str | ServingFormat, *,
           pool: Executor | None = None, reuse: Mapping[str, torch.Tensor] | None = None,
           amax: dict[str, np.ndarray] | None = None,
           given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """The serving state dict of ``fmt`` for ``state``.

    Each tensor the format selects (:meth:`ServingFormat.selects`) becomes its quantized tensor,
    under its own name, followed by its scale tensor (name + :attr:`~ServingFormat.scale_suffix`);
    every other floating tensor is cast to bfloat16, and the rest is kept as it is. The same
    state gives the same bits on every machine.

    Args:
        state: tensor names to tensors (any device).
        fmt: a format name or a :class:`ServingFormat`.
        pool: threads to quantize tensors on concurrently (the kernels release the GIL), e.g. a
            publisher's encode threads; None quantizes in the calling thread. The result is the
            same either way.
        reuse: an earlier result of ``derive`` for the same format, whose quantized tensors and
            scales this one is written into where their names, shapes and dtypes still fit (a
            publisher deriving every version saves the fresh pages: about a third of the
            quantization's time). That earlier result must no longer be in use.
        amax: when given, filled with each quantized bfloat16 tensor's blocks' largest ``|x|``
            (bfloat16 bits, one uint16 per scale) where the native quantizers run
            (:mod:`deltastore.write.requant` keeps them).
        given: ``(quantized, scale)`` of selected tensors the caller already has (requantized
            incrementally): placed as they are, not quantized.

    Returns:
        A new dict in ``state``'s order (each scale right after its tensor): CPU, contiguous,
        detached tensors. A kept tensor that already is a CPU, contiguous bfloat16 (or
        non-floating) tensor is returned itself, not copied: do not modify it while the result
        is in use.

    Raises:
        UnknownFormatError: ``fmt`` is not a known format.
        InvalidStateDictError: a value that is not a dense tensor, a selected tensor of a dtype
            the quantizers do not take (float64: cast it or exclude it), or a scale name that
            the state already uses; each names the tensor.

    Example::

        derive({"mlp.down_proj.weight": w, "norm.weight": g}, "mxfp8").keys()
        # ['mlp.down_proj.weight', 'mlp.down_proj.weight_scale', 'norm.weight']
    """
    fmt = serving_format(fmt)
    quantize = {"fp8-block128": quantize_fp8_block128, "mxfp8": quantize_mxfp8}.get(fmt.name)
    out: dict[str, torch.Tensor] = {}
    selected: list[tuple[str, torch.Tensor]] = []  # quantized in order, after the checks
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.layout} tensor on {t.device}"
            raise InvalidStateDictError(f"{name!r}: a serving format derives from dense tensors with data, got {what}")
        if quantize is None or not fmt.selects(name, t.shape):
            out[name] = _keep(t)
            continue
        scale_name = name + SCALE_SUFFIX[fmt.name]
        if scale_name in state:
            raise InvalidStateDictError(
                f"{name!r}: {fmt.name} adds its scale as {scale_name!r}, a name the state already holds; rename "
                f"that tensor or exclude {name!r} from the format"
            )
        if given is not None and name in given:
            out[name], out[scale_name] = given[name]
            continue
        out[name] = out[scale_name] = None  # type: ignore[assignment]  # placed here, filled below
        selected.append((name, t))

    def run(item: tuple[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        name, t = item
        out = None
        if reuse is not None and name in reuse and name + SCALE_SUFFIX[fmt.name] in reuse:
            out = (reuse[name], reuse[name + SCALE_SUFFIX[fmt.name]])
        blocks = None
        if amax is not None and t.dtype == torch.bfloat16 and kernels.requant_classify is not None:
            blocks = amax[name] = np.empty(math.prod(scale_shape(fmt.name, t.shape)), dtype=np.uint16)
        try:
            return quantize(t, out=out, amax=blocks)  # type: ignore[misc]
        except InvalidStateDictError as e:
            raise InvalidStateDictError(f"{name!r}: {e}") from e

    # in order either way; a pool's map raises the first failure when its result is reached
    for (name, _), (q, scale) in zip(selected, (pool.map if pool is not None and selected else map)(run, selected)):
        out[name], out[name + SCALE_SUFFIX[fmt.name]] = q, scale
    logger.debug("%s: %d of %d tensors quantized", fmt.name, len(selected), len(state))
    return out


@functools.lru_cache(maxsize=1 << 16)
def _selected(include: tuple[str, ...], exclude: tuple[str, ...], name: str) -> bool:
    """Whether the patterns select ``name`` (remembered: a publisher asks per tensor, per
    version)."""
    return _matches(name, include) and not _matches(name, exclude)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _keep(t: torch.Tensor) -> torch.Tensor:
    """A tensor a format does not quantize: floating ones as bfloat16 (float64 through float32),
    every NaN a cast makes written as 0x7FC0; the rest as it is. CPU and contiguous."""
    if t.dtype == torch.bfloat16 and t.is_cpu and not t.requires_grad and t.is_contiguous():
        return t  # as it is (a publisher's state: every version, per tensor)
    t = (t.detach() if t.requires_grad else t).to("cpu")  # .to and .contiguous: no copy when not needed
    if t.is_floating_point() and t.dtype != torch.bfloat16:
        if t.dtype == torch.float64:
            t = t.to(torch.float32)  # spelled out: the two roundings are part of the format
        t = t.to(torch.bfloat16)
        nan = torch.isnan(t)
        if nan.any():  # PyTorch's vectorized cast writes 0xFFFF, its scalar one 0x7FC0
            t.view(torch.int16)[nan] = BF16_NAN_BITS
    return t.contiguous()
