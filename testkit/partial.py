"""Partial pulls, computed independently of deltastore: what a selection of rows should hold
(cut from the full state with torch), and the bytes a pull of it should fetch (from the plan)."""

from __future__ import annotations

import torch

from deltastore.format.history import History
from deltastore.layout.select import Selection, resolve
from deltastore.read.plan import layout, plan_forward, plan_from_anchor
from deltastore.storage import open_store


def expected_rows(state: dict[str, torch.Tensor], sel: Selection) -> dict[str, torch.Tensor]:
    """What the selection should hold: cut from a full state independently of deltastore."""
    import fnmatch

    out = {}
    for n, t in state.items():
        if not any(fnmatch.fnmatchcase(n, p) for p in sel.names) or any(fnmatch.fnmatchcase(n, p) for p in sel.exclude):
            continue
        dim = None
        if sel.shard is not None and t.dim() > 0:
            dims = [d for p, d in sel.shard_dims or () if fnmatch.fnmatchcase(n, p)]
            if dims:
                dim = dims[0]
            elif sel.shard_names is None or any(fnmatch.fnmatchcase(n, p) for p in sel.shard_names):
                dim = sel.shard[0]
        if dim is not None:
            _, r, w = sel.shard
            s = t.shape[dim]
            t = t.narrow(dim, r * s // w, (r + 1) * s // w - r * s // w)
        out[n] = t.contiguous()
    return out


def needed_bytes(url: str, sel: Selection, version: int, since: int | None = None) -> int:
    """Bytes of the segments whose chunks overlap the selection, from the plan."""
    store = open_store(url)
    hist = History(store, None)
    head = hist.read_head()[0]
    key, m = hist.find(version, head)
    ms = hist.anchor_chain(key, m)
    specs = layout(ms[0][1])
    res = resolve(sel, specs)
    if since is None:
        plans = plan_from_anchor(ms, specs)
    else:
        plans = plan_forward([x for x in ms if x[1].version > since], specs)
    return sum(p.cost for p in plans if (p.name, p.index) in res.chunks)
