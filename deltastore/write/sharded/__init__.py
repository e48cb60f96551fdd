"""Sharded publishing (SPEC §8, design 010): every rank publishes the rows it owns.

A :class:`ShardedPublisher` runs on every rank of a ``torch.distributed`` process group. Each
rank passes the tensors, or the row ranges of tensors, it holds (FSDP2 DTensor local shards
among them, never gathered), encodes them against its own reference copy of those rows, and
uploads its packs under the version's attempt. Rank 0 then checks the parts, uploads their part
manifests and the version manifest that lists them, and makes the version visible with the one
HEAD compare-and-swap of SPEC §5. No rank ever holds another rank's rows.

One publish is five steps, all ranks in lockstep (every collective is over ``group``)::

    1. all_gather   each rank: what it owns (name, dtype, global shape, rows; a digest when
                    that is what every rank planned last, design 010 D7), the version it
                    holds, step, anchor request, or its local error; rank 0 adds its pre-plan
                    of a steady-state version (next version, same layout and base, design 010 D6)
                    -> every rank computes the same layout, or the same ShardMismatchError,
                       and the same verdict on the pre-plan
    2. broadcast    only when the pre-plan does not hold (the first version, a layout change, an
                    anchor request, a failure before): rank 0 reads HEAD (claim, fencing,
                    unknown outcomes: the version chain), picks version, attempt, kind, lineage; writes
                    the layout object if new
    3. (local)      each rank: encode its rows, upload its packs, build its part manifest
    4. gather       part references and part manifests to rank 0, or each rank's error
    5. broadcast    rank 0: uploads the part manifests, and an unsigned version's manifest
                    (its header and part list), while it joins and checks the parts (once:
                    the version manifest is stored without a second join), then CASes HEAD
                    once (nothing read back: the next tip is what it wrote); the outcome (or
                    the error) goes to every rank

:meth:`ShardedPublisher.publish_async` runs steps 1-4 alike and returns there: rank 0 joins and
commits the version (step 5) on a thread of its own while every rank goes on to the next
version, planned on the one being committed (design 010 D10); the outcome reaches every rank
with the next call's step 1 (or a :meth:`~ShardedPublisher.flush`), and a version whose base
then failed fails too, so nothing is committed on a base that is not in the store.

A steady-state version therefore costs three collectives (on gloo, four gloo operations: design
010 D9) and, on rank 0, no read of the store; the uploads overlap the join instead of preceding
the gather or following it.

The modules: :mod:`.collectives` (the ranks' channel), :mod:`.planning` (claims, layout, shares,
plans), :mod:`.part` (a rank's part), :mod:`.coordinator` (rank 0: plan, join, commit through the
version chain, the async committer) and :mod:`.publisher` (the class the ranks call).

A rank that fails raises its own error after telling the others, which raise
:class:`~deltastore.errors.PartFailedError`; a rank that dies makes the collectives of the
others fail, which is reported the same way. Either way HEAD has not moved: the packs already
uploaded sit unreferenced under the attempt and GC collects them after its grace period. The
next publish is a new attempt.

A publisher that holds no reference copy (a restarted job, or after any failure) resumes from
the store (``resume=True``, design 010 D11): when HEAD's version has the layout the ranks plan
now, step 2 names it, every rank reads back only its own rows of it (the chunks of its pieces,
each verified against its digest), and the ranks agree in one more all_gather that every rank
did, so the version is a delta; if any rank failed, every rank drops what it read and the
version is an anchor.
"""

from deltastore.write.sharded.collectives import INLINE_BYTES
from deltastore.write.sharded.planning import Rows, plan_layout
from deltastore.write.sharded.publisher import ShardedPublisher

__all__ = ["INLINE_BYTES", "Rows", "ShardedPublisher", "plan_layout"]
