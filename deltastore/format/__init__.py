"""Format: the bucket's objects (keys, models, strict parsing, columnar tables, parts, signatures) and the HEAD/manifest reader (docs/SPEC.md §1-4)."""
