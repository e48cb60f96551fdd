"""The compressed tier of federated rounds (design 009 D11, SPEC §14.1): opt-in, per site.

At low bandwidth a site may send only part of its change: per floating tensor, the
``density`` fraction of elements whose change (plus the error it has not sent yet) is largest
(*top-k*) among those the served dtype can hold (a change below half the base element's
spacing rounds away in bf16: it waits in the error until it has grown past it), each value
quantized to ``bits`` bits (a sign and ``2^(bits-1)`` magnitudes, the
means of equal-count groups of the kept magnitudes). What it leaves out, and what the
quantization and the cast to the served dtype lost, is kept by the site (*error feedback*) and
added to its next round's change, as SparseLoCo and DeMo do: over rounds every part of the
change is sent.

The result is published as an ordinary based version of ``base + sent change``: its segments
are exact, every reader applies exactly what the site published, and the global version is
exactly what the aggregator merged. What is lossy is the site's own result, so the version
says so (the manifest's ``compression``, :class:`~deltastore.format.models.CompressionRef`)
and an aggregator reads it only when it opted in (``ResultPolicy(accept_compressed=True)``; else
:class:`~deltastore.errors.CompressedVersionError`).

Pure apart from the error kept between rounds: tensors in, tensors out, no IO.

Example::

    site = Site(global_url, site_url, dtype=torch.bfloat16, compression=Compression(density=0.01))
    site.run_round(train)                     # publishes the compressed result, keeps the error
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from deltastore._util.files import fsync_path
from deltastore.errors import CorruptObjectError, InvalidStateDictError
from deltastore.format.models import CompressionRef

#: The method name recorded in a compressed version's manifest (SPEC §14.1).
METHOD = "topk"
#: Most bits a quantized value may take: beyond 8, sending the value unquantized is as cheap.
MAX_BITS = 8


@dataclass(frozen=True)
class Compression:
    """The compressed tier's settings.

    Attributes:
        density: the fraction of each floating tensor's elements sent per round, in (0, 1]
            (at least one element of a tensor that changed).
        bits: bits per sent value, 1 to 8: a sign and ``2^(bits-1)`` magnitudes per tensor.
        error_feedback: keep what was not sent and add it to the next round's change (the
            default; without it, what top-k and quantization drop is lost).

    Raises:
        ValueError: a value out of range.
    """

    density: float = 0.01
    bits: int = 2
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) \
                or not math.isfinite(self.density) or not 0 < self.density <= 1:
            raise ValueError(f"Compression.density must be in (0, 1], got {self.density!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= MAX_BITS:
            raise ValueError(f"Compression.bits must be an integer in [1, {MAX_BITS}], got {self.bits!r}")

    def ref(self) -> CompressionRef:
        """The manifest's record of these settings."""
        return CompressionRef(method=METHOD, density=float(self.density), bits=self.bits,
                              error_feedback=self.error_feedback)


def quantize(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (1-D fp32) quantized to a sign and ``2^(bits-1)`` magnitudes: the magnitudes
    are ranked and cut into that many groups of (nearly) equal count, and each value takes its
    group's mean magnitude with its own sign. Deterministic; zeros stay zero."""
    k = values.numel()
    if k == 0:
        return values.clone()
    levels = min(2 ** (bits - 1), k)
    mag = values.abs()
    order = torch.argsort(mag, stable=True)
    group = torch.empty(k, dtype=torch.int64)
    group[order] = torch.arange(k, dtype=torch.int64) * levels // k
    sums = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, mag.to(torch.float64))
    counts = torch.bincount(group, minlength=levels).to(torch.float64)
    means = (sums / counts).to(torch.float32)
    return torch.sign(values) * means[group]


def spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between each of ``values`` (fp32, holding values of ``dtype``) and the next
    value of ``dtype`` away from zero: a change below half of it rounds away in ``dtype``.
    Zero for zeros (any change of a zero is held, down to the subnormals)."""
    _, exponent = torch.frexp(values)
    gap = torch.ldexp(torch.full_like(values, torch.finfo(dtype).eps / 2), exponent)
    return torch.where(values == 0, 0.0, gap)


class Compressor:
    """A site's compressed tier: makes each round's published state and keeps the error.

    Args:
        compression: the settings.

    Example::

        c = Compressor(Compression(density=0.02))
        sent = c.compress(trained_state, base_state)   # publish ``sent`` (same dtypes as base)
    """

    def __init__(self, compression: Compression = Compression()):
        if not isinstance(compression, Compression):
            raise TypeError(f"compression must be a Compression, not {type(compression).__name__}")
        self.compression = compression
        #: tensor name → the change not sent yet (fp32), carried to the next round
        self.residual: dict[str, torch.Tensor] = {}

    def compress(self, state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state to publish for ``state`` (the site's trained tensors, any floating dtype)
        on ``base`` (the round's global tensors): per floating tensor, ``base`` plus the top-k
        of ``state − base + residual`` among the changes ``base``'s dtype can hold, quantized,
        cast to ``base``'s dtype. Other tensors are sent as they are. Updates the residual (with error feedback) to what was not sent.

        Raises:
            InvalidStateDictError: a tensor of ``state`` that ``base`` lacks, or of another shape.
        """
        c = self.compression
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            b = base.get(name)
            if b is None or tuple(b.shape) != tuple(t.shape):
                got = "missing" if b is None else f"{list(b.shape)}"
                raise InvalidStateDictError(f"compressed result: tensor {name!r} {list(t.shape)} does not match the "
                                            f"round's base ({got})")
            if not (t.is_floating_point() and b.is_floating_point()):
                out[name] = t
                continue
            b32 = b.detach().to("cpu", torch.float32).reshape(-1)
            change = t.detach().to("cpu", torch.float32).reshape(-1) - b32
            change = torch.where(torch.isfinite(change), change, 0.0)  # a NaN or Inf element never moves
            if c.error_feedback and name in self.residual:
                change += self.residual[name].reshape(-1)
            published = b.detach().to("cpu").contiguous().clone()
            flat = published.view(-1)
            # only changes the served dtype can hold: one that rounds back to the base's value
            # would spend the round's budget on nothing (it stays in the residual, and goes once
            # it has grown past half the base element's spacing)
            magnitude = torch.where(change.abs() >= spacing(b32, b.dtype) / 2, change.abs(), 0.0)
            k = min(math.ceil(c.density * change.numel()), int(torch.count_nonzero(magnitude)))
            if k:
                idx = torch.topk(magnitude, k, sorted=False).indices.sort().values
                flat[idx] = (b32[idx] + quantize(change[idx], c.bits)).to(b.dtype)
                # what the base moved by after the cast, not what was meant: a change the
                # cast to the served dtype swallowed stays in the residual
                change[idx] -= flat[idx].to(torch.float32) - b32[idx]
            out[name] = published
            if c.error_feedback:
                self.residual[name] = change.view(b.shape)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The residual, to keep across a restart of the site (e.g. ``safetensors`` save)."""
        return {n: t.clone() for n, t in self.residual.items()}

    def load_state_dict(self, residual: Mapping[str, torch.Tensor]) -> None:
        """Restore a residual saved by :meth:`state_dict`."""
        self.residual = {n: t.detach().to("cpu", torch.float32).clone() for n, t in residual.items()}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the residual to ``path`` (safetensors), atomically: a crash leaves the previous
        file or the new one."""
        from safetensors.torch import save_file

        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        save_file({n: t.contiguous() for n, t in self.residual.items()}, str(tmp),
                  metadata={"deltastore": "compression residual", "method": METHOD})
        fsync_path(tmp)
        os.replace(tmp, target)
        fsync_path(target.parent, strict=False)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore the residual :meth:`save` wrote to ``path``.

        Raises:
            FileNotFoundError: no such file. CorruptObjectError: not a residual file.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            self.load_state_dict(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise CorruptObjectError(f"{path}: not a compression residual file ({e}); delete it to start the "
                                     "error feedback afresh") from e
