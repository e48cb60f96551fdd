"""Lifecycle: the history index, garbage collection, compaction, the fleet ledger (docs/SPEC.md §10-12)."""
