"""The serving quantizers (docs/SPEC.md "Serving formats: quantizers"): the fast paths against
the numpy reference and against the engines' reference arithmetic, bit for bit; the E4M3 cast;
the special blocks (all zero, NaN, ±Inf, huge, subnormal, -0.0); the dequantization error bound;
and the native kernels against the PyTorch path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deltastore._util import kernels
from deltastore.errors import InvalidStateDictError
from deltastore.serving import quantize as qmod
from deltastore.serving.quantize import (
    AMAX_FLOOR,
    E4M3_NAN,
    E8M0_NAN,
    F32_NAN_BITS,
    INV_E4M3_MAX_BITS,
    dequantize_fp8_block128,
    dequantize_mxfp8,
    encode_e4m3,
    quantize_fp8_block128,
    quantize_mxfp8,
    reference_quantize,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
QUANTIZERS = {"fp8-block128": quantize_fp8_block128, "mxfp8": quantize_mxfp8}
HAVE_NATIVE = all(getattr(kernels, n, None) is not None for n in ("quantize_fp8_block128", "quantize_mxfp8"))
needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="native quantizers not built")
PATHS = [False, pytest.param(True, marks=needs_native)]


def codes(t: torch.Tensor) -> np.ndarray:
    """Raw bits: uint8 for fp8/uint8 tensors, uint32 for float32 (NaN payloads count)."""
    t = t.contiguous()
    return t.view(torch.int32).numpy().view(np.uint32) if t.dtype == torch.float32 else t.view(torch.uint8).numpy()


def assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    for x, y, part in zip(a, b, ("elements", "scales")):
        where = f"{what} {part}"
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{where}: {x.dtype}{list(x.shape)}, {y.dtype}{list(y.shape)}"
        diff = np.flatnonzero(codes(x).ravel() != codes(y).ravel())
        assert diff.size == 0, f"{where}: {diff.size} differ, first at flat index {diff[0]}"


def f32(bits: int) -> float:
    return float(np.uint32(bits).view(np.float32))


def tensor(values, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(dtype)


@st.composite
def weights(draw, method: str) -> torch.Tensor:
    """Small ragged weights: random magnitudes per row, and a few special values dropped in."""
    if method == "fp8-block128":
        shape = (draw(st.integers(1, 200)), draw(st.integers(1, 200)))
    else:
        shape = (draw(st.integers(1, 40)), 32 * draw(st.integers(1, 4)))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    exp = draw(st.integers(-40, 20))
    rows = torch.exp2(torch.randint(exp - 6, exp + 1, (shape[0], 1), generator=g).float())
    w = (torch.randn(shape, generator=g) * rows).to(dtype)
    specials = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e38, 448.0, 2.0**-133]
    for value in draw(st.lists(st.sampled_from(specials), max_size=4)):
        i, j = draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1))
        w[i, j] = value
    if draw(st.booleans()):  # an all-zero region: whole blocks of zeros
        w[: shape[0] // 2, : shape[1] // 2] = 0
    return w


# --- bit identity -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(QUANTIZERS))
@given(data=st.data())
def test_fast_path_matches_the_reference(method, data):
    w = data.draw(weights(method))
    assert_same(QUANTIZERS[method](w, native=False), reference_quantize(w, method), f"{method} {w.dtype}")


@needs_native
@pytest.mark.parametrize("method", list(QUANTIZERS))
@given(data=st.data())
def test_native_matches_the_pytorch_path(method, data):
    w = data.draw(weights(method))
    assert_same(QUANTIZERS[method](w, native=True), QUANTIZERS[method](w, native=False), f"{method} {w.dtype}")


def _vllm_per_block_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per_block_cast_to_fp8 (use_ue8m0=False) as PyTorch evaluates it on CUDA: its
    ``amax / 448.0`` divides by a Python scalar, which CUDA computes as ``amax × float32(1/448)``."""
    m, n = x.shape
    padded = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=x.dtype)
    padded[:m, :n] = x
    view = padded.view(-1, 128, padded.size(1) // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = amax * torch.tensor(1 / 448.0, dtype=torch.float32)
    q = (view * (1.0 / sf)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:m, :n].contiguous(), sf.view(view.size(0), view.size(2))


def _torchao_rceil(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao ``to_mx(x, float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)`` (eager path)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    descale = blocks.abs().amax(-1).float() * (1.0 / 448.0)
    bits = descale.view(torch.int32)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = (exp + torch.where(exp == 0, mant > 0x400000, mant != 0)).to(torch.uint8)
    mult = ((254 - e.to(torch.int32)) << 23).view(torch.float32)
    return (blocks.float() * mult.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape), e


def _vllm_mxfp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``_mxfp8_e4m3_quantize_torch`` (ceil(log2(amax / 448)) + 127, clamped, then a
    division by the power of two), evaluated here on the CPU: an exact division by 448 instead of
    the multiplication by float32(1/448), which changes no exponent for 16-bit inputs."""
    blocks = x.float().view(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    biased = (torch.ceil(torch.log2(amax / 448.0)) + 127.0).clamp(0, 254)
    q = (blocks / torch.exp2(biased - 127.0).unsqueeze(-1)).view(x.shape).to(torch.float8_e4m3fn)
    return q, biased.to(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_block128_is_vllms_per_block_cast(dtype):
    g = torch.Generator().manual_seed(7)
    for shape in [(260, 200), (129, 257)]:
        w = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 4, (shape[0], 1), generator=g))).to(dtype)
        assert_same(quantize_fp8_block128(w), _vllm_per_block_cast_to_fp8(w), f"{shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_is_torchao_rceil_and_vllms_online_quantizer(dtype):
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-20, 6, (64, 1), generator=g))).to(dtype)
    w[0, :32] = 3.5  # amax/448 exactly a power of two: the boundary of the round-up
    w[1, :32] = 2.0**-130 if dtype == torch.bfloat16 else 0  # a subnormal (bf16) or zero block
    ours = quantize_mxfp8(w)
    assert_same(ours, _torchao_rceil(w), f"torchao {dtype}")
    assert_same(ours, _vllm_mxfp8_torch(w), f"vLLM {dtype}")
    assert ours[1][0, 0] == 127 - 7  # 2**-7 >= 3.5/448: no round-up past the exact power


# --- the E4M3 cast ----------------------------------------------------------------------------


def test_pytorch_cast_is_the_specified_e4m3_rounding():
    """The PyTorch path casts with PyTorch; the reference and the native kernel with the
    specified encoder. They must agree on every rounding boundary of the E4M3 range."""
    top = np.arange(0x3A000000 >> 19, 0x44000000 >> 19, dtype=np.uint32) << 19  # every kept-bits + round bit
    pats = [np.arange(1 << 16, dtype=np.uint32) << 16]  # every bfloat16
    for low in (0, 1, 0x3FFFF, 0x40000, 0x7FFFF):
        pats += [top | np.uint32(low), top | np.uint32(low) | np.uint32(0x80000000)]
    values = np.concatenate(pats).view(np.float32)
    ours = encode_e4m3(values)
    theirs = torch.from_numpy(values.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    keep = ~np.isnan(values)  # PyTorch keeps a NaN's sign; the formats write every NaN as 0x7F
    assert np.array_equal(ours[keep], theirs[keep])
    assert (ours[~keep] == E4M3_NAN).all()


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (448.0, 0x7E), (464.0, 0x7E), (500.0, 0x7E), (float("inf"), 0x7E), (-float("inf"), 0xFE),
        (float("nan"), 0x7F), (-float("nan"), 0x7F), (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38),
        (1.0625, 0x38), (1.1875, 0x3A), (2.0**-6, 0x08), (2.0**-9, 0x01), (2.0**-10, 0x00),
        (1.5 * 2.0**-9, 0x02), (-(2.0**-10) * 1.01, 0x81), (240.0, 0x77), (2.0**-130, 0x00),
    ],
)  # fmt: skip
def test_encode_e4m3(value, code):
    assert int(encode_e4m3(np.array([value], np.float32))[0]) == code


# --- special blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("native", PATHS)
def test_fp8_block128_special_blocks(native):
    w = torch.full((256, 384), 0.5, dtype=torch.bfloat16)
    w[:128, :128] = 0
    w[5, 7] = -0.0
    w[0:2, 128] = tensor([float("inf"), -2.0])  # block (0, 1): ±Inf
    w[1, 129] = -float("inf")
    w[130, 300] = float("nan")  # block (1, 2): NaN wins over the Inf below it
    w[131, 301] = float("inf")
    w[200, 10] = torch.finfo(torch.bfloat16).max  # block (1, 0): huge
    q, s = quantize_fp8_block128(w, native=native)
    c, sb = codes(q), codes(s)
    zero_scale = np.float32(f32(0x38D1B717)) * np.float32(f32(INV_E4M3_MAX_BITS))
    assert sb[0, 0] == np.float32(zero_scale).view(np.uint32) and np.float32(AMAX_FLOOR).view(np.uint32) == 0x38D1B717
    assert c[0, 0] == 0x00 and c[5, 7] == 0x80  # zeros keep their sign
    assert sb[0, 1] == 0x7F800000 and c[0, 128] == E4M3_NAN and c[1, 129] == E4M3_NAN
    assert c[1, 128] == 0x80 and c[3, 200] == 0x00  # finite elements of an Inf block: ±0
    assert sb[1, 2] == F32_NAN_BITS and (c[128:256, 256:384] == E4M3_NAN).all()
    assert c[200, 10] == 0x7E and np.isfinite(s[1, 0].item())  # the block's maximum maps to 448
    assert (c[0:128, 256:384] == 0x7E).all()  # every element is its block's maximum: 448
    d = dequantize_fp8_block128(q, s)
    assert torch.isnan(d[130:256, 256:]).all() and torch.isfinite(d[:128, :128]).all()


@pytest.mark.parametrize("native", PATHS)
def test_mxfp8_special_blocks(native):
    w = torch.full((4, 192), 0.5, dtype=torch.bfloat16)
    w[0, :32] = 0
    w[0, 3] = -0.0
    w[0, 40] = float("inf")  # block (0, 1)
    w[0, 70] = float("nan")  # block (0, 2)
    w[1, :32] = tensor([2.0**-133] * 32)  # bfloat16's smallest subnormal
    w[2, :32] = torch.finfo(torch.bfloat16).max
    w[3, 32:64] = tensor([-3.5] + [1e-3] * 31)  # amax/448 = 2**-7 exactly
    q, e = quantize_mxfp8(w, native=native)
    c, ec = codes(q), codes(e)
    assert ec[0, 0] == 0 and c[0, 0] == 0x00 and c[0, 3] == 0x80
    assert ec[0, 1] == E8M0_NAN and ec[0, 2] == E8M0_NAN and (c[0, 32:96] == E4M3_NAN).all()
    assert ec[1, 0] == 0 and (c[1, :32] == 0x08).all()  # 2**-133 × 2**127 = 2**-6
    assert ec[2, 0] == 127 + 120 and c[2, 0] == 0x78  # max = 255·2**120: 2**120 >= max/448; 255 rounds to 256
    assert ec[3, 1] == 127 - 7 and c[3, 32] == 0xFE  # -3.5 × 2**7 = -448
    assert ec[3, 0] == 127 - 9 and (c[3, :32] == 0x78).all()  # 2**-9 >= 0.5/448; 0.5 × 2**9 = 256
    d = dequantize_mxfp8(q, e)
    assert torch.isnan(d[0, 32:96]).all() and d[3, 32].item() == -3.5 and d[0, 3].item() == 0.0


# --- error bound ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantization_error_bound(dtype):
    """Half an E4M3 step of each element (relative 2**-4), or half the smallest subnormal step
    of its block (2**-10 × scale), plus the float32 rounding before the cast."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(200, 160, generator=g) * torch.exp2(torch.randint(-30, 10, (200, 1), generator=g))).to(dtype)
    x = w.float()
    q, s = quantize_fp8_block128(w)
    scale = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :160]
    err = (dequantize_fp8_block128(q, s) - x).abs()
    assert (err <= x.abs() * (2.0**-4 + 2.0**-20) + scale * (2.0**-10 + 2.0**-30)).all()
    q, e = quantize_mxfp8(w)
    scale = torch.exp2(e.float() - 127).repeat_interleave(32, 1)
    err = (dequantize_mxfp8(q, e) - x).abs()
    assert (err <= x.abs() * 2.0**-4 + scale * 2.0**-10).all()


# --- input checks -----------------------------------------------------------------------------


def test_quantizers_refuse_what_they_cannot_quantize():
    with pytest.raises(InvalidStateDictError, match="2-D"):
        quantize_fp8_block128(torch.zeros(4, 4, 4, dtype=torch.bfloat16))
    with pytest.raises(InvalidStateDictError, match="float64"):
        quantize_fp8_block128(torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(InvalidStateDictError, match="multiple of 32|blocks of 32"):
        quantize_mxfp8(torch.zeros(4, 48, dtype=torch.bfloat16))
    with pytest.raises(InvalidStateDictError, match="unknown method"):
        reference_quantize(torch.zeros(4, 32), "nvfp4")
    with pytest.raises(InvalidStateDictError, match="do not fit"):
        dequantize_fp8_block128(torch.zeros(130, 4, dtype=torch.float8_e4m3fn), torch.zeros(1, 1))
    with pytest.raises(InvalidStateDictError, match="do not fit"):
        dequantize_mxfp8(torch.zeros(2, 64, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8))


def test_shapes_layouts_and_empty_tensors():
    w = torch.randn(5, 3, 64).to(torch.bfloat16)  # mxfp8 takes any leading dimensions
    q, e = quantize_mxfp8(w)
    assert q.shape == w.shape and e.shape == (5, 3, 2) and e.dtype == torch.uint8
    t = torch.randn(200, 130).to(torch.bfloat16).t()  # not contiguous
    assert_same(quantize_fp8_block128(t), quantize_fp8_block128(t.contiguous()), "transposed")
    q, s = quantize_fp8_block128(torch.zeros(0, 300, dtype=torch.bfloat16))
    assert q.shape == (0, 300) and s.shape == (0, 3)
    q, e = quantize_mxfp8(torch.zeros(3, 0, dtype=torch.bfloat16))
    assert q.shape == (3, 0) and e.shape == (3, 0)


def test_native_true_without_the_kernel_says_so(monkeypatch):
    monkeypatch.setattr(kernels, "quantize_fp8_block128", None, raising=False)
    with pytest.raises(InvalidStateDictError, match="not loaded"):
        quantize_fp8_block128(torch.zeros(2, 2), native=True)


@needs_native
def test_native_kernel_checks_its_buffers():
    src = np.zeros(4 * 64 * 2, np.uint8)
    q, e = np.zeros(4 * 64, np.uint8), np.zeros(4 * 2, np.uint8)
    kernels.quantize_mxfp8(src, 0, 4, 64, q, e, 0, 4)
    with pytest.raises(ValueError):
        kernels.quantize_mxfp8(src, 0, 4, 64, q, e, 0, 5)  # rows out of range
    with pytest.raises(ValueError):
        kernels.quantize_mxfp8(src[:-1], 0, 4, 64, q, e, 0, 4)  # short source
    with pytest.raises(ValueError):
        kernels.quantize_fp8_block128(src, 0, 4, 64, q, np.zeros(2, np.float32), 0, 1)  # wrong scale count


def test_step_boundaries_do_not_change_the_result(monkeypatch):
    """The PyTorch path works in steps of STEP_ELEMENTS; a tensor spanning several steps gives
    what one step gives."""
    w = (torch.randn(300, 600) * 0.1).to(torch.bfloat16)
    whole = quantize_fp8_block128(w, native=False), quantize_mxfp8(w[:, :576], native=False)
    monkeypatch.setattr(qmod, "STEP_ELEMENTS", 128 * 256)
    assert_same(quantize_fp8_block128(w, native=False), whole[0], "fp8 steps")
    assert_same(quantize_mxfp8(w[:, :576], native=False), whole[1], "mx steps")


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("method", sorted(QUANTIZERS))
def test_results_written_into_earlier_outputs_are_the_same_bits(method, native):
    """``out=`` (a publisher reusing its last version's tensors): every element and scale is
    written anew, whatever the buffers held; buffers that do not fit are not used."""
    quantize = QUANTIZERS[method]
    w = (torch.randn(300, 256) * 0.05).to(torch.bfloat16)
    w[7, 3] = float("nan")
    want = quantize(w, native=native)
    q, s = quantize(torch.randn(300, 256).to(torch.bfloat16) * 100, native=native)
    q.view(torch.uint8).fill_(0x55)
    s.view(torch.uint8).fill_(0xAA)
    got = quantize(w, native=native, out=(q, s))
    assert got[0] is q and got[1] is s
    assert_same(got, want, f"{method} into earlier outputs")
    wrong = (torch.empty(300, 128, dtype=torch.float8_e4m3fn), s)
    fresh = quantize(w, native=native, out=wrong)
    assert fresh[0] is not wrong[0] and fresh[1] is not s
    assert_same(fresh, want, f"{method} with outputs that do not fit")


@pytest.mark.skipif(kernels.quantize_fp8_block128 is None, reason="needs the native kernels")
def test_amax_is_each_blocks_largest_magnitude_as_bfloat16_bits() -> None:
    w = (torch.randn(300, 416, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    w[5, 7] = float("nan")
    bits = w.view(torch.int16).to(torch.int32) & 0x7FFF  # |x| as bits; a NaN's above every number
    fp8 = np.empty(3 * 4, np.uint16)
    quantize_fp8_block128(w, amax=fp8)
    padded = torch.zeros(384, 512, dtype=torch.int32)
    padded[:300, :416] = bits
    want = padded.view(3, 128, 4, 128).amax(dim=(1, 3)).reshape(-1)
    assert fp8.tolist() == want.tolist()
    mx = np.empty(300 * 13, np.uint16)
    quantize_mxfp8(w, amax=mx)
    assert mx.tolist() == bits.view(300, 13, 32).amax(dim=2).reshape(-1).tolist()
    with pytest.raises(InvalidStateDictError, match="bfloat16"):
        quantize_fp8_block128(w.float(), amax=fp8)
    with pytest.raises(InvalidStateDictError, match="one per scale"):
        quantize_mxfp8(w, amax=np.empty(3, np.uint16))
