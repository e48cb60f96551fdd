"""Format stability: bytes written by an older release (tests/golden/, produced by
tests/golden/make_golden.py at commit 9a91ec2) are read by this one, bit for bit.

- every golden segment decodes to exactly the recorded bits (``decode_full``; ``apply_delta``
  forward and inverse), for every codec id and width;
- today's writers (``full/2``, ``add-sparse/1``, ``add-dense/1``, and the private v1 encoders
  kept for tests) re-encode the golden inputs to byte-identical segments, and composing golden
  deltas gives the golden result: a change to the writers that alters bytes must be deliberate
  (new golden files and a note in docs/codec-format.md), never silent;
- the golden store (schema 1) is readable by Subscriber: ``pull`` of every version equals the
  recorded safetensors, ``pull_into`` walks each version forward in place, ``log`` lists them;
- the golden schema-2 store (tests/golden/make_golden_schema2.py at 47edebe, the last schema-2
  writer: anchors, deltas, a layout change, two versions signed with Ed25519) is read the same
  way, and its signatures verify.

The golden files are never rewritten by the tests: the store is copied to a temporary
directory before it is opened.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deltastore import Subscriber, codec

GOLDEN = Path(__file__).parent / "golden"
SEGMENTS = GOLDEN / "segments"
INDEX = json.loads((SEGMENTS / "index.json").read_text())
STORE = GOLDEN / "store-schema1"
EXPECTED = GOLDEN / "store-schema1-expected"
N_VERSIONS = 9


def _array(name: str) -> np.ndarray:
    with gzip.open(SEGMENTS / name, "rb") as f:
        return np.load(f, allow_pickle=False)


def _seg(name: str) -> bytes:
    return (SEGMENTS / name).read_bytes()


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


SEGMENT_CASES = [
    pytest.param(case, seg, id=seg["file"].removesuffix(".seg"))
    for case in INDEX["cases"]
    for seg in case["segments"]
]


def test_golden_covers_every_codec_and_width():
    seen = {(s["codec"], np.dtype(c["dtype"]).itemsize) for c in INDEX["cases"] for s in c["segments"]}
    assert seen == {(c, w) for c in codec.KNOWN_CODECS for w in (1, 2, 4, 8)}


@pytest.mark.parametrize("case, seg", SEGMENT_CASES)
def test_golden_segment_decodes(case, seg):
    data = _seg(seg["file"])
    new = _array(case["new"])
    dt = new.dtype
    h = codec.peek_header(data)
    assert (h.codec, h.width, h.count, h.total_size) == (seg["codec"], dt.itemsize, case["count"], len(data))
    assert h.n_changed == seg["n_changed"]
    if seg["codec"] in codec.FULL_CODECS:
        out = codec.decode_full(data, codec=seg["codec"], dtype=dt, count=case["count"])
        assert out.dtype == dt and _bits(out) == _bits(new)
        return
    old = _array(case["old"])
    t = old.copy()
    codec.apply_delta(t, data, codec=seg["codec"])
    assert _bits(t) == _bits(new)
    codec.apply_delta(t, data, codec=seg["codec"], inverse=True)
    assert _bits(t) == _bits(old)
    assert int(np.count_nonzero(old != new)) == seg["n_changed"]


def _reencode(seg: dict, old: np.ndarray | None, new: np.ndarray) -> codec.Segment | None:
    kw = {"level": seg["level"]} if "level" in seg else {}
    if seg["fn"] == "full1":
        return codec._encode_full_v1(new, **kw)
    if seg["fn"] == "full2":
        return codec.encode_full(new, float_bits=seg["float_bits"], **kw)
    if seg["fn"] == "xor":
        return codec._encode_delta_xor(old, new, **kw)
    assert seg["fn"] == "add", seg
    return codec.encode_delta(old, new, **kw)


@pytest.mark.parametrize("case, seg", SEGMENT_CASES)
def test_writers_reproduce_golden_bytes(case, seg):
    old = _array(case["old"]) if case["old"] else None
    new = _array(case["new"])
    out = _reencode(seg, old, new)
    assert out is not None
    assert (out.codec, out.n_changed) == (seg["codec"], seg["n_changed"])
    assert out.data == _seg(seg["file"])


@pytest.mark.parametrize(
    "comp", INDEX["compose"], ids=[c["result"]["file"].removesuffix(".result.seg") for c in INDEX["compose"]]
)
def test_golden_compose(comp):
    a, b, c = (_array(comp["arrays"][k]) for k in ("a", "b", "c"))
    sa, sb, want = (_seg(comp[k]["file"]) for k in ("a", "b", "result"))
    r = codec.compose_deltas(sa, sb, codec_a=comp["a"]["codec"], codec_b=comp["b"]["codec"],
                             dtype=a.dtype, count=comp["count"], base=a)
    assert r is not None
    assert (r.codec, r.n_changed, r.data) == (comp["result"]["codec"], comp["result"]["n_changed"], want)
    t = a.copy()
    codec.apply_delta(t, want, codec=comp["result"]["codec"])
    assert _bits(t) == _bits(c)
    assert b is not None  # the middle state: the two input deltas pass through it
    t = a.copy()
    codec.apply_delta(t, sa, codec=comp["a"]["codec"])
    assert _bits(t) == _bits(b)


# --- the golden store ---------------------------------------------------------------------


@pytest.fixture
def store_url(tmp_path) -> str:
    dst = tmp_path / "store"
    shutil.copytree(STORE, dst)
    return str(dst)


def _expected(version: int) -> dict[str, torch.Tensor]:
    return load_file(str(EXPECTED / f"v{version}.safetensors"))


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), f"{what}: {name}"
        gb = g.contiguous().view(-1).view(torch.uint8) if g.numel() else g.new_empty(0, dtype=torch.uint8)
        wb = w.contiguous().view(-1).view(torch.uint8) if w.numel() else w.new_empty(0, dtype=torch.uint8)
        assert torch.equal(gb, wb), f"{what}: {name} differs"


def _layout(sd: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}


def test_golden_store_log(store_url):
    with Subscriber(store_url, threads=1) as sub:
        log = sub.log()
    assert [v.version for v in log] == list(range(1, N_VERSIONS + 1))
    assert [v.step for v in log] == list(range(N_VERSIONS))
    assert [v.kind for v in log] == ["anchor", "delta", "delta", "delta", "anchor", "delta", "delta", "anchor", "delta"]
    assert all(v.writer == "golden" and v.metadata == {"golden": True} for v in log)


@pytest.mark.parametrize("version", range(1, N_VERSIONS + 1))
def test_golden_store_pull(store_url, version):
    with Subscriber(store_url, threads=1) as sub:
        _assert_bit_equal(sub.pull(version), _expected(version), f"pull({version})")


def test_golden_store_pull_latest(store_url):
    with Subscriber(store_url, threads=1) as sub:
        _assert_bit_equal(sub.pull(), _expected(N_VERSIONS), "pull()")


@pytest.mark.parametrize("start", range(1, N_VERSIONS))
def test_golden_store_pull_into(store_url, start):
    """From each version: step by step to the last version of its layout, and in one jump."""
    expected = {v: _expected(v) for v in range(1, N_VERSIONS + 1)}
    same = [v for v in range(start + 1, N_VERSIONS + 1) if _layout(expected[v]) == _layout(expected[start])]
    last = max(same, default=start)
    with Subscriber(store_url, threads=1) as sub:
        target = sub.pull(start)
        for v in same:
            info = sub.pull_into(target, v)
            assert info is not None and info.version == v
            _assert_bit_equal(target, expected[v], f"pull_into {start} -> {v}")
    with Subscriber(store_url, threads=1) as sub:
        target = sub.pull(start)
        if last != start:
            assert sub.pull_into(target, last).version == last
        _assert_bit_equal(target, expected[last], f"pull_into {start} -> {last} in one step")
    if last == N_VERSIONS:
        with Subscriber(store_url, threads=1) as sub:
            target = sub.pull(start)
            sub.pull_into(target)
            _assert_bit_equal(target, expected[N_VERSIONS], f"pull_into {start} -> latest")


def test_golden_files_untouched_by_reading(store_url):
    """The copy is what the tests open; the golden directory holds only store objects."""
    assert sorted(p.name for p in STORE.iterdir()) == ["HEAD", "blobs", "manifests"]


# --- the golden schema-2 store (tests/golden/make_golden_schema2.py at 47edebe) -------------

STORE2 = GOLDEN / "store-schema2"
EXPECTED2 = GOLDEN / "store-schema2-expected"
SIGNING_PUB2 = GOLDEN / "store-schema2-signing.pub"
N_VERSIONS2 = 7


@pytest.fixture
def store2_url(tmp_path) -> str:
    dst = tmp_path / "store2"
    shutil.copytree(STORE2, dst)
    return str(dst)


def _expected2(version: int) -> dict[str, torch.Tensor]:
    return load_file(str(EXPECTED2 / f"v{version}.safetensors"))


def test_golden_schema2_store_log(store2_url):
    with Subscriber(store2_url, threads=1) as sub:
        log = sub.log()
    assert [v.version for v in log] == list(range(1, N_VERSIONS2 + 1))
    assert [v.step for v in log] == list(range(N_VERSIONS2))
    assert [v.kind for v in log] == ["anchor", "delta", "delta", "anchor", "delta", "anchor", "delta"]
    assert [v.writer for v in log] == ["golden2"] * 5 + ["golden2-signed"] * 2
    assert all(v.metadata == {"golden": 2} for v in log)


@pytest.mark.parametrize("version", range(1, N_VERSIONS2 + 1))
def test_golden_schema2_store_pull(store2_url, version):
    with Subscriber(store2_url, threads=1) as sub:
        _assert_bit_equal(sub.pull(version), _expected2(version), f"pull({version})")


@pytest.mark.parametrize("start", range(1, N_VERSIONS2))
def test_golden_schema2_store_pull_into(store2_url, start):
    """From each version: step by step to every later version of its layout, and in one jump."""
    expected = {v: _expected2(v) for v in range(1, N_VERSIONS2 + 1)}
    same = [v for v in range(start + 1, N_VERSIONS2 + 1) if _layout(expected[v]) == _layout(expected[start])]
    with Subscriber(store2_url, threads=1) as sub:
        target = sub.pull(start)
        for v in same:
            info = sub.pull_into(target, v)
            assert info is not None and info.version == v
            _assert_bit_equal(target, expected[v], f"pull_into {start} -> {v}")
    if same:
        with Subscriber(store2_url, threads=1) as sub:
            target = sub.pull(start)
            assert sub.pull_into(target, same[-1]).version == same[-1]
            _assert_bit_equal(target, expected[same[-1]], f"pull_into {start} -> {same[-1]} in one step")


def test_golden_schema2_store_signed_versions(store2_url):
    """v6 and v7 were signed: a subscriber trusting the key reads them, and refuses v5
    (unsigned); a subscriber trusting another key refuses v7."""
    from deltastore.errors import SignatureError
    from deltastore.signing import generate_key_files

    with Subscriber(store2_url, threads=1, trusted_keys=[SIGNING_PUB2.read_bytes()]) as sub:
        for v in (6, 7):
            _assert_bit_equal(sub.pull(v), _expected2(v), f"signed pull({v})")
        with pytest.raises(SignatureError):
            sub.pull(5)
    _, other = generate_key_files(Path(store2_url).parent / "other.pem")
    with Subscriber(store2_url, threads=1, trusted_keys=[other]) as sub, pytest.raises(SignatureError):
        sub.pull(7)


def test_golden_schema2_files_untouched_by_reading(store2_url):
    assert sorted(p.name for p in STORE2.iterdir()) == ["HEAD", "blobs", "manifests"]
    assert all(p.suffix == ".json" for p in (STORE2 / "manifests").iterdir())
