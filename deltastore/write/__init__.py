"""Write path: the HEAD commit protocol, the version chain, encoding, the publishers (docs/SPEC.md §5)."""
