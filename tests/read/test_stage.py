"""Staged updates: patches are minimal, the swap is all-or-nothing and detects foreign writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltastore.errors import IntegrityError
from deltastore.format.history import VersionInfo
from deltastore.layout.tensors import bits
from deltastore.read.stage import DENSE_PATCH_FRACTION, StagedUpdate, make_patch
from testkit.tensors import raw


def _info(v: int) -> VersionInfo:
    return VersionInfo(version=v, step=None, parent=v - 1, kind="delta", anchor=1, created="", writer="w",
                       bytes_stored=0, tensors_changed=0, elements_changed=0, manifest="m")


def _staged(target: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> StagedUpdate:
    up = StagedUpdate(info=_info(2), from_version=1)
    for name, t in new.items():
        p = make_patch(name, 0, (0, t.numel()), bits(target[name]), bits(t))
        if p is not None:
            up.patches.append(p)
    return up


def test_sparse_and_dense_patches_bring_the_target_to_the_new_bits():
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(1000, generator=g).bfloat16(), "b": torch.randn(64, generator=g), "c": torch.zeros(3)}
    new = {k: v.clone() for k, v in old.items()}
    new["a"][::97] += 1  # sparse
    new["b"] += 1  # dense
    new["a"][5] = float("nan")
    new["b"][0] = -0.0
    target = {k: v.clone() for k, v in old.items()}
    up = _staged(target, new)
    kinds = {p.name: p.positions is None for p in up.patches}
    assert kinds == {"a": False, "b": True}  # "c" unchanged: no patch
    assert up.changed == {"a": [(0, 1000)], "b": [(0, 64)]}
    pause = up.swap(target)
    assert pause >= 0
    for k in new:
        assert raw(target[k]) == raw(new[k]), k


def test_dense_threshold():
    cur = np.zeros(100, np.uint16)
    res = cur.copy()
    n = int(DENSE_PATCH_FRACTION * 100)
    res[:n] = 1
    assert make_patch("x", 0, (0, 100), cur, res).positions is not None
    res[: n + 1] = 1
    assert make_patch("x", 0, (0, 100), cur, res).positions is None


def test_a_write_between_staging_and_swap_is_detected_and_nothing_stays_applied():
    old = {"a": torch.arange(100, dtype=torch.float32), "b": torch.arange(50, dtype=torch.float32)}
    new = {"a": old["a"] + 1, "b": old["b"].clone()}
    new["b"][7] = 99
    target = {k: v.clone() for k, v in old.items()}
    up = _staged(target, new)
    up.patches.sort(key=lambda p: p.name)  # "a" is swapped before "b" fails
    target["b"][7] = -5  # a foreign write at a patched position
    before = {k: raw(v) for k, v in target.items()}
    with pytest.raises(IntegrityError, match="'b' chunk 0 changed between staging and swap"):
        up.swap(target)
    assert {k: raw(v) for k, v in target.items()} == before


def test_patch_memory_is_proportional_to_what_changed():
    cur = np.zeros(1 << 20, np.uint16)
    res = cur.copy()
    res[::1000] = 3
    p = make_patch("x", 0, (0, cur.size), cur, res)
    assert p.nbytes < cur.nbytes * 0.02
