"""A reader's memory is bounded by the tensors plus a constant per decode thread (SPEC §7 step 8).

A store may declare any chunk size: here one 128 MiB tensor is a single chunk, in packs of a
few hundred KB. ``pull`` must hold no more than the tensor it returns plus
``DECODE_MEMORY_BYTES`` (it used to build the chunk beside the tensor, with two more chunk-sized
temporaries for the rotation: ~3.4x the chunk), and ``pull_into`` of a delta of that chunk no
more than ``DECODE_MEMORY_BYTES`` (a third of the chunk changed: on both paths too large to
decode whole, so it is applied a piece at a time). Peak RSS (VmHWM) is measured in a fresh
interpreter, above its resident size just before each call, on the native and the numpy path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltastore import Publisher
from deltastore.codec import apply
from deltastore.read.engine import DECODE_MEMORY_BYTES
from deltastore.write.policy import LayoutPolicy

MIB = 1 << 20
ELEMENTS = 32 << 20  # float32: 128 MiB, one chunk: twice the decode bound, so one extra chunk-sized copy fails

PROBE = r"""
import json, os, sys
from deltastore import Subscriber

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

def rise(call):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from the resident size
    before = rss()
    out = call()
    return out, peak() - before

with Subscriber(sys.argv[1], threads=1) as sub:
    sub.latest()  # HEAD, a manifest and the modules a read needs, before anything is measured
    target, pulled = rise(lambda: sub.pull(1))
    _, stepped = rise(lambda: sub.pull_into(target))
    declared = sum(t.numel() * t.element_size() for t in target.values())
print(json.dumps({"declared": declared, "pull": pulled, "pull_into": stepped}))
"""


@pytest.mark.slow  # a chunk large enough to stand out of the interpreter's noise: ~10 s
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS is read from /proc (Linux)")
def test_a_huge_chunk_costs_the_tensor_and_a_constant(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    w = torch.zeros(ELEMENTS)
    w[::4093] = 1.5  # compressible planes, not all CONST: zstd sections, streamed
    w[7::65521] = -3.0
    with Publisher(url, layout_policy=LayoutPolicy(chunk_bytes=ELEMENTS * 4)) as pub:
        pub.publish({"w": w})
        w[1::3] += 0.5  # a third changed: an add-sparse delta too large to decode whole
        info = pub.publish({"w": w})
    del w
    packs = sum(p.stat().st_size for p in (tmp_path / "store").rglob("*.pack"))
    assert packs < 2 * MIB, "the test means few stored bytes for a large chunk"
    assert info.version == 2
    for path in ("native", "numpy"):
        env = dict(os.environ, DELTASTORE_NATIVE="1" if path == "native" else "0")
        run = subprocess.run([sys.executable, "-c", PROBE, url], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["declared"] == ELEMENTS * 4
        assert got["pull"] <= got["declared"] + DECODE_MEMORY_BYTES, (
            f"{path}: pull held {(got['pull'] - got['declared']) / MIB:.0f} MiB besides the tensor")
        assert got["pull_into"] <= DECODE_MEMORY_BYTES, (
            f"{path}: pull_into of a delta held {got['pull_into'] / MIB:.0f} MiB")


def test_the_per_thread_bound_covers_the_whole_decodes() -> None:
    """What the codec decodes whole stays within the stated bound, with room for a piece's
    working set and the streamed sections' windows."""
    from deltastore.codec import full, planes

    windows = 14 * ((1 << planes.MAX_WINDOW_LOG) + (512 << 10))  # add-sparse of width 8: 14 sections
    assert apply.WHOLE_MAX_BYTES + (8 << 20) <= DECODE_MEMORY_BYTES
    assert 3 * full.WHOLE_MAX_BYTES <= DECODE_MEMORY_BYTES
    assert windows + 32 * apply.PIECE_ELEMENTS * 2 <= DECODE_MEMORY_BYTES
