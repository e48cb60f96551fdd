"""One host copy per node (deltastore.integrations.sharedcopy, ``HostCopy(shared=...)``).

- processes (here: HostCopies with their own locks, as separate processes have) that share a
  directory hold one copy: one follows the store, the others read 0 bytes of it and swap the
  same bits into their engines, the tensors each version changed;
- a reader never takes a version the leader is writing, nor one a dead leader left half written;
- when the leader goes, a reader takes over and goes on from the copy (checked against its
  digests, nothing fetched), or loads it whole when the leader left it mid-write; every engine
  goes on, bit-exact, swapping only what changed since the version it serves;
- the leader's error is every reader's;
- the directory: refused for another store, no room is SharedCopyError before anything is
  mapped, left-overs of killed processes are cleared, the last process out removes it;
- a whole version left by killed processes is served by nobody until the next leader has
  checked it against its digests, then gone on from without a fetch; a damaged one is loaded
  whole;
- real processes: three follow one store, the leader is killed with SIGKILL, the two others
  serve every later version bit-exact.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltastore import Publisher
from deltastore.errors import SharedCopyError
from deltastore.integrations.hostcopy import HostCopy
from deltastore.integrations.sharedcopy import SharedCopy, default_shared_dir
from deltastore.layout.select import Selection
from deltastore.write.policy import WriterPolicy

DEADLINE_S = 60.0


class Engine:
    """An engine's weights, as an Applier fills them (clones: the host copy's tensors are only
    valid during the call)."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []

    def apply(self, tensors, version) -> None:
        self.calls.append([n for n, _ in tensors])
        self.held.update({n: t.clone() for n, t in tensors})


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 16, generator=g), "layers.0.w": torch.randn(32, 16, generator=g),
            "layers.1.w": torch.randn(32, 16, generator=g), "norm": torch.randn(16, generator=g)}


def _edit(state: dict[str, torch.Tensor], name: str, value: float) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    out[name].view(-1)[0] = value
    return out


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.bfloat16() for n, t in state.items()}


def _holds(engine: Engine, state: dict[str, torch.Tensor]) -> bool:
    want = _bf16(state)
    return set(engine.held) == set(want) and all(torch.equal(engine.held[n], want[n]) for n in want)


def _wait(pred, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _staged(h: HostCopy, version: int) -> bool:
    st = h.status()
    assert st["error"] is None, st["error"]
    return st["staged"] is not None and st["staged"]["version"] >= version and not (h.shared.state() or {}).get("writing")


@pytest.fixture
def shared_dir(tmp_path):
    # a tmpfs where there is one (the copy's home), else the test's directory
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    path = base / f"deltastore-test-{os.getpid()}-{tmp_path.name}"
    yield str(path)
    assert not path.exists(), "the last process out did not remove the shared copy"


@contextlib.contextmanager
def _node(tmp_path: Path, path: str, v1: dict[str, torch.Tensor], n: int) -> Iterator[tuple[Publisher, list[HostCopy]]]:
    """A store with ``v1`` published and ``n`` copies sharing ``path`` (the first leads), all
    ready; every copy is closed after the block."""
    url = str(tmp_path / "store")
    with Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1)
        hs = _copies(url, path, n)
        try:
            yield pub, hs
        finally:
            for h in hs:
                h.close()


def _copies(url: str, path: str, n: int, select: Selection | None = None) -> list[HostCopy]:
    hs = [HostCopy(url, interval=0.02, threads=1, shared=path, select=select) for _ in range(n)]
    hs[0].start()
    _wait(lambda: hs[0].shared.leads, "the first copy did not lead")
    for h in hs[1:]:
        h.start()
    for h in hs:
        assert h.wait_ready(DEADLINE_S)
    return hs


def test_copies_share_one_follower_and_swap_what_changed(tmp_path, shared_dir) -> None:
    v1 = _state(0)
    with _node(tmp_path, shared_dir, v1, 3) as (pub, hs):
        engines = [Engine() for _ in hs]
        assert [h.status()["shared"]["leader"] for h in hs] == [True, False, False]
        assert [h.sync(e, block=True).version for h, e in zip(hs, engines)] == [1, 1, 1]
        assert all(_holds(e, v1) and sorted(e.calls[0]) == sorted(v1) for e in engines)
        model_bytes = sum(t.numel() * 2 for t in v1.values())
        files = sorted(p.name for p in Path(shared_dir).glob("weights.*.bin"))
        assert files == ["weights.0.bin"] and model_bytes <= os.path.getsize(Path(shared_dir) / files[0]) < 2 * model_bytes
        v2 = _edit(v1, "norm", 3.0)
        pub.publish(v2)
        v3 = _edit(v2, "layers.1.w", -2.0)
        pub.publish(v3)
        _wait(lambda: _staged(hs[2], 3), "version 3 was not staged")
        # one reader syncs at each version, the other only at the last: the union since its own
        assert hs[1].sync(engines[1], block=True).version == 3
        assert engines[1].calls[-1] == ["layers.1.w", "norm"]
        v4 = _edit(v3, "embed", 5.0)
        pub.publish(v4)
        _wait(lambda: _staged(hs[1], 4), "version 4 was not staged")
        assert [h.sync(e, block=True).version for h, e in zip(hs, engines)] == [4, 4, 4]
        assert engines[1].calls[-1] == ["embed"]
        assert engines[0].calls[-1] == engines[2].calls[-1] == ["embed", "layers.1.w", "norm"]
        assert all(_holds(e, v4) for e in engines)
        assert hs[0].sub.bytes_fetched > 0 and [h.sub.bytes_fetched for h in hs[1:]] == [0, 0]
        assert [h.sync(e).version for h, e in zip(hs, engines)] == [4, 4, 4] and len(engines[0].calls) == 2


def test_a_reader_never_takes_a_version_being_written(tmp_path, shared_dir) -> None:
    v1 = _state(1)
    with _node(tmp_path, shared_dir, v1, 2) as (pub, (leader, reader)):
        engine = Engine()
        assert reader.sync(engine).version == 1
        pub.publish(_edit(v1, "norm", 7.0))
        _wait(lambda: _staged(reader, 2), "version 2 was not staged")
        with leader.shared.begin_write():  # the leader is writing its next version
            assert reader.sync(engine).version == 1 and len(engine.calls) == 1
            leader.shared.landed(leader.staged.to_dict(), [], {})
        # a leader that died in its swap: the mark stays, the lock is free; nobody takes it
        leader.shared._update(writing=True)
        assert reader.sync(engine, block=True).version == 1 and len(engine.calls) == 1
        assert reader.status()["staged"]["version"] == 2
        leader.shared._update(writing=False)
        assert reader.sync(engine).version == 2 and _holds(engine, _edit(v1, "norm", 7.0))


def _leads_at(hs: list[HostCopy], version: int) -> HostCopy | None:
    """The one of ``hs`` that leads once its subscriber holds ``version`` and the copy is written."""
    for h in hs:
        if h.shared.leads and h.sub.version == version and not (h.shared.state() or {}).get("writing"):
            return h
    return None


def test_another_copy_leads_when_the_leader_goes(tmp_path, shared_dir) -> None:
    v1 = _state(2)
    with _node(tmp_path, shared_dir, v1, 3) as (pub, hs):
        engines = [Engine() for _ in hs]
        assert [h.sync(e).version for h, e in zip(hs, engines)] == [1, 1, 1]
        v2 = _edit(v1, "layers.0.w", 4.0)
        pub.publish(v2)
        _wait(lambda: _staged(hs[1], 2), "version 2 was not staged")
        hs[0].close()  # the leader goes with version 2 in the copy and served by no engine
        _wait(lambda: _leads_at(hs[1:], 2), "nobody took over")
        leader = _leads_at(hs[1:], 2)
        # the new leader checked the copy against version 2's digests and went on from it
        assert leader.sub.bytes_fetched == 0 and sum(h.shared.leads for h in hs[1:]) == 1
        assert [h.sync(e, block=True).version for h, e in zip(hs[1:], engines[1:])] == [2, 2]
        assert all(e.calls[-1] == ["layers.0.w"] and _holds(e, v2) for e in engines[1:])
        v3 = _edit(v2, "norm", -1.0)
        pub.publish(v3)
        _wait(lambda: all(_staged(h, 3) for h in hs[1:]), "version 3 was not staged")
        assert [h.sync(e, block=True).version for h, e in zip(hs[1:], engines[1:])] == [3, 3]
        assert all(e.calls[-1] == ["norm"] and _holds(e, v3) for e in engines[1:])
        assert leader.sub.bytes_fetched > 0  # the delta, from the store
        # the leader goes in the middle of a write (the mark stays): the last copy cannot trust
        # the copy and loads version 3 whole; its engine, which took version 3 before, swaps nothing
        last = next(h for h in hs[1:] if h is not leader)
        engine = engines[hs.index(last)]
        leader.shared._update(writing=True)
        leader.close()
        _wait(lambda: _leads_at([last], 3), "the last copy did not take over")
        assert last.sub.bytes_fetched > 0
        calls = len(engine.calls)
        assert last.sync(engine, block=True).version == 3 and len(engine.calls) == calls
        v4 = _edit(v3, "embed", 2.0)
        pub.publish(v4)
        _wait(lambda: _staged(last, 4), "version 4 was not staged")
        assert last.sync(engine, block=True).version == 4 and engine.calls[-1] == ["embed"] and _holds(engine, v4)


def test_the_copy_of_a_selection_is_taken_over_without_a_fetch(tmp_path, shared_dir) -> None:
    v1 = _state(4)
    layers = Selection(names=["layers.*"])
    with Publisher(str(tmp_path / "store"), dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1)
        hs = _copies(str(tmp_path / "store"), shared_dir, 2, select=layers)
        try:
            engine = Engine()
            assert hs[1].sync(engine, block=True).version == 1
            hs[0].close()
            _wait(lambda: _leads_at(hs[1:], 1), "the other copy did not take over")
            assert hs[1].sub.bytes_fetched == 0
            v2 = _edit(v1, "layers.1.w", 3.0)
            pub.publish(v2)
            _wait(lambda: _staged(hs[1], 2), "version 2 was not staged")
            assert hs[1].sync(engine, block=True).version == 2 and engine.calls[-1] == ["layers.1.w"]
            assert all(torch.equal(engine.held[n], v2[n].bfloat16()) for n in ("layers.0.w", "layers.1.w"))
            assert sorted(engine.held) == ["layers.0.w", "layers.1.w"]
        finally:
            for h in hs:
                h.close()


def test_the_leaders_error_is_every_readers(tmp_path, shared_dir) -> None:
    v1 = _state(3)
    with _node(tmp_path, shared_dir, v1, 2) as (pub, (leader, reader)):
        engine = Engine()
        assert reader.sync(engine).version == 1
        pub.publish({**v1, "norm": torch.zeros(9)}, anchor=True)  # a layout the followed copy cannot take
        _wait(lambda: reader.status()["error"] is not None, "the reader did not see the leader's error")
        assert "LayoutMismatchError" in reader.status()["error"]
        with pytest.raises(RuntimeError, match="shared host copy"):
            reader.sync(engine)
        assert _holds(engine, v1)  # the engine keeps what it served


def test_the_directory_is_the_copys_alone_and_goes_with_the_last(tmp_path, shared_dir, monkeypatch) -> None:
    url = str(tmp_path / "store")
    with Publisher(url, dtype=torch.bfloat16) as pub:
        pub.publish(_state(4))
    # left-overs of processes killed without closing (mid-write, another store's): cleared by the
    # first to open it alone
    os.makedirs(shared_dir)
    Path(shared_dir, "weights.3.bin").write_bytes(b"stale")
    Path(shared_dir, "state.json").write_text(json.dumps({"format": 1, "identity": {"url": "elsewhere"},
                                                           "generation": 3, "writing": True}))
    h = HostCopy(url, shared=shared_dir)
    try:
        assert not Path(shared_dir, "weights.3.bin").exists()
        assert (h.shared.state() or {}).get("generation") is None
        with pytest.raises(SharedCopyError, match="directory of its own"):  # another store, while this one uses it
            HostCopy(url, shared=shared_dir, format="fp8-block128")
        with pytest.raises(SharedCopyError, match="directory of its own"):
            SharedCopy(shared_dir, {"url": "s3://other/run"})
    finally:
        h.close()
    assert not Path(shared_dir).exists()

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    h = HostCopy(url, shared=shared_dir, interval=0.02)
    h.start()
    try:
        assert h.wait_ready(DEADLINE_S)
        assert "SharedCopyError" in h.status()["error"] and "no room" in h.status()["error"]
        assert not list(Path(shared_dir).glob("weights.*.bin"))
    finally:
        h.close()
    assert default_shared_dir({"url": url}) != default_shared_dir({"url": url, "format": "mxfp8"})
    assert default_shared_dir({"url": url}).startswith(("/dev/shm/deltastore-copy-", "/tmp"))


_PROCESS = textwrap.dedent("""
    import hashlib, json, sys, time
    import torch
    from deltastore.integrations.hostcopy import HostCopy

    url, path, last = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class Engine:
        held = {}
        def apply(self, tensors, version):
            self.held.update({n: t.clone() for n, t in tensors})

    h = HostCopy(url, interval=0.02, threads=1, shared=path)
    h.start()
    engine = Engine()
    served = None
    while served is None or served.version < last:
        st = h.status()
        print(json.dumps({"leader": st["shared"]["leader"], "fetched": h.sub.bytes_fetched,
                          "served": None if served is None else served.version}), flush=True)
        served = h.sync(engine)
        time.sleep(0.02)
    digest = hashlib.sha256(b"".join(engine.held[n].view(torch.uint8).numpy().tobytes() for n in sorted(engine.held)))
    print(json.dumps({"done": served.version, "sha256": digest.hexdigest(), "fetched": h.sub.bytes_fetched}), flush=True)
    h.close()
""")


@pytest.mark.parametrize("damage", [None, "flip", "truncate"])
def test_a_copy_left_by_killed_processes_is_checked_and_gone_on_from(tmp_path, shared_dir, damage) -> None:
    url = str(tmp_path / "store")
    script = tmp_path / "engine.py"
    script.write_text(_PROCESS)
    v1 = _state(6)
    v2 = _edit(v1, "embed", 9.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1)
        pub.publish(v2)
        # the node's only engine process, killed while it serves version 2 (it waits for a 99th)
        proc = subprocess.Popen([sys.executable, str(script), url, shared_dir, "99"], stdout=subprocess.PIPE,
                                text=True, env=env)
        try:
            deadline = time.monotonic() + DEADLINE_S
            while json.loads(proc.stdout.readline() or '{"served": -1}').get("served") != 2:
                assert time.monotonic() < deadline and proc.poll() is None, "the engine process did not serve version 2"
        finally:
            proc.kill()
            proc.wait()
        weights = next(Path(shared_dir).glob("weights.*.bin"))
        data = bytearray(weights.read_bytes())
        if damage == "flip":  # a bit flipped in the kept copy: its digest check fails, so it is loaded whole
            data[len(data) // 2] ^= 0x10
        elif damage == "truncate":  # shorter than its index: not kept at all
            del data[len(data) // 2:]
        weights.write_bytes(bytes(data))
        h = HostCopy(url, interval=0.02, threads=1, shared=shared_dir)
        try:
            assert h.shared.state()["version"] is None  # kept, unchecked: nobody serves it yet
            h.start()
            assert h.wait_ready(DEADLINE_S)
            engine = Engine()
            assert h.sync(engine, block=True).version == 2 and _holds(engine, v2)
            assert sorted(engine.calls[-1]) == sorted(v2)  # a new engine takes every tensor
            assert (h.sub.bytes_fetched > 0) == (damage is not None)
            v3 = _edit(v2, "norm", 1.5)
            pub.publish(v3)
            _wait(lambda: _staged(h, 3), "version 3 was not staged")
            assert h.sync(engine, block=True).version == 3 and engine.calls[-1] == ["norm"] and _holds(engine, v3)
        finally:
            h.close()


def test_processes_share_one_copy_and_survive_their_leaders_death(tmp_path, shared_dir) -> None:
    url = str(tmp_path / "store")
    script = tmp_path / "engine.py"
    script.write_text(_PROCESS)
    states = [_state(5)]
    for i in range(4):
        states.append(_edit(states[-1], ["embed", "norm", "layers.0.w", "layers.1.w"][i], float(i + 1)))
    want = __import__("hashlib").sha256(b"".join(
        t.bfloat16().view(torch.uint8).numpy().tobytes() for _, t in sorted(_bf16(states[-1]).items()))).hexdigest()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(states[0])
        procs = [subprocess.Popen([sys.executable, str(script), url, shared_dir, "5"], stdout=subprocess.PIPE,
                                  text=True, env=env) for _ in range(3)]
        try:
            lines: dict[int, dict] = {}

            def read_until(p, pred):
                deadline = time.monotonic() + DEADLINE_S
                while time.monotonic() < deadline:
                    line = p.stdout.readline()
                    assert line, "an engine process ended early"
                    lines[p.pid] = json.loads(line)
                    if pred(lines[p.pid]):
                        return lines[p.pid]
                raise AssertionError("an engine process did not get there")

            for p in procs:
                read_until(p, lambda d: d.get("served") == 1)
            leaders = [p for p in procs if read_until(p, lambda d: True)["leader"]]
            assert len(leaders) == 1
            leader = leaders[0]
            readers = [p for p in procs if p is not leader]
            pub.publish(states[1])
            for p in procs:
                read_until(p, lambda d: d.get("served") == 2)
            assert all(lines[p.pid]["fetched"] == 0 for p in readers)  # one process fetches for the node
            os.kill(leader.pid, signal.SIGKILL)
            leader.wait(DEADLINE_S)
            for s in states[2:]:
                pub.publish(s)
            done = [read_until(p, lambda d: "done" in d) for p in readers]
            assert [d["done"] for d in done] == [5, 5] and all(d["sha256"] == want for d in done)
            assert sorted(d["fetched"] > 0 for d in done) == [False, True]  # one took over; the other still reads
            for p in readers:
                assert p.wait(DEADLINE_S) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
