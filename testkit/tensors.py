"""Tensors for tests: bit-exact comparison, special values, a tiny trainer, small states.

Everything compares raw bit patterns (``deltastore.layout.tensors.bits``), never float values, so NaN
payloads, ``-0.0`` and subnormals count.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from deltastore.layout.tensors import bits

#: A small chunk size so that tiny test tensors still span several chunks (the unit of change
#: detection, planning and rollback), without large tensors.
SMALL_CHUNK_BYTES = 512


# --- bit-exact comparison ------------------------------------------------------------------


#: Modules a test's child processes import before any test code runs (see :func:`mp_context`).
#: ``torch.distributed.tensor`` (DTensor, which pulls in sympy) is what a sharded publisher
#: imports at its first publish: seconds in every rank of every test otherwise.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "numpy", "deltastore", "deltastore.write.sharded",
            "deltastore.lifecycle.gc"]


def mp_context() -> Any:
    """The multiprocessing context for tests that start real processes (ranks, racers, killed
    GCs): a forkserver that imported torch and deltastore once, so each child starts in
    milliseconds instead of importing torch again (seconds on two cores). Children start as
    with ``spawn`` otherwise (a fresh process tree, no inherited threads or locks). Falls back
    to ``spawn`` where there is no forkserver (not POSIX)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def raw(t: torch.Tensor) -> bytes:
    """The tensor's raw little-endian bytes."""
    return bits(t.detach().cpu().contiguous()).tobytes()


def snapshot(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Deep, bit-exact copies (clone copies bytes; no float op touches NaN payloads)."""
    return {n: t.detach().cpu().clone() for n, t in state.items()}


def bits_differ(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> str | None:
    """None when ``a`` and ``b`` hold the same names, dtypes, shapes and bits; else why not."""
    if set(a) != set(b):
        return f"names differ: only left {sorted(set(a) - set(b))}, only right {sorted(set(b) - set(a))}"
    for n in sorted(a):
        x, y = a[n], b[n]
        if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            return f"{n!r}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if raw(x) != raw(y):
            bx, by = bits(x.detach().cpu().contiguous()), bits(y.detach().cpu().contiguous())
            where = np.flatnonzero(bx != by)
            return f"{n!r}: {where.size} element(s) differ in bits, first at {int(where[0])}"
    return None


def assert_bits_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], what: str = "") -> None:
    why = bits_differ(a, b)
    assert why is None, f"{what}: {why}" if what else why


# --- special values --------------------------------------------------------------------------


def _from_bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    width = torch.empty((), dtype=dtype).element_size() * 8
    signed = [v - (1 << width) if v >= 1 << (width - 1) else v for v in values]
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


#: float32 patterns a float-typed path would break: quiet/signalling NaNs with payloads, ±0, ±inf,
#: subnormals.
F32_SPECIALS = [0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7FA12345, 0xFF800001, 0x7F800001,
                0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF]  # fmt: skip
BF16_SPECIALS = [0x7FC0, 0xFFC1, 0x7F81, 0xFFFF, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x807F]
F16_SPECIALS = [0x7E00, 0xFE01, 0x7C01, 0x7FFF, 0x8000, 0x7C00, 0xFC00, 0x0001]
F64_SPECIALS = [0x7FF8000000000000, 0xFFF8000000000ABC, 0x7FF0000000000001, 0x8000000000000000,
                0x7FF0000000000000, 0x0000000000000001]  # fmt: skip


def specials(dtype: torch.dtype) -> torch.Tensor:
    table = {torch.float32: F32_SPECIALS, torch.bfloat16: BF16_SPECIALS, torch.float16: F16_SPECIALS,
             torch.float64: F64_SPECIALS}  # fmt: skip
    return _from_bits(table[dtype], dtype)


# --- a tiny trainer ---------------------------------------------------------------------------


class TinyMLP(torch.nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 16):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class TinyTrainer:
    """fp32 master weights trained with AdamW (lr 1e-5), exported as bf16 after each step.

    With a learning rate this small only elements whose fp32 update crosses a bf16 rounding
    boundary change in the export: about 1% per step, as in real fine-tuning.
    The exported state also carries other dtypes and special values, some of which change.
    """

    def __init__(self, seed: int = 0, *, d_in: int = 32, d_hidden: int = 64, d_out: int = 16):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = TinyMLP(d_in, d_hidden, d_out)
        with torch.no_grad():  # weights of real-model magnitude, so that ~1% of bf16s move per step
            for p in self.model.parameters():
                p.normal_(0.0, 1.0, generator=g)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, weight_decay=0.01)
        self.g = g
        self.d_in, self.d_out = d_in, d_out
        self.step_count = 0
        self.x = torch.randn(64, d_in, generator=g)
        self.y = torch.randn(64, d_out, generator=g)
        # Extras that are not parameters: every dtype the format must carry bit-exactly.
        self.extras: dict[str, torch.Tensor] = {
            "extra.f32": torch.randn(40, 8, generator=g),
            "extra.f16": torch.randn(24, 4, generator=g).half(),
            "extra.f64": torch.randn(10, 3, generator=g).double(),
            "extra.i64": torch.randint(-(2**40), 2**40, (30,), generator=g),
            "extra.bool": torch.rand(50, generator=g) > 0.5,
            "extra.step": torch.tensor(0, dtype=torch.int64),  # 0-d, changes every step
            "extra.scale": torch.tensor(1.5, dtype=torch.float32),  # 0-d, constant
            "extra.nan32": specials(torch.float32),
            "extra.nan16": specials(torch.float16),
            "extra.nanbf16": specials(torch.bfloat16),
            "extra.nan64": specials(torch.float64),
        }

    def export(self) -> dict[str, torch.Tensor]:
        out = {n: p.detach().to(torch.bfloat16) for n, p in self.model.state_dict().items()}
        out.update({n: t.clone() for n, t in self.extras.items()})
        return out

    def step(self) -> dict[str, torch.Tensor]:
        """One optimizer step (plus small edits to the extras); returns the new export."""
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.step_count += 1
        e = self.extras
        e["extra.step"] = torch.tensor(self.step_count, dtype=torch.int64)
        i = self.step_count % e["extra.f32"].shape[0]
        e["extra.f32"] = e["extra.f32"].clone()
        e["extra.f32"][i, self.step_count % 8] += 1.0
        e["extra.bool"] = e["extra.bool"].clone()
        e["extra.bool"][self.step_count % 50] ^= True
        # Permute the NaN payloads so that a delta touches them too.
        e["extra.nan32"] = e["extra.nan32"].roll(1)
        e["extra.nanbf16"] = e["extra.nanbf16"].roll(1)
        if self.step_count % 3 == 0:
            e["extra.i64"] = e["extra.i64"].clone()
            e["extra.i64"][self.step_count % 30] = -(2**62) + self.step_count
        return self.export()


def sparse_edit(state: Mapping[str, torch.Tensor], rng: np.random.Generator, fraction: float = 0.01) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with about ``fraction`` of elements (at least one) given random bits."""
    out = {}
    for n, t in state.items():
        c = t.clone()
        b = bits(c)
        if b.size:
            k = max(1, int(b.size * fraction)) if rng.random() < 0.7 else 0
            idx = rng.integers(0, b.size, size=k)
            b[idx] = rng.integers(0, np.iinfo(b.dtype).max, size=k, dtype=b.dtype, endpoint=True)
        out[n] = c
    return out


def small_state(seed: int = 0, n: int = 4, rows: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.int64]
    return {f"t{i}": torch.randn(rows, 8, generator=g).to(dtypes[i % len(dtypes)]) for i in range(n)}


def state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and raw bits of every tensor, in name order: one
    string that is equal exactly when two states are bit-identical (what benchmarks compare
    across processes)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(bits(t).tobytes() if t.numel() else b"")
    return h.hexdigest()
