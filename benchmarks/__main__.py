"""``python -m benchmarks``: run the benchmark harness (see benchmarks/run.py)."""

from benchmarks.run import main

main()
