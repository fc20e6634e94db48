"""Planning: profiles, cut points, PipeDream's partitioning optimizer, baselines."""
