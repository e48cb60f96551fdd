"""The collectives of a sharded publish (design 010 D9) and the errors ranks tell each other.

:class:`Collectives` is the one channel of a :class:`~deltastore.write.sharded.ShardedPublisher`'s
ranks: all_gather, broadcast from rank 0 and gather to rank 0 of small Python objects. On a
gloo group they move pickled bytes in CPU tensors themselves: a small object's all_gather or
broadcast is one gloo operation, not torch's two (sizes, then data) with their device and size
bookkeeping. Any other backend (NCCL: device tensors) keeps torch's object collectives. Pickle
among one job's ranks, as torch's.
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from typing import Any

import torch

from deltastore import errors as error_classes
from deltastore.errors import DeltastoreError, PartFailedError

#: The rank that reads HEAD, writes the layout and the version manifest and CASes HEAD: the
#: one rank every process group has.
COORDINATOR = 0
#: Pickled bytes a broadcast or all_gather carries in its one round (after an 8-byte length):
#: a steady version's report, plan and outcome are ~0.3-2 KB, so each is one gloo operation
#: instead of the two (sizes, then data) of torch's object collectives; a larger object (the
#: first version's claims, large metadata) takes a second round with its remaining bytes.
INLINE_BYTES = 8192
#: The length prefix of a collective's buffer (little-endian unsigned).
LENGTH_BYTES = 8

#: A reported error: the exception's class name and message.
Reported = tuple[str, str]


class Collectives:
    """The object collectives over ``group`` (default: the world) of ``dist``
    (``torch.distributed``, initialised).

    Attributes:
        rank, world: this rank and the group's size.
        lean: the gloo byte path (design 010 D9) is used; False: torch's object collectives.
        url: named in the error of a lost rank (set once the store is open).

    Every collective raises PartFailedError when a rank died or the group timed out.
    """

    def __init__(self, dist: Any, group: Any = None):
        self.dist = dist
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)
        # CPU tensors carry the collectives' bytes on gloo; other backends use torch's object collectives
        self.lean = str(dist.get_backend(group)) == "gloo"
        self.url = "?"

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        out: list[Any] = [None] * self.world
        try:
            if self.lean:
                out = self._all_gather_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            else:
                self.dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:  # gloo/NCCL: a rank died or the group timed out
            raise PartFailedError(f"a rank of the sharded publisher of {self.url} was lost ({e}); "
                                  "nothing was committed by this step") from e
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (the others pass anything)."""
        box = [obj]
        try:
            if self.lean:
                return self._broadcast_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == COORDINATOR else b"")
            self.dist.broadcast_object_list(box, src=self.global_rank(COORDINATOR), group=self.group)
        except RuntimeError as e:
            raise PartFailedError(f"a rank of the sharded publisher of {self.url} was lost ({e}); "
                                  "nothing was committed unless rank 0 reports otherwise") from e
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """On rank 0 every rank's ``obj`` in rank order; None on the others."""
        out: list[Any] | None = [None] * self.world if self.rank == COORDINATOR else None
        try:
            if self.lean:
                return self._gather_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            self.dist.gather_object(obj, out, dst=self.global_rank(COORDINATOR), group=self.group)
        except RuntimeError as e:
            raise PartFailedError(f"a rank of the sharded publisher of {self.url} was lost ({e}); nothing was committed") from e
        return out

    def _all_gather_bytes(self, data: bytes) -> list[Any]:
        """Every rank's object: one all_gather of ``INLINE_BYTES`` (and a length) per rank; a
        second round of the remaining bytes only when some rank's object is larger."""
        mine = _framed(data, INLINE_BYTES)
        rows = torch.empty((self.world, mine.numel()), dtype=torch.uint8)
        self.dist.all_gather(list(rows.unbind(0)), mine, group=self.group)
        table = rows.numpy()
        lengths = [int.from_bytes(table[r, :LENGTH_BYTES].tobytes(), "little") for r in range(self.world)]
        rest = max(lengths) - INLINE_BYTES
        if rest <= 0:
            return [pickle.loads(table[r, LENGTH_BYTES:LENGTH_BYTES + n].tobytes()) for r, n in enumerate(lengths)]
        tail = torch.zeros(rest, dtype=torch.uint8)
        extra = data[INLINE_BYTES:]
        if extra:
            tail[:len(extra)] = torch.frombuffer(bytearray(extra), dtype=torch.uint8)
        tails = torch.empty((self.world, rest), dtype=torch.uint8)
        self.dist.all_gather(list(tails.unbind(0)), tail, group=self.group)
        more = tails.numpy()
        return [pickle.loads(table[r, LENGTH_BYTES:LENGTH_BYTES + min(n, INLINE_BYTES)].tobytes()
                             + more[r, :max(n - INLINE_BYTES, 0)].tobytes()) for r, n in enumerate(lengths)]

    def _broadcast_bytes(self, data: bytes) -> Any:
        """Rank 0's object (``data``: its pickle on rank 0): one broadcast of ``INLINE_BYTES``
        and the length; a second of the remaining bytes only for a larger object."""
        src = self.global_rank(COORDINATOR)
        buf = _framed(data, INLINE_BYTES)
        self.dist.broadcast(buf, src=src, group=self.group)
        head = buf.numpy()
        n = int.from_bytes(head[:LENGTH_BYTES].tobytes(), "little")
        if n <= INLINE_BYTES:
            return pickle.loads(head[LENGTH_BYTES:LENGTH_BYTES + n].tobytes())
        if self.rank == COORDINATOR:
            tail = torch.frombuffer(bytearray(data[INLINE_BYTES:]), dtype=torch.uint8)
        else:
            tail = torch.empty(n - INLINE_BYTES, dtype=torch.uint8)
        self.dist.broadcast(tail, src=src, group=self.group)
        return pickle.loads(head[LENGTH_BYTES:].tobytes() + tail.numpy().tobytes())

    def _gather_bytes(self, data: bytes) -> list[Any] | None:
        """Every rank's object on rank 0 (None elsewhere): an all_gather of the lengths (every
        rank sends a buffer of the largest), then one gather."""
        lengths = torch.empty((self.world, 1), dtype=torch.int64)
        self.dist.all_gather(list(lengths.unbind(0)), torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        sizes = lengths.view(-1).tolist()
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = torch.empty((self.world, buf.numel()), dtype=torch.uint8) if self.rank == COORDINATOR else None
        self.dist.gather(buf, list(rows.unbind(0)) if rows is not None else None, dst=self.global_rank(COORDINATOR),
                          group=self.group)
        if rows is None:
            return None
        table = rows.numpy()
        return [pickle.loads(table[r, :n].tobytes()) for r, n in enumerate(sizes)]

    def global_rank(self, rank: int) -> int:
        """The global rank of ``rank`` of the group."""
        return rank if self.group is None else self.dist.get_global_rank(self.group, rank)


def _framed(data: bytes, inline: int) -> torch.Tensor:
    """``inline`` + 8 bytes: the length of ``data``, then its first ``inline`` bytes (zeros after)."""
    buf = torch.zeros(LENGTH_BYTES + inline, dtype=torch.uint8)
    head = len(data).to_bytes(LENGTH_BYTES, "little") + data[:inline]
    buf[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return buf


def error_of(e: BaseException) -> Reported:
    """``e`` as told to the other ranks."""
    return (type(e).__name__, str(e))


def done(outcome: tuple[str, Any]) -> Future[tuple[str, Any]]:
    """A Future already resolved with ``outcome``."""
    f: Future[tuple[str, Any]] = Future()
    f.set_result(outcome)
    return f


def raise_reported(error: Reported, *, default: type[DeltastoreError] = PartFailedError) -> None:
    """Raise an error reported by another rank (:func:`exception_of`)."""
    raise exception_of(error, default=default)


def exception_of(error: Reported, *, default: type[DeltastoreError] = PartFailedError) -> DeltastoreError:
    """The exception of an error reported by another rank: its own deltastore class when it
    has one (so a ConflictError or FencedError reads the same on every rank), else ``default``."""
    name, message = error
    cls = getattr(error_classes, name, None)
    if isinstance(cls, type) and issubclass(cls, DeltastoreError):
        try:
            return cls(message)
        except TypeError:  # a class whose constructor wants more than a message
            pass
    return default(f"{name}: {message}")
