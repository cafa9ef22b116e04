"""Running recursa across processes: `ddp` (the data-parallel learner)."""
