"""Serving formats (docs/SPEC.md "Serving formats: quantizers"): names and patterns, which tensors
each format quantizes, the serving state dict derive makes, and the errors it raises.
"""

from __future__ import annotations

import pytest
import torch

from deltastore.errors import FormatError, InvalidStateDictError, UnknownFormatError
from deltastore.serving import (
    DEFAULT_EXCLUDE,
    KNOWN_FORMATS,
    SCALE_SUFFIX,
    ServingFormat,
    derive,
    quantize_fp8_block128,
    quantize_mxfp8,
    serving_format,
)
from testkit.tensors import assert_bits_equal, raw


def llama_like() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)

    return {
        "model.embed_tokens.weight": w(100, 64),
        "model.layers.0.input_layernorm.weight": w(64),
        "model.layers.0.self_attn.q_proj.weight": w(64, 64),
        "model.layers.0.self_attn.q_proj.bias": w(64),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": w(144, 64),  # ragged rows (DeepSeek: 576)
        "model.layers.0.mlp.gate.weight": w(8, 64),  # MoE router
        "model.layers.0.mlp.experts.0.gate_proj.weight": w(40, 64),  # 40 rows, 64 columns
        "model.layers.0.mlp.experts.0.down_proj.weight": w(64, 40),  # 40 columns: not mxfp8
        "model.layers.0.mlp.shared_expert_gate.weight": w(1, 64),
        "model.norm.weight": w(64, dtype=torch.float32),
        "lm_head.weight": w(100, 64),
        "rotary.inv_freq": w(16, dtype=torch.float64),
        "step": torch.tensor(7),
    }


QUANTIZED = {
    "fp8-block128": {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.down_proj.weight",
    },
    "mxfp8": {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
    },
}


# --- names and patterns -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["fp8", "FP8-BLOCK128", "nvfp4", ""])
def test_unknown_format_lists_the_known_ones(bad):
    with pytest.raises(UnknownFormatError) as e:
        serving_format(bad)
    assert e.value.available == KNOWN_FORMATS == ("bf16", "fp8-block128", "mxfp8")
    assert all(name in str(e.value) for name in KNOWN_FORMATS) and repr(bad) in str(e.value)
    with pytest.raises(UnknownFormatError):
        derive({}, bad)


def test_serving_format_takes_a_name_or_a_format():
    fmt = ServingFormat("mxfp8", exclude=())
    assert serving_format(fmt) is fmt
    assert serving_format("fp8-block128") == ServingFormat("fp8-block128")
    assert serving_format("fp8-block128").exclude == DEFAULT_EXCLUDE
    assert serving_format("bf16").include == () and serving_format("bf16").scale_suffix is None
    with pytest.raises(UnknownFormatError):
        serving_format(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "bf16", "include": ("*.weight",)},
        {"name": "fp8-block128", "include": "*.weight"},  # a string, not a sequence of patterns
        {"name": "mxfp8", "exclude": ("",)},
        {"name": "mxfp8", "include": (3,)},
    ],
)
def test_invalid_patterns_are_refused(kwargs):
    with pytest.raises(FormatError):
        ServingFormat(**kwargs)


def test_the_default_selection_follows_the_engines():
    state = llama_like()
    for name in KNOWN_FORMATS:
        fmt = serving_format(name)
        chosen = {n for n, t in state.items() if fmt.selects(n, t.shape)}
        assert chosen == QUANTIZED.get(name, set()), name
    fp8 = serving_format("fp8-block128")
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "transformer.wte.weight", "model.norm.weight",
                 "model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.mlp.router.weight"):
        assert not fp8.selects(kept, (64, 64)), kept
    assert fp8.selects("model.layers.3.block_sparse_moe.experts.1.w1.weight", (64, 64))


def test_patterns_can_be_replaced():
    fmt = ServingFormat("fp8-block128", include=("*.mlp.*",), exclude=("*.down_proj.*",))
    assert fmt.selects("l.mlp.up_proj.weight", (4, 4)) and fmt.selects("l.mlp.up_proj.bias2d", (4, 4))
    assert not fmt.selects("l.mlp.down_proj.weight", (4, 4)) and not fmt.selects("l.attn.q.weight", (4, 4))
    assert not fmt.selects("l.mlp.up_proj.weight", (4, 4, 4))  # only 2-D tensors, whatever the patterns
    assert ServingFormat("fp8-block128", exclude=()).selects("lm_head.weight", (4, 4))
    assert not ServingFormat("fp8-block128").selects("model.Norm.weight".lower(), (4, 4))
    assert ServingFormat("fp8-block128").selects("model.NORM_proj.weight", (4, 4))  # case-sensitive


# --- derive -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8-block128", "mxfp8"])
def test_derive_quantizes_the_selected_and_keeps_the_rest(name):
    state = llama_like()
    out = derive(state, name)
    quantize = {"fp8-block128": quantize_fp8_block128, "mxfp8": quantize_mxfp8}[name]
    suffix = SCALE_SUFFIX[name]
    expected = []
    for n, t in state.items():
        expected.append(n)
        if n in QUANTIZED[name]:
            expected.append(n + suffix)
            assert_bits_equal({n: out[n], "s": out[n + suffix]}, dict(zip((n, "s"), quantize(t))))
            assert out[n].dtype == torch.float8_e4m3fn
        elif t.is_floating_point():
            assert out[n].dtype == torch.bfloat16 and raw(out[n]) == raw(t.to(torch.float32).to(torch.bfloat16))
        else:
            assert out[n] is state[n]
    assert list(out) == expected  # the input's order, each scale right after its tensor
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in out.values())
    scale = out["model.layers.0.self_attn.kv_a_proj_with_mqa.weight" + suffix]
    assert scale.shape == ((2, 1) if name == "fp8-block128" else (144, 2))
    assert scale.dtype == (torch.float32 if name == "fp8-block128" else torch.uint8)


def test_derive_bf16_casts_floating_tensors_only():
    state = llama_like()
    out = derive(state, "bf16")
    assert list(out) == list(state)
    assert out["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]  # bf16 already: not copied
    assert out["model.norm.weight"].dtype == torch.bfloat16 and out["step"] is state["step"]
    x = torch.tensor([1 + 2**-8 + 2**-40], dtype=torch.float64)  # float64 rounds through float32
    assert derive({"x": x}, "bf16")["x"].item() == 1.0
    nans = torch.full((40,), float("nan"))
    nans[3] = -float("nan")
    for dtype in (torch.float32, torch.float16, torch.float64):
        out = derive({"n": nans.to(dtype)}, "bf16")["n"]
        assert (out.view(torch.int16) == 0x7FC0).all(), dtype  # one NaN, whatever the cast wrote
    nan_bf16 = torch.tensor([-1], dtype=torch.int16).view(torch.bfloat16)  # a bf16 NaN is kept as it is
    assert raw(derive({"n": nan_bf16}, "bf16")["n"]) == raw(nan_bf16)


def test_derive_is_deterministic_and_takes_any_layout():
    state = llama_like()
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].t()
    for name in KNOWN_FORMATS:
        a, b = derive(state, name), derive({k: v.contiguous() for k, v in state.items()}, name)
        assert_bits_equal(a, b, name)


def test_derive_refuses_a_name_collision():
    state = llama_like()
    state["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(InvalidStateDictError, match=r"q_proj\.weight'.*q_proj\.weight_scale_inv"):
        derive(state, "fp8-block128")
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in derive(state, "mxfp8")  # mxfp8 adds _scale
    state["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(1, 1)
    with pytest.raises(InvalidStateDictError, match="weight_scale"):
        derive(state, "mxfp8")


def test_derive_names_the_tensor_it_cannot_quantize():
    with pytest.raises(InvalidStateDictError, match=r"'layers\.0\.o_proj\.weight'.*float64"):
        derive({"layers.0.o_proj.weight": torch.zeros(4, 32, dtype=torch.float64)}, "mxfp8")
    with pytest.raises(InvalidStateDictError, match="'a.weight'.*list"):
        derive({"a.weight": [1.0]}, "bf16")  # type: ignore[dict-item]
    with pytest.raises(InvalidStateDictError, match="'s.weight'.*sparse"):
        derive({"s.weight": torch.eye(3).to_sparse()}, "fp8-block128")
    keep = ServingFormat("mxfp8", exclude=("*o_proj*",))  # excluded: kept (cast), not refused
    assert derive({"layers.0.o_proj.weight": torch.zeros(4, 32, dtype=torch.float64)}, keep)[
        "layers.0.o_proj.weight"
    ].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["fp8-block128", "mxfp8"])
def test_derive_into_an_earlier_result_gives_the_same_bits(name):
    """``reuse=``: the quantized tensors and scales of an earlier result are written anew; kept
    tensors are never taken from it."""
    earlier = derive(llama_like(), name)
    state = {n: t * 3 if t.is_floating_point() else t for n, t in llama_like().items()}
    want = derive(state, name)
    got = derive(state, name, reuse=earlier)
    assert list(got) == list(want)
    assert_bits_equal(got, want)
    fmt = serving_format(name)
    for n, t in got.items():
        quantized = n not in state or fmt.selects(n, state[n].shape)
        assert (t is earlier[n]) == quantized, n
