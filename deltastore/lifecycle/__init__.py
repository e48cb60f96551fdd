"""Lifecycle: the history index, garbage collection, compaction (docs/SPEC.md §11-12)."""
