"""Write the schema-4 golden store under tests/golden/ (run once; the files are committed as data).

Written by deltastore at issue 9 (branch i9-many, design 007: the first writer of schema 4, tensor
groups), with::

    python tests/golden/make_golden_schema4.py          # from the repository root

It refuses to overwrite existing files: the point of the files is that they were written by an
older release and are read, bit for bit, by every later one (tests/test_golden_schema4.py).
Inputs are deterministic (fixed seeds), but manifests carry random ids and times, so running it
again gives other bytes: the files are written once, never regenerated.

The grouping *policy* is shrunk here (GROUP_MEMBER_MAX_BYTES 512, GROUP_TARGET_BYTES 512, chunks
of 1 KiB), so that a few KiB of tensors exercise everything the *format* allows: several groups
per dtype, groups cut into several chunks that split members, 0-d members, NaN and -0.0 payloads,
and tensors left ungrouped. Readers never depend on the policy.

What it writes:

``store-schema4/``
    v1 a grouped anchor, v2-v4 deltas, v5 an anchor of the same layout, v6-v8 deltas; a
    compactor registers the squash S(2, 8) in the history index.
``store-schema4-expected/vN.safetensors`` and ``sha256.json``
    The state dict of every version N, as published, and each tensor's SHA-256.
``store-schema4-facts.json``
    What the generator did (versions, groups, the squash), for the tests.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from make_golden_schema3 import _copy_store, _write_shas  # noqa: E402

SEED = 20261201
VERSIONS = 8
SQUASH_BASE = 2


def write_schema4(store_dir: Path, expected_dir: Path, facts_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import deltastore
    from deltastore.write.policy import AnchorPolicy, LayoutPolicy, WriterPolicy
    import deltastore.layout.groups as groups
    from deltastore.lifecycle.compact import compact
    from deltastore.format.history import History
    from deltastore.storage import open_store

    groups.GROUP_MEMBER_MAX_BYTES = 512
    groups.GROUP_TARGET_BYTES = 512
    g = torch.Generator().manual_seed(SEED)

    def bf16(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd: dict[str, torch.Tensor] = {}
    for i in range(12):
        sd[f"layer.{i}.norm.weight"] = torch.ones(16, dtype=torch.float32) + i
        sd[f"layer.{i}.bias"] = bf16(24)
        if i % 4 == 0:
            sd[f"layer.{i}.proj"] = bf16(32, 16)  # 1 KiB: above the (shrunk) member limit
        sd[f"layer.{i}.expert.w"] = bf16(4, 8)
    sd["step"] = torch.tensor(0, dtype=torch.int64)  # 0-d
    sd["scale"] = torch.tensor(1.5, dtype=torch.float32)  # 0-d, groups with the fp32 norms
    sd["specials"] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40], dtype=torch.float32)
    sd["mask"] = torch.rand(30, generator=g) < 0.5  # a lonely bool: never a group of one
    nan = torch.tensor([0x7FC1, 0xFFC3 - 0x10000, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    sd["bf16.payloads"] = nan.clone()

    def nudge():
        for k, t in sd.items():
            if t.dtype == torch.bfloat16 and t.numel() > 8:
                v = t.view(torch.int16).view(-1)
                idx = torch.randperm(v.numel(), generator=g)[: max(1, v.numel() // 50)]
                v[idx] += torch.randint(1, 3, (idx.numel(),), generator=g, dtype=torch.int16)
        sd["step"] += 1
        sd["specials"] = sd["specials"].roll(1)
        sd["bf16.payloads"] = sd["bf16.payloads"].roll(1)

    expected_dir.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp())
    url = str(tmp / "store")
    try:
        with deltastore.Publisher(url, writer_policy=WriterPolicy(writer_id="golden4", threads=1),
                                  anchor_policy=AnchorPolicy("every", every=4),
                                  layout_policy=LayoutPolicy(chunk_bytes=1024, group_small_tensors=True)) as pub:
            for s in range(VERSIONS):
                if s:
                    nudge()
                info = pub.publish(sd, step=s, metadata={"golden": 4})
                assert info.version == s + 1 and info.kind == ("anchor" if s in (0, 4) else "delta"), info
                save_file({k: v.contiguous() for k, v in sd.items()}, str(expected_dir / f"v{info.version}.safetensors"))
        rep = compact(url, bases=[SQUASH_BASE], writer="golden4-compactor", threads=1)
        assert rep.registered and [(s.from_, s.to) for s in rep.squashes] == [(SQUASH_BASE, VERSIONS)], rep
        sq = rep.squashes[0]
        h = History(open_store(url))
        head = h.read_head()[0]
        _, m = h.find(1, head)
        layout = h.layout(m.layout)
        assert m.schema_ == 4 and layout.schema_ == 4, (m.schema_, layout.schema_)
        members = layout.members()
        assert len(members) >= 4 and "mask" in layout.name and "layer.0.proj" in layout.name, layout.name
        facts = {
            "versions": VERSIONS,
            "anchors": [1, 5],
            "groups": {row: [mm.name for mm in ms] for row, ms in members.items()},
            "ungrouped": [n for n in layout.name if n not in members],
            "squash": {"from": sq.from_, "to": sq.to, "key": sq.key, "bytes": sq.bytes, "chain_bytes": sq.chain_bytes},
        }
        facts_path.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
        _copy_store(tmp / "store", store_dir)
        _write_shas(expected_dir)
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    store, expected, facts = HERE / "store-schema4", HERE / "store-schema4-expected", HERE / "store-schema4-facts.json"
    for p in (store, expected, facts):
        if p.exists():
            raise SystemExit(f"{p} exists: golden files are written once, never regenerated")
    write_schema4(store, expected, facts)
    print(f"wrote {store}, {expected} and {facts}")


if __name__ == "__main__":
    main()
