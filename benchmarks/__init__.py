"""Benchmarks: deltastore against the formats it replaces, on real fine-tuning workloads.

``python -m benchmarks.workload`` generates the workloads; ``python -m benchmarks`` runs the
harness. See docs/benchmarks.md.
"""
