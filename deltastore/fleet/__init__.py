"""Running a fleet of workers: mirrors, one fetch per node, metrics, deadlines, a fleet target,
the fleet ledger of heartbeats."""
