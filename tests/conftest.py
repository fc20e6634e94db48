"""Shared test set-up: one thread per process keeps timings and numerics predictable on CPU."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

from hypothesis import HealthCheck, settings  # noqa: E402

# No test times anything: Hypothesis's clock-based checks (a deadline per example, "too slow" data
# generation) only measure how loaded the machine is, so they are off for every property test.
settings.register_profile("pipetrain", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pipetrain")
