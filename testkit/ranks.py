"""Ranks of a gloo process group for the sharded-publishing tests and the golden generator.

:func:`run_ranks` starts ``world`` real processes (the forkserver of :func:`testkit.tensors.mp_context`)
that join a process group over 127.0.0.1 and run one named scenario of :data:`SCENARIOS`; each
rank writes its outcome (or its error) to a file that the caller reads back.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from deltastore import Subscriber
from deltastore.errors import InvalidStateDictError, PartFailedError, ShardMismatchError
from deltastore.format.keys import HEAD_KEY
from deltastore.storage import open_store
from deltastore.write.policy import AnchorPolicy, WriterPolicy
from testkit.grid_ranks import scenario_grid, scenario_grid_golden
from testkit.rank_env import head_version, record_pack_reads, set_storage_options, storage_options
from testkit.tensors import mp_context


#: Seconds a test waits for its ranks: spawning imports torch in each (a few seconds on 2 cores).
RANKS_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_model(version: int) -> dict[str, torch.Tensor]:
    """The whole model at ``version`` (every rank and the test compute the same): a few
    elements change per version, as in RL steps."""
    g = torch.Generator().manual_seed(1234)
    state = {
        "a": torch.randn(10, 6, generator=g).to(torch.bfloat16),  # split by rows
        "b": torch.randn(5, generator=g),  # whole, on the last rank
        "c": torch.randint(0, 100, (7, 3), generator=g, dtype=torch.int32),  # whole, on rank 0
        "s": torch.tensor(3.5),  # 0-d, passed by every rank (replicated)
    }
    for v in range(2, version + 1):
        g2 = torch.Generator().manual_seed(v)
        for name in ("a", "b", "c"):
            flat = state[name].view(-1)
            idx = torch.randint(0, flat.numel(), (3,), generator=g2)
            flat[idx] = flat[idx] + (1 if name == "c" else 0.5)
    return state


def rank_state(version: int, rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` holds of version ``version``: FSDP-like row shards of ``a``."""
    from deltastore.write.sharded import Rows

    full = full_model(version)
    per = -(-10 // world)  # ceil, as FSDP2's torch.chunk
    start, stop = min(rank * per, 10), min((rank + 1) * per, 10)
    out: dict[str, Any] = {"a": Rows(full["a"][start:stop].clone(), start, 10), "s": full["s"]}
    if rank == 0:
        out["c"] = full["c"]
    if rank == world - 1:
        out["b"] = full["b"]
    return out


def _rank_main(rank: int, world: int, port: int, url: str, scenario: str, out: str,
               options: dict[str, Any] | None = None) -> None:
    import torch.distributed as dist

    set_storage_options(options)
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        result.update(SCENARIOS[scenario](rank, world, url))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result["error"] = (type(e).__name__, str(e), traceback.format_exc())
    finally:
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


def _publish_versions(rank: int, world: int, url: str, versions: range) -> dict[str, Any]:
    from deltastore.write.sharded import ShardedPublisher

    infos = []
    with ShardedPublisher(url, storage_options=storage_options(), writer_policy=WriterPolicy(threads=1),
                          anchor_policy=AnchorPolicy(every=3)) as pub:
        for v in versions:
            info = pub.publish(rank_state(v, rank, world), step=v, metadata={"v": v})
            infos.append((info.version, info.kind))
    return {"infos": infos}


def _scenario_versions(rank: int, world: int, url: str) -> dict[str, Any]:
    return _publish_versions(rank, world, url, range(1, 5))


def _scenario_disagree(rank: int, world: int, url: str) -> dict[str, Any]:
    from deltastore.write.sharded import Rows, ShardedPublisher

    out: dict[str, Any] = {}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        t = torch.zeros(4, 3 if rank == 0 else 2)
        for what, state, step in (
            ("shape", {"x": t}, 1),  # rank 0: [4,3] and rank 1: [4,2] under one name, both whole
            ("overlap", {"x": Rows(torch.zeros(3, 2), 0 if rank == 0 else 2, 5)}, 1),
            ("gap", {"x": Rows(torch.zeros(2, 2), 0 if rank == 0 else 3, 5)}, 1),
            ("step", {"x": torch.zeros(2)}, rank),
        ):
            try:
                pub.publish(state, step=step)
                out[what] = None
            except ShardMismatchError as e:
                out[what] = str(e)
        # agreeing ranks then commit
        out["ok"] = pub.publish({"x": Rows(torch.full((2, 2), float(rank)), 2 * rank, 4)}, step=9).version
        if rank == 1:  # as if rank 1 had missed a publish: the ranks disagree on the version
            pub._known = 7
        try:
            pub.publish({"x": Rows(torch.full((2, 2), 5.0), 2 * rank, 4)}, step=10)
            out["version"] = None
        except ShardMismatchError as e:
            out["version"] = str(e)
    return out


def _scenario_fail_then_retry(rank: int, world: int, url: str) -> dict[str, Any]:
    """Rank 1 fails while writing its part of version 2; nothing is committed; the retry does."""
    from deltastore.write import sharded

    out: dict[str, Any] = {}
    with sharded.ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(rank_state(1, rank, world), step=1)
        # A bad tensor on one rank (its rows of "a" not contiguous), found by the one batched
        # check of the rank's tensors (design 010 D8): named on every rank, nothing written.
        state = rank_state(2, rank, world)
        if rank == 1:
            rows = state["a"].local
            strided = torch.empty(rows.shape[1], rows.shape[0], dtype=rows.dtype).t()
            strided.copy_(rows)
            state["a"] = sharded.Rows(strided, state["a"].start, state["a"].rows)
        try:
            pub.publish(state, step=2)
        except (PartFailedError, InvalidStateDictError) as e:
            out["invalid"] = (type(e).__name__, str(e))
        out["head_after_invalid"] = head_version(url)
        with _part_fails(rank == 1):
            try:
                pub.publish(rank_state(2, rank, world), step=2)
            except (PartFailedError, OSError) as e:
                out["failure"] = type(e).__name__
        out["head_after_failure"] = head_version(url)
        info = pub.publish(rank_state(2, rank, world), step=2)
        out["retry"] = (info.version, info.kind)
    return out


@contextlib.contextmanager
def _part_fails(here: bool) -> Iterator[None]:
    """Within: this rank's part manifest fails to build (an OSError), when ``here``."""
    from deltastore.write.sharded import part

    real = part.encode_part

    def broken(**kw: Any) -> bytes:
        raise OSError("disk full (injected)")

    if here:
        part.encode_part = broken
    try:
        yield
    finally:
        part.encode_part = real


def _die_in_encode_part() -> None:
    """This rank is SIGKILLed when it builds its next part manifest (after uploading its packs)."""
    from deltastore.write.sharded import part

    def die(**kw: Any) -> bytes:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    part.encode_part = die


def _scenario_killed(rank: int, world: int, url: str) -> dict[str, Any]:
    """Rank 1 is SIGKILLed after uploading its packs, before its part manifest."""
    from deltastore.write import sharded

    out: dict[str, Any] = {}
    with sharded.ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(rank_state(1, rank, world), step=1)
        if rank == 1:
            _die_in_encode_part()
        try:
            pub.publish(rank_state(2, rank, world), step=2)
            out["published"] = True
        except PartFailedError as e:
            out["failure"] = str(e)
    return out


def _scenario_fsdp(rank: int, world: int, url: str) -> dict[str, Any]:
    """A real FSDP2 module (fully_shard on CPU): its DTensor local shards are published."""
    from torch.distributed.fsdp import fully_shard

    from deltastore.write.sharded import ShardedPublisher

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fulls = []
    with ShardedPublisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1)) as pub:
        for step in range(3):
            sd = model.state_dict()
            assert any(type(v).__name__ == "DTensor" for v in sd.values())
            info = pub.publish(sd, step=step)
            # for the test only: the whole model, as a reader should see it
            fulls.append((info.version, {k: v.full_tensor().detach().to(torch.bfloat16).clone() for k, v in sd.items()}))
            loss = model(torch.randn(4, 12)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    # a restart on the same sharding (torch.chunk rows: [3, 10] splits 2 | 1) resumes: a delta
    # (anchor_every: the cost policy would anchor anyway, every element changes at this lr)
    with ShardedPublisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1),
                          anchor_policy=AnchorPolicy(every=100)) as pub:
        sd = model.state_dict()
        info = pub.publish(sd, step=3)
        fulls.append((info.version, {k: v.full_tensor().detach().to(torch.bfloat16).clone() for k, v in sd.items()}))
    return {"fulls": fulls if rank == 0 else None, "resumed": info.kind}


def _scenario_signed(rank: int, world: int, url: str) -> dict[str, Any]:
    """Rank 0 signs the joined form of each sharded version (SPEC §3.1, §8); a publisher
    without the key is then refused on every rank before anything is written, unless it
    passes allow_unsigned."""
    import torch.distributed as dist

    from deltastore.errors import SigningRequiredError
    from deltastore.write.sharded import ShardedPublisher

    key = Path(url.removeprefix("file://")).parent / "key.pem"
    with ShardedPublisher(url, signing_key=key, writer_policy=WriterPolicy(threads=1)) as pub:
        for v in (1, 2):
            pub.publish(rank_state(v, rank, world), step=v)
    signed = None
    if rank == 0:
        with Subscriber(url, trusted_keys=[key.with_suffix(".pub")]) as sub:
            signed = sub.pull(2)
    dist.barrier()  # every rank's publisher is closed
    store = open_store(url)
    head = store.get(HEAD_KEY)
    refused = None
    try:
        ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)).close()
    except SigningRequiredError as e:
        refused = str(e)
    unchanged = store.get(HEAD_KEY) == head
    store.close()
    # every rank has read HEAD back before rank 0 opens the next publisher, whose claim writes it
    dist.barrier()
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1, allow_unsigned=True)) as pub:
        unsigned = pub.publish(rank_state(3, rank, world), step=3).version
    return {"signed": signed, "refused": refused, "unchanged": unchanged, "unsigned": unsigned}


def _scenario_steady(rank: int, world: int, url: str) -> dict[str, Any]:
    """Per version: the rounds of collectives and rank 0's reads of the store. Rank 1 asks
    for an anchor at version 3, which rank 0's pre-plan (a delta) did not foresee."""
    from deltastore.write.sharded import ShardedPublisher

    out: dict[str, Any] = {"broadcasts": [], "reads": [], "infos": []}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:
        calls = {"broadcast": 0, "read": 0}
        real_broadcast = pub.collectives.broadcast

        def broadcast(obj: Any) -> Any:
            calls["broadcast"] += 1
            return real_broadcast(obj)

        pub.collectives.broadcast = broadcast  # type: ignore[method-assign]
        for op in ("get", "get_if_changed", "get_range", "head", "list"):
            real = getattr(pub.store, op, None)
            if real is not None:
                def counted(*a: Any, _real: Any = real, **k: Any) -> Any:
                    calls["read"] += 1
                    return _real(*a, **k)
                setattr(pub.store, op, counted)
        for v in range(1, 6):
            calls.update(broadcast=0, read=0)
            info = pub.publish(rank_state(v, rank, world), step=v, anchor=(rank == 1 and v == 3))
            out["infos"].append((info.version, info.kind))
            out["broadcasts"].append(calls["broadcast"])
            out["reads"].append(calls["read"])
    return out


def _scenario_part_upload_fails(rank: int, world: int, url: str) -> dict[str, Any]:
    """Rank 0's upload of rank 1's part manifest of version 2 fails: nothing is committed (on
    any rank the same error class), and the retry commits."""
    from deltastore.errors import StorageError
    from deltastore.write.sharded import ShardedPublisher, coordinator

    out: dict[str, Any] = {}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(rank_state(1, rank, world), step=1)
        real = coordinator.put_immutable
        if rank == 0:
            def broken(store: Any, key: str, data: bytes, what: str) -> None:
                if what == "part manifest 1":
                    raise StorageError(f"uploading {key} failed (injected)")
                real(store, key, data, what)
            coordinator.put_immutable = broken
        try:
            pub.publish(rank_state(2, rank, world), step=2)
        except StorageError as e:
            out["failure"] = type(e).__name__
        coordinator.put_immutable = real
        out["head_after_failure"] = head_version(url)
        info = pub.publish(rank_state(2, rank, world), step=2)
        out["retry"] = (info.version, info.kind)
        out["next"] = (pub.publish(rank_state(3, rank, world), step=3).kind)
        # rank 0's pre-plan of version 4 fails (as prepare() does when fenced or an earlier
        # outcome is still unknown): every rank raises its class, nothing is committed
        if rank == 0:
            def no_preplan(**kw: Any) -> None:
                raise StorageError("HEAD unreadable (injected)")
            pub._coordinator.preplan = no_preplan  # type: ignore[method-assign]
        try:
            pub.publish(rank_state(4, rank, world), step=4)
        except StorageError as e:
            out["preplan_failure"] = type(e).__name__
        if rank == 0:
            del pub._coordinator.preplan
        out["head_after_preplan_failure"] = head_version(url)
        info = pub.publish(rank_state(4, rank, world), step=4)
        out["after"] = (info.version, info.kind)
        # rank 0's join refuses the parts of version 5 after the version manifest's upload began
        # (design 010 D9): every rank raises its class, HEAD stays, the retry commits
        real_join = coordinator.join_parts
        if rank == 0:
            def refuse(*a: Any, **k: Any) -> Any:
                from deltastore.errors import CorruptObjectError
                time.sleep(0.5)  # a join that takes a while: the uploads begun before it run meanwhile
                raise CorruptObjectError("part manifest refused (injected)")
            coordinator.join_parts = refuse
        try:
            pub.publish(rank_state(5, rank, world), step=5)
        except Exception as e:  # noqa: BLE001 - its class is the result
            out["join_failure"] = type(e).__name__
        coordinator.join_parts = real_join
        out["head_after_join_failure"] = head_version(url)
        info = pub.publish(rank_state(5, rank, world), step=5)
        out["after_join"] = (info.version, info.kind, info.manifest)
    return out


def _scenario_claims(rank: int, world: int, url: str) -> dict[str, Any]:
    """Design 010 D7: claims go as a digest once every rank planned them; a rank that lost its
    plan makes every rank send its claims in one more round; a new row split is a new layout."""
    from deltastore.write.sharded import Rows, ShardedPublisher

    out: dict[str, Any] = {"rounds": [], "sent": [], "infos": [], "share_kept": []}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:
        calls: list[Any] = []
        real = pub.collectives.all_gather

        def all_gather(obj: Any) -> Any:
            calls.append(obj)
            return real(obj)

        pub.collectives.all_gather = all_gather  # type: ignore[method-assign]
        for v in range(1, 8):
            state = rank_state(v, rank, world)
            if v == 4 and rank == 1:
                pub._planned = None  # as a rank that planned nothing would: one more round on every rank
            if v >= 6:  # rows [0, 4) on rank 0, [4, 10) on rank 1: another layout
                start, stop = (0, 4) if rank == 0 else (4, 10)
                state["a"] = Rows(full_model(v)["a"][start:stop].clone(), start, 10)
            calls.clear()
            specs = pub._share.specs if pub._share is not None else None
            info = pub.publish(state, step=v)
            out["share_kept"].append(pub._share.specs is specs)  # design 010 D8: made once per layout
            out["infos"].append((info.version, info.kind))
            out["rounds"].append(len(calls))
            out["sent"].append("claims" if calls[0].claims is not None else "digest")
    return out


def _collective_object(rank: int, big: int, size: int) -> tuple[str, int, bytes]:
    return ("obj", rank, bytes([rank + 1]) * (size if rank == big else 3))


def _scenario_collectives(rank: int, world: int, url: str) -> dict[str, Any]:
    """The collectives of design 010 D9 on a gloo group: rank-dependent objects below, at and
    above INLINE_BYTES through the lean path and through torch's object collectives; the gloo
    operations each lean call made."""
    import torch.distributed as dist

    from deltastore.write.sharded import INLINE_BYTES, ShardedPublisher

    sizes = (0, 100, INLINE_BYTES - 200, INLINE_BYTES + 1, 3 * INLINE_BYTES + 5)  # pickles under and over the inline bytes

    class Counting:  # torch.distributed, counting the operations the lean path calls
        def __init__(self) -> None:
            self.ops = 0

        def __getattr__(self, name: str) -> Any:
            real = getattr(dist, name)
            if name not in ("all_gather", "broadcast", "gather"):
                return real

            def op(*a: Any, **k: Any) -> Any:
                self.ops += 1
                return real(*a, **k)
            return op

    out: dict[str, Any] = {"lean": [], "torch": [], "ops": [], "expected": []}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        net = pub.collectives
        assert net.lean
        counting = Counting()
        for size in sizes:
            for big in range(world):  # the rank whose object is ``size`` bytes; the others' are small
                mine = _collective_object(rank, big, size)
                root = ("root", bytes(range(256)) * (size // 256) + b"x")
                for lean in (True, False):
                    net.lean = lean
                    net.dist = counting if lean else dist
                    counting.ops = 0
                    got = (net.all_gather(mine), counting.ops)
                    counting.ops = 0
                    got += (net.broadcast(root if rank == 0 else None), counting.ops)
                    counting.ops = 0
                    got += (net.gather(mine), counting.ops)
                    out["lean" if lean else "torch"].append(got[0::2])
                    if lean:
                        out["ops"].append((size, got[1::2]))
                out["expected"].append(([_collective_object(r, big, size) for r in range(world)], root))
        net.dist, net.lean = dist, True
    return out


#: Seconds rank 0's commit is held back in the publish_async scenarios, so that the next version
#: is planned while the last one is still being committed (what a slow store does).
SLOW_COMMIT_S = 0.4


def _slow_commits(pub: Any, fail: int | None = None) -> dict[str, int]:
    """Rank 0: hold every commit back SLOW_COMMIT_S (and fail version ``fail`` after it); count
    the plans made ahead of a commit and the plans made from HEAD."""
    from deltastore.errors import StorageError

    counts = {"ahead": 0, "planned": 0, "failed": 0}
    coord = pub._coordinator
    commit, ahead, plan = coord.commit, coord.preplan_ahead, coord.plan

    def slow_commit(p: Any, *a: Any, **k: Any) -> Any:
        time.sleep(SLOW_COMMIT_S)
        if p.version == fail and not counts["failed"]:  # once: the retry is that version again
            counts["failed"] = 1
            raise StorageError(f"injected: the store refused version {p.version}")
        return commit(p, *a, **k)

    def counted_ahead(**k: Any) -> Any:
        out = ahead(**k)
        counts["ahead"] += out is not None
        return out

    def counted_plan(*a: Any, **k: Any) -> Any:
        counts["planned"] += 1
        return plan(*a, **k)

    coord.commit, coord.preplan_ahead, coord.plan = slow_commit, counted_ahead, counted_plan
    return counts


def _scenario_async_versions(rank: int, world: int, url: str) -> dict[str, Any]:
    """Six versions by publish_async back to back (rank 0's commits slowed), a flush, then a
    synchronous publish on top."""
    from concurrent.futures import InvalidStateError

    from deltastore.write.sharded import ShardedPublisher

    out: dict[str, Any] = {}
    with ShardedPublisher(url, storage_options=storage_options(), writer_policy=WriterPolicy(threads=1),
                          anchor_policy=AnchorPolicy(every=4)) as pub:
        counts = _slow_commits(pub) if rank == 0 else None
        futures = []
        for v in range(1, 7):
            futures.append(pub.publish_async(rank_state(v, rank, world), step=v, metadata={"v": v}))
            if v == 1:
                out["first_done_at_once"] = futures[0].done()
                try:
                    futures[0].result()  # would wait forever: resolved by this rank's next call
                    out["result_before_flush"] = "returned"
                except InvalidStateError as e:
                    out["result_before_flush"] = str(e)
        pub.flush()
        out["infos"] = [(f.result().version, f.result().kind) for f in futures]
        out["head_after_flush"] = head_version(url)
        info = pub.publish(rank_state(7, rank, world), step=7)
        out["sync"] = (info.version, info.kind)
        out["counts"] = counts
    return out


def _scenario_async_failures(rank: int, world: int, url: str) -> dict[str, Any]:
    """A commit that fails in the background (version 2) and the version planned on it
    (version 3); then a part that fails (rank 1, version 3 again); each time the retry commits."""
    from deltastore.errors import DeltastoreError
    from deltastore.write import sharded

    out: dict[str, Any] = {}
    with sharded.ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        counts = _slow_commits(pub, fail=2) if rank == 0 else None
        f1 = pub.publish_async(rank_state(1, rank, world), step=1)
        f2 = pub.publish_async(rank_state(2, rank, world), step=2)
        f3 = pub.publish_async(rank_state(3, rank, world), step=3)  # planned on 2, still committing
        try:
            pub.flush()
        except DeltastoreError as e:
            out["flush"] = (type(e).__name__, str(e))
        try:  # raised once: a second flush has nothing to say
            pub.flush()
            out["second_flush"] = "quiet"
        except DeltastoreError as e:
            out["second_flush"] = (type(e).__name__, str(e))
        out["futures"] = [(f1.result().version, f1.result().kind), (type(f2.exception()).__name__, str(f2.exception())),
                          (type(f3.exception()).__name__, str(f3.exception()))]
        out["head_after_failure"] = head_version(url)
        f = pub.publish_async(rank_state(2, rank, world), step=2)  # no reference: resumed from version 1, a delta
        pub.flush()
        out["retry"] = (f.result().version, f.result().kind)
        # rank 1 fails to write its part of the next version: its Future holds its own error,
        # rank 0's a PartFailedError; the next call raises them, once
        with _part_fails(rank == 1):
            f4 = pub.publish_async(rank_state(3, rank, world), step=3)
        try:
            pub.publish_async(rank_state(3, rank, world), step=3)
            out["next_call"] = "published"
        except (DeltastoreError, OSError) as e:
            out["next_call"] = type(e).__name__
        out["part_future"] = type(f4.exception(timeout=0)).__name__
        out["head_after_part"] = head_version(url)
        info = pub.publish(rank_state(3, rank, world), step=3)
        out["part_retry"] = (info.version, info.kind)
        out["counts"] = counts
    return out


def _scenario_async_killed(rank: int, world: int, url: str) -> dict[str, Any]:
    """publish_async: rank 1 is SIGKILLed while it writes its part of version 2, with version 1
    still being committed on rank 0."""
    from deltastore.write import sharded

    out: dict[str, Any] = {}
    with sharded.ShardedPublisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        if rank == 0:
            _slow_commits(pub)
        f1 = pub.publish_async(rank_state(1, rank, world), step=1)
        if rank == 1:
            _die_in_encode_part()
        try:
            pub.publish_async(rank_state(2, rank, world), step=2)
            out["published"] = True
        except PartFailedError as e:
            out["failure"] = str(e)
        # encoding version 2 advanced rank 0's reference: it must not stay as if it held version 1
        out["reference_dropped"] = pub._reference is None and pub._held is None
    out["f1"] = f1.result(timeout=0).version  # rank 0's close waited for version 1's commit
    out["head"] = head_version(url)
    return out


def _scenario_async_close(rank: int, world: int, url: str) -> dict[str, Any]:
    """close() without a flush: rank 0 waits for its commits; the other ranks' Futures say
    their outcome did not reach them."""
    from deltastore.write.sharded import ShardedPublisher

    pub = ShardedPublisher(url, writer_policy=WriterPolicy(threads=1))
    if rank == 0:
        _slow_commits(pub)
    f1 = pub.publish_async(rank_state(1, rank, world), step=1)
    f2 = pub.publish_async(rank_state(2, rank, world), step=2)
    pub.close()
    import torch.distributed as dist

    dist.barrier()  # rank 0 has closed: its commits are done
    out: dict[str, Any] = {"head": head_version(url)}
    for name, f in (("f1", f1), ("f2", f2)):
        e = f.exception(timeout=0)
        out[name] = ("ok", f.result().version) if e is None else (type(e).__name__, str(e))
    return out


def _scenario_resume(rank: int, world: int, url: str) -> dict[str, Any]:
    """Design 010 D11: a new publisher (a restart) resumes from the store by reading back only
    this rank's rows; resume=False anchors; another row split anchors."""
    from deltastore.write.sharded import Rows, ShardedPublisher

    out: dict[str, Any] = {"infos": []}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:
        for v in (1, 2):
            info = pub.publish(rank_state(v, rank, world), step=v)
            out["infos"].append((info.version, info.kind, info.bytes_stored))
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:  # restarted: no reference copy
        reads = record_pack_reads(pub)
        info = pub.publish(rank_state(3, rank, world), step=3)
        out["infos"].append((info.version, info.kind, info.bytes_stored))
        out["reads"] = list(reads)
        info = pub.publish(rank_state(4, rank, world), step=4)  # steady again: nothing read back
        out["infos"].append((info.version, info.kind, info.bytes_stored))
        out["reads_after"] = len(reads) - len(out["reads"])
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1, resume=False),
                          anchor_policy=AnchorPolicy(every=100)) as pub:
        reads = record_pack_reads(pub)
        info = pub.publish(rank_state(5, rank, world), step=5)
        out["infos"].append((info.version, info.kind, info.bytes_stored))
        out["reads_no_resume"] = len(reads)
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:  # rows of "a" split 6 | 4: another layout
        state = rank_state(6, rank, world)
        full = full_model(6)["a"]
        start, stop = (0, 6) if rank == 0 else (6, 10)
        state["a"] = Rows(full[start:stop].clone(), start, 10)
        info = pub.publish(state, step=6)
        out["infos"].append((info.version, info.kind, info.bytes_stored))
    return out


def _scenario_resume_bad_rows(rank: int, world: int, url: str) -> dict[str, Any]:
    """A restart whose rank 1 finds a chunk of its rows corrupt (the test damaged its pack):
    every rank drops what it read, the version is an anchor, the next one a delta on it."""
    from deltastore.write.sharded import ShardedPublisher

    out: dict[str, Any] = {"infos": []}
    with ShardedPublisher(url, writer_policy=WriterPolicy(threads=1), anchor_policy=AnchorPolicy(every=100)) as pub:
        real = pub._resume_from

        def resume_from(*a: Any, **k: Any) -> Any:
            plan = real(*a, **k)
            out["resumed"] = (plan.kind, plan.has_base, pub._reference is None, pub._held)
            return plan

        pub._resume_from = resume_from  # type: ignore[method-assign]
        real_read = pub._part.read_rows

        def read_rows(*a: Any, **k: Any) -> Any:
            try:
                got = real_read(*a, **k)
            except Exception as e:
                out["read"] = type(e).__name__
                raise
            out["read"] = "ok"
            return got

        pub._part.read_rows = read_rows  # type: ignore[method-assign]
        for v in (3, 4):
            info = pub.publish(rank_state(v, rank, world), step=v)
            out["infos"].append((info.version, info.kind))
    return out


SCENARIOS = {
    "async_versions": _scenario_async_versions,
    "async_failures": _scenario_async_failures,
    "async_close": _scenario_async_close,
    "async_killed": _scenario_async_killed,
    "steady": _scenario_steady,
    "claims": _scenario_claims,
    "part_upload_fails": _scenario_part_upload_fails,
    "signed": _scenario_signed,
    "versions": _scenario_versions,
    "disagree": _scenario_disagree,
    "fail_then_retry": _scenario_fail_then_retry,
    "killed": _scenario_killed,
    "fsdp": _scenario_fsdp,
    "collectives": _scenario_collectives,
    "resume": _scenario_resume,
    "resume_bad_rows": _scenario_resume_bad_rows,
    "grid": scenario_grid,
    "grid_golden": scenario_grid_golden,
}


def run_ranks(world: int, url: str, scenario: str, tmp: Path, options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` spawned ranks; their results (a killed rank: exit code)."""
    out = tmp / f"out-{scenario}-{world}-{os.urandom(4).hex()}"
    out.mkdir()
    ctx = mp_context()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, url, scenario, str(out), options)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(RANKS_TIMEOUT_S)
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"rank": r, "hung": True})
            continue
        f = out / f"rank{r}.pkl"
        results.append(pickle.loads(f.read_bytes()) if f.exists() else {"rank": r, "exitcode": p.exitcode})
    return results
