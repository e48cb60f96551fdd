"""Layout: tensor specs and torch validation, tensor groups, column grids, partial-pull selections (docs/SPEC.md §2, §8)."""
