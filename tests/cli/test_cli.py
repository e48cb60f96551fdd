"""The ``deltastore`` CLI: publish → log → pull → verify, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltastore.cli import main
from deltastore.layout.tensors import bits
from testkit.publishing import publish_in_turn


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(bits(a[k]), bits(b[k])) for k in a
    )


@pytest.fixture
def checkpoints(tmp_path: Path) -> list[Path]:
    """Four safetensors checkpoints where each step changes a few bf16 elements."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "layer.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "layer.bias": torch.randn(32, generator=g),
        "steps": torch.tensor(0),
    }
    paths = []
    for i in range(4):
        p = tmp_path / f"step{i}.safetensors"
        save_file(sd, str(p))
        paths.append(p)
        sd = {k: v.clone() for k, v in sd.items()}
        sd["layer.weight"][i, : i + 1] += 0.5
        sd["steps"] += 1
    return paths


def test_publish_log_pull_verify_roundtrip(tmp_path: Path, checkpoints: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    for i, p in enumerate(checkpoints):
        assert main(["publish", store, str(p), "--step", str(i * 10), "--metadata", json.dumps({"i": i})]) == 0
    out = capsys.readouterr().out
    assert "published version 1 (anchor)" in out and "published version 4 (delta)" in out

    assert main(["log", store, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    assert [r["step"] for r in rows] == [0, 10, 20, 30]
    assert [r["kind"] for r in rows] == ["anchor", "delta", "delta", "delta"]
    assert rows[3]["metadata"] == {"i": 3}
    # step k changed k elements of the weight (k = 1..3) plus the counter
    assert [r["elements_changed"] for r in rows[1:]] == [2, 3, 4]
    assert all(r["bytes_stored"] < rows[0]["bytes_stored"] for r in rows[1:])

    assert main(["log", store]) == 0
    text = capsys.readouterr().out.splitlines()
    assert len(text) == 4 and text[0].startswith("v1") and "anchor" in text[0]

    for v, p in enumerate(checkpoints, start=1):
        out_file = tmp_path / f"pulled{v}.safetensors"
        assert main(["pull", store, str(out_file), "--version", str(v)]) == 0
        assert _same(load_file(str(out_file)), load_file(str(p)))
    latest = tmp_path / "latest.safetensors"
    assert main(["pull", store, str(latest)]) == 0
    assert _same(load_file(str(latest)), load_file(str(checkpoints[-1])))

    capsys.readouterr()
    assert main(["verify", store, "--all"]) == 0
    assert capsys.readouterr().out.count("OK version") == 4


def test_verify_fails_on_a_corrupted_pack(tmp_path: Path, checkpoints: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    for p in checkpoints[:2]:
        assert main(["publish", str(store), str(p)]) == 0
    packs = sorted((store / "objects").rglob("*.pack"))  # schema 3: objects/<attempt>/<sha>.pack
    pack = max((p for p in packs if p.is_file()), key=lambda p: p.stat().st_size)  # the anchor's
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(store)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "IntegrityError" in err and pack.name in err


def test_verify_checks_every_serving_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``verify`` checks the store's chain and each serving stream of the version it checks (a
    stream declared at version 3 from there on); a damaged stream pack fails it, naming the
    stream; ``--format`` picks chains, the store's own format naming the store's."""
    g = torch.Generator().manual_seed(0)
    states = [{"model.layers.0.mlp.down_proj.weight": torch.randn(256, 256, generator=g).bfloat16(),
               "model.norm.weight": torch.randn(256, generator=g).bfloat16()} for _ in range(4)]
    store = str(tmp_path / "store")
    publish_in_turn(store, ((), states[:2]), (["bf16", "fp8-block128"], states[2:]))
    capsys.readouterr()
    assert main(["verify", store, "--all"]) == 0
    out = capsys.readouterr().out
    assert out.count("OK version") == 6 and "OK version 3 (fp8-block128)" in out and "OK version 4 (fp8-block128)" in out
    assert main(["verify", store, "--all", "--json", "--format", "fp8-block128"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["streams"]["fp8-block128"]["versions"] == [3, 4] and "versions" not in doc

    packs = sorted((tmp_path / "store" / "streams" / "fp8-block128" / "objects").rglob("*.pack"))
    pack = max(packs, key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert main(["verify", store, "--all"]) == 1
    captured = capsys.readouterr()
    bad = [line for line in captured.out.splitlines() if line.startswith("BAD")]
    assert bad and all(" (fp8-block128): " in line for line in bad) and captured.out.count("OK version") == 5
    assert "IntegrityError" in captured.err and "fp8-block128 stream" in captured.err and pack.name in captured.err
    assert main(["verify", store, "--json"]) == 1  # the latest version's chain: both stream versions are on it
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and not doc["problems"] and doc["streams"]["fp8-block128"]["problems"]
    assert main(["verify", store, "--all", "--format", "bf16"]) == 0  # the store's own chain only
    out = capsys.readouterr().out
    assert out.count("OK version") == 4 and "(bf16)" not in out
    assert main(["verify", store, "--format", "mxfp8"]) == 1
    err = capsys.readouterr().err
    assert "UnknownFormatError" in err and "fp8-block128" in err


def test_log_lists_each_serving_streams_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltastore import Publisher, Subscriber

    g = torch.Generator().manual_seed(2)
    states = [{"model.layers.0.mlp.down_proj.weight": torch.randn(256, 256, generator=g).bfloat16()} for _ in range(2)]
    store = str(tmp_path / "store")
    with Publisher(store, formats=["bf16", "fp8-block128", "mxfp8"]) as pub:
        for s in states:
            pub.publish(s)
    with Subscriber(store) as sub:
        infos = sub.log()
    assert all(set(i.stream_bytes) == {"fp8-block128", "mxfp8"} and min(i.stream_bytes.values()) > 0 for i in infos)
    capsys.readouterr()
    assert main(["log", store, "--json"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["stream_bytes"] for d in docs] == [i.stream_bytes for i in infos]
    assert main(["log", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("+ fp8-block128 " in line and "+ mxfp8 " in line for line in lines)


def test_verify_all_checks_a_stream_no_longer_published(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``verify --all`` checks every stream a retained version carries: a format the trainer
    stopped publishing is still read by its workers, so its damage must still be found."""
    g = torch.Generator().manual_seed(1)
    states = [{"model.layers.0.mlp.down_proj.weight": torch.randn(256, 256, generator=g).bfloat16()} for _ in range(4)]
    store = str(tmp_path / "store")
    publish_in_turn(store, (["bf16", "fp8-block128"], states[:2]), ((), states[2:]))
    capsys.readouterr()
    assert main(["verify", store, "--all"]) == 0
    out = capsys.readouterr().out
    assert out.count("OK version") == 6 and "OK version 2 (fp8-block128)" in out
    assert main(["verify", store, "--version", "2", "--format", "fp8-block128"]) == 0
    assert "OK version 2 (fp8-block128)" in capsys.readouterr().out
    pack = max((tmp_path / "store" / "streams" / "fp8-block128" / "objects").rglob("*.pack"),
               key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert main(["verify", store, "--all"]) == 1
    assert "fp8-block128 stream" in capsys.readouterr().err


def test_verify_all_checks_a_streams_versions_from_before_a_pause(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A format published again after a pause starts a new chain; ``verify --all`` still checks
    its retained versions from before the pause, and finds their damage."""
    g = torch.Generator().manual_seed(2)
    states = [{"model.layers.0.mlp.down_proj.weight": torch.randn(256, 256, generator=g).bfloat16()} for _ in range(4)]
    store = str(tmp_path / "store")
    publish_in_turn(store, (["bf16", "fp8-block128"], states[:1]), ((), states[1:2]))
    first = {p: p.stat().st_size for p in (tmp_path / "store" / "streams").rglob("*.pack")}
    publish_in_turn(store, (["bf16", "fp8-block128"], states[2:]))
    capsys.readouterr()
    assert main(["verify", store, "--all"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "(fp8-block128)" in line] == [
        f"OK version {v} (fp8-block128): 2 tensors verified" for v in (1, 3, 4)]  # weight and scale
    pack = max(first, key=first.__getitem__)  # version 1's, from before the pause
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert main(["verify", store, "--all"]) == 1
    err = capsys.readouterr().err
    assert "fp8-block128 stream" in err and "version 1" in err


def test_errors_are_one_line_and_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "nosuchscheme://bucket/x", str(tmp_path / "o.safetensors")]) == 2  # usage
    err = capsys.readouterr().err
    assert err.startswith("deltastore: error: UnsupportedURLError") and err.count("\n") <= 2
    (tmp_path / "empty").mkdir()
    assert main(["pull", str(tmp_path / "empty"), str(tmp_path / "o.safetensors")]) == 1
    assert "VersionNotFoundError" in capsys.readouterr().err
    assert main(["publish", str(tmp_path / "s"), str(tmp_path / "missing.safetensors")]) == 1
    assert "missing.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_layout_change_needs_anchor(tmp_path: Path, checkpoints: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "store")
    assert main(["publish", store, str(checkpoints[0])]) == 0
    other = tmp_path / "other.safetensors"
    save_file({"layer.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}, str(other))
    capsys.readouterr()
    assert main(["publish", store, str(other)]) == 1
    assert "LayoutMismatchError" in capsys.readouterr().err
    assert main(["publish", store, str(other), "--anchor"]) == 0
    out = tmp_path / "o.safetensors"
    assert main(["pull", store, str(out)]) == 0
    assert _same(load_file(str(out)), load_file(str(other)))


def test_console_script_and_debug_traceback(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "deltastore", "log", "nosuchscheme://x"]
    quiet = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DELTASTORE_DEBUG": ""})
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    loud = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DELTASTORE_DEBUG": "1"})
    assert loud.returncode != 0 and "Traceback" in loud.stderr


# --- pull --follow --------------------------------------------------------------------------


def test_pull_follow_json_keeps_out_current(tmp_path: Path, checkpoints: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    store, out = str(tmp_path / "store"), tmp_path / "out.safetensors"
    for p in checkpoints[:2]:
        assert main(["publish", store, str(p)]) == 0
    capsys.readouterr()
    assert main(["pull", store, str(out), "--follow", "--json", "--interval", "0.01", "--max-versions", "1",
                 "--cache", str(tmp_path / "cache"), "--worker-id", "w1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["version"] for x in lines] == [2] and lines[0]["full_load"]
    for k in ("bytes_fetched", "fetch_s", "decode_s", "pause_s"):
        assert k in lines[0]
    assert _same(load_file(str(out)), load_file(str(checkpoints[1])))
    assert not Path(f"{out}.partial").exists()
    assert (tmp_path / "store" / "workers" / "w1.json").exists()  # the heartbeat
    # Restart from the cache: the cached version costs no pack bytes, the next one is a delta.
    assert main(["publish", store, str(checkpoints[2])]) == 0
    capsys.readouterr()
    assert main(["pull", store, str(out), "--follow", "--json", "--interval", "0.01", "--max-versions", "2",
                 "--cache", str(tmp_path / "cache")]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["version"], x["full_load"], x["bytes_fetched"] == 0) for x in lines] == [(2, True, True), (3, False, False)]
    assert _same(load_file(str(out)), load_file(str(checkpoints[2])))


def test_pull_follow_refuses_a_cache_path_that_is_a_file_before_waiting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")
    t0 = time.monotonic()
    assert main(["pull", str(tmp_path / "store"), str(tmp_path / "out.safetensors"), "--follow", "--cache", str(not_a_dir)]) == 1
    assert time.monotonic() - t0 < 10  # the store does not exist: a wait would never end
    err = capsys.readouterr().err
    assert err == f"deltastore: error: WorkerCacheError: worker cache path {not_a_dir} is not a directory; pass a directory for the cache\n"


def test_pull_follow_goes_on_when_its_cache_cannot_be_saved(tmp_path: Path, checkpoints: list[Path],
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    store, out, cache = tmp_path / "store", tmp_path / "out.safetensors", tmp_path / "cache"
    real = safetensors.torch.save_file

    def full_cache_disk(tensors, filename, metadata=None):
        if Path(filename).parent == cache:
            Path(filename).write_bytes(b"\0" * 10)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_cache_disk)
    assert main(["publish", str(store), str(checkpoints[0])]) == 0
    capsys.readouterr()

    def publish_next() -> None:  # while the follower waits
        from deltastore import Publisher

        with Publisher(str(store)) as pub:
            pub.publish(load_file(str(checkpoints[1])))

    writer = threading.Timer(0.3, publish_next)
    writer.start()
    try:
        rc = main(["pull", str(store), str(out), "--follow", "--interval", "0.01", "--max-versions", "2",
                   "--cache", str(cache)])
    finally:
        writer.join()
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert [line.split(" ")[0] for line in captured.out.splitlines()] == ["v1", "v2"]
    assert _same(load_file(str(out)), load_file(str(checkpoints[1])))
    assert "without updating the worker cache: WorkerCacheError" in captured.err and "Traceback" not in captured.err
    assert list(cache.iterdir()) == []


def test_pull_follow_ends_cleanly_on_sigterm(tmp_path: Path, checkpoints: list[Path]) -> None:
    import signal
    import time

    store, out = str(tmp_path / "store"), tmp_path / "out.safetensors"
    assert main(["publish", store, str(checkpoints[0])]) == 0
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "deltastore", "pull", store, str(out), "--follow", "--interval", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("v1 (full load)"), first
    assert main(["publish", store, str(checkpoints[1])]) == 0
    assert proc.stdout.readline().startswith("v2 (from v1)")
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert _same(load_file(str(out)), load_file(str(checkpoints[1])))


@pytest.mark.slow
def test_pull_follow_killed_at_any_time_leaves_out_a_whole_version(tmp_path: Path, checkpoints: list[Path]) -> None:
    """SIGKILL while following (mid-write of OUT or of the cache): OUT is always one whole
    published version, and a restart with the same cache reaches the latest one."""
    import signal
    import time

    store, out, cache = str(tmp_path / "store"), tmp_path / "out.safetensors", str(tmp_path / "cache")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "deltastore", "pull", store, str(out), "--follow", "--interval", "0.01", "--cache", cache]
    env = {**os.environ, "PYTHONPATH": str(root)}
    published = [load_file(str(p)) for p in checkpoints]
    assert main(["publish", store, str(checkpoints[0])]) == 0
    for i, p in enumerate(checkpoints[1:], start=1):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=root, env=env)
        assert proc.stdout is not None
        proc.stdout.readline()  # following
        assert main(["publish", store, str(p)]) == 0
        time.sleep(0.05 * i)  # kill at a different point of the next version each time
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        got = load_file(str(out))
        assert any(_same(got, s) for s in published[: i + 1]), f"kill {i}: OUT is not one published version"
    proc = subprocess.Popen([*cmd, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=env)
    assert proc.stdout is not None
    versions = []
    while not versions or versions[-1] < len(published):
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        versions.append(json.loads(line)["version"])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert _same(load_file(str(out)), published[-1])
