"""Torch glue (deltastore.layout.tensors) and what ``publish`` accepts: every dtype bit-exact, bad input
refused with the tensor's name before anything is written."""

from __future__ import annotations

import uuid
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltastore import InvalidStateDictError, LayoutMismatchError, Publisher, Subscriber
from deltastore.layout.tensors import (
    TensorSpec,
    bits,
    check_layout,
    spec_for,
    state_digest,
    validate_state_dict,
)
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.stores import keys
from testkit.tensors import SMALL_CHUNK_BYTES, assert_bits_equal, small_state, snapshot

#: Every dtype deltastore must carry bit-exactly (1-, 2-, 4- and 8-byte elements).
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
]  # fmt: skip


def _url() -> str:
    return f"memory://tensors-{uuid.uuid4().hex}"


def _random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` holding arbitrary bit patterns (NaN payloads, subnormals, ...)."""
    t = torch.empty(shape, dtype=dtype)
    b = bits(t)
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        b[:] = rng.integers(0, 2, size=b.size, dtype=b.dtype)
    else:
        b[:] = rng.integers(0, np.iinfo(b.dtype).max, size=b.size, dtype=b.dtype, endpoint=True)
    return t


# --- bits and specs ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bits_is_a_view_of_the_tensor(dtype: torch.dtype) -> None:
    t = _random_bits(dtype, (5, 3), seed=1)
    b = bits(t)
    assert b.dtype.kind == "u" and b.itemsize == t.element_size() and b.shape == (15,)
    assert bits(t.clone()).tobytes() == b.tobytes()
    b[0] ^= 1  # a view: writing the bits writes the tensor
    assert bits(t)[0] == b[0]


@given(
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
    width=st.sampled_from([1, 2, 4, 8]),
    target=st.integers(1, 200),
)
@settings(deadline=None)
def test_chunks_partition_the_tensor(shape: tuple[int, ...], width: int, target: int) -> None:
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}[width]
    spec = spec_for("x", torch.empty(shape, dtype=dtype), target)
    assert spec.shape == shape and spec.chunk_rows >= 1
    spans = [spec.chunk_span(i) for i in range(spec.n_chunks)]
    assert spans[0][0] == 0 and spans[-1][1] == spec.numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    row_bytes = spec.row_elems * width
    for a, b in spans:
        assert b >= a
        # a chunk stays within the target unless a single row is already larger
        assert (b - a) * width <= max(target, row_bytes)
    if shape:
        assert spec.n_chunks == max(1, -(-shape[0] // spec.chunk_rows))
    else:
        assert spans == [(0, 1)]


def test_state_digest_sees_every_bit() -> None:
    a = bits(_random_bits(torch.bfloat16, (64,), seed=3)).copy()
    d = state_digest(a)
    assert d == state_digest(a.copy()) and len(d) == 32
    for i in (0, 31, 63):
        for bit in (0, 15):
            b = a.copy()
            b[i] ^= np.uint16(1 << bit)
            assert state_digest(b) != d


def test_check_layout_names_the_first_difference() -> None:
    specs = {n: spec_for(n, t) for n, t in small_state(0).items()}
    check_layout(specs, small_state(1), against="v1")
    for mutate, name in [
        (lambda s: s.pop("t2"), "t2"),
        (lambda s: s.__setitem__("zz", torch.zeros(1)), "zz"),
        (lambda s: s.__setitem__("t1", s["t1"].double()), "t1"),
        (lambda s: s.__setitem__("t3", s["t3"].reshape(16, 16)), "t3"),
    ]:
        s = small_state(1)
        mutate(s)
        with pytest.raises(LayoutMismatchError, match=name):
            check_layout(specs, s, against="v1")


# --- publish: every dtype and shape round-trips ----------------------------------------------


def test_every_dtype_and_odd_shape_round_trips_bit_exactly() -> None:
    state: dict[str, torch.Tensor] = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).removeprefix("torch.")
        state[f"{name}.mat"] = _random_bits(dt, (37, 5), seed=i)
        state[f"{name}.scalar"] = _random_bits(dt, (), seed=100 + i)
        state[f"{name}.empty"] = torch.empty((0, 3), dtype=dt)
    state["vector"] = _random_bits(torch.bfloat16, (1000,), seed=7)
    state["4d"] = _random_bits(torch.float16, (3, 1, 4, 5), seed=8)
    state["zero-width"] = torch.empty((6, 0), dtype=torch.float32)
    url = _url()
    versions = [snapshot(state)]
    rng = np.random.default_rng(0)
    for _ in range(2):  # flip random bits, including 0-d and bool tensors
        nxt = snapshot(versions[-1])
        for n, t in nxt.items():
            b = bits(t)
            if b.size and rng.random() < 0.6:
                b[rng.integers(0, b.size)] ^= 1
        versions.append(nxt)
    with Publisher(url, writer_policy=WriterPolicy(threads=2), layout_policy=LayoutPolicy(chunk_bytes=SMALL_CHUNK_BYTES)) as pub:
        for v in versions:
            pub.publish(v)
    with Subscriber(url, threads=2) as sub:
        for i, v in enumerate(versions, start=1):
            assert_bits_equal(sub.pull(i), v, f"version {i}")
        target = sub.pull(1)
        sub.pull_into(target)
        assert_bits_equal(target, versions[-1])


# --- publish: bad input ----------------------------------------------------------------------


def _bad_inputs() -> list[tuple[str, object, str]]:
    with warnings.catch_warnings():  # sparse CSR is "beta", quantized tensors "deprecated"
        warnings.simplefilter("ignore", UserWarning)
        return _make_bad_inputs()


def _make_bad_inputs() -> list[tuple[str, object, str]]:
    good = small_state(0)
    cases: list[tuple[str, object, str]] = []

    def with_(name: str, value: object) -> dict:
        d = dict(good)
        d[name] = value
        return d

    cases.append(("list value", with_("weights.list", [1.0, 2.0]), "weights.list"))
    cases.append(("numpy value", with_("weights.np", np.zeros(3)), "weights.np"))
    cases.append(("nested dict", with_("block", {"w": torch.zeros(2)}), "block"))
    cases.append(("None value", with_("gone", None), "gone"))
    cases.append(("sparse", with_("emb.sparse", torch.eye(4).to_sparse()), "emb.sparse"))
    cases.append(("sparse csr", with_("emb.csr", torch.eye(4).to_sparse_csr()), "emb.csr"))
    cases.append(("non-contiguous", with_("w.T", torch.randn(4, 6).t()), "w.T"))
    cases.append(("strided slice", with_("w.step", torch.randn(10)[::2]), "w.step"))
    cases.append(("complex128", with_("c.z", torch.zeros(3, dtype=torch.complex128)), "c.z"))
    cases.append(("quantized", with_("q.w", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)), "q.w"))
    cases.append(("meta device", with_("m.w", torch.empty(3, device="meta")), "m.w"))
    cases.append(("non-str key", {**good, 7: torch.zeros(2)}, "7"))
    cases.append(("empty key", {**good, "": torch.zeros(2)}, "''"))
    cases.append(("empty dict", {}, "empty"))
    cases.append(("not a mapping", [torch.zeros(2)], "list"))
    return cases


@pytest.mark.parametrize("what, state, name", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_state_dict_is_refused_before_any_write(what: str, state: object, name: str) -> None:
    url = _url()
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        pub.publish(small_state(0))
        before = keys(pub.store)
        with pytest.raises(InvalidStateDictError) as exc:
            pub.publish(state)  # type: ignore[arg-type]
        assert name in str(exc.value), str(exc.value)
        assert keys(pub.store) == before, "nothing may be written for a refused state dict"
        assert pub.version == 1
        assert pub.publish(small_state(1)).version == 2
    # also as the very first publish of a store
    with Publisher(_url(), writer_policy=WriterPolicy(threads=2)) as pub:
        with pytest.raises(InvalidStateDictError):
            pub.publish(state)  # type: ignore[arg-type]
        assert keys(pub.store) <= {"HEAD"}, "nothing but the takeover's claim (HEAD at version 0, SPEC §5)"


@pytest.mark.parametrize(
    "metadata",
    [{"x": object()}, {"x": torch.zeros(1)}, {1j: 1}, ["not", "a", "mapping"], {"s": {1, 2}}],
)
def test_metadata_must_be_json(metadata: object) -> None:
    with Publisher(_url(), writer_policy=WriterPolicy(threads=2)) as pub:
        with pytest.raises(InvalidStateDictError, match="metadata"):
            pub.publish(small_state(0), metadata=metadata)  # type: ignore[arg-type]
        assert keys(pub.store) <= {"HEAD"}, "nothing but the takeover's claim"
        assert pub.version == 0


def test_validate_accepts_modules_and_returns_tensors() -> None:
    m = torch.nn.Linear(3, 2)
    out = validate_state_dict(m)  # type: ignore[arg-type]
    assert set(out) == {"weight", "bias"}
    assert all(isinstance(t, torch.Tensor) for t in out.values())
    with Publisher(_url(), writer_policy=WriterPolicy(threads=2)) as pub:
        assert pub.publish(m).version == 1


def test_tensor_spec_is_the_layout() -> None:
    s = TensorSpec("w", "bfloat16", (10, 4), 3)
    assert (s.numel, s.n_chunks, s.width, s.row_elems) == (40, 4, 2, 4)
    assert [s.chunk_span(i) for i in range(4)] == [(0, 12), (12, 24), (24, 36), (36, 40)]


@pytest.mark.parametrize("step", [1.5, "5", object(), [1], float("nan")],
                         ids=["1.5", "'5'", "object()", "[1]", "nan"])
def test_bad_step_is_refused_before_any_write(step: object) -> None:
    with Publisher(_url(), writer_policy=WriterPolicy(threads=2)) as pub:
        with pytest.raises(InvalidStateDictError, match="step"):
            pub.publish(small_state(0), step=step)  # type: ignore[arg-type]
        assert keys(pub.store) <= {"HEAD"}, "nothing but the takeover's claim"


@pytest.mark.parametrize("step, stored", [(np.int64(5), 5), (torch.tensor(7), 7), (2**62, 2**62), (-3, -3), (None, None)], ids=repr)
def test_integer_like_steps_are_recorded(step: object, stored: int | None) -> None:
    url = _url()
    with Publisher(url, writer_policy=WriterPolicy(threads=2)) as pub:
        assert pub.publish(small_state(0), step=step).step == stored  # type: ignore[arg-type]
    with Subscriber(url) as sub:
        assert sub.latest().step == stored
