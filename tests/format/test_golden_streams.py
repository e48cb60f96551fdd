"""Format stability of serving streams (schema 5, SPEC §15): the golden store written by the
first writer of streams (tests/golden/make_golden.py streams) is read bit for bit in every
format by this release and every later one, and today's quantizers still derive exactly what
it holds. The golden files are never rewritten: the store is copied first."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deltastore import Subscriber
from deltastore.errors import UnknownFormatError
from deltastore.format.history import History
from deltastore.serving.formats import derive, serving_format
from deltastore.storage import open_store
from testkit.tensors import assert_bits_equal

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
STORE = GOLDEN / "store-streams"
EXPECTED = GOLDEN / "store-streams-expected"
FORMATS = ("bf16", "fp8-block128", "mxfp8")
N = 6


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    dst = tmp_path_factory.mktemp("golden") / "store-streams"
    shutil.copytree(STORE, dst)
    return str(dst)


def _expected(fmt: str, v: int) -> dict[str, torch.Tensor]:
    return load_file(str(EXPECTED / fmt / f"v{v}.safetensors"))


def _sha(t: torch.Tensor) -> str:
    t = t.contiguous()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


@pytest.mark.parametrize("fmt", FORMATS)
def test_expected_files_match_their_sidecar(fmt: str) -> None:
    shas = json.loads((EXPECTED / fmt / "sha256.json").read_text())
    assert sorted(shas) == sorted(f"v{v}" for v in range(1, N + 1))
    for v in range(1, N + 1):
        assert {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _sha(t)}
                for k, t in _expected(fmt, v).items()} == shas[f"v{v}"], (fmt, v)


def test_manifests_are_schema5_and_name_every_stream(url: str) -> None:
    h = History(open_store(url))
    head = h.read_head()[0]
    assert head.schema_ == 3
    for v in range(1, N + 1):
        key, m = h.find(v, head)
        assert m.schema_ == 5 and m.stream == "bf16" and m.formats() == FORMATS, v
        for ref in m.streams:
            assert ref.key.startswith(f"streams/{ref.format}/manifests/{v:012d}-"), (v, ref.key)
        assert m.kind == ("anchor" if v in (1, 4) else "delta"), v


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_version_reads_back_in_every_format(url: str, fmt: str) -> None:
    with Subscriber(url, threads=1, format=fmt) as sub:
        for v in range(1, N + 1):
            assert_bits_equal(sub.pull(v), _expected(fmt, v), f"{fmt} pull({v})")
        target = sub.pull(1)
        for v in range(2, N + 1):
            assert sub.pull_into(target, version=v)
            assert_bits_equal(target, _expected(fmt, v), f"{fmt} pull_into({v})")
        assert sub.verify(all_versions=True).ok


@pytest.mark.parametrize("fmt", ("fp8-block128", "mxfp8"))
def test_todays_quantizers_derive_what_the_store_holds(fmt: str) -> None:
    for v in range(1, N + 1):
        assert_bits_equal(derive(_expected("bf16", v), serving_format(fmt)), _expected(fmt, v), f"derive {fmt} v{v}")


def test_a_format_the_store_lacks_lists_the_ones_it_has(url: str) -> None:
    with Subscriber(url, format="fp8-tensor") as sub, pytest.raises(UnknownFormatError) as e:
        sub.pull(1)
    assert e.value.available == FORMATS
