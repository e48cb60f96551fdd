"""The quantizers of the serving formats (docs/SPEC.md "Serving formats: quantizers").

Pure functions: a tensor in, tensors out, no IO, no globals. Two formats, each matching the
reference the inference engines quantize with, bit for bit:

- **fp8-block128**: one float32 scale per 128×128 block of a 2-D weight, FP8 E4M3 elements;
  the layout of DeepSeek-V3 checkpoints and of vLLM's block-FP8 loading (``X.weight`` +
  ``X.weight_scale_inv``). Reference: ``per_block_cast_to_fp8`` of vLLM
  (vllm/utils/deep_gemm.py) and DeepGEMM (deep_gemm/utils/math.py), evaluated as PyTorch
  evaluates it on a CUDA device.
- **mxfp8**: OCP Microscaling v1.0 MXFP8 — 32-element blocks along the last dimension, an E8M0
  shared scale per block (a uint8 biased exponent), FP8 E4M3 elements. The scale is the
  power of two at or above ``amax / 448`` ("RCEIL"): torchao ``to_mx(...,
  ScaleCalculationMode.RCEIL)`` and vLLM's online MXFP8 quantizer (``_mxfp8_e4m3_quantize_torch``
  in vllm/model_executor/layers/quantization/utils/mxfp8_utils.py).

Every step is exact or one IEEE-754 binary32 operation rounded to nearest-even, so the results
do not depend on the machine. Three implementations write the same bits (the tests compare
them): the native kernels (deltastore/_native/quant.c, one pass per block, threads over block
rows, used when the extension has them), the PyTorch path (blockwise, a 4 MiB float32 scratch
instead of float32 copies of the tensor), and :func:`reference_quantize` (numpy over a padded
float32 copy, with its own E4M3 encoder instead of PyTorch's cast).

Example::

    q, scale_inv = quantize_fp8_block128(w)            # w: [M, N] bfloat16
    w_hat = dequantize_fp8_block128(q, scale_inv)      # float32: w within half an E4M3 step
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltastore._util import jobs, kernels
from deltastore.errors import InvalidStateDictError

#: The largest finite FP8 E4M3 (``float8_e4m3fn``) value; every scale maps a block's absolute
#: maximum to about this.
E4M3_MAX = 448.0
#: fp8-block128: the side of a square block (rows × columns) sharing one scale.
BLOCK = 128
#: mxfp8: the number of consecutive elements of the last dimension sharing one scale (OCP MX).
MX_BLOCK = 32
#: fp8-block128: a block's absolute maximum is raised to at least this (as float32,
#: 0x38D1B717) before the scale is taken, as the reference does: an all-zero block then gets
#: a finite scale and zero elements instead of 0/0.
AMAX_FLOOR = 1e-4
#: float32(1/448) = 0x3B124925: the scale is ``amax × INV_E4M3_MAX`` in float32. PyTorch on
#: CUDA evaluates the reference's ``amax / 448.0`` this way (a division by a Python scalar is a
#: multiplication by its float32 reciprocal); on a CPU it divides, which differs in the last bit
#: for about half of all bf16 block maxima.
INV_E4M3_MAX_BITS = 0x3B124925
#: The code every NaN element is written as (positive NaN, S.1111.111).
E4M3_NAN = 0x7F
#: The E8M0 code of NaN: the mxfp8 scale of a block holding a NaN or an infinity.
E8M0_NAN = 0xFF
#: The E8M0 exponent bias: code ``e`` means 2**(e - 127).
E8M0_BIAS = 127
#: The float32 NaN every NaN fp8-block128 scale is written as (the canonical quiet NaN).
F32_NAN_BITS = 0x7FC00000
#: Dtypes the quantizers take: all three convert to float32 exactly.
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: Elements per blockwise step of the PyTorch paths: the float32 scratch (4 MiB) and the
#: input slice stay in cache across the three passes over it (widen, scale, cast).
STEP_ELEMENTS = 1 << 20

_INV_E4M3_MAX = torch.tensor(INV_E4M3_MAX_BITS, dtype=torch.int32).view(torch.float32)
_AMAX_FLOOR = torch.tensor(AMAX_FLOOR, dtype=torch.float32)


# --- fp8-block128 --------------------------------------------------------------------------


def quantize_fp8_block128(w: torch.Tensor, *, native: bool | None = None,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None,
                          amax: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to FP8 E4M3 with one float32 scale per 128×128 block.

    Per block (a partial block at the bottom or right edge holds only the elements that exist):
    ``amax = max(max|x|, 1e-4)``, ``scale_inv = fl(amax × fl(1/448))``, ``rec = fl(1 / scale_inv)``
    and each element ``q = e4m3(fl(x × rec))``, rounded to nearest-even. A block holding a NaN
    gets ``scale_inv`` NaN and NaN elements; a block holding ±Inf (no NaN) gets
    ``scale_inv = +Inf``, NaN for the infinities and ±0 for the finite elements. Every NaN is
    written as 0x7F (elements) or 0x7FC00000 (scales).

    Args:
        w: a 2-D bfloat16, float16 or float32 tensor (any device; computed on the CPU).
        native: True to require the native kernel, False to run the PyTorch path, None (the
            default) for the native kernel when it is loaded. Both write the same bits.
        out: ``(q, scale_inv)`` tensors to write into, e.g. an earlier result's (a publisher
            deriving every version reuses its memory: fresh pages cost about a third of the
            quantization); used only when both are CPU, contiguous and of the result's shape and
            dtype, else new tensors are returned.
        amax: a uint16 array with one element per scale, filled with each block's largest
            ``|x|`` as bfloat16 bits (what :mod:`deltastore.write.requant` keeps to requantize
            the next version incrementally). bfloat16 input and the native kernel only.

    Returns:
        ``(q, scale_inv)``: ``q`` float8_e4m3fn of ``w``'s shape, ``scale_inv`` float32 of shape
        ``[ceil(M/128), ceil(N/128)]`` (the dequantization multiplier: ``w ≈ q × scale_inv``).
        Both CPU and contiguous.

    Raises:
        InvalidStateDictError: ``w`` is not 2-D, or of another dtype; ``native=True`` without the
            native kernel; ``amax`` without the native kernel or for other than bfloat16 input.

    Example::

        q, s = quantize_fp8_block128(torch.randn(576, 7168, dtype=torch.bfloat16))
        s.shape   # torch.Size([5, 56])
    """
    x = _checked(w, "fp8-block128", two_d=True)
    m, n = x.shape
    q, scale = _outputs(out, (m, n), torch.float8_e4m3fn, scale_shape("fp8-block128", (m, n)), torch.float32)
    kernel = _kernel("quantize_fp8_block128", native)
    tail = _amax_arg(amax, kernel, x, scale)
    if x.numel() == 0:
        return q, scale
    if kernel is not None:
        _split(kernel, (_bytes(x), _dtype_code(x), m, n, _bytes(q), scale.numpy()), _cdiv(m, BLOCK), m * n, tail)
        return q, scale
    cols = max(BLOCK, STEP_ELEMENTS // BLOCK // BLOCK * BLOCK)  # columns per step: whole blocks
    scratch = torch.empty(min(m, BLOCK) * min(n, cols), dtype=torch.float32)
    for bi, r0 in enumerate(range(0, m, BLOCK)):
        rows = x[r0 : r0 + BLOCK]
        s = torch.maximum(_amax_128(rows), _AMAX_FLOOR).mul_(_INV_E4M3_MAX)  # maximum: NaN stays NaN
        scale[bi] = s
        rec = torch.reciprocal(s)
        for c0 in range(0, n, cols):
            _scale_cast(rows[:, c0 : c0 + cols], rec[c0 // BLOCK : _cdiv(c0 + cols, BLOCK)], BLOCK,
                        q[r0 : r0 + BLOCK, c0 : c0 + cols], scratch)
    _canonical_nans(q, scale)
    return q, scale


def dequantize_fp8_block128(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 weight an engine computes from fp8-block128: ``fl(float(q) × scale_inv)`` of
    each element's block (DeepSeek-V3's ``weight_dequant``, before its cast to the default dtype).

    Args:
        q: float8_e4m3fn ``[M, N]``.
        scale_inv: float32 ``[ceil(M/128), ceil(N/128)]``.

    Returns:
        float32 ``[M, N]`` on the CPU.

    Raises:
        InvalidStateDictError: dtypes or shapes that do not belong together.
    """
    q, scale_inv = _cpu(q), _cpu(scale_inv)
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or scale_inv.dtype != torch.float32:
        raise InvalidStateDictError(
            f"fp8-block128 dequantization takes a 2-D float8_e4m3fn tensor and float32 scales, got "
            f"{q.dtype}{list(q.shape)} and {scale_inv.dtype}{list(scale_inv.shape)}"
        )
    m, n = q.shape
    if tuple(scale_inv.shape) != (_cdiv(m, BLOCK), _cdiv(n, BLOCK)):
        raise InvalidStateDictError(
            f"fp8-block128: scales of shape {list(scale_inv.shape)} do not fit a [{m}, {n}] weight; "
            f"expected [{_cdiv(m, BLOCK)}, {_cdiv(n, BLOCK)}]"
        )
    full = scale_inv.repeat_interleave(BLOCK, 0)[:m].repeat_interleave(BLOCK, 1)[:, :n]
    return q.to(torch.float32).mul_(full)


# --- mxfp8 ---------------------------------------------------------------------------------


def quantize_mxfp8(w: torch.Tensor, *, native: bool | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None,
                   amax: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP8: 32-element blocks along the last dimension, E8M0 scales, E4M3 elements.

    Per block: ``r = fl(max|x| × fl(1/448))``; the scale exponent ``e`` is the smallest with
    ``2**(e-127) ≥ r``, clamped to [0, 254] (read off r's float32 bits: its biased exponent, plus
    one when any mantissa bit is set; for a subnormal r, 1 when ``r > 2**-127`` else 0); each
    element ``q = e4m3(x × 2**(127-e))`` (exact before the one rounding, to nearest-even; never
    above 448). An all-zero block gets ``e = 0``. A block holding a NaN or ±Inf gets ``e = 0xFF``
    (E8M0 NaN) and every element 0x7F (NaN).

    Args:
        w: a bfloat16, float16 or float32 tensor of at least one dimension whose last dimension
            is a multiple of 32 (any device; computed on the CPU).
        native, out, amax: as in :func:`quantize_fp8_block128` (``amax``: one per block of 32).

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn of ``w``'s shape; ``scales`` uint8 of shape
        ``[..., K/32]``, the biased exponents (decode: 2**(e-127), 0xFF NaN). CPU, contiguous.

    Raises:
        InvalidStateDictError: another dtype, no dimension, or a last dimension that is not a
            multiple of 32 (serve such a tensor unquantized: engines refuse MXFP8 there too).

    Example::

        q, e = quantize_mxfp8(torch.randn(4096, 11008, dtype=torch.bfloat16))
        e.dtype, e.shape   # torch.uint8, torch.Size([4096, 344])
    """
    x = _checked(w, "mxfp8", two_d=False)
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise InvalidStateDictError(
            f"mxfp8 quantizes blocks of {MX_BLOCK} along the last dimension; shape {list(x.shape)} has "
            f"{k} there. Keep this tensor unquantized (vLLM and SGLang refuse MXFP8 for such a layer)"
        )
    q, scales = _outputs(out, tuple(x.shape), torch.float8_e4m3fn, scale_shape("mxfp8", x.shape), torch.uint8)
    kernel = _kernel("quantize_mxfp8", native)
    tail = _amax_arg(amax, kernel, x, scales)
    if x.numel() == 0:
        return q, scales
    if kernel is not None:
        rows = x.numel() // k
        _split(kernel, (_bytes(x), _dtype_code(x), rows, k, _bytes(q), scales.numpy()), rows, x.numel(), tail)
        return q, scales
    rows_2d, q_2d, e_2d = x.view(-1, k), q.view(-1, k), scales.view(-1, k // MX_BLOCK)
    step = max(1, STEP_ELEMENTS // k)
    scratch = torch.empty(min(rows_2d.shape[0], step) * k, dtype=torch.float32)
    for r0 in range(0, rows_2d.shape[0], step):
        rows = rows_2d[r0 : r0 + step]
        e = _e8m0_rceil(_amax_32(rows).mul_(_INV_E4M3_MAX))  # [rows, K/32]
        e_2d[r0 : r0 + step] = e
        _scale_cast(rows, _e8m0_reciprocal(e), MX_BLOCK, q_2d[r0 : r0 + step], scratch)
    bad = e_2d == E8M0_NAN
    if bad.any():  # a NaN or an infinity in the block: every element NaN, whatever the arithmetic gave
        q_2d.view(torch.uint8).unflatten(-1, (-1, MX_BLOCK))[bad] = E4M3_NAN
    return q, scales


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values MXFP8 encodes: ``float(q) × 2**(e-127)`` per block (exact), with scale
    code 0xFF decoding to NaN (OCP MX v1.0; vLLM's emulation reads 0xFF as 2**128 instead).

    Args:
        q: float8_e4m3fn ``[..., K]``.
        scales: uint8 ``[..., K/32]``.

    Returns:
        float32 of ``q``'s shape on the CPU.

    Raises:
        InvalidStateDictError: dtypes or shapes that do not belong together.
    """
    q, scales = _cpu(q), _cpu(scales)
    if q.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8 or q.dim() < 1:
        raise InvalidStateDictError(
            f"mxfp8 dequantization takes float8_e4m3fn elements and uint8 scales, got "
            f"{q.dtype}{list(q.shape)} and {scales.dtype}{list(scales.shape)}"
        )
    k = q.shape[-1]
    if k % MX_BLOCK or tuple(scales.shape) != (*q.shape[:-1], k // MX_BLOCK):
        raise InvalidStateDictError(
            f"mxfp8: scales of shape {list(scales.shape)} do not fit elements of shape {list(q.shape)}"
        )
    mult = _e8m0_value(scales.to(torch.int32))
    return q.to(torch.float32).mul_(mult.repeat_interleave(MX_BLOCK, -1))


# --- the reference -------------------------------------------------------------------------


def reference_quantize(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizers written plainly, for tests and benchmarks: numpy float32 arithmetic over
    a zero-padded copy, element by element, and :func:`encode_e4m3` instead of PyTorch's cast.
    Slow and memory-hungry (several float32 copies), but independent of the fast paths.

    Args:
        w: as :func:`quantize_fp8_block128` (``method="fp8-block128"``) or
            :func:`quantize_mxfp8` (``method="mxfp8"``) take it.
        method: ``"fp8-block128"`` or ``"mxfp8"``.

    Returns:
        What the quantizer of ``method`` returns.

    Raises:
        InvalidStateDictError: as the quantizer of ``method`` raises; an unknown method.
    """
    f32 = np.float32
    inv_max = np.uint32(INV_E4M3_MAX_BITS).view(f32)
    if method == "fp8-block128":
        x = _checked(w, method, two_d=True).to(torch.float32).numpy()
        m, n = x.shape
        pm, pn = _cdiv(m, BLOCK) * BLOCK, _cdiv(n, BLOCK) * BLOCK
        padded = np.zeros((pm, pn), f32)  # zeros never raise a block's maximum
        padded[:m, :n] = x
        blocks = padded.reshape(pm // BLOCK, BLOCK, pn // BLOCK, BLOCK)
        with np.errstate(invalid="ignore", divide="ignore"):
            amax = np.maximum(np.abs(blocks).max(axis=(1, 3), keepdims=True), f32(AMAX_FLOOR))  # NaN wins
            scale = amax * inv_max
            p = blocks * (f32(1) / scale)
        codes = encode_e4m3(p.reshape(pm, pn)[:m, :n])
        scale = np.where(np.isnan(scale), np.uint32(F32_NAN_BITS).view(f32), scale)
        return _from_codes(codes), torch.from_numpy(np.ascontiguousarray(scale.reshape(pm // BLOCK, pn // BLOCK)))
    if method == "mxfp8":
        x = _checked(w, method, two_d=False)
        k = x.shape[-1]
        if k % MX_BLOCK:
            raise InvalidStateDictError(f"mxfp8: the last dimension ({k}) is not a multiple of {MX_BLOCK}")
        blocks = x.to(torch.float32).numpy().reshape(-1, MX_BLOCK)
        with np.errstate(invalid="ignore", over="ignore"):
            r = np.abs(blocks).max(axis=1, initial=f32(0)) * inv_max  # NaN wins
            frac, ex = np.frexp(r)  # r = frac·2**ex with 0.5 <= frac < 1, subnormals included
            ceil_log2 = np.where(frac == 0.5, ex - 1, ex).astype(np.int64)
            exps = np.where(r == 0, 0, np.clip(ceil_log2 + E8M0_BIAS, 0, 254))
            exps = np.where(np.isfinite(r), exps, E8M0_NAN)
            p = (blocks.astype(np.float64) * np.ldexp(1.0, E8M0_BIAS - exps)[:, None]).astype(f32)  # exact
        codes = np.where((exps != E8M0_NAN)[:, None], encode_e4m3(p), np.uint8(E4M3_NAN))
        e = torch.from_numpy(exps.astype(np.uint8).reshape(*x.shape[:-1], k // MX_BLOCK))
        return _from_codes(codes.reshape(x.shape)), e
    raise InvalidStateDictError(f"reference_quantize: unknown method {method!r}; use 'fp8-block128' or 'mxfp8'")


def encode_e4m3(values: np.ndarray) -> np.ndarray:
    """float32 values to FP8 E4M3 (``float8_e4m3fn``) codes: round to nearest, ties to even;
    finite values and infinities beyond 448 saturate to ±448 (0x7E/0xFE); NaN is 0x7F; the sign
    of zero is kept. What PyTorch ≥ 2.13 writes for ``.to(torch.float8_e4m3fn)``, except that it
    keeps a NaN's sign.

    Args:
        values: a float32 array.

    Returns:
        uint8 codes of the same shape.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    mag = bits & np.uint32(0x7FFFFFFF)
    # normal range (>= 2**-6): keep 3 mantissa bits, round the 20 dropped ones to nearest-even
    code = (((mag >> 23).astype(np.int64) - 120) << 3) | ((mag >> 20) & 7)
    rest = mag & np.uint32(0xFFFFF)
    code += (rest > 0x80000) | ((rest == 0x80000) & ((code & 1) == 1))
    # subnormal range: multiples of 2**-9, rounded to nearest-even (rint); 8 is the smallest normal
    small = np.rint(np.minimum(mag, np.uint32(0x3C800000)).view(np.float32) * np.float32(512))
    code = np.where(mag < 0x3C800000, small.astype(np.int64), code)
    code = np.where(mag > 0x43E00000, 0x7E, code)  # beyond 448 (Inf too): saturate
    out = code.astype(np.uint8) | sign
    return np.where(mag > 0x7F800000, np.uint8(E4M3_NAN), out)


# --- helpers -------------------------------------------------------------------------------


def scale_shape(method: str, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The shape of the scales ``method`` (``"fp8-block128"`` or ``"mxfp8"``) gives a tensor of
    ``shape``: ``[ceil(M/128), ceil(N/128)]``, or ``[..., K/32]``."""
    if method == "mxfp8":
        return (*shape[:-1], shape[-1] // MX_BLOCK)
    return (_cdiv(shape[0], BLOCK), _cdiv(shape[1], BLOCK))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _outputs(out: tuple[torch.Tensor, torch.Tensor] | None, q_shape: tuple[int, ...], q_dtype: torch.dtype,
             s_shape: tuple[int, ...], s_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` when both tensors fit (CPU, contiguous, the shapes and dtypes), else new ones."""
    if out is not None:
        q, s = out
        if all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
               and tuple(t.shape) == tuple(shape) and t.dtype == dtype
               for t, shape, dtype in ((q, q_shape, q_dtype), (s, s_shape, s_dtype))):
            return q, s
    return torch.empty(q_shape, dtype=q_dtype), torch.empty(s_shape, dtype=s_dtype)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _checked(w: torch.Tensor, method: str, *, two_d: bool) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise InvalidStateDictError(f"{method} quantizes a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in INPUT_DTYPES:
        raise InvalidStateDictError(
            f"{method} quantizes bfloat16, float16 or float32 tensors, got {w.dtype}; cast the tensor "
            "(float64 to float32) or keep it unquantized"
        )
    if (two_d and w.dim() != 2) or w.dim() < 1:
        raise InvalidStateDictError(
            f"{method} quantizes {'2-D' if two_d else 'at least 1-D'} tensors, got shape {list(w.shape)}"
        )
    return _cpu(w)


def _kernel(name: str, native: bool | None):
    kernel = getattr(kernels, name, None)
    if native is True and kernel is None:
        raise InvalidStateDictError(
            f"native {name} is not loaded (no C compiler at install, an older build, or "
            f"{kernels.ENV_VAR}=0); pass native=None to use the PyTorch path"
        )
    return kernel if native is not False else None


def _amax_arg(amax: np.ndarray | None, kernel, x: torch.Tensor, scale: torch.Tensor) -> tuple:
    """The kernel's trailing ``amax`` argument (empty without one), checked."""
    if amax is None:
        return ()
    if kernel is None or x.dtype != torch.bfloat16:
        raise InvalidStateDictError("amax is filled by the native quantizers from bfloat16 input only")
    if not isinstance(amax, np.ndarray) or amax.dtype != np.uint16 or amax.size != scale.numel():
        raise InvalidStateDictError(f"amax must be a uint16 array of {scale.numel()} elements, one per scale")
    return (amax,)


def _split(kernel, args: tuple, units: int, elements: int, tail: tuple = ()) -> None:
    """Run a native kernel over units [0, units) (block rows or rows), in one call per thread
    when the tensor is large enough to pay for the threads (the kernels release the GIL);
    ``tail``: arguments after the range."""
    parts = max(1, min(jobs.default_threads(), units, elements // STEP_ELEMENTS))
    bounds = [units * i // parts for i in range(parts + 1)]
    if parts == 1:
        kernel(*args, 0, units, *tail)
        return
    with ThreadPoolExecutor(parts) as pool:
        for f in [pool.submit(kernel, *args, a, b, *tail) for a, b in zip(bounds, bounds[1:])]:
            f.result()


def _dtype_code(x: torch.Tensor) -> int:
    return INPUT_DTYPES.index(x.dtype)


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """The bits of |x| as integers (int16 for 16-bit floats, int32 for float32). Non-negative
    floats order as their bits do, and a NaN's bits exceed every other value's, so an integer
    maximum is max|x| with NaN winning, and cheaper than |x| in floating point."""
    if x.element_size() == 2:
        return x.view(torch.int16) & 0x7FFF
    return x.view(torch.int32) & 0x7FFFFFFF


def _bits_to_float(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = torch.int16 if torch.empty((), dtype=dtype).element_size() == 2 else torch.int32
    return bits.to(width).view(dtype).to(torch.float32)


def _amax_128(rows: torch.Tensor) -> torch.Tensor:
    """float32 max|x| of each 128-column block of ``rows`` (≤ 128 rows; the last block may be
    narrower)."""
    a = _abs_bits(rows)
    n = a.shape[1]
    full = n // BLOCK * BLOCK
    parts = [a[:, :full].unflatten(1, (-1, BLOCK)).amax(0).amax(1)] if full else []
    if full < n:
        parts.append(a[:, full:].amax().reshape(1))
    return _bits_to_float(torch.cat(parts) if len(parts) > 1 else parts[0], rows.dtype)


def _amax_32(rows: torch.Tensor) -> torch.Tensor:
    """float32 max|x| of each 32-element block of each row of ``rows`` (int32 reductions over a
    short last dimension vectorize; int16 ones do not)."""
    a = _abs_bits(rows).to(torch.int32)
    return _bits_to_float(a.unflatten(1, (-1, MX_BLOCK)).amax(-1), rows.dtype)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a numpy array (the native kernels' buffers)."""
    return t.view(torch.uint8).numpy()


def _scale_cast(x: torch.Tensor, mult: torch.Tensor, b: int, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """``out = e4m3(fl(x × mult))``, with ``mult[..., j]`` the multiplier of columns
    [j·b, (j+1)·b) (1-D: of every row; 2-D: of its row); ``scratch`` holds the float32
    products: one widening copy, one multiply in place, one cast."""
    rows, n = x.shape
    buf = scratch[: rows * n].view(rows, n)
    buf.copy_(x)
    full = n // b * b
    if full:
        per_block = mult[..., : full // b].unsqueeze(-1)  # [blocks, 1] or [rows, blocks, 1]
        buf[:, :full].unflatten(-1, (-1, b)).mul_(per_block)
    if full < n:  # a partial last block (fp8-block128 only: mxfp8 blocks divide the rows)
        buf[:, full:].mul_(mult[full // b])
    out.copy_(buf)


def _canonical_nans(q: torch.Tensor, scale: torch.Tensor) -> None:
    """Rewrite the NaNs of non-finite fp8-block128 blocks as 0x7F / 0x7FC00000: the reference
    leaves their signs and payloads to the hardware."""
    bad = ~torch.isfinite(scale)
    if not bad.any():
        return
    codes = q.view(torch.uint8)
    for bi, bj in bad.nonzero().tolist():
        block = codes[bi * BLOCK : (bi + 1) * BLOCK, bj * BLOCK : (bj + 1) * BLOCK]
        block[(block & 0x7F) == E4M3_NAN] = E4M3_NAN
    scale.view(torch.int32)[torch.isnan(scale)] = F32_NAN_BITS


def _e8m0_rceil(r: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent of the power of two at or above each float32 ``r`` (≥ 0 or NaN):
    uint8, 0xFF for NaN and Inf. Normal r: its biased exponent, plus one when a mantissa bit is
    set; subnormal r: 1 above 2**-127, else 0."""
    bits = r.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = mant > (exp == 0).to(torch.int32).mul_(0x400000)
    return exp.add_(up).clamp_(max=E8M0_NAN).to(torch.uint8)  # 0xFF (+1) stays 0xFF


def _e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """float32 2**(e-127) for int32 codes ``e`` in [0, 255] (0xFF: NaN; 0: the subnormal 2**-127)."""
    bits = torch.where(e == 0, 0x00400000, e << 23)
    bits = torch.where(e == E8M0_NAN, F32_NAN_BITS, bits)
    return bits.to(torch.int32).view(torch.float32)


def _e8m0_reciprocal(e: torch.Tensor) -> torch.Tensor:
    """float32 2**(127-e) for uint8 codes: always a normal float32 since finite blocks have
    e <= 247 (r < 2**120). A NaN code gives -Inf; those blocks are rewritten afterwards."""
    return ((2 * E8M0_BIAS - e.to(torch.int32)) << 23).view(torch.float32)


def _from_codes(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)).view(torch.float8_e4m3fn)
