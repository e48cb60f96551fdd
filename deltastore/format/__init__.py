"""Format: the bucket's objects and how they are read and written (docs/SPEC.md §1–4, §8, §11–14).

By layer, each module importing only the ones above it:

- :mod:`~deltastore.format.keys`: key shapes, content addresses, attempt ids and lineages;
- :mod:`~deltastore.format.models`: the objects as pydantic models (HEAD, manifests, layouts,
  the history index, squash manifests), their canonical JSON, chunk geometry;
- :mod:`~deltastore.format.parse`: strict reading of stored bytes (size, zstd, JSON, depth,
  schema), typed errors, HEAD;
- :mod:`~deltastore.format.checks`: the invariants of manifests and layouts;
- :mod:`~deltastore.format.tables`: the columnar chunk table;
- :mod:`~deltastore.format.parts`: part manifests of sharded versions;
- :mod:`~deltastore.format.manifest`: manifests as stored (parse and encode);
- :mod:`~deltastore.format.objects`: index, layout and squash objects as stored;
- :mod:`~deltastore.format.signing` and :mod:`~deltastore.format.history` (reading a store's
  chain of versions) on top.
"""
