"""``deltastore log URL --plot FILE.png``: the picture is drawn from the store's real numbers,
and a missing matplotlib is one clear error line (before any IO)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deltastore.cli import EXIT_FAILED, EXIT_OK, main
from deltastore.cli.plot import points_of_store
from deltastore.lifecycle.compact import compact
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy
from deltastore.write.publisher import Publisher


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(128, 64, generator=g).bfloat16()}
    with Publisher(url, anchor_policy=AnchorPolicy(every=4)) as pub:
        for i in range(9):
            sd = {"w": sd["w"].clone()}
            sd["w"].view(-1)[: 10 * (i + 1)] += 0.5
            pub.publish(sd, step=i)
    compact(url, bases=[2])
    return url


def test_points_are_the_store_history(store: str) -> None:
    with open_store(store) as st:
        points, squashes = points_of_store(st)
    assert [p.version for p in points] == list(range(1, 10))
    assert [p.version for p in points if p.kind == "anchor"] == [1, 5, 9]
    assert all(p.elements_total == 128 * 64 for p in points)
    assert [p.elements_changed for p in points if p.kind == "delta"] == [10 * (v) for v in (2, 3, 4, 6, 7, 8)]
    assert [(s.from_, s.to) for s in squashes] == [(2, 9)] and squashes[0].bytes > 0


def test_log_plot_writes_a_png(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "history.png"
    assert main(["log", store, "--plot", str(out)]) == EXIT_OK
    assert f"wrote {out}" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_log_plot_without_matplotlib(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["log", store, "--plot", str(tmp_path / "h.png")]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("deltastore: error: ImportError") and "deltastore-weights[plot]" in err
    assert not (tmp_path / "h.png").exists()
