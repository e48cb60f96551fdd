"""Read path: planning, fetching, verifying and applying versions; the subscriber (docs/SPEC.md §7)."""
