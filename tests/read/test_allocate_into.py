"""``Subscriber.allocate(into=...)``: the tensors carved from one buffer of the caller's.

- every tensor (a whole subscriber, group members included, and a partial one) is a view of the
  buffer, at a multiple of 64 bytes, and a pull into them is bit-exact at every version;
- a ``meta`` buffer gives the same offsets without memory;
- a buffer of the wrong kind is refused before anything is carved.
"""

from __future__ import annotations

import pytest
import torch

from deltastore import Subscriber
from deltastore.layout.groups import CARVE_ALIGN
from deltastore.layout.select import Selection
from deltastore.write.policy import LayoutPolicy
from testkit.partial import expected_rows
from testkit.stores import publish_edits
from testkit.tensors import assert_bits_equal


def _chain(url: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    state = {f"blk.{i}.norm": torch.randn(40, generator=g).bfloat16() for i in range(6)}
    state["big"] = torch.randn(1000, 160, generator=g).bfloat16()  # > 256 KiB: not grouped
    state["f32"] = torch.randn(33, generator=g)
    return publish_edits(url, state, 3, seed=4, fraction=0.05,
                         layout_policy=LayoutPolicy(chunk_bytes=4096, group_small_tensors=True))


@pytest.mark.parametrize("sel", [None, Selection(names=("blk.[24].norm", "big"), shard=(0, 1, 3), shard_names=("big",))],
                         ids=["whole", "partial"])
def test_tensors_are_views_of_the_callers_buffer_and_pull_into_them(tmp_path, sel) -> None:
    url = str(tmp_path / "store")
    states = _chain(url)
    asked: list[int] = []
    buf = torch.full((1 << 20,), 0xAB, dtype=torch.uint8)  # not zeros: the bytes are left as they are

    def into(n: int) -> torch.Tensor:
        asked.append(n)
        return buf[:n + 100]  # longer than asked is fine

    with Subscriber(url, threads=2, select=sel) as sub:
        meta = sub.allocate(into=lambda n: torch.empty(n, dtype=torch.uint8, device="meta"))
        got = sub.allocate(into=into)
        assert len(asked) == 1 and asked[0] % CARVE_ALIGN == 0
        assert list(got) == list(meta)
        base = buf.data_ptr()
        ends = []
        for name, t in got.items():
            off = t.data_ptr() - base
            assert 0 <= off and off + t.numel() * t.element_size() <= asked[0]
            assert off == meta[name].storage_offset() * meta[name].element_size()  # the meta buffer's offsets
            assert meta[name].device.type == "meta" and meta[name].shape == t.shape and meta[name].dtype == t.dtype
            ends.append((off, off + t.numel() * t.element_size()))
        ends.sort()
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two tensors overlap
        assert got[next(iter(got))].view(-1)[:1].view(torch.uint8)[0] == 0xAB  # not zeroed
        for v in (1, 2, 3):
            sub.pull_into(got, v)
            want = states[v - 1] if sel is None else expected_rows(states[v - 1], sel)
            assert_bits_equal(got, want, f"v{v}")
        units = sub.units()
        if sel is None:
            groups = [s for s in units.values() if s.members]
            assert groups  # the layout really groups the small tensors
            for s in groups:  # a group's members back to back from an aligned start, like its row
                first = got[s.members[0].name].data_ptr() - base
                assert first % CARVE_ALIGN == 0
                for m in s.members:
                    assert got[m.name].data_ptr() - base == first + m.offset * got[m.name].element_size()
        for name in units:
            if name in got:
                assert (got[name].data_ptr() - base) % CARVE_ALIGN == 0


def test_a_buffer_of_the_wrong_kind_is_refused(tmp_path) -> None:
    url = str(tmp_path / "store")
    _chain(url)
    with Subscriber(url) as sub:
        for bad in (lambda n: torch.empty(n, dtype=torch.float32), lambda n: torch.empty(n - 1, dtype=torch.uint8),
                    lambda n: torch.empty(2, n, dtype=torch.uint8), lambda n: bytearray(n),
                    lambda n: torch.empty(2 * n, dtype=torch.uint8)[::2]):
            with pytest.raises(ValueError, match="contiguous 1-D uint8"):
                sub.allocate(into=bad)
